"""Engine benchmark: our engine against transformers on the same model, prompts and threads, in one run.

Workload: N requests of P random prompt tokens and O output tokens (EOS ignored, greedy). Baselines: transformers
``model.generate`` in static batches of 16, and transformers' continuous batching (``generate_batch``). Also the
machine's floors (matmul GFLOP/s, copy GB/s measured now), decode CPU overhead per step on the tiny model at
batch 64, and prefix reuse (TTFT with the radix cache vs --disable-radix-cache on a shared system prompt).

    python -m benchmarks.bench_engine --models tiny 150m --dtypes float32 bfloat16
    python -m benchmarks.bench_engine --models smollm2 --dtypes float32 bfloat16   # the real default model
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (BENCH_MODELS, copy_gbps, hf_model, machine, matmul_gflops, model_config, model_dir, table,
                               write_json)
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompts_for(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def make_core(path: Path, dtype: str, threads: int, n: int, tokens: int, radix: bool = True,
              kv_cache_dtype: str = "auto") -> EngineCore:
    return EngineCore(EngineConfig(
        ModelConfig(model_path=str(path), dtype=dtype, num_threads=threads),
        CacheConfig(max_total_tokens=n * tokens + 4096, disable_radix_cache=not radix, kv_cache_dtype=kv_cache_dtype),
        SchedulerConfig(max_running_requests=n, chunked_prefill_size=512, max_prefill_tokens=4096)))


def run_ours(path: Path, dtype: str, threads: int, prompts: list[list[int]], out_len: int,
             kv_cache_dtype: str = "auto") -> dict[str, Any]:
    core = make_core(path, dtype, threads, len(prompts), len(prompts[0]) + out_len, radix=False,
                     kv_cache_dtype=kv_cache_dtype)
    greedy = dict(temperature=0.0, ignore_eos=True)
    # warm up on full-length prompts, so kernels compiled per shape (oneDNN) are not timed
    warm = [core.make_request(p, SamplingParams(max_new_tokens=2, **greedy), detokenize=False) for p in prompts[:2]]
    core.run_to_completion(warm)
    reqs = [core.make_request(p, SamplingParams(max_new_tokens=1, **greedy), detokenize=False) for p in prompts]
    t = time.perf_counter()
    core.run_to_completion(reqs)
    prefill_s = time.perf_counter() - t
    model_time = [0.0]
    last: list[Any] = [None]
    forward, schedule = core.model.forward, core.scheduler.schedule

    def timed_forward(*a: Any, **k: Any) -> torch.Tensor:
        s = time.perf_counter()
        out = forward(*a, **k)
        model_time[0] += time.perf_counter() - s
        return out

    def recorded_schedule() -> Any:
        last[0] = schedule()
        return last[0]
    core.model.forward = timed_forward  # type: ignore[method-assign]
    core.scheduler.schedule = recorded_schedule  # type: ignore[method-assign]
    reqs = [core.make_request(p, SamplingParams(max_new_tokens=out_len, **greedy)) for p in prompts]
    for r in reqs:
        core.add_request(r)
    decode_steps: dict[int, list[tuple[float, float]]] = {}
    t0 = time.perf_counter()
    while core.has_work:
        model_time[0] = 0.0
        s = time.perf_counter()
        core.step()
        dt = time.perf_counter() - s
        batch = last[0]
        if batch is not None and batch.num_tokens == len(batch.seqs):  # a pure decode step
            decode_steps.setdefault(len(batch.seqs), []).append((dt, dt - model_time[0]))
    wall = time.perf_counter() - t0
    n_out = sum(len(r.output_ids) for r in reqs)
    full = decode_steps.get(len(prompts), [])
    return {
        "prefill_tok_s": sum(map(len, prompts)) / prefill_s,
        "decode_tok_s_at_full_batch": len(prompts) * len(full) / sum(d for d, _ in full) if full else None,
        "decode_step_ms_at_full_batch": 1e3 * sum(d for d, _ in full) / len(full) if full else None,
        "decode_overhead_ms_at_full_batch": 1e3 * sum(o for _, o in full) / len(full) if full else None,
        "decode_tok_s_by_batch": {b: b * len(v) / sum(d for d, _ in v) for b, v in sorted(decode_steps.items())},
        "wall_s": wall, "output_tok_s": n_out / wall,
    }


def run_hf_static(path: Path, dtype: str, prompts: list[list[int]], out_len: int, batch: int = 16) -> dict[str, Any]:
    model = hf_model(path, DTYPES[dtype])
    model.generation_config.eos_token_id = None
    groups = [torch.tensor(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]
    with torch.no_grad():
        model.generate(groups[0], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up, full shapes
        t = time.perf_counter()
        for g in groups:
            model.generate(g, max_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        for g in groups:
            model.generate(g, max_new_tokens=out_len, do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - t
    decode_step = (wall - prefill_s) / (out_len - 1) / len(groups)
    return {"prefill_tok_s": sum(map(len, prompts)) / prefill_s, "decode_step_ms_at_batch": 1e3 * decode_step,
            "decode_tok_s": batch / decode_step, "wall_s": wall, "output_tok_s": len(prompts) * out_len / wall}


def run_hf_cb(path: Path, dtype: str, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = hf_model(path, DTYPES[dtype])
    cfg = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(inputs=prompts, generation_config=cfg)
    wall = time.perf_counter() - t
    n_out = sum(len(o.generated_tokens) for o in out.values())
    return {"wall_s": wall, "output_tok_s": n_out / wall}


def prefix_reuse(threads: int, system_len: int = 2000, suffix_len: int = 100, n: int = 8) -> dict[str, Any]:
    path = model_dir("tiny")
    rng = random.Random(1)
    system = [rng.randrange(10, 4000) for _ in range(system_len)]
    prompts = [system + [rng.randrange(10, 4000) for _ in range(suffix_len)] for _ in range(n + 1)]
    result = {}
    for radix in (True, False):
        core = make_core(path, "float32", threads, n + 1, system_len + suffix_len + 8, radix=radix)
        ttfts = []
        for i, p in enumerate(prompts):
            req = core.make_request(p, SamplingParams(max_new_tokens=1, temperature=0.0), detokenize=False)
            core.run_to_completion([req])
            if i:  # the first request warms the cache (and the process)
                ttfts.append(req.first_token_time - req.arrival)
        result["radix" if radix else "no_radix"] = sum(ttfts) / len(ttfts)
    result["ratio"] = result["radix"] / result["no_radix"]
    return result


def count_params(path: Path) -> tuple[int | None, int | None]:
    """All parameters, and those that take part in matmuls (all but the input embedding, which is a lookup)."""
    if path.suffix == ".gguf":
        from gguf import GGUFReader
        shapes = {t.name: int(t.n_elements) for t in GGUFReader(str(path)).tensors}
        total = sum(shapes.values())
        return total, total - shapes["token_embd.weight"] if "output.weight" in shapes else total
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None, None
    from safetensors import safe_open
    total = embed = 0
    lm_head = False
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                numel = 1
                for d in st.get_slice(key).get_shape():
                    numel *= d
                total += numel
                embed += numel if key.endswith("embed_tokens.weight") else 0
                lm_head = lm_head or key.startswith("lm_head")
    return total, total - embed if lm_head else total  # tied: the embedding is also the output matmul


def kv_token_bytes(path: Path, dtype: str) -> int:
    """Bytes of K and V one token keeps in the cache, over all layers."""
    cfg = model_config(path)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * DTYPES[dtype].itemsize


def token_floors(floors: dict[str, float], dtype: str, matmul_params: int | None, kv_bytes: int, batch: int,
                 context: float) -> dict[str, float]:
    """Floors in tokens/s from this run's matmul throughput: 2 flops per matmul parameter per token (attention's
    own flops are left out, so these are upper bounds on what the weights allow). Decode uses the batch-64
    matmul rate, prefill the batch-512 one (float32) or the bfloat16 rate. The decode floor "with KV" also
    reads every cached token's K and V (`kv_bytes` each, `context` tokens per sequence) once per step at this
    run's copy rate: at batch 64 and ~576 tokens of context that read is most of a 150M model's step."""
    if not matmul_params:
        return {}
    bf16 = dtype == "bfloat16"
    decode = floors["matmul_gflops_bf16_m64" if bf16 else "matmul_gflops_f32_m64"] * 1e9
    prefill = floors["matmul_gflops_bf16_m64" if bf16 else "matmul_gflops_f32_m512"] * 1e9
    step = batch * 2 * matmul_params / decode + batch * context * kv_bytes / (floors["copy_gbps"] * 1e9)
    return {"decode_floor_tok_s": decode / (2 * matmul_params),
            "prefill_floor_tok_s": prefill / (2 * matmul_params),
            "decode_floor_with_kv_tok_s": batch / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "150m"], choices=list(BENCH_MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES))
    ap.add_argument("--baselines", nargs="*", default=["static", "cb"], choices=["static", "cb"])
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "bfloat16"],
                    help="also run our engine with these KV pool dtypes (auto = the model's); baselines run once")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-prefix-reuse", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    floors = {"matmul_gflops_f32_m64": matmul_gflops(64, 768, 3072, torch.float32),
              "matmul_gflops_f32_m512": matmul_gflops(512, 768, 3072, torch.float32),
              "matmul_gflops_bf16_m64": matmul_gflops(64, 768, 3072, torch.bfloat16),
              "copy_gbps": copy_gbps()}
    print(table([floors], list(floors)))
    rows: list[dict[str, Any]] = []
    for name in args.models:
        path = model_dir(name)
        params, matmul_params = count_params(path)
        for dtype in args.dtypes:
            prompts = prompts_for(args.num_requests, args.prompt_len, 4000)
            peak = floors["matmul_gflops_bf16_m64" if dtype == "bfloat16" else "matmul_gflops_f32_m512"]
            job_flops = 2 * (params or 0) * args.num_requests * (args.prompt_len + args.output_len)
            def floors_for(kv: str) -> dict[str, float]:
                return token_floors(floors, dtype, matmul_params, kv_token_bytes(path, dtype if kv == "auto" else kv),
                                    args.num_requests, args.prompt_len + args.output_len / 2)
            base = {"model": name, "dtype": dtype, "params": params, "job_floor_s": job_flops / peak / 1e9,
                    **floors_for("auto")}
            for kv in args.kv_cache_dtypes:
                if kv == dtype:
                    continue  # the same as auto
                floors_kv = floors_for(kv)
                ours = run_ours(path, dtype, args.threads, prompts, args.output_len, kv_cache_dtype=kv)
                decode = ours["decode_tok_s_at_full_batch"]
                ratio = decode / floors_kv["decode_floor_tok_s"] if decode and floors_kv else None
                rows.append({**base, **floors_kv, "system": "splitserve" if kv == "auto" else f"splitserve kv={kv}",
                             "kv_cache_dtype": kv, **ours, "decode_vs_floor": ratio})
                print(f"{name} {dtype} {rows[-1]['system']}: {ours}")
            if "static" in args.baselines:
                rows.append({**base, "system": "hf-static-16", **run_hf_static(path, dtype, prompts,
                                                                               args.output_len)})
                print(rows[-1])
            if "cb" in args.baselines:
                rows.append({**base, "system": "hf-generate_batch", **run_hf_cb(path, dtype, prompts,
                                                                                args.output_len)})
                print(rows[-1])
    print(table(rows, ["model", "dtype", "system", "wall_s", "output_tok_s", "prefill_tok_s",
                       "decode_tok_s_at_full_batch", "decode_vs_floor", "decode_overhead_ms_at_full_batch",
                       "job_floor_s", "prefill_floor_tok_s", "decode_floor_tok_s", "decode_floor_with_kv_tok_s"]))
    prefix = None if args.skip_prefix_reuse else prefix_reuse(args.threads)
    if prefix:
        print(f"prefix reuse TTFT: radix {prefix['radix'] * 1e3:.1f} ms, no radix {prefix['no_radix'] * 1e3:.1f} ms, "
              f"ratio {prefix['ratio']:.3f}")
    write_json(args.out, {"config": vars(args), "machine": machine(), "floors": floors, "runs": rows,
                          "prefix_reuse": prefix})


if __name__ == "__main__":
    main()
