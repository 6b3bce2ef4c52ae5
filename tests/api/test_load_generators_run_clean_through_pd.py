"""Two load generators nobody here wrote, pointed at the router as a user load-testing the cluster would:
guidellm (the vLLM project's) and NVIDIA's aiperf, each the PyPI release in its own virtualenv
(scripts/install-load-tools.sh, which scripts/test.sh runs first), streaming chat completions to prefill and decode
workers on SmolLM2. Each run must end with every request answered, each with exactly the tokens it asked for
(``max_completion_tokens`` with ``ignore_eos``, as both tools send them), and each prompt's token count as the
tool took it from the server's usage equal to what /tokenize counts for the messages the tool sent. Both send
more than OpenAI's basic fields (guidellm ``stream_options.continuous_usage_stats`` on every request, aiperf too
with ``--per-chunk-usage``; both ``max_completion_tokens``, ``ignore_eos`` and content-part messages): a field
the server refused would fail the run."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.pd.conftest import Cluster

REPO = Path(__file__).resolve().parents[2]
REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 2, 64, 16
# the tools send only to 127.0.0.1 and read the tokenizer from the served model's folder (no model hub; aiperf
# refuses a folder path under HF_HUB_OFFLINE=1, taking it for a hub id)
ENV = {**os.environ, "NO_PROXY": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def tools() -> dict[str, Path]:
    """The CLIs, installed first if they are not (minutes, once per machine)."""
    done = subprocess.run([str(REPO / "scripts" / "install-load-tools.sh")], capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, f"scripts/install-load-tools.sh failed:\n{done.stderr[-4000:]}"
    return {Path(p).name: Path(p) for p in done.stdout.split()}


@pytest.fixture(scope="module")
def tokenizer(pd: Cluster) -> str:
    return httpx.get(pd.router.url + "/get_model_info", timeout=30).json()["tokenizer_path"]


def counted(pd: Cluster, messages: list[dict]) -> int:
    """Prompt tokens of a chat request's messages, as the server counts them (chat template included)."""
    r = httpx.post(pd.router.url + "/tokenize", json={"messages": messages}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


def run(args: list[str], cwd: Path) -> None:
    done = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def test_guidellm_gets_every_request_answered_in_full(pd: Cluster, model: str, tools: dict[str, Path],
                                                       tokenizer: str, tmp_path: Path) -> None:
    out = tmp_path / "guidellm.json"
    run([str(tools["guidellm"]), "run", "--backend", f"kind=openai_http,target={pd.router.url},model={model}",
         "--profile", f"kind=concurrent,streams={CONCURRENCY}",
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--seed", "kind=static,value=7",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"], tmp_path)
    (bench,) = json.loads(out.read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                  "total": REQUESTS}
    for req in bench["requests"]["successful"]:
        body = json.loads(req["request_args"])["body"]
        assert body["stream"] and body["stream_options"]["continuous_usage_stats"]
        assert req["output_metrics"]["text_tokens"] == OUTPUT_TOKENS and req["output"]
        assert req["input_metrics"]["text_tokens"] == counted(pd, body["messages"]) > PROMPT_TOKENS // 2
        assert 1 <= req["info"]["timings"]["token_iterations"] <= OUTPUT_TOKENS  # chunks with text, streamed


def test_aiperf_gets_every_request_answered_in_full(pd: Cluster, model: str, tools: dict[str, Path],
                                                     tokenizer: str, tmp_path: Path) -> None:
    out = tmp_path / "aiperf"
    run([str(tools["aiperf"]), "profile", "--model", model, "--url", pd.router.url, "--endpoint-type", "chat",
         "--streaming", "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
         "--tokenizer", tokenizer, "--prompt-input-tokens-mean", str(PROMPT_TOKENS),
         "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
         "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
         "--per-chunk-usage", "--random-seed", "7", "--workers-max", "1", "--no-gpu-telemetry",
         "--ui-type", "none", "--output-artifact-dir", str(out)], tmp_path)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS and not summary["error_summary"], summary["error_summary"]
    sent = {s["session_id"]: s["payloads"][0] for s in json.loads((out / "inputs.json").read_text())["data"]}
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    for rec in records:
        m = {k: v["value"] for k, v in rec["metrics"].items()}
        payload = sent[rec["metadata"]["conversation_id"]]
        assert payload["max_completion_tokens"] == OUTPUT_TOKENS and payload["ignore_eos"] is True
        assert m["output_sequence_length"] == m["usage_completion_tokens"] == OUTPUT_TOKENS
        assert m["input_sequence_length"] == m["usage_prompt_tokens"] == counted(pd, payload["messages"])
