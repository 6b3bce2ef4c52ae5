"""Speculative decoding benchmark, engine level, one run: speculation off against ``ngram`` (a token tree by default),
``ngram_chain`` (one continuation per draft) and ``draft_model`` on
the same engine settings, for each dtype and batch size, with the variants interleaved in every repeat (2-core
hosts are noisy). The draft model is ``--draft-model`` in ``--draft-dtype`` (default: the target itself in
bfloat16; ``benchmarks/export_checkpoint.py --layers N`` writes a cheaper, layer-truncated draft).

Workloads (both variants produce the same tokens, so the comparison is work for work):
- ``copy`` (greedy): chat requests that repeat a paragraph given in the prompt, or rewrite a given function with
  a docstring added (paragraphs of this repository's docs and functions of its engine, so the text is real,
  frozen in benchmarks/data/spec_copy_tasks.json so that runs on different days measure the same texts): what
  prompt lookup is for.
- ``random`` (seeded sampling at temperature 1, so the output wanders and has little to copy, while a seed still
  makes both variants produce the same tokens): prompts of seeded random token ids.

Each measurement runs max(B, 4) requests in groups of B (so batch 1 averages over 4 tasks, not one): a group
starts at once, steps until all have their first token, then its decode is timed; reported is output tokens
after the first over the groups' decode time. Reported per variant: decode tokens/s, forward
passes, accepted / drafted tokens, mean accepted drafts per verification, and the ratio variant / off of the same
repeat (the median over repeats), and the share of requests whose output was the same in both variants (all of
them where every layer's decode rows go through the batch-invariant kernels, as on an AVX-512 BF16 host in both
dtypes; elsewhere a bfloat16 verification's rows may go through a GEMM whose sums depend on the row count, and a
near-tie between two tokens can go the other way, as it can when the batch size changes without speculation).
``NAME@K`` runs a variant with K draft tokens, so lengths compare interleaved in one run.

    python -m benchmarks.bench_spec --model smollm2 --dtypes float32 bfloat16 --batches 1 4 16 --repeats 3
    python -m benchmarks.bench_spec --variants ngram draft_model --draft-model /tmp/smollm2-8l --draft-dtype auto
    python -m benchmarks.bench_spec --dtypes bfloat16 --batches 1 --workloads copy --variants ngram@4 ngram@8
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, model_dir, table, write_json
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
# The copy tasks, frozen (2026-12-03): built from the docs and sources they name, which keep changing, they made
# runs on different days measure different texts (batch 1's four tasks took 228 forwards for 508 tokens on
# 2026-12-02 and 360 on 2026-12-03, with the same engine: SmolLM2 copies some texts and rewrites others).
COPY_TASKS = REPO / "benchmarks" / "data" / "spec_copy_tasks.json"
SOURCES = ["engine/scheduler/kv_manager.py", "engine/scheduler/scheduler.py", "engine/detokenizer.py",
           "engine/sampler.py", "engine/mem/radix_cache.py", "engine/grammar/state.py", "engine/spec/ngram.py",
           "engine/models/llama.py"]


def copy_tasks() -> list[str]:
    """The 16 copy-heavy tasks, as frozen in ``COPY_TASKS``."""
    return json.loads(COPY_TASKS.read_text())["tasks"]


def build_copy_tasks() -> list[str]:
    """16 copy-heavy tasks, interleaved: repeat a paragraph, rewrite a function adding a docstring, taken from the
    repository as it is now (``--write-copy-tasks`` freezes them)."""
    text = "\n\n".join((REPO / "docs" / f).read_text() for f in ("architecture.md", "kv_transfer.md", "api.md"))
    paragraphs = [p.strip() for p in text.split("\n\n")
                  if 400 <= len(p.strip()) <= 1200 and not p.lstrip().startswith(("```", "|", "#", "-"))][:8]
    functions = []
    for path in SOURCES:
        text = (REPO / path).read_text()
        fns = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)
               and 8 <= (n.end_lineno or 0) - n.lineno <= 30]
        functions.append(ast.get_source_segment(text, fns[0]) or "")
    tasks = []
    for para, code in zip(paragraphs, functions):
        tasks.append(f"Repeat the following text exactly, word for word:\n\n{para}")
        tasks.append(f"Here is a Python function:\n\n```python\n{code}\n```\n\nRewrite it exactly, adding a "
                     "one-line docstring.")
    return tasks


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(n)]


def make_core(path: Path, dtype: str, threads: int, batch: int, spec: SpeculativeConfig) -> EngineCore:
    return EngineCore(EngineConfig(
        ModelConfig(model_path=str(path), dtype=dtype, num_threads=threads),
        CacheConfig(max_total_tokens=batch * 1600 + 4096),
        SchedulerConfig(max_running_requests=max(batch, 1), max_prefill_tokens=8192),
        speculative=spec))


def measure(core: EngineCore, prompts: list[list[int]], batch: int, max_new: int,
            sampled: bool) -> dict[str, Any]:
    spec = core.spec
    drafted0, accepted0, verified0 = (spec.drafted, spec.accepted, spec.verifications) if spec else (0, 0, 0)
    forwards, seconds, outputs = 0, 0.0, []
    for g in range(0, len(prompts), batch):
        reqs = [core.make_request(p, SamplingParams(max_new_tokens=max_new, temperature=1.0 if sampled else 0.0,
                                                    seed=g + i if sampled else None, ignore_eos=sampled),
                                  detokenize=False) for i, p in enumerate(prompts[g:g + batch])]
        for r in reqs:
            core.add_request(r)
        while not all(r.output_ids for r in reqs):
            core.step()
        start = time.perf_counter()
        while not all(r.finished for r in reqs):
            core.step()
            forwards += 1
        seconds += time.perf_counter() - start
        outputs += [r.output_ids for r in reqs]
    tokens = sum(len(o) - 1 for o in outputs)
    core.flush_cache()  # the next repeat computes its prompts again
    out = {"tok_s": tokens / seconds, "tokens": tokens, "forwards": forwards, "outputs": outputs}
    if spec is not None:
        out["accept_ratio"] = (spec.accepted - accepted0) / max(1, spec.drafted - drafted0)
        out["accepted_per_verify"] = (spec.accepted - accepted0) / max(1, spec.verifications - verified0)
    return out


VARIANTS = ("ngram", "ngram_chain", "draft_model")


def variant_name(text: str) -> str:
    """``ngram``, or ``ngram@6`` (6 draft tokens): argparse's check of a --variants entry."""
    name, at, k = text.partition("@")
    if name not in VARIANTS or (at and not (k.isdigit() and 1 <= int(k) <= 16)):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(VARIANTS)}, optionally @K (1-16 draft tokens)")
    return text


def spec_for(variant: str, args: argparse.Namespace, path: Path) -> SpeculativeConfig:
    """The speculation settings of a variant (``none`` is speculation off)."""
    name, _, k = variant.partition("@")
    tokens = int(k) if k else args.draft_tokens
    if name == "none":
        return SpeculativeConfig()
    if name == "ngram":
        return SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=tokens,
                                 speculative_ngram_branches=args.ngram_branches, speculative_ngram_min=args.ngram_min)
    if name == "ngram_chain":
        return SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=tokens,
                                 speculative_ngram_branches=1, speculative_ngram_min=2)
    return SpeculativeConfig(speculative_algorithm="draft_model", speculative_num_draft_tokens=tokens,
                             speculative_draft_model_path=args.draft_model or str(path),
                             speculative_draft_dtype=args.draft_dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=["copy", "random"], choices=["copy", "random"])
    ap.add_argument("--variants", nargs="+", default=["ngram", "ngram_chain", "draft_model"], type=variant_name,
                    help="ngram: the defaults (a token tree); ngram_chain: one continuation, suffixes of 2-4 tokens "
                         "(the defaults until 2026-12-05); draft_model. NAME@K: with K draft tokens instead of "
                         "--draft-tokens (ngram@4 ngram@6 compares two lengths, interleaved)")
    ap.add_argument("--ngram-branches", type=int, default=SpeculativeConfig().speculative_ngram_branches)
    ap.add_argument("--ngram-min", type=int, default=SpeculativeConfig().speculative_ngram_min)
    ap.add_argument("--draft-model", default=None, help="draft_model's checkpoint (default: the target itself)")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--draft-tokens", type=int, default=SpeculativeConfig().speculative_num_draft_tokens)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/spec-smollm2.json"))
    ap.add_argument("--write-copy-tasks", action="store_true",
                    help=f"rebuild {COPY_TASKS.relative_to(REPO)} from the repository as it is now, and exit")
    args = ap.parse_args()
    if args.write_copy_tasks:
        COPY_TASKS.parent.mkdir(parents=True, exist_ok=True)
        COPY_TASKS.write_text(json.dumps({"built": time.strftime("%Y-%m-%d"), "sources": SOURCES,
                                          "tasks": build_copy_tasks()}, indent=1) + "\n")
        print(f"wrote {COPY_TASKS}")
        return
    path = model_dir(args.model)
    variants = ["none", *args.variants]
    specs = {v: spec_for(v, args, path) for v in variants}
    rows: list[dict[str, Any]] = []
    top = max(args.batches)
    for dtype in args.dtypes:
        cores = {v: make_core(path, dtype, args.threads, top, specs[v]) for v in variants}
        tok = cores["none"].tokenizer
        copy = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in copy_tasks()]
        rand = random_prompts(max(top, 4), cores["none"].arch.vocab_size)
        for batch in args.batches:
            for workload in args.workloads:
                prompts = (copy if workload == "copy" else rand)[:max(batch, 4)]
                runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                for rep in range(args.repeats):
                    for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                        runs[v].append(measure(cores[v], prompts, batch, args.max_new_tokens, workload == "random"))
                base = runs["none"]
                row: dict[str, Any] = {"dtype": dtype, "batch": batch, "workload": workload,
                                       "off_tok_s": statistics.median(r["tok_s"] for r in base),
                                       "tokens": base[0]["tokens"], "forwards_off": base[0]["forwards"]}
                for v in args.variants:
                    row[f"{v}_tok_s"] = statistics.median(r["tok_s"] for r in runs[v])
                    row[f"{v}_speedup"] = statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(base, runs[v]))
                    row[f"{v}_accept_ratio"] = statistics.mean(r["accept_ratio"] for r in runs[v])
                    row[f"{v}_accepted_per_verify"] = statistics.mean(r["accepted_per_verify"] for r in runs[v])
                    row[f"{v}_forwards"] = runs[v][0]["forwards"]
                    row[f"{v}_same_output"] = sum(a == b for a, b in zip(base[0]["outputs"], runs[v][0]["outputs"])
                                                  ) / len(prompts)
                rows.append(row)
                print(table(rows[-1:], list(rows[-1])), flush=True)
        del cores
    print(table(rows, list(rows[0])))
    write_json(Path(args.out), {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
