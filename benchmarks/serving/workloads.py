"""Workloads: the items a run sends, all drawn from one seed. An item is one conversation of one or more turns;
single-shot workloads have one turn per item. The client renders an item's turns into completions prompts,
chat messages or /generate text (``render_prompt`` / ``render_messages``)."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serving.config import ConfigError, WorkloadConfig
from benchmarks.serving.text import TextMaker


@dataclass(frozen=True)
class Turn:
    text: str  # the user's message (the whole prompt for single-shot items)
    output_len: int
    tag: str
    planned_len: int  # prompt length the workload asked for, in the text maker's unit (tokens or words)


@dataclass(frozen=True)
class Item:
    index: int
    turns: tuple[Turn, ...]
    system: str | None = None  # a system prompt (the shared prefix), sent before the turns
    group: int | None = None  # shared-prefix: which system prompt
    messages: tuple[dict[str, Any], ...] | None = field(default=None)  # jsonl chat items, sent as given


def draw_len(rng: random.Random, base: int, dist: str, spread: float) -> int:
    if dist == "fixed" or spread == 0:
        return base
    if dist == "uniform":
        lo, hi = max(1, round(base * (1 - spread))), max(1, round(base * (1 + spread)))
        return rng.randint(lo, hi)
    if dist == "lognormal":
        return max(1, round(base * math.exp(rng.gauss(0.0, spread))))
    raise ConfigError(f"unknown length distribution {dist!r}")


def zipf_weights(n: int, alpha: float) -> list[float]:
    return [1.0 / (k + 1) ** alpha for k in range(n)]


def _random(cfg: WorkloadConfig, rng: random.Random, tm: TextMaker) -> list[Item]:
    items = []
    for i in range(cfg.num_prompts):
        n_in = draw_len(rng, cfg.input_len, cfg.length_dist, cfg.length_spread)
        n_out = draw_len(rng, cfg.output_len, cfg.length_dist, cfg.length_spread)
        items.append(Item(i, (Turn(tm.make(rng, n_in), n_out, "random", n_in),)))
    return items


def _shared_prefix(cfg: WorkloadConfig, rng: random.Random, tm: TextMaker) -> list[Item]:
    prefixes = [tm.make(rng, cfg.prefix_len) for _ in range(cfg.num_groups)]
    groups = rng.choices(range(cfg.num_groups), weights=zipf_weights(cfg.num_groups, cfg.zipf_alpha),
                         k=cfg.num_prompts)
    items = []
    for i, g in enumerate(groups):
        n_suffix = draw_len(rng, cfg.suffix_len, cfg.length_dist, cfg.length_spread)
        n_out = draw_len(rng, cfg.output_len, cfg.length_dist, cfg.length_spread)
        turn = Turn(tm.make(rng, n_suffix), n_out, "shared-prefix", cfg.prefix_len + n_suffix)
        items.append(Item(i, (turn,), system=prefixes[g], group=g))
    return items


def _multi_turn(cfg: WorkloadConfig, rng: random.Random, tm: TextMaker) -> list[Item]:
    items = []
    for i in range(cfg.num_prompts):
        turns = []
        for t in range(cfg.num_turns):
            n_in = draw_len(rng, cfg.input_len, cfg.length_dist, cfg.length_spread)
            n_out = draw_len(rng, cfg.output_len, cfg.length_dist, cfg.length_spread)
            turns.append(Turn(tm.make(rng, n_in), n_out, f"turn{t + 1}", n_in))
        items.append(Item(i, tuple(turns)))
    return items


def _interference(cfg: WorkloadConfig, rng: random.Random, tm: TextMaker) -> list[Item]:
    items = []
    for i in range(cfg.num_prompts):
        if (i + 1) % cfg.long_every == 0:
            turn = Turn(tm.make(rng, cfg.long_prompt_len), cfg.long_output_len, "long", cfg.long_prompt_len)
        else:
            n_in = draw_len(rng, cfg.input_len, cfg.length_dist, cfg.length_spread)
            n_out = draw_len(rng, cfg.output_len, cfg.length_dist, cfg.length_spread)
            turn = Turn(tm.make(rng, n_in), n_out, "short", n_in)
        items.append(Item(i, (turn,)))
    return items


def _jsonl(cfg: WorkloadConfig, rng: random.Random, tm: TextMaker) -> list[Item]:
    path = Path(cfg.dataset_path or "")
    if not path.is_file():
        raise ConfigError(f"--dataset-path {path}: no such file")
    items: list[Item] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(items) >= cfg.num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            items.append(_jsonl_item(obj, len(items), cfg.output_len, tm, f"{path}:{lineno}"))
    if not items:
        raise ConfigError(f"{path}: no prompts (expected lines like {{\"prompt\": \"...\"}})")
    return items


def _jsonl_item(obj: Any, index: int, default_out: int, tm: TextMaker, where: str) -> Item:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: each line must be a JSON object")
    out = obj.get("output_len", obj.get("max_tokens", default_out))
    if not isinstance(out, int) or out < 1:
        raise ConfigError(f"{where}: output_len must be a positive integer")
    tag = str(obj.get("tag", "jsonl"))
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        return Item(index, (Turn(obj["prompt"], out, tag, tm.count(obj["prompt"])),))
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in msgs):
        planned = sum(tm.count(m["content"]) for m in msgs)
        last = msgs[-1]["content"]
        return Item(index, (Turn(last, out, tag, planned),), messages=tuple(msgs))
    raise ConfigError(f"{where}: needs a non-empty \"prompt\" string or a \"messages\" list of "
                      "{\"role\": str, \"content\": str}")


BUILDERS = {"random": _random, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn,
            "interference": _interference, "jsonl": _jsonl}


def build_items(cfg: WorkloadConfig, tm: TextMaker) -> list[Item]:
    return BUILDERS[cfg.workload](cfg, random.Random(cfg.seed), tm)


def render_messages(item: Item, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """Chat messages for ``item``'s turn ``turn``: the whole history so far, with the answers received."""
    if item.messages is not None:
        return [dict(m) for m in item.messages]
    msgs = [{"role": "system", "content": item.system}] if item.system is not None else []
    for t in range(turn):
        msgs += [{"role": "user", "content": item.turns[t].text}, {"role": "assistant", "content": answers[t]}]
    msgs.append({"role": "user", "content": item.turns[turn].text})
    return msgs


def render_prompt(item: Item, turn: int, answers: list[str]) -> str:
    """One prompt string: the shared prefix then the question; several turns become a plain transcript."""
    if item.messages is None and len(item.turns) == 1:
        text = item.turns[0].text
        return text if item.system is None else f"{item.system}\n{text}"
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in render_messages(item, turn, answers)]
    return "\n".join(lines) + "\nAssistant:"


def describe(cfg: WorkloadConfig, items: list[Item], tm: TextMaker) -> dict[str, Any]:
    """What was generated, for the result JSON (planned lengths; the measured ones come from the server)."""
    turns = [t for it in items for t in it.turns]
    planned = [t.planned_len for t in turns]
    out = {"name": cfg.workload, "num_items": len(items), "num_requests": len(turns),
           "planned_prompt_len": {"mean": sum(planned) / len(planned), "min": min(planned), "max": max(planned)},
           "planned_output_tokens": sum(t.output_len for t in turns),
           "tags": sorted({t.tag for t in turns})}
    if cfg.workload == "shared-prefix":
        counts = [0] * cfg.num_groups
        for it in items:
            counts[it.group or 0] += 1
        out["group_counts"] = counts
        out["item_groups"] = [it.group for it in items]
    return out
