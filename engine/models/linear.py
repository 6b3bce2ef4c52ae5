"""Linear layers whose weights are reordered once, at load, into the CPU GEMM's own blocked layout (oneDNN).

``F.linear`` repacks the whole weight on every call. At decode batch sizes (a few to a few hundred rows) that
repacking is a large share of the matmul: prepacked weights measured 1.2-1.7x faster in float32 and 1.6-2.5x in
bfloat16 (where oneDNN also uses AMX when the CPU has it) for 16-200 rows, and the same at 512 rows. This is
what torch.compile's CPU weight prepacking does; here it is done eagerly, without a compile step.

In float32, though, MKL's own GEMM behind ``F.linear`` is 10-16% faster for prefill-sized steps (thousands of
rows), and the decode gain is a few percent, so by default (``auto``) only bfloat16 weights are packed;
``on`` packs float32 too. Float32 results differ from ``F.linear`` only by summation order (about 1e-7
relative). Only CPU weights are packed; everything else keeps ``nn.Linear``."""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; 64 measured best across 1-512 rows (1 was 1.5-2x slower)
PACK_ROWS_HINT = 64
_PACKABLE = (torch.float32, torch.bfloat16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def should_prepack(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """``--weight-prepack``: auto = bfloat16 only, on = whatever can be packed, off = nothing."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--weight-prepack must be auto, on or off, not {mode!r}")
    return mode != "off" and can_prepack(device, dtype) and (mode == "on" or dtype == torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's layout. Inputs are [rows, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, tied_lm_head: torch.Tensor | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (the dense weight is dropped). With tied
    embeddings, ``tied_lm_head`` (the embedding matrix) also gets a packed copy as ``model.lm_head``, since the
    embedding lookup still needs the dense one. Returns how many layers were packed."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(mod.weight.detach(), mod.bias))
    if tied_lm_head is not None:
        model.lm_head = PackedLinear(tied_lm_head.detach(), None)
        targets.append(("lm_head", model.lm_head))
    log.info("prepacked %d linear layers for the CPU GEMM", len(targets))
    return len(targets)
