"""Attention backends over the paged KV pool, behind one interface (base.AttentionBackend)."""
from engine.config import EngineConfigError
from engine.runner.attention.base import AttentionBackend, AttentionMeta, ExtendSeq
from engine.runner.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMeta", "ExtendSeq", "TorchAttentionBackend", "create_backend"]


def create_backend(name: str, pool: object, num_heads: int, head_dim: int) -> AttentionBackend:
    if name in ("auto", "torch"):
        return TorchAttentionBackend(pool, num_heads, head_dim)  # type: ignore[arg-type]
    raise EngineConfigError(f"--attention-backend {name!r} is unknown")
