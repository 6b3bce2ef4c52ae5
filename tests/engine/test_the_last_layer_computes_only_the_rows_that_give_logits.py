"""A prefill chunk's last decoder layer runs its output projection and MLP for the rows that give logits only (the
sampling row of each prompt, prompt-logprob rows): no later layer reads the others. Every row's K/V is still
written, so what follows the prompt is unchanged (checked against transformers in test_logits_match_transformers,
and here against a run that computed every row). This is the per-layer path (the native layer stack, which does
the same, is checked bit for bit against it in test_layer_stack_matches_the_layers)."""
from __future__ import annotations

from pathlib import Path

from engine.models import llama
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core


def mlp_rows(core) -> list[list[int]]:  # noqa: ANN001 - an EngineCore
    """Rows entering each layer's MLP, per forward (recorded by hooks)."""
    seen: list[list[int]] = []
    layers = core.model.layers

    def hook(i: int):  # noqa: ANN202
        def record(_mod, args) -> None:  # noqa: ANN001
            if i == 0:
                seen.append([])
            seen[-1].append(args[0].shape[0])
        return record
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(hook(i))
    return seen


def generate(core, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(p, params, detokenize=False) for p in prompts]
    core.run_to_completion(reqs)
    return [r.output_ids for r in reqs]


def test_only_the_sampling_rows_reach_the_last_layers_mlp_and_the_tokens_do_not_change(
        tiny_model_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    prompts = [list(range(5, 45)), list(range(100, 123))]
    core = make_core(tiny_model_dir, disable_radix_cache=True, decode_stack="off")
    seen = mlp_rows(core)
    got = generate(core, prompts)
    first = seen[0]  # the prefill step: both prompts whole (63 rows), two of them sampling
    assert first[:-1] == [63] * (len(first) - 1) and first[-1] == 2, first

    def every_row(self, input_ids, positions, logit_rows, backend):  # noqa: ANN001, ANN202 - the old forward
        h = self.embed_tokens(input_ids)
        rope = self.rope.table(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, backend)
        return self.tail(h, residual, logit_rows)
    monkeypatch.setattr(llama.CausalLM, "forward", every_row)
    assert generate(make_core(tiny_model_dir, disable_radix_cache=True, decode_stack="off"), prompts) == got
