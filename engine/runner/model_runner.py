"""The model runner: flattens a scheduled batch into tensors (token ids, positions, pool slots, page tables),
runs the model through the attention backend, and returns the logits of the positions to sample, and of every
prompt position of a request that asked for prompt logprobs (echo with logprobs)."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from engine.mem.kv_pool import KVPool
from engine.models.llama import CausalLM
from engine.runner.attention.base import AttentionBackend, AttentionMeta, ExtendSeq
from engine.runner.attention.torch_backend import TorchAttentionBackend
from engine.runner.layer_stack import LayerStack
from engine.scheduler.batch import ScheduledBatch, ScheduledSeq
from engine.spec.tree import depths, path


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [rows of the sampled sequences, vocab] float32 (1 + len(draft) rows each)
    sampled: list[ScheduledSeq]
    # per extend chunk that asked for prompt logprobs: the chunk and the logits of its positions that predict a
    # prompt token (positions seq.start, seq.start + 1, ...)
    prompt_logits: list[tuple[ScheduledSeq, torch.Tensor]]
    # a runner built with hidden=True: the final hidden state of every computed row ([T, hidden]), and each
    # sequence's first row in it (a drafted one's rows are its newest token, then its draft nodes)
    hidden: torch.Tensor | None = None
    first_rows: dict[int, int] | None = None  # id(seq) -> row


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend, device: torch.device,
                 hidden: bool = False, layer_stack: bool = True) -> None:
        """``hidden``: every forward also returns the final hidden states of all its rows (a drafter that reads
        the target's features, engine/spec/base.py). ``layer_stack``: steps run their layers as one native call
        where they can (layer_stack.py)."""
        self.hidden = hidden
        self.stack = (LayerStack.build(model, pool, backend.scale, backend.native_decode, backend.native_prefill)
                      if layer_stack and isinstance(backend, TorchAttentionBackend) else None)
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.page_size = pool.shape.page_size

    def _slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    @staticmethod
    def _prompt_rows(s: ScheduledSeq, q_start: int, rows: list[tuple[ScheduledSeq, int, int]]) -> None:
        """For a request that asked for prompt logprobs: the chunk's positions whose next token is a prompt token."""
        if s.req.sampling.prompt_logprobs is None:
            return
        last = min(s.end, len(s.req.prompt_ids) - 1)
        if last > s.start:
            rows.append((s, q_start, last - s.start))

    @staticmethod
    def _draft_rows(s: ScheduledSeq) -> list[tuple[int, int, list[int]]]:
        """Per computed row of a decode (its newest token, then each draft node): its rotary position, how many of
        the request's first positions it attends over, and the storage positions it attends over after those (a
        tree node's path where it leaves the chain of storage positions; engine/spec/tree.py)."""
        if not s.parents:
            return [(pos, pos + 1, []) for pos in range(s.start, s.end)]
        rows = [(s.start, s.start + 1, [])]
        for i, depth in enumerate(depths(s.parents, len(s.draft))):
            nodes = path(s.parents, i)
            m = next((j for j, node in enumerate(nodes) if node != j), len(nodes))  # nodes 0..m-1: storage order
            rows.append((s.start + depth, s.start + 1 + m, [s.start + 1 + node for node in nodes[m:]]))
        return rows

    def settle_draft(self, seq: ScheduledSeq, moves: list[tuple[int, int]]) -> None:
        """Move an accepted tree path's K/V to the positions a chain would have put it at (tree.moves: offsets
        after the newest token, copied in order)."""
        pages = seq.req.pages
        for src, dst in moves:
            self.pool.copy_slot(self._slot(pages, seq.start + src), self._slot(pages, seq.start + dst))

    @staticmethod
    def sampled_order(batch: ScheduledBatch) -> list[ScheduledSeq]:
        """The sequences whose logits ``forward`` returns, in its order (decodes, drafted ones included, first);
        a drafted sequence has one row per computed position, the others one row each."""
        return ([s for s in batch.seqs if s.sample and (s.num_tokens == 1 or s.draft)]
                + [s for s in batch.seqs if s.sample and s.num_tokens > 1 and not s.draft])

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> ForwardOutput:
        """Logits (float32) for the sampled sequences, in the returned order, and the prompt rows."""
        p = self.page_size
        decode = [s for s in batch.seqs if s.num_tokens == 1 or s.draft]
        extend = [s for s in batch.seqs if s.num_tokens > 1 and not s.draft]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        kv_lens: list[int] = []
        table: list[list[int]] = []
        prompt_rows: list[tuple[ScheduledSeq, int, int]] = []
        extra: list[list[int]] = []  # per decode row: slots it attends over past its kv_len (draft tree paths)
        first_rows: dict[int, int] = {}
        for s in decode:  # one token each (a prefill chunk of one token lands here too); a draft's positions are
            req = s.req   # decode rows too, each attending over the positions up to its own (causal by kv_len)
            first_rows[id(s)] = len(ids)
            self._prompt_rows(s, len(ids), prompt_rows)
            ids.extend(req.tokens(s.start, s.start + 1))
            ids.extend(s.draft)
            for row, (pos, seen, own) in enumerate(self._draft_rows(s)):
                positions.append(pos)
                slots.append(self._slot(req.pages, s.start + row))  # row i's K/V at storage position start + i
                kv_lens.append(seen)
                table.append(req.pages[: (seen - 1) // p + 1])
                extra.append([self._slot(req.pages, at) for at in own])
                if s.sample:
                    logit_rows.append(len(positions) - 1)
            if s.sample:
                sampled.append(s)
        extends: list[ExtendSeq] = []
        for s in extend:
            req = s.req
            q_start = first_rows[id(s)] = len(ids)
            ids.extend(req.tokens(s.start, s.end))
            positions.extend(range(s.start, s.end))
            slots.extend(self._slot(req.pages, t) for t in range(s.start, s.end))
            pages = torch.tensor(req.pages[: -(-s.end // p)], dtype=torch.long, device=self.device)
            extends.append(ExtendSeq(q_start, s.num_tokens, s.end, pages))
            if s.sample:
                logit_rows.append(len(ids) - 1)
                sampled.append(s)
            self._prompt_rows(s, q_start, prompt_rows)
        n_sampled = len(logit_rows)
        for _, q_start, n in prompt_rows:
            logit_rows.extend(range(q_start, q_start + n))
        width = max((len(t) for t in table), default=0)
        meta = AttentionMeta(
            out_slots=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode=len(kv_lens),
            decode_kv_lens=torch.tensor(kv_lens, dtype=torch.long, device=self.device),
            decode_page_table=torch.tensor([t + [0] * (width - len(t)) for t in table], dtype=torch.long,
                                           device=self.device).reshape(len(table), width),
            extends=tuple(extends),
        )
        if any(extra):
            most = max(len(e) for e in extra)
            meta = replace(meta, decode_extra_slots=torch.tensor([e + [0] * (most - len(e)) for e in extra],
                                                                 dtype=torch.long, device=self.device),
                           decode_extra_lens=torch.tensor([len(e) for e in extra], dtype=torch.long,
                                                          device=self.device))
        self.backend.begin(meta)
        args = (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device))
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        # the last layer projects out only the rows whose logits are wanted, unless a drafter reads every row's
        # final hidden state
        cut = not self.hidden and logit_rows != list(range(len(ids)))
        if self.stack is not None and self.stack.takes(meta, len(logit_rows) if cut else None):
            extend_args = self.backend.extend_args if isinstance(self.backend, TorchAttentionBackend) else None
            if not self.hidden and self.stack.ends_take(len(logit_rows)):  # the model's ends in the same call
                logits = self.stack.logits(*args, max(positions), meta, extend_args, rows if cut else None)
                return self._output(logits, n_sampled, sampled, prompt_rows, None, first_rows)
            h, residual = self.stack.run(*args, meta, extend_args, rows if cut else None)
            hidden = self.model.tail(h, residual, None) if self.hidden else None
            logits = (self.model.head(hidden[rows]) if hidden is not None
                      else self.model.head(self.model.tail(h, residual, None)) if cut
                      else self.model.tail(h, residual, rows))
        else:
            hidden = self.model(*args, None, self.backend) if self.hidden else None
            logits = self.model.head(hidden[rows]) if hidden is not None else self.model(*args, rows, self.backend)
        return self._output(logits, n_sampled, sampled, prompt_rows, hidden, first_rows)

    @staticmethod
    def _output(logits: torch.Tensor, n_sampled: int, sampled: list[ScheduledSeq],
                prompt_rows: list[tuple[ScheduledSeq, int, int]], hidden: torch.Tensor | None,
                first_rows: dict[int, int]) -> ForwardOutput:
        prompt_logits, at = [], n_sampled
        for seq, _, n in prompt_rows:
            prompt_logits.append((seq, logits[at:at + n]))
            at += n
        sampled_logits = logits if n_sampled == logits.shape[0] else logits[:n_sampled]  # no view where all are
        return ForwardOutput(sampled_logits, sampled, prompt_logits, hidden, first_rows if hidden is not None else None)
