"""SharedSegment: a named POSIX shared-memory segment for a decode worker's KV pool (Linux /dev/shm).

The decode worker creates one (`SharedSegment.create(size)`), lays its pool out in `buffer`
(e.g. `torch.frombuffer(seg.buffer, dtype=torch.bfloat16)` or `KVLayout.packed(seg.address, ...)`)
and passes it to DecodeTransferManager(segments=[seg]). The prefill worker maps it by name to
write pages with memcpy. The segment starts with a one-page header holding a random nonce; the
prefill side checks it, which proves both ends really see the same memory (same host and the same
/dev/shm, not just the same hostname). Segments are named `splitserve-kv-<pid>-<random>`; the
creator unlinks on close(), and create() removes stale segments left by dead processes.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import secrets
from pathlib import Path

from kv_transfer.wire.errors import ConfigError

log = logging.getLogger("kv_transfer")

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096
MAGIC = b"SPLITSERVE-KV-1\0"
_NAME_RE = re.compile(r"^splitserve-kv-(\d+)-[0-9a-f]+$")


class SharedSegment:
    """A mapped segment; `buffer`/`address`/`size` describe the usable area after the header."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self._mmap = mm
        self._owner = owner
        self.size = len(mm) - HEADER_BYTES
        self.buffer: memoryview = memoryview(mm)[HEADER_BYTES:]
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping; gives its address
        self.address = ctypes.addressof(self._anchor) + HEADER_BYTES
        self.nonce = bytes(mm[len(MAGIC):len(MAGIC) + 16])

    @classmethod
    def create(cls, size: int, name: str | None = None) -> "SharedSegment":
        """Create and map a zero-filled segment with `size` usable bytes."""
        if size <= 0:
            raise ConfigError(f"shared segment size must be > 0, got {size}")
        _sweep_stale()
        name = name or f"splitserve-kv-{os.getpid()}-{secrets.token_hex(6)}"
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise ConfigError(f"shared segment {name} already exists; pick another name") from exc
        except OSError as exc:
            raise ConfigError(f"cannot create shared segment in {SHM_DIR}: {exc}") from exc
        try:
            os.ftruncate(fd, size + HEADER_BYTES)
            mm = mmap.mmap(fd, size + HEADER_BYTES)
        except OSError as exc:
            os.unlink(path)
            raise ConfigError(f"cannot size shared segment {name} to {size} bytes: {exc}; "
                              "is /dev/shm large enough?") from exc
        finally:
            os.close(fd)
        mm[:len(MAGIC)] = MAGIC
        mm[len(MAGIC):len(MAGIC) + 16] = secrets.token_bytes(16)
        return cls(name, mm, owner=True)

    @classmethod
    def open(cls, name: str, nonce: bytes | None = None) -> "SharedSegment":
        """Map an existing segment; ConfigError if absent or (with `nonce`) not the expected one."""
        try:
            fd = os.open(_path(name), os.O_RDWR)
        except OSError as exc:
            raise ConfigError(f"cannot open shared segment {name}: {exc}") from exc
        try:
            # No MAP_POPULATE: on tmpfs it would allocate the whole pool (sized for the worst case) at once;
            # pages fault in as transfers first touch them, which costs little next to the copy itself.
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if mm[:len(MAGIC)] != MAGIC or (nonce is not None and mm[len(MAGIC):len(MAGIC) + 16] != nonce):
            mm.close()
            raise ConfigError(f"shared segment {name} is not the peer's (different host or /dev/shm)")
        return cls(name, mm, owner=False)

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.size

    def close(self) -> None:
        """Unmap (and unlink, for the creator). Views of `buffer` still alive keep the mapping."""
        try:
            self.buffer.release()
        except BufferError:
            pass  # a caller still holds a view made from it; the mapping stays until that view dies
        del self._anchor
        try:
            self._mmap.close()
        except BufferError:
            log.warning("shared segment %s still has exported views; leaving it mapped", self.name)
        if self._owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass


def _path(name: str) -> Path:
    if "/" in name or not name:
        raise ConfigError(f"invalid shared segment name {name!r}")
    return SHM_DIR / name


def _sweep_stale() -> None:
    """Remove segments of ours whose creating process no longer exists."""
    if not SHM_DIR.is_dir():
        raise ConfigError(f"{SHM_DIR} is missing; the shm transfer backend needs Linux POSIX shared memory")
    for entry in SHM_DIR.iterdir():
        match = _NAME_RE.match(entry.name)
        if not match:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            entry.unlink(missing_ok=True)
        except PermissionError:
            pass
