"""Which transport: the decode side offers, the prefill side picks.

Decode side (`ReceiveSide`): registers its KV buffers and aux array with every transport its
backend allows and describes them in an Offer. Prefill side (`SendSide`): picks a writer for a
peer's offer. `auto` prefers shm when the peer's segments can be mapped here (proof of one host
sharing /dev/shm) and falls back to mooncake; `fake` works only inside one process.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kv_transfer.config import TransferConfig
from kv_transfer.wire.errors import ConfigError, TransportMismatchError
from kv_transfer.shm import SharedSegment
from kv_transfer.transport import PeerWriter, fake
from kv_transfer.transport.mooncake import MooncakeEngine, MooncakeWriter, mooncake_available
from kv_transfer.transport.shm import ShmWriter

log = logging.getLogger("kv_transfer")


@dataclass(frozen=True)
class Offer:
    mooncake_session: str = ""
    shm_regions: tuple[tuple[str, bytes, int, int], ...] = field(default_factory=tuple)
    fake_session: str = ""


class ReceiveSide:
    """Decode side: exposes `regions` (KV buffers + aux) through the configured backend(s)."""

    def __init__(self, config: TransferConfig, regions: list[tuple[int, int]],
                 segments: list[SharedSegment]) -> None:
        self._fake_session = ""
        self.mooncake: MooncakeEngine | None = None
        backend = config.backend
        shm: list[tuple[str, bytes, int, int]] = []
        if backend in ("shm", "auto") and segments:
            uncovered = [r for r in regions if not any(s.contains(*r) for s in segments)]
            if not uncovered:
                shm = [(s.name, s.nonce, s.address, s.size) for s in segments]
            elif backend == "shm":
                raise ConfigError(f"--transfer-backend shm needs the KV pool and aux array inside the given "
                                  f"shared segments; {len(uncovered)} region(s) are outside them")
        elif backend == "shm":
            raise ConfigError("--transfer-backend shm needs the KV pool in a SharedSegment passed as segments=")
        if backend == "mooncake" or (backend == "auto" and (mooncake_available() or not shm)):
            self.mooncake = MooncakeEngine(config)
            self.mooncake.register(regions)
        elif backend == "auto":
            log.warning("mooncake is not importable; offering shm only (same-host prefill workers)")
        if backend == "fake":
            self._fake_session = fake.register_session(regions)
        self.offer = Offer(
            mooncake_session=self.mooncake.session if self.mooncake else "",
            shm_regions=tuple(shm),
            fake_session=self._fake_session,
        )

    def close(self) -> None:
        if self._fake_session:
            fake.unregister_session(self._fake_session)


class SendSide:
    """Prefill side: `writer_for(offer)`. With P2PHANDSHAKE metadata and no fixed port, each Mooncake peer gets
    its own engine: inside one engine, a write stuck on a frozen peer could stall writes to the others for
    seconds (seen here with Mooncake 0.3.13). A fixed `host:port` or a metadata server (where an engine's
    segment is named after its host) allows one engine per process, so those share one."""

    def __init__(self, config: TransferConfig, source_regions: list[tuple[int, int]]) -> None:
        self._config = config
        self._sources = source_regions
        self._per_peer = config.metadata_server == "P2PHANDSHAKE" and ":" not in config.hostname
        self._shared: MooncakeEngine | None = None
        self._lock = threading.Lock()

    def _writer(self, session: str) -> MooncakeWriter:
        if self._per_peer:
            engine = MooncakeEngine(self._config)
            try:
                engine.register(self._sources)
            except BaseException:
                engine.shutdown()
                raise
            return MooncakeWriter(engine, session, owns_engine=True)
        with self._lock:
            if self._shared is None:
                engine = MooncakeEngine(self._config)
                engine.register(self._sources)
                self._shared = engine
            return MooncakeWriter(self._shared, session)

    def writer_for(self, offer: Offer, peer: str) -> PeerWriter:
        backend = self._config.backend
        if backend == "fake":
            if not offer.fake_session:
                raise TransportMismatchError(f"peer {peer} does not offer the fake transport; "
                                             "start both sides with --transfer-backend fake", peer=peer)
            return fake.FakeWriter(offer.fake_session)
        if backend in ("shm", "auto") and offer.shm_regions:
            try:
                return ShmWriter(list(offer.shm_regions))
            except ConfigError as exc:
                if backend == "shm":
                    raise TransportMismatchError(f"cannot map peer {peer}'s shared segments ({exc}); "
                                                 "shm works only on one host", peer=peer) from exc
                log.info("peer shm not mappable here, using mooncake peer=%s", peer)
        if backend in ("mooncake", "auto") and offer.mooncake_session:
            return self._writer(offer.mooncake_session)
        raise TransportMismatchError(
            f"no common transport with peer {peer}: this side is --transfer-backend {backend}, the peer "
            f"offers {_describe(offer)}", peer=peer)


def _describe(offer: Offer) -> str:
    kinds = [k for k, v in (("mooncake", offer.mooncake_session), ("shm", offer.shm_regions),
                            ("fake", offer.fake_session)) if v]
    return ", ".join(kinds) or "nothing"
