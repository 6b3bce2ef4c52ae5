"""HiCache's host tier as the radix tree sees it: the L2 pool, the device pool it copies to and from, the
device allocator load-back takes pages from, the write policy, and the counters /metrics reports. The tree
decides what moves where (engine/mem/hiradix_cache.py); this object moves it and counts it. Load-backs copy on
one loader thread (``start_load``) and are counted when the tree takes their pages (``finish_load``): the
loader touches only the load's own pages and the store, never the tree or the counters."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import HICACHE_WRITE_POLICIES, CacheConfig, EngineConfigError
from engine.mem.allocator import PageAllocator
from engine.mem.host_pool import HostPool
from engine.mem.kv_pool import KVPool
from engine.tiny_model import default_cache_dir
from engine.mem.mooncake_store import MooncakeConfigError, MooncakeStore, MooncakeStoreOptions
from engine.mem.storage import (DIGEST, FileStore, PageStore, StoreError, StoreUnreachable, chain_keys,
                                 model_fingerprint, unseal)
from engine.mem.store_guard import GuardedStore, StoreUnavailable
from engine.mem.store_writer import StoreWriter, batches

log = logging.getLogger(__name__)
MEMO_TOKENS = 1 << 20  # prompts' store keys remembered, in tokens (a few MB)
LOOKUP_TTL_S = 0.5  # a store lookup's answer is reused this long, unless this worker wrote to the store since (a
LOOKUPS_KEPT = 4096  # request queued behind others is matched every step: a lookup each would cost a round trip)


@dataclass
class HiCacheStats:
    """Monotonic counters since start (read by /metrics and /get_server_info)."""

    loaded_tokens: int = 0  # tokens copied L2 -> L1 (prefix hits served from the host tier)
    loaded_bytes: int = 0
    written_tokens: int = 0  # tokens copied L1 -> L2
    written_bytes: int = 0
    store_loaded_tokens: int = 0  # tokens copied L3 -> L1 (prefix hits served from the store)
    store_misses: int = 0  # entries found missing, short or corrupt when read (recomputed instead)
    store_failures: int = 0  # store operations that failed (unreachable, full, too slow)
    load_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # drained by metrics


@dataclass
class LoadOutcome:
    """What one load's copies did on the loader thread, for the engine thread to account (``finish_load``)."""

    host_bytes: int = 0  # copied L2 -> L1
    host_seconds: float = 0.0  # the time those copies took
    stored: int = 0  # stored entries copied into the load's pages, in order
    misses: int = 0  # an entry missing, short or corrupt ended the read
    corrupt: str | None = None  # its key, if it was there but bad (rewritten by the next write of that page)
    failure: StoreError | None = None  # the store failed the read
    seconds: float = 0.0


class HostTier:
    def __init__(self, host: HostPool, kv: KVPool, device: PageAllocator, write_policy: str = "write_through",
                 write_threshold: int = 2, store: PageStore | None = None, namespace: bytes = b"",
                 clock: Callable[[], float] = time.monotonic, overlap: bool | None = None) -> None:
        """``overlap``: whether a copy on the loader thread runs beside the step rather than taking its cores
        (None: detect; see ``copies_overlap``)."""
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r} is not one of {', '.join(HICACHE_WRITE_POLICIES)}")
        self.host = host
        self.kv = kv
        self.device = device
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        self.store = store
        self.namespace = namespace  # model identity and KV layout: L3 keys of another model never match
        self.stats = HiCacheStats()
        self._key_memo: OrderedDict[tuple[str | None, tuple[int, ...]], list[str]] = OrderedDict()
        self._memo_tokens = 0
        self._bad: set[str] = set()  # store keys found corrupt since: misses until this worker rewrites them
        self._clock = clock
        self._lookups: OrderedDict[tuple[str, str], tuple[float, int, int]] = OrderedDict()  # -> (t, written, n)
        self.writer = None if store is None else StoreWriter(store, host.shape.page_size)
        self._loader: ThreadPoolExecutor | None = None
        self._copy_rate: float | None = None  # bytes/s of recent L2 -> L1 copies
        self._stream = None  # CUDA: the loader's copy stream (not run here: no device)
        self.overlap = copies_overlap(kv.data.device) if overlap is None else overlap

    # -- what the tree asks ------------------------------------------------------------------------------------
    def mirrors(self, hits: int) -> bool:
        """Should an L1 node with ``hits`` be copied to L2 now (rather than when it is evicted)?"""
        if self.write_policy == "write_through":
            return True
        return self.write_policy == "write_through_selective" and hits >= self.write_threshold

    def device_available(self) -> int:
        return self.device.available

    def alloc_device(self, n: int) -> list[int] | None:
        return self.device.alloc(n)

    def host_available(self) -> int:
        return self.host.allocator.available

    def alloc_host(self, n: int) -> list[int] | None:
        return self.host.allocator.alloc(n)

    def free_host(self, pages: Sequence[int]) -> None:
        self.host.allocator.free(pages)

    # -- copies --------------------------------------------------------------------------------------------------
    def save(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.stats.written_bytes += self.host.save(self.kv, device_pages, host_pages)
        self.stats.written_tokens += len(host_pages) * self.host.shape.page_size

    def start_load(self, copies: Sequence[tuple[Sequence[int], Sequence[int]]], keys: Sequence[str],
                   pages: Sequence[int]) -> Future[LoadOutcome]:
        """``copy_in`` on the loader thread (one thread: loads run in the order they start, and at most one copy
        competes with the engine's step for the cores and memory bandwidth)."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        return self._loader.submit(self.copy_in, copies, keys, pages)

    def copy_in(self, copies: Sequence[tuple[Sequence[int], Sequence[int]]], keys: Sequence[str],
                pages: Sequence[int]) -> LoadOutcome:
        """Copy each (host pages, device pages) pair in order, then the stored entries ``keys`` into ``pages``
        until the first missing, corrupt or failed one. Touches only the pages named and the store, so it may
        run off the engine thread while the pages are the caller's alone."""
        start, out = time.perf_counter(), LoadOutcome()
        cuda = self.kv.data.device.type == "cuda"
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.kv.data.device)
        with torch.inference_mode(), (torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext()):
            for host_pages, device_pages in copies:  # on CUDA: DMA on a stream of its own, beside the step's
                out.host_bytes += self.host.load(self.kv, host_pages, device_pages)
            if cuda:
                self._stream.synchronize()  # done before the tree takes the pages (and timed as what it took)
            out.host_seconds = time.perf_counter() - start
            if keys:
                self._read(keys, pages, out)
        out.seconds = time.perf_counter() - start
        return out

    def copy_seconds(self, pages: int) -> float:
        """Expected time to copy ``pages`` from L2 to L1 (at the recent copies' rate; infinite before the first)."""
        if self._copy_rate is None:
            return math.inf
        return pages * self.host.page_bytes_all_layers / self._copy_rate

    def finish_load(self, out: LoadOutcome, host_tokens: int) -> None:
        """Account a finished load on the engine thread; ``host_tokens`` of its L2 copies reached the tree."""
        s = self.stats
        s.loaded_bytes += out.host_bytes
        s.loaded_tokens += host_tokens
        s.store_loaded_tokens += out.stored * self.host.shape.page_size
        s.store_misses += out.misses
        s.load_seconds.append(out.seconds)
        if out.host_bytes and out.host_seconds > 0:
            rate = out.host_bytes / out.host_seconds
            self._copy_rate = rate if self._copy_rate is None else 0.8 * self._copy_rate + 0.2 * rate
        if out.failure is not None:
            self._failed("read", out.failure)
        if out.misses:
            self._lookups.clear()  # what the lookups said is out of date
        if out.corrupt is not None and len(self._bad) < 65536:
            self._bad.add(out.corrupt)  # the next write of this page overwrites whatever is there

    # -- the shared store (L3) -------------------------------------------------------------------------------
    def _keys(self, extra_key: str | None, tokens: Sequence[int]) -> list[str]:
        """Store keys of ``tokens``' pages, remembered for the last few prompts (a queued request is matched
        at every admission attempt)."""
        memo = (extra_key, tuple(tokens))
        if (keys := self._key_memo.get(memo)) is None:
            ns = self.namespace + b"\0" + (b"" if extra_key is None else b"k" + extra_key.encode())
            keys = self._key_memo[memo] = chain_keys(ns, tokens, self.host.shape.page_size)
            self._memo_tokens += len(tokens)
            while self._memo_tokens > MEMO_TOKENS and len(self._key_memo) > 1:
                self._memo_tokens -= len(self._key_memo.popitem(last=False)[0][1])
        else:
            self._key_memo.move_to_end(memo)
        return keys

    def _failed(self, op: str, e: StoreError) -> None:
        if isinstance(e, StoreUnavailable):  # not attempted: the guard logged why, once
            return
        self.stats.store_failures += 1
        log.warning("hicache store %s failed, going on without it: %s", op, e)

    def stored_run(self, extra_key: str | None, tokens: Sequence[int], first_page: int) -> list[str]:
        """Keys of the pages of ``tokens`` from ``first_page`` on that the store holds, up to the first it lacks."""
        assert self.store is not None
        keys = self._keys(extra_key, tokens)[first_page:]
        if not keys:
            return []
        memo, now = (keys[0], keys[-1]), self._clock()  # chained keys: the pair names the whole run
        written = self.writer.stored_tokens if self.writer is not None else 0
        if (seen := self._lookups.get(memo)) is not None and now - seen[0] < LOOKUP_TTL_S and seen[1] == written:
            return keys[:seen[2]]
        try:
            present = self.store.exists(keys)
        except StoreError as e:
            self._failed("lookup", e)
            return []
        present = [p and k not in self._bad for k, p in zip(keys, present)]  # a corrupt entry not yet replaced
        n = present.index(False) if False in present else len(keys)
        self._lookups[memo] = (now, written, n)
        self._lookups.move_to_end(memo)
        if len(self._lookups) > LOOKUPS_KEPT:
            self._lookups.popitem(last=False)
        return keys[:n]

    def write_store(self, extra_key: str | None, prefix: Sequence[int], device_pages: Sequence[int],
                    retry: bool = False) -> int:
        """Queue the last ``len(device_pages)`` pages of ``prefix`` (whose KV they hold) for the store; the
        engine thread only copies them (engine/mem/store_writer.py). Returns the write's id, 0 if it was dropped."""
        assert self.writer is not None
        keys = self._keys(extra_key, prefix)[-len(device_pages):]
        overwrite = frozenset(k for k in keys if k in self._bad)

        def snapshot() -> list[torch.Tensor]:
            return [self._page_view(p).clone(memory_format=torch.contiguous_format).cpu() for p in device_pages]
        job = self.writer.submit(keys, len(device_pages) * self._entry_bytes(), snapshot, overwrite, retry)
        if job:
            self._bad.difference_update(overwrite)
        return job

    def write_failed(self, job: int) -> bool:
        """Did store write ``job`` fail, with the store up again (worth its one retry)?"""
        return self.writer is not None and self.store_state() == "up" and self.writer.failed(job)

    def _read(self, keys: Sequence[str], device_pages: Sequence[int], out: LoadOutcome) -> None:
        """Copy stored pages into ``device_pages`` in order, stopping at the first missing, corrupt or failed
        one, or when the reads have taken the store's deadline in all; ``out`` says how far it got and why."""
        assert self.store is not None
        size = self._entry_bytes()
        budget = time.monotonic() + getattr(self.store, "timeout", 60.0)
        for batch in batches(list(zip(keys, device_pages)), size, self.store.max_batch_bytes):
            if out.stored and time.monotonic() > budget:
                return  # a slow store: recompute the rest rather than hold the load on it
            try:
                entries = self.store.get([k for k, _ in batch])
            except StoreError as e:
                out.failure = e
                return
            if len(entries) != len(batch):
                out.failure = StoreError(f"{len(entries)} entries for {len(batch)} keys")
                return
            for (key, page), entry in zip(batch, entries):
                data = unseal(entry, size)
                if data is None:
                    out.misses += 1
                    if entry is None:  # gone since the lookup (evicted): nothing to repair
                        log.info("hicache store entry %s went away after its lookup: recomputing from there", key)
                    else:  # short or corrupt: replace it with the recomputed page
                        log.warning("hicache store entry %s is corrupt: recomputing from there", key)
                        out.corrupt = key
                        self._delete(key, out)
                    return
                self._set_page(page, data)
                out.stored += 1

    def _entry_bytes(self) -> int:
        view = self._page_view(0)
        return view.numel() * view.element_size()

    def _delete(self, key: str, out: LoadOutcome) -> None:
        try:
            self.store.delete([key])
        except StoreError as e:
            out.failure = e

    def _page_view(self, page: int):  # noqa: ANN202 - a tensor view
        ps = self.host.shape.page_size
        return self.kv.data[:, :, page * ps:(page + 1) * ps]

    def _set_page(self, page: int, data: bytes) -> None:
        view = self._page_view(page)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(view.dtype).view(view.shape)
        view.copy_(src)

    def check_integrity(self, owned: Sequence[int]) -> None:
        self.host.allocator.check_integrity([owned])

    def store_state(self) -> str:
        """connecting, up or down (a guarded store); up for an unguarded one (tests hand the tier a bare store)."""
        return getattr(self.store, "state", "up")

    def counters(self) -> dict[str, int]:
        """Monotonic counters since start, the store writer's included (for /metrics and /get_server_info)."""
        s, w = self.stats, self.writer
        return {"loaded_tokens": s.loaded_tokens, "loaded_bytes": s.loaded_bytes, "written_tokens": s.written_tokens,
                "written_bytes": s.written_bytes, "stored_tokens": w.stored_tokens if w else 0,
                "store_loaded_tokens": s.store_loaded_tokens, "store_misses": s.store_misses,
                "store_failures": s.store_failures + (w.failures if w else 0),
                "store_writes_dropped": w.dropped if w else 0}

    def close(self) -> None:
        """Finish the load in flight, then queued store writes (briefly), and close the store, unless a write is
        still running on it."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self.writer is not None and not self.writer.close():
            log.warning("hicache store writer still busy at shutdown: leaving the store client open")
        elif self.store is not None:
            self.store.close()

    def describe(self) -> dict[str, int | str | None]:
        return {"write_policy": self.write_policy, "host_pages_total": self.host.allocator.capacity,
                "host_pages_used": self.host.allocator.used,
                "storage_backend": None if self.store is None else self.store.name,
                "store_state": None if self.store is None else self.store_state(), **self.counters()}


def copies_overlap(device: torch.device) -> bool:
    """Does a host -> pool copy on its own thread run beside the model's step? On CUDA, yes (a DMA transfer);
    on CPU only if torch's threads leave a core free, else the copy takes the step's cores: measured on the
    2-core EPYC (benchmarks/bench_hicache_overlap.py) decoding streams gained nothing from it and the loaded
    request's TTFT grew by a step."""
    if device.type == "cuda":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return torch.get_num_threads() < cores


def open_store(cfg: CacheConfig, entry_bytes: int) -> PageStore | None:
    """The shared tier ``cfg`` names, behind a per-operation deadline; a malformed setting is a start-up error
    naming its flag, an unreachable store is not (the worker recomputes until it answers)."""
    if cfg.hicache_storage_backend == "none":
        return None
    max_batch = PageStore.max_batch_bytes
    if cfg.hicache_storage_backend == "file":
        root = Path(cfg.hicache_storage_dir or default_cache_dir() / "hicache")
        try:
            FileStore(root)
        except StoreError as e:
            raise EngineConfigError(f"--hicache-storage-dir: {e}") from e
        connect = lambda: FileStore(root)  # noqa: E731
    else:
        try:
            opts = MooncakeStoreOptions.parse(cfg.hicache_storage_backend_extra_config)
        except MooncakeConfigError as e:
            raise EngineConfigError(f"--hicache-storage-backend-extra-config {e}") from e
        connect = lambda: MooncakeStore(opts, cfg.hicache_storage_timeout)  # noqa: E731
        max_batch = opts.max_batch_bytes
        if entry_bytes + DIGEST > max_batch:
            raise EngineConfigError(f"--hicache-storage-backend-extra-config: local_buffer_size "
                                    f"{opts.local_buffer_size} is under twice one page's KV ({entry_bytes} bytes)")
    store = GuardedStore(cfg.hicache_storage_backend, connect, cfg.hicache_storage_timeout,
                         retry_after=max(1.0, 2.5 * cfg.hicache_storage_timeout), max_batch_bytes=max_batch)
    if not store.wait_connected(cfg.hicache_storage_timeout):
        if store.connect_error is not None and not isinstance(store.connect_error, StoreUnreachable):
            store.close()  # the store answered and refused these settings: retrying will not help
            raise EngineConfigError(f"--hicache-storage-backend-extra-config: {store.connect_error}")
        log.warning("hicache %s store not reachable at start-up: serving without it until it answers",
                    cfg.hicache_storage_backend)
    return store


def host_tier_for(cfg: CacheConfig, pool: KVPool, device_pages: PageAllocator, device: torch.device,
                  config: Path | None = None, weights: Callable[[], Sequence[Path]] = tuple,
                  weight_dtype: str = "") -> HostTier | None:
    """The host tier ``cfg`` asks for (--hicache-size GB, or --hicache-ratio times the device pool), or None;
    with a store, its keys are namespaced by the checkpoint (``config``, ``weights()``), the dtype the weights
    run in (which changes the KV computed) and the KV layout."""
    if not cfg.enable_hierarchical_cache:
        return None
    page_bytes = pool.shape.page_size * pool.shape.bytes_per_token
    pages = (int(cfg.hicache_size * 1e9 // page_bytes) if cfg.hicache_size else
             int(device_pages.capacity * cfg.hicache_ratio))
    if pages < 1:
        raise EngineConfigError(f"--hicache-size {cfg.hicache_size} GB holds no page ({page_bytes} bytes each)")
    store = open_store(cfg, page_bytes)
    model_id = "" if store is None else model_fingerprint(config or Path("config.json"), weights())
    s = pool.shape
    layout = f"{model_id}|{weight_dtype}|{s.num_layers}x{s.num_kv_heads}x{s.head_dim}|{s.dtype}|page{s.page_size}"
    return HostTier(HostPool(pool.shape, pages + 1, device), pool, device_pages, cfg.hicache_write_policy,
                    cfg.hicache_write_threshold, store, layout.encode())
