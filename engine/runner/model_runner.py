"""The model runner: flattens a scheduled batch into tensors (token ids, positions, pool slots, page tables),
runs the model through the attention backend, and returns the logits of the positions to sample."""
from __future__ import annotations

import torch

from engine.mem.kv_pool import KVPool
from engine.models.llama import CausalLM
from engine.runner.attention.base import AttentionBackend, AttentionMeta, ExtendSeq
from engine.scheduler.batch import ScheduledBatch, ScheduledSeq


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.page_size = pool.shape.page_size

    def _slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Returns logits [n, vocab] (float32) for the sampled sequences, in the returned order."""
        p = self.page_size
        decode = [s for s in batch.seqs if s.num_tokens == 1]
        extend = [s for s in batch.seqs if s.num_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        kv_lens: list[int] = []
        table: list[list[int]] = []
        for s in decode:
            req, pos = s.req, s.start
            ids.extend(req.tokens(pos, pos + 1))
            positions.append(pos)
            slots.append(self._slot(req.pages, pos))
            kv_lens.append(pos + 1)
            table.append(req.pages[: pos // p + 1])
            if s.sample:
                logit_rows.append(len(ids) - 1)
                sampled.append(s)
        extends: list[ExtendSeq] = []
        for s in extend:
            req = s.req
            q_start = len(ids)
            ids.extend(req.tokens(s.start, s.end))
            positions.extend(range(s.start, s.end))
            slots.extend(self._slot(req.pages, t) for t in range(s.start, s.end))
            pages = torch.tensor(req.pages[: -(-s.end // p)], dtype=torch.long, device=self.device)
            extends.append(ExtendSeq(q_start, s.num_tokens, s.end, pages))
            if s.sample:
                logit_rows.append(len(ids) - 1)
                sampled.append(s)
        width = max((len(t) for t in table), default=0)
        meta = AttentionMeta(
            out_slots=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode=len(decode),
            decode_kv_lens=torch.tensor(kv_lens, dtype=torch.long, device=self.device),
            decode_page_table=torch.tensor([t + [0] * (width - len(t)) for t in table], dtype=torch.long,
                                           device=self.device).reshape(len(table), width),
            extends=tuple(extends),
        )
        self.backend.begin(meta)
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            torch.tensor(logit_rows, dtype=torch.long, device=self.device),
            self.backend,
        )
        return logits, sampled
