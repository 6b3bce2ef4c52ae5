"""Verification: a decoding request with draft d_1..d_k computes positions for [last, d_1, ..., d_k] in one forward
pass, giving k + 1 rows of logits. Row i is sampled exactly as non-speculative decoding would sample the token
after last, d_1..d_i (same penalties over the output so far, same logit_bias, same seeded uniform for that output
position, same raw logprobs); call that t_i. The output gains t_0, t_1, ... up to and including the first t_i
that differs from d_{i+1} (or t_k when every draft matched): the accepted drafts plus one token of the target's.

Why this is lossless: every emitted token is the token the target would have sampled at that position given the
same prefix, so greedy output is token-identical, a seeded request is token-identical, and an unseeded request's
output has the target's distribution. For a drafter that proposes one token (a point mass q), this is rejection
sampling (Leviathan et al. 2023): d is accepted with probability p(d) = min(1, p(d)/q(d)), and on rejection the
token comes from p without d, renormalised, which is p(.)/(1 - p(d)) over the others, as sampling from p
conditioned on not d gives."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.batch import ScheduledSeq

if TYPE_CHECKING:
    from engine.sampler import TokenLogprob
    from engine.spec.speculator import Speculator


@dataclass(frozen=True)
class DraftRow:
    """What the sampler reads of a request for verification row i: its output as if d_1..d_i were accepted."""

    sampling: SamplingParams
    seed: int | None
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: Any = None  # the request's GrammarState, which the mask filler advances by ``ahead`` for this row
    ahead: tuple[int, ...] = ()


def draft_rows(req: Request, draft: tuple[int, ...]) -> list[DraftRow]:
    """The k + 1 rows a drafted request samples."""
    return [DraftRow(req.sampling, req.seed, req.prompt_ids, req.output_ids + list(draft[:i]), req.grammar,
                     tuple(draft[:i])) for i in range(len(draft) + 1)]


def accepted(draft: tuple[int, ...], sampled: list[int]) -> list[int]:
    """The tokens verification emits: ``sampled[i]`` (t_i) for i = 0, 1, ... through the first that differs
    from ``draft[i]`` (or the last row's)."""
    assert len(sampled) == len(draft) + 1, "one sampled token per verified position"
    for i, d in enumerate(draft):
        if sampled[i] != d:
            return sampled[:i + 1]
    return list(sampled)


def split_rows(order: list[ScheduledSeq], tokens: list[int], logprobs: list[TokenLogprob | None],
               errors: dict[int, Exception], spec: Speculator | None) -> tuple[
                   dict[Request, list[int]], dict[Request, list[TokenLogprob]], dict[Request, tuple[int, int]],
                   list[tuple[Request, Exception]]]:
    """From a step's sampled rows (``order``: the sampled sequences, 1 + len(draft) rows each) to, per request,
    the tokens it emits (a drafted one's verified run), their logprobs, (drafted, accepted) for drafted ones,
    and the requests whose rows failed (each with its error), which emit nothing."""
    new: dict[Request, list[int]] = {}
    lps: dict[Request, list[TokenLogprob]] = {}
    drafts: dict[Request, tuple[int, int]] = {}
    failed: list[tuple[Request, Exception]] = []
    at = 0
    for seq in order:
        req, span = seq.req, range(at, at + 1 + len(seq.draft))
        at = span.stop
        error = next((errors[i] for i in span if i in errors), None)
        if error is not None:
            failed.append((req, error))
            continue
        rows = tokens[span.start:span.stop]
        run = spec.verify(seq, rows) if seq.draft and spec is not None else rows
        new[req] = run
        lps[req] = [lp for lp in logprobs[span.start:span.start + len(run)] if lp is not None]
        if seq.draft:
            drafts[req] = (len(seq.draft), len(run) - 1)
    return new, lps, drafts, failed
