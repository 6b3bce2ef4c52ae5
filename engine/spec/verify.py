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
conditioned on not d gives.

A tree draft (engine/spec/tree.py) verifies every node the same way: node i's row is sampled as the token after
the root's sequence plus node i's path, with the seeded uniform of its depth's output position; the walk from the
root follows the child that holds the sampled token. Each emitted token is still the target's sample given the
tokens before it, so trees are exactly as lossless as chains, whatever branches they hold."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.batch import ScheduledSeq
from engine.spec.tree import path, walk

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


def draft_rows(req: Request, draft: tuple[int, ...], parents: tuple[int, ...] = ()) -> list[DraftRow]:
    """The 1 + len(draft) rows a drafted request samples: the root's, then each node's (its path accepted)."""
    aheads = [()] + [tuple(draft[j] for j in path(parents, i)) for i in range(len(draft))]
    return [DraftRow(req.sampling, req.seed, req.prompt_ids, req.output_ids + list(a), req.grammar, a)
            for a in aheads]


def accepted(draft: tuple[int, ...], sampled: list[int], parents: tuple[int, ...] = ()) -> list[int]:
    """The tokens verification emits: for a chain ``sampled[i]`` (t_i) for i = 0, 1, ... through the first that
    differs from ``draft[i]`` (or the last row's); for a tree, the sampled tokens along the walk (tree.walk)."""
    return walk(draft, parents, sampled)[0]


class Verified(NamedTuple):
    """A step's sampled rows, per request: the tokens it emits (a drafted one's verified run), their logprobs,
    (drafted, accepted) for drafted ones, the requests whose rows failed (each with its error; they emit
    nothing), and a drafted request's accepted nodes (a tree's K/V moves by them, tree.moves)."""

    new: dict[Request, list[int]]
    logprobs: dict[Request, list[TokenLogprob]]
    drafts: dict[Request, tuple[int, int]]
    failed: list[tuple[Request, Exception]]
    nodes: dict[Request, list[int]]  # a drafted request's accepted draft nodes, in path order


def split_rows(order: list[ScheduledSeq], tokens: list[int], logprobs: list[TokenLogprob | None],
               errors: dict[int, Exception], spec: Speculator | None) -> Verified:
    """From a step's sampled rows (``order``: the sampled sequences, 1 + len(draft) rows each) to what each
    request emits."""
    out = Verified({}, {}, {}, [], {})
    at = 0
    for seq in order:
        req, span = seq.req, range(at, at + 1 + len(seq.draft))
        at = span.stop
        error = next((errors[i] for i in span if i in errors), None)
        if error is not None:
            out.failed.append((req, error))
            continue
        rows = tokens[span.start:span.stop]
        run, nodes = (spec.verify(seq, rows) if seq.draft and spec is not None
                      else (rows, list(range(len(rows) - 1))))
        out.new[req] = run
        out.logprobs[req] = [lp for lp in (logprobs[span.start + r] for r in [0, *(1 + i for i in nodes)])
                             if lp is not None]
        if seq.draft:
            out.nodes[req] = nodes
            out.drafts[req] = (len(seq.draft), len(run) - 1)
    return out


def feature_rows(seqs: list[ScheduledSeq], first_rows: dict[int, int],
                 verified: Verified) -> list[tuple[ScheduledSeq, list[int]]]:
    """Per computed sequence, the forward's rows of the positions it keeps, from ``seq.start`` on: a chunk's or a
    decode's every row, a drafted request's newest token and its accepted nodes (none for a failed request)."""
    failed = {id(req) for req, _ in verified.failed}
    out = []
    for seq in seqs:
        if id(seq.req) in failed or seq.req.finished and seq.req not in verified.new:
            continue
        first = first_rows[id(seq)]
        if seq.draft:
            out.append((seq, [first, *(first + 1 + i for i in verified.nodes.get(seq.req, []))]))
        else:
            out.append((seq, list(range(first, first + seq.num_tokens))))
    return out
