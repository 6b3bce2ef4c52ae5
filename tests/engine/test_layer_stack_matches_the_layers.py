"""The native layer stack (engine/runner/layer_stack.c) computes what the per-layer path computes, bit for bit:
every forward of a mixed run (decode rows alone, decode rows beside prefill chunks, prefill chunks alone, chunks
over a cached prefix, draft-tree verifications whose rows attend over paths out of storage order, retraction in a
tight pool) runs both ways on the same batch and the logits compare equal, on the tiny Llama and on a Qwen2
checkpoint (QKV bias). The stack takes the steps whose rows, and rows whose logits are wanted, are counts every
layer's few-rows GEMM takes, and is left out with ``--decode-stack off``, for Qwen3's per-head norms and under a
KV pool narrower than the model. SmolLM2 in float32 and bfloat16:
tests/real_model/test_smollm2_layer_stack_matches_the_layers.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine_core import EngineCore
from engine.models import row_calibration
from engine.runner.attention.base import AttentionMeta, ExtendSeq
from engine.runner.layer_stack import LayerStack
from engine.sampling_params import SamplingParams
from tests.drafters import TreeDrafter, drafting_always
from tests.engine.conftest import make_core
from tests.engine.test_speculative_decoding_is_lossless import NGRAM, params, prompts, run
from tests.helpers import write_hf_checkpoint


class BothPaths:
    """Runs every forward of ``core`` with the stack and again without it (the second writes the same K/V to the
    same slots) and asserts equal outputs; counts the forwards, those the stack took and those whose ends (the
    embedding, the final norm and the LM head) it ran too. ``ends=False``: the stack runs the layers alone."""

    def __init__(self, core: EngineCore, ends: bool = True) -> None:
        runner = core.runner
        stack = runner.stack
        assert stack is not None, "the stack was meant to be built"
        assert stack.head is not None, "the stack was meant to take the model's ends"
        if not ends:
            stack.head = None
        self.forwards = self.stacked = self.stacked_extends = self.cut = self.ended = 0
        forward, run_stack, run_logits = runner.forward, stack.run, stack.logits

        def counted(*args):  # noqa: ANN002, ANN202
            self.stacked += 1
            self.stacked_extends += bool(args[2].extends)
            h, residual = run_stack(*args)
            if args[4] is not None:  # the last layer's rows: those whose logits are wanted (all of them, in
                # another order, for a whole prompt chunk with prompt logprobs)
                self.cut += 1
                assert h.shape[0] == residual.shape[0] == args[4].shape[0] <= args[0].shape[0]
            return h, residual
        stack.run = counted  # type: ignore[method-assign]

        def counted_logits(*args):  # noqa: ANN002, ANN202
            self.stacked += 1
            self.ended += 1
            self.stacked_extends += bool(args[3].extends)
            logits = run_logits(*args)
            if args[5] is not None:
                self.cut += 1
                assert logits.shape[0] == args[5].shape[0] <= args[0].shape[0]
            return logits
        stack.logits = counted_logits  # type: ignore[method-assign]

        def both(batch):  # noqa: ANN001, ANN202
            self.forwards += 1
            got = forward(batch)
            runner.stack = None
            try:
                want = forward(batch)
            finally:
                runner.stack = stack
            assert torch.equal(got.logits, want.logits)
            assert [id(s) for s in got.sampled] == [id(s) for s in want.sampled]
            for (_, a), (_, b) in zip(got.prompt_logits, want.prompt_logits, strict=True):
                assert torch.equal(a, b)
            assert (got.hidden is None) == (want.hidden is None)
            if got.hidden is not None:
                assert torch.equal(got.hidden, want.hidden)
            return got
        runner.forward = both  # type: ignore[method-assign]


def pin_kernel_rows(monkeypatch: pytest.MonkeyPatch, top: int = 63) -> None:
    """Pins the few-rows kernel's own calibration to 1-``top`` rows. The host's answer varies (a Zen 3 host's gave
    the tiny model 1-32 and SmolLM2 1-64, too few for any step with prefill chunks in these runs, which then all
    went through the layers), so pinned, the steps the stack takes are the same on every host. Which GEMM takes
    the other counts (oneDNN or MKL), the packed routes and bfloat16's widening keep the host's answers."""
    real = row_calibration.cached_rows
    rows = frozenset(range(1, top + 1))
    monkeypatch.setattr(row_calibration, "cached_rows", lambda key, measure, file=None:
                        real(key, measure, file) if "onednn" in key or "-vs-" in key or "widen" in key else rows)


def check_mixed_run(core: EngineCore, n: int = 8, ends: bool = True) -> BothPaths:
    both = BothPaths(core, ends)
    run(core, prompts(n), [params(i) for i in range(n)])
    assert both.stacked > both.stacked_extends > 0, "the stack took decode steps and steps with prefill chunks"
    assert both.cut > 0, "a prefill chunk's last layer ran over its sampling row alone"
    assert (both.ended == both.stacked) if ends else both.ended == 0
    return both


@pytest.mark.parametrize("ends", [True, False], ids=["with_ends", "layers_alone"])
@pytest.mark.parametrize("pool", [8192, 160], ids=["roomy", "tight"])
def test_tiny_llama_steps_and_tree_verifications_match(tiny_model_dir: Path, pool: int, ends: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pin_kernel_rows(monkeypatch)  # the first step (8 prompts' 8-token chunks, 64 rows) is left to the layers
    ref = run(make_core(tiny_model_dir), prompts(8), [params(i) for i in range(8)])
    core = make_core(tiny_model_dir, chunk=8, max_total_tokens=pool, speculative=drafting_always(NGRAM),
                     drafter=TreeDrafter({r.rid: r.output_ids for r in ref}, 4000))
    both = check_mixed_run(core, ends=ends)
    assert both.stacked < both.forwards, "steps of more rows than the GEMM kernel takes go through the layers"
    if pool == 160:
        assert core.scheduler.num_retractions > 0, "the tight pool was meant to retract"


def test_plain_decoding_with_prompt_logprobs_matches(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, chunk=16)
    both = BothPaths(core)
    reqs = [core.make_request(p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2,
                                                prompt_logprobs=1 if i % 2 else None), detokenize=False)
            for i, p in enumerate(prompts(6))]
    for r in reqs:
        core.add_request(r)
    for _ in range(500):
        if all(r.finished for r in reqs):
            break
        core.step()
    assert all(r.finished for r in reqs) and both.stacked > 0


def test_a_qwen2_checkpoint_with_qkv_bias_matches(tmp_path: Path, tiny_model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pin_kernel_rows(monkeypatch)
    ckpt = write_hf_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=4096, tokenizer_from=tiny_model_dir)
    core = make_core(ckpt, chunk=8, speculative=drafting_always(NGRAM))
    assert core.model.layers[0].self_attn.qkv_proj.bias is not None
    check_mixed_run(core)


def _core(model_dir: Path, decode_stack: str = "auto", kv_cache_dtype: str = "auto") -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model_path=str(model_dir), decode_stack=decode_stack),
                                   CacheConfig(page_size=4, max_total_tokens=2048, kv_cache_dtype=kv_cache_dtype)))


def test_the_stack_is_left_out_where_it_does_not_apply(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert isinstance(_core(tiny_model_dir).runner.stack, LayerStack)
    assert _core(tiny_model_dir, decode_stack="off").runner.stack is None
    assert _core(tiny_model_dir, kv_cache_dtype="bfloat16").runner.stack is None  # the K/V would need converting
    qwen3 = write_hf_checkpoint(tmp_path / "qwen3", "qwen3", tokenizer_from=tiny_model_dir)
    assert _core(qwen3).runner.stack is None  # per-head QK norms


def test_the_stack_takes_only_its_row_counts(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir)
    stack = core.runner.stack
    assert stack is not None and stack.rows and stack.extends
    inside, outside = min(stack.rows), max(stack.rows) + 1

    def meta(decodes: int, extends: tuple[ExtendSeq, ...] = ()) -> AttentionMeta:
        rows = decodes + sum(e.q_len for e in extends)
        return AttentionMeta(torch.arange(rows), decodes, torch.ones(decodes, dtype=torch.long),
                             torch.ones(decodes, 1, dtype=torch.long), extends)
    assert stack.takes(meta(inside))
    assert not stack.takes(meta(outside))
    chunk = (ExtendSeq(inside, 3, 3, torch.tensor([1])),)
    assert stack.takes(meta(inside, chunk)) == (inside + 3 in stack.rows)
    assert not stack.takes(meta(outside, chunk))
    assert not stack.takes(meta(0, chunk), out_rows=outside)  # the last layer's GEMMs run over the wanted rows
    runner = core.runner
    without = LayerStack.build(runner.model, runner.pool, runner.backend.scale, native_decode=True)
    assert without is not None and not without.extends and not without.takes(meta(0, chunk))


def test_the_stack_refuses_a_token_or_position_outside_its_tables(tiny_model_dir: Path) -> None:
    stack = _core(tiny_model_dir).runner.stack
    assert stack is not None and stack.head is not None and stack.ends_take(1)
    # one decode row at position 0: its K/V into slot 0, attending over that slot (page 0)
    meta = AttentionMeta(torch.zeros(1, dtype=torch.long), 1, torch.ones(1, dtype=torch.long),
                         torch.zeros(1, 1, dtype=torch.long), ())
    vocab = stack.model.embed_tokens.weight.shape[0]
    ok = stack.logits(torch.tensor([vocab - 1]), torch.tensor([0]), 0, meta)
    assert ok.shape == (1, vocab) and ok.dtype == torch.float32 and torch.isfinite(ok).all()
    with pytest.raises(IndexError, match="token id"):
        stack.logits(torch.tensor([vocab]), torch.tensor([0]), 0, meta)
    rows = stack.model.rope.tables(1)[0].shape[0]
    with pytest.raises(IndexError, match="position"):  # top_position understated: the tables were not grown to it
        stack.logits(torch.tensor([1]), torch.tensor([rows]), 0, meta)
