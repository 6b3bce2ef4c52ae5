"""Sampling: pure functions from a step's logits and its requests' parameters to next tokens.

Order per row: raw log-probabilities (for ``logprobs``) -> the grammar's token mask -> penalties (repetition on
prompt+output, frequency and presence on output) -> ``logit_bias`` (added to the logits, OpenAI's semantics) ->
greedy argmax, or temperature
-> top-k / top-p / min-p filtering -> one draw from the distribution by inverting its cumulative sum at a uniform
u in [0, 1) (sampler.c on CPU, which also filters without sorting the vocabulary: one random number per row where
an exponential race needs one per vocabulary entry). A request with a seed takes u from (seed, output position)
alone, so its tokens do not depend on batching, preemption or which worker runs the step.

One request never fails another: the per-row work (penalties, bias, logprobs) runs row by row, and
a row that raises is reported in ``errors`` (its token is -1) while every other row is sampled as usual; the
batched work (filtering and the draw, argmax) does not depend on what a request asked for."""
from __future__ import annotations

import ctypes
import functools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine import native
from engine.request import Request

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one sampling step (splitmix64 of seed and position)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    def pack(self) -> bytes:
        """Compact bytes (the prefill worker sends the first token's logprobs in the aux record)."""
        head = struct.pack("<ifB", self.token_id, self.logprob, len(self.top))
        return head + b"".join(struct.pack("<if", t, v) for t, v in self.top)

    @classmethod
    def unpack(cls, data: bytes, offset: int = 0) -> TokenLogprob:
        token, logprob, n = struct.unpack_from("<ifB", data, offset)
        top = [struct.unpack_from("<if", data, offset + 9 + 8 * i) for i in range(n)]
        return cls(token, logprob, [(int(t), float(v)) for t, v in top])

    @property
    def packed_size(self) -> int:
        return 9 + 8 * len(self.top)


def pack_logprobs(lps: list[TokenLogprob]) -> bytes:
    """A list of logprobs as bytes (the prefill worker sends a prompt's logprobs to the decode worker)."""
    return struct.pack("<I", len(lps)) + b"".join(lp.pack() for lp in lps)


def unpack_logprobs(data: bytes) -> list[TokenLogprob]:
    """The inverse of pack_logprobs; ValueError for bytes that are not a whole list."""
    try:
        (count,) = struct.unpack_from("<I", data)
        out, offset = [], 4
        for _ in range(count):
            lp = TokenLogprob.unpack(data, offset)
            out.append(lp)
            offset += lp.packed_size
    except struct.error as e:
        raise ValueError(f"truncated logprobs payload: {e}") from None
    if offset != len(data):
        raise ValueError(f"logprobs payload has {len(data) - offset} trailing bytes")
    return out


def adjust_row(x: torch.Tensor, req: Request) -> None:
    """Penalties, then logit_bias, in place on one row of logits."""
    sp = req.sampling
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_ids) | set(req.output_ids)), dtype=torch.long, device=x.device)
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and req.output_ids:
        out = torch.tensor(req.output_ids, dtype=torch.long, device=x.device)
        counts = torch.bincount(out, minlength=x.shape[0]).to(x.dtype)
        x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=x.device)
        x[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=x.dtype, device=x.device)


def _per_row(rows: list[int], fn: Callable[[int], None], errors: dict[int, Exception] | None) -> None:
    """``fn(row)`` for each row; with ``errors`` a row that raises is recorded there instead of raising."""
    for row in rows:
        if errors is not None and row in errors:
            continue
        try:
            fn(row)
        except Exception as e:  # noqa: BLE001 - one request's failure, reported for that request alone
            if errors is None:
                raise
            errors[row] = e


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k / top-p nucleus / min-p threshold (not renormalised)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
    drop |= before >= top_p.unsqueeze(1)
    drop |= sorted_p < (min_p * sorted_p[:, :1].squeeze(1)).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    keep_sorted = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, keep_sorted)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of a seeded request's draw at an output position: 53 bits of step_seed."""
    return (step_seed(seed, position) >> 10) * 2.0**-53


def _uniforms(rows: list[int], reqs: list[Request], shared: torch.Generator) -> torch.Tensor:
    u = torch.rand(len(rows), dtype=torch.float64, generator=shared)
    for i, r in enumerate(rows):
        if reqs[r].seed is not None:
            u[i] = seeded_uniform(reqs[r].seed, len(reqs[r].output_ids))
    return u


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("sampler.c"))
    if lib is not None:
        lib.splitserve_sample_rows.restype = ctypes.c_int
        lib.splitserve_sample_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + \
            [ctypes.c_void_p] * 6 + [ctypes.c_int]
    return lib


@dataclass(frozen=True)
class Filters:
    """Per drawn row: keep the top_k most likely tokens (the vocabulary size: all), the top_p nucleus (1.0: all),
    the tokens at least min_p as likely as the most likely (0.0: all)."""

    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32


def _draw_rows(x: torch.Tensor, rows: list[int], reqs: list[Request], u: torch.Tensor) -> list[int]:
    """``draw`` for the listed rows with their requests' temperature and filters, the native kernel's arguments
    built as C arrays from the parameters rather than as tensors (a batch-1 sampled step spent ~0.3 ms in the
    dozen small torch ops that built them, in caches the step's weights had swept). The values are ``draw``'s: the
    float32 temperatures' float32 reciprocals (a double quotient rounded to float32 is the float32 quotient; one
    below float32's range is 0 there, and 1 / 0 is inf, as torch's reciprocal gives: the kernel takes the argmax)."""
    sps = [reqs[i].sampling for i in rows]
    vocab = x.shape[-1]
    temperature = (ctypes.c_float * len(rows))(*(sp.temperature for sp in sps))
    got = _native_draw(x, rows, [1.0 / t if t else math.inf for t in temperature],
                       [sp.top_k if sp.top_k > 0 else vocab for sp in sps], [sp.top_p for sp in sps],
                       [sp.min_p for sp in sps], u)
    if got is not None:
        return got
    filters = (Filters(torch.tensor([sp.top_k if sp.top_k > 0 else vocab for sp in sps]),
                       torch.tensor([sp.top_p for sp in sps]), torch.tensor([sp.min_p for sp in sps]))
               if any(sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0 for sp in sps) else None)
    return _torch_draw(x, rows, torch.tensor([sp.temperature for sp in sps]), u, filters).tolist()


def _native_draw(x: torch.Tensor, rows: list[int], inv_temperature: list[float], top_k: list[int],
                 top_p: list[float], min_p: list[float], u: torch.Tensor) -> list[int] | None:
    """The rows' tokens from sampler.c (each list per row; top_k past the vocabulary keeps all of it), or None
    where it does not run: not CPU float32 rows, uniforms not contiguous float64, or its scratch not allocated."""
    lib = _kernel() if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1 else None
    if lib is None or u.dtype != torch.float64 or not u.is_contiguous():
        return None
    n, vocab = len(rows), x.shape[1]
    f32, i64 = ctypes.c_float * n, ctypes.c_int64 * n
    out = i64()
    if lib.splitserve_sample_rows(x.data_ptr(), i64(*rows), n, vocab, x.stride(0), f32(*inv_temperature),
                                  i64(*(min(k, vocab) for k in top_k)), f32(*top_p), f32(*min_p), u.data_ptr(), out,
                                  torch.get_num_threads()) != 0:
        return None
    return list(out)


def draw(x: torch.Tensor, rows: list[int], temperature: torch.Tensor, u: torch.Tensor,
         filters: Filters | None = None) -> torch.Tensor:
    """One token per listed row of logits ``x``, from softmax(x[row] / temperature[i]) restricted by
    ``filters``, with uniform u[i]. Native on CPU (sampler.c); elsewhere filter_probs and a float64 cumulative
    sum inverted in token order."""
    n, vocab = len(rows), x.shape[1]
    got = _native_draw(x, rows, (1.0 / temperature).float().tolist(),
                       filters.top_k.tolist() if filters else [vocab] * n,
                       filters.top_p.tolist() if filters else [1.0] * n,
                       filters.min_p.tolist() if filters else [0.0] * n, u.to(torch.float64).contiguous())
    return torch.tensor(got, dtype=torch.int64) if got is not None else _torch_draw(x, rows, temperature, u, filters)


def _torch_draw(x: torch.Tensor, rows: list[int], temperature: torch.Tensor, u: torch.Tensor,
                filters: Filters | None) -> torch.Tensor:
    """``draw`` in torch: filter_probs and a float64 cumulative sum inverted in token order."""
    w = torch.softmax(x[rows].double() / temperature.to(x.device, torch.float64).unsqueeze(1), dim=-1)
    if filters is not None:
        w = filter_probs(w, *(t.to(x.device) for t in (filters.top_k, filters.top_p, filters.min_p)))
    cum = w.cumsum(dim=-1)
    target = (u.to(cum) * cum[:, -1]).unsqueeze(1)
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of a 2-D tensor (first index on ties). On CPU numpy's SIMD argmax is used:
    over a batch of 64 x 32000 float32 logits it took 0.34 ms where torch's took 2.5 ms."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(x.numpy(), axis=1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, reqs: list[Request], shared: torch.Generator,
           errors: dict[int, Exception] | None = None,
           constrain: Callable[[torch.Tensor], None] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [len(reqs), V] float32 (modified in place); ``reqs`` are the rows' requests, or what a row reads of
    one (engine/spec/verify.DraftRow: a request's output as if drafts were accepted). Returns next tokens and,
    where asked, logprobs.
    With ``errors`` given, a row whose request made its own sampling fail is recorded there (token -1, no
    logprobs) and the other rows are unaffected; without it the first such failure raises. ``constrain``
    (a grammar's token mask) runs on the logits after the raw logprobs are taken and before penalties: logprobs
    stay the model's own, the sampled token is always one the grammar allows."""
    want_lp = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
    if constrain is not None:
        constrain(logits)
    _per_row([i for i, r in enumerate(reqs) if r.sampling.adjusts_logits],
             lambda i: adjust_row(logits[i], reqs[i]), errors)
    rows = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
    # the argmax only where a row is greedy (over SmolLM2's 49k vocabulary it is tens of microseconds in a step)
    token_list = row_argmax(logits).tolist() if len(rows) < len(reqs) else [0] * len(reqs)
    if rows:
        for i, token in zip(rows, _draw_rows(logits, rows, reqs, _uniforms(rows, reqs, shared)), strict=True):
            token_list[i] = token
    logprobs: list[TokenLogprob | None] = [None] * len(reqs)
    if raw_lp is not None:
        lp_row = {i: j for j, i in enumerate(want_lp)}

        def record(i: int) -> None:
            k = reqs[i].sampling.logprobs or 0
            row = raw_lp[lp_row[i]]
            top: list[tuple[int, float]] = []
            if k:
                vals, ids = row.topk(k)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprob(token_list[i], float(row[token_list[i]]), top)
        _per_row(want_lp, record, errors)
    for i in errors or ():
        token_list[i], logprobs[i] = -1, None
    return token_list, logprobs


def record_prompt_logprobs(req: Request, start: int, rows: torch.Tensor) -> None:
    """Append the logprobs of prompt tokens start + 1 ... from the logits of positions start ... (raw, before
    any penalty or bias). A recomputed chunk (after retraction) adds nothing twice."""
    k = req.sampling.prompt_logprobs or 0
    lp = torch.log_softmax(rows.float(), dim=-1)
    targets = torch.tensor(req.prompt_ids[start + 1:start + 1 + rows.shape[0]], dtype=torch.long)
    chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    tops = lp.topk(k, dim=-1) if k else None
    for i, (token, value) in enumerate(zip(targets.tolist(), chosen)):
        if start + i != len(req.prompt_logprobs):
            continue
        top = list(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else []
        req.prompt_logprobs.append(TokenLogprob(token, float(value), top))
