"""lm-eval-harness itself (PyPI ``lm-eval``, its ``local-completions`` model) runs a multiple-choice task through
the router on the real model: every choice is a loglikelihood request (``echo``, ``logprobs``, ``max_tokens`` 0),
which through PD needs the prompt logprobs the prefill worker sends with the transfer. The scores equal the
colocated server's, and the model gets most of these easy facts right. The task and its data are local files
(no dataset download)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.pd.conftest import Cluster, wait_pool_idle

FACTS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The capital of Italy is", ["Vienna", "Rome", "Lisbon", "Oslo"], 1),
    ("The capital of Japan is", ["Seoul", "Beijing", "Bangkok", "Tokyo"], 3),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("One, two, three, four,", ["five", "ten", "blue", "dog"], 0),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("The color of grass is", ["green", "purple", "orange", "black"], 0),
    ("A week has seven", ["days", "hours", "apples", "wheels"], 0),
]
TASK = """task: splitserve_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def run_lm_eval(url: str, model: str, tokenizer: str, tasks: Path, out: Path) -> dict[int, list[float]]:
    """Each document's choice loglikelihoods, as lm-eval logged them."""
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
            f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
            "num_concurrent=4,max_retries=1", "--tasks", "splitserve_facts", "--include_path", str(tasks),
            "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (samples,) = out.glob("*/samples_splitserve_facts_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return {d["doc_id"]: [float(r[0][0]) for r in d["resps"]] for d in docs}


def test_lm_eval_multiple_choice_scores_match_the_colocated_server(pd: Cluster, model: str, tmp_path: Path) -> None:
    data = tmp_path / "facts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in FACTS))
    (tmp_path / "splitserve_facts.yaml").write_text(TASK.format(data=data))
    tokenizer = httpx.get(pd.router.url + "/get_model_info", timeout=30).json()["tokenizer_path"]
    through_pd = run_lm_eval(pd.router.url, model, tokenizer, tmp_path, tmp_path / "pd")
    colocated = run_lm_eval(pd.colocated.url, model, tokenizer, tmp_path, tmp_path / "colocated")
    assert sorted(through_pd) == list(range(len(FACTS)))
    for doc, (_, choices, answer) in enumerate(FACTS):
        assert len(through_pd[doc]) == len(choices)
        assert max(abs(a - b) for a, b in zip(through_pd[doc], colocated[doc])) < 1e-3, doc
    right = sum(max(range(len(c)), key=lambda i: through_pd[d][i]) == a for d, (_, c, a) in enumerate(FACTS))
    assert right >= 6, right  # a trained model, not noise (random guessing gets 2 of 8)
    wait_pool_idle(pd.prefill), wait_pool_idle(pd.decode)
