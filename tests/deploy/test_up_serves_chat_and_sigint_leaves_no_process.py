"""``splitserve up`` end to end, on the default model (the README's first command): the cluster comes up on free
ports serving SmolLM2-135M-Instruct, which answers a real question sensibly, the printed curl and openai examples work as
pasted, chat completions (streamed and not) go through the router with the real ``openai`` client, every process
logs to the terminal with its prefix and to its own file, and SIGINT stops the whole process tree with status 0."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx
from openai import OpenAI

from tests.deploy.conftest import children_of, cmdline, environ_of, wait_all_gone


def test_up_serves_chat_and_sigint_leaves_no_process(up_factory) -> None:
    up = up_factory("--prefill", "1", "--decode", "2")
    router = up.wait_ready()
    names = ["prefill-0", "decode-0", "decode-1", "router"]

    # Every worker is behind the router and healthy.
    workers = httpx.get(router + "/workers", timeout=10).json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill"]
    assert all(w["healthy"] for w in workers)

    # The printed curl body and openai snippet work as they are.
    out = up.text()
    body = re.search(r"-d '(\{.*\})'", out).group(1)
    reply = httpx.post(router + "/v1/chat/completions", json=json.loads(body), timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    snippet = re.search(r"python - <<'PY'\n(.*?)\nPY", out, re.S).group(1)
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr

    # The openai client, streamed and not, on the real default model.
    client = OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    capital = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        temperature=0)
    assert "Paris" in capital.choices[0].message.content and capital.choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "Tell me about prefill and decode."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content and plain.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    # Greedy on both paths, so the streamed text is the same text.
    assert streamed == plain.choices[0].message.content

    # Output: a prefix per process on the terminal, and one log file per process in the run folder.
    for name in names:
        assert re.search(rf"^{re.escape(name)}\s*\| ", out, re.M), f"no terminal line from {name}"
        log = (up.run_dir / f"{name}.log").read_text()
        assert "$ " in log and len(log.splitlines()) > 3, f"{name}.log is nearly empty"

    tree = children_of(up.proc.pid)
    pids = {up.pid_of(n) for n in names}
    assert pids <= tree, f"processes {pids - tree} are not under splitserve up"

    # The bootstrap handshakes carry one cluster token, made for this cluster and handed over in the environment,
    # never on a command line.
    tokens = {n: environ_of(up.pid_of(n)).get("SPLITSERVE_CLUSTER_TOKEN") for n in names}
    assert len(set(tokens.values())) == 1 and len(tokens["prefill-0"] or "") >= 32, tokens
    assert all(tokens["prefill-0"] not in cmdline(up.pid_of(n)) for n in names)
    # Likewise one fresh worker key: the router presents it, a client that goes to a worker directly gets 401
    # (probes stay open), and the operator finds it in the run folder.
    key = (up.run_dir / "worker-api-key").read_text().strip()
    assert len(key) >= 32 and environ_of(up.pid_of("router")).get("SPLITSERVE_WORKER_API_KEY") == key
    assert all(environ_of(up.pid_of(n)).get("SPLITSERVE_API_KEY") == key for n in names[:-1])
    assert all(key not in cmdline(up.pid_of(n)) for n in names)
    for w in workers:
        assert httpx.post(w["url"] + "/flush_cache", timeout=30).status_code == 401
        assert httpx.get(w["url"] + "/health", timeout=30).status_code == 200
        assert httpx.get(w["url"] + "/get_load", headers={"Authorization": f"Bearer {key}"},
                         timeout=30).status_code == 200

    up.signal(signal.SIGINT)
    assert up.proc.wait(90) == 0, up.text()[-3000:]
    left = wait_all_gone(tree, 10)
    assert not left, "left running after SIGINT: " + "; ".join(f"{p}: {cmdline(p)}" for p in left)
    assert "stopped; logs are in" in up.text()
