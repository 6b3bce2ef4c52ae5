"""HiCache's shared tier (L3): KV pages in a store other workers can read, addressed by content.

A page's key is a hash chain, blake2b(previous page's key + the page's token ids), seeded with a namespace:
the model's identity, the KV layout (layers, KV heads, head dim, dtype, page size) and the request's
``extra_key``. Two workers with the same model and layout therefore share entries, different namespaces never
do, and a key names its whole prefix, not just its page. An entry is the page's K and V for every layer
followed by a 16-byte blake2b digest of them; a missing, short or corrupt entry is a miss (the tokens are
recomputed), never wrong KV. Store failures (unreachable, full, slow past its deadline) are misses or dropped
writes as well, counted and logged: no request fails because of the store."""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
DIGEST = 16


def chain_keys(namespace: bytes, tokens: Sequence[int], page_size: int) -> list[str]:
    """The store key of every whole page of ``tokens`` (page i's key covers tokens[: (i + 1) * page_size])."""
    n = len(tokens) - len(tokens) % page_size
    data, step = struct.pack(f"<{n}I", *tokens[:n]), 4 * page_size  # each id as 4 little-endian bytes
    keys, prev = [], hashlib.blake2b(namespace, digest_size=20).digest()
    for start in range(0, len(data), step):
        prev = hashlib.blake2b(prev + data[start:start + step], digest_size=20).digest()
        keys.append(prev.hex())
    return keys


def seal(data: bytes) -> bytes:
    return data + hashlib.blake2b(data, digest_size=DIGEST).digest()


def unseal(entry: bytes | None, size: int) -> bytes | None:
    """The payload of a sealed entry of ``size`` payload bytes, or None if it is missing, short or corrupt."""
    if entry is None or len(entry) != size + DIGEST:
        return None
    data = entry[:size]
    return data if hashlib.blake2b(data, digest_size=DIGEST).digest() == entry[size:] else None


class StoreError(Exception):
    """The store could not do what was asked (unreachable, full, too slow)."""


class StoreUnreachable(StoreError):
    """The store cannot be reached at all: stop asking it for a while (engine/mem/store_guard.py)."""


class PageStore(ABC):
    """Bytes by key, a batch of keys per call (one round trip for a network store). Implementations raise
    StoreError for failures; a key that is simply absent is not one."""

    name = "store"
    max_batch_bytes = 64 << 20  # most entry bytes one call may move (Mooncake: half its local buffer)

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """One entry (or None) per key, in order."""

    @abstractmethod
    def put(self, items: Sequence[tuple[str, bytes]], overwrite: bool = False) -> None:
        """Store each entry; ``overwrite`` replaces one already there (a bad entry), else it may be kept."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove entries (bad ones); absent is fine."""

    def close(self) -> None:
        """Release connections and memory given to the store; a no-op by default."""

    def direct(self) -> PageStore | None:
        """The store for a background thread to call directly (no deadline: nobody waits on it), or None while
        it should not be asked."""
        return self


class FileStore(PageStore):
    """``--hicache-storage-backend file``: one file per page under a directory (``--hicache-storage-dir``) that
    workers on one host, or on a shared file system, point at. Writes go to a temporary file and are renamed
    into place, so a reader sees a whole entry or none."""

    name = "file"

    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot use {root} as the store directory: {e}") from e

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StoreError(f"reading {key}: {e}") from e
        return out

    def put(self, items: Sequence[tuple[str, bytes]], overwrite: bool = False) -> None:
        for key, data in items:  # a rename replaces an entry already there: ``overwrite`` is what it does anyway
            path = self._path(key)
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                except BaseException:
                    os.unlink(tmp)
                    raise
            except OSError as e:
                raise StoreError(f"writing {key}: {e}") from e

    def exists(self, keys: Sequence[str]) -> list[bool]:
        try:
            return [self._path(key).is_file() for key in keys]
        except OSError as e:
            raise StoreError(f"looking up {keys[0]}...: {e}") from e

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as e:
                raise StoreError(f"deleting {key}: {e}") from e


def model_fingerprint(config: Path, weights: Sequence[Path]) -> str:
    """Identity of a checkpoint for L3 namespaces: its config.json and, per weight file, its size and 16
    64-KiB samples spread over it (two fine-tunes of one architecture differ throughout their weights; hashing
    whole files would cost seconds per GB at start-up)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(weights):
        size = path.stat().st_size
        h.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(1 << 16))
    return h.hexdigest()


def weight_files(folder: Path, gguf: Path | None) -> list[Path]:
    if gguf is not None:
        return [gguf]
    return [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
