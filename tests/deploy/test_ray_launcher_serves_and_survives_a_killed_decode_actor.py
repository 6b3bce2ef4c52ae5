"""The Ray launcher against a real Ray head started here on 127.0.0.1 (``ray start --head``, stopped afterwards),
with the tiny model: chat completions go through the router; a decode actor killed with ``ray.kill`` is restarted
by Ray, its old process dies with it, the launcher moves the router to the new address and the cluster serves
again; SIGINT then removes every actor, the placement group and every process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.deploy.conftest import (
    SMALL_WORKERS,
    LineReader,
    chat_succeeds_within,
    cmdline,
    environ_of,
    wait_all_gone,
)
from tests.deploy.ray_head import RayHead
from tests.helpers import REPO

NAMESPACE = "splitserve-test"


@pytest.fixture
def ray_head() -> Iterator[RayHead]:
    head = RayHead(num_cpus=4)
    try:
        yield head.wait_ready()
    finally:
        left = head.stop()
        assert not left, f"Ray processes outlived the head: {left}"


def ray_driver(head: RayHead, code: str) -> object:
    """Runs ``code`` (which prints one JSON line last) as a separate Ray driver connected to the head."""
    prologue = (f"import json, ray\nray.init(address={head.address!r}, namespace={NAMESPACE!r}, "
                f"log_to_driver=False)\n")
    res = subprocess.run([sys.executable, "-c", prologue + code], capture_output=True, text=True, timeout=120,
                         env=head.env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_ray_launcher_serves_and_survives_a_killed_decode_actor(ray_head: RayHead, tmp_path) -> None:
    # A request the cluster cannot hold (GPUs on a CPU-only head) fails with what was asked and what is there.
    too_big = subprocess.run([sys.executable, "-m", "deploy.ray.launch", "--address", ray_head.address,
                              "--namespace", NAMESPACE, "--decode-gpus", "1", "--startup-timeout", "3"],
                             capture_output=True, text=True, timeout=120, env=ray_head.env, cwd=REPO)
    assert too_big.returncode == 1, too_big.stdout[-2000:] + too_big.stderr[-2000:]
    assert "Ray could not place 1 prefill and 1 decode workers" in too_big.stdout and "--decode-gpus" in too_big.stdout

    launcher = LineReader([sys.executable, "-m", "deploy.ray.launch", "--address", ray_head.address,
                           "--namespace", NAMESPACE, "--prefill", "1", "--decode", "1", "--port", "0",
                           "--num-cpus-per-worker", "1", "--model-path", "tiny", f"--worker-args={SMALL_WORKERS}"],
                          tmp_path / "launcher.out", env=ray_head.env)
    try:
        router = launcher.wait_for(r"SplitServe is ready on Ray: router at (http://\S+)", 300).group(1)
        client = OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Where do the KV pages go?"}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
        streamed = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                       temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            reply.choices[0].message.content

        # Kill the decode actor; Ray restarts it. (The mark comes first: the launcher may report the restart
        # before the driver that killed the actor has exited.)
        mark = len(launcher.lines)
        old = ray_driver(ray_head, "a = ray.get_actor('splitserve-test-decode-0')\n"
                                   "info = ray.get(a.info.remote())\nray.kill(a, no_restart=False)\n"
                                   "print(json.dumps(info))")
        launcher.wait_for(r"splitserve-test-decode-0 was restarted by Ray \(restart 1\)", 180, mark)
        launcher.wait_for(r"router: added splitserve-test-decode-0 at ", 180, mark)
        assert not wait_all_gone({old["pid"]}, 30), f"the killed actor's process lives on: {cmdline(old['pid'])}"
        workers = httpx.get(router + "/workers", timeout=10).json()["workers"]
        decode_urls = [w["url"] for w in workers if w["role"] == "decode"]
        assert len(decode_urls) == 1 and decode_urls[0] != old["url"], workers
        reply = chat_succeeds_within(router, 90)
        assert reply.json()["choices"][0]["message"]["content"]
        new = ray_driver(ray_head, "print(json.dumps([ray.get(ray.get_actor(n).info.remote()) for n in "
                                   "ray.util.list_named_actors()]))")
        assert {i["name"] for i in new} == {f"{NAMESPACE}-{n}" for n in ("prefill-0", "decode-0", "router")}
        pids = {i["pid"] for i in new}
        # One cluster token and one worker key, made by the launcher and handed over in the environment: the
        # restarted actor got the same ones; a client that goes to a worker directly gets 401.
        envs = {i["role"]: environ_of(i["pid"]) for i in new}
        token, key = envs["prefill"]["SPLITSERVE_CLUSTER_TOKEN"], envs["prefill"]["SPLITSERVE_API_KEY"]
        assert len(token) >= 32 and len(key) >= 32
        assert envs["decode"]["SPLITSERVE_CLUSTER_TOKEN"] == token and envs["decode"]["SPLITSERVE_API_KEY"] == key
        assert envs["router"]["SPLITSERVE_WORKER_API_KEY"] == key
        assert all(token not in cmdline(p) and key not in cmdline(p) for p in pids)
        assert httpx.post(decode_urls[0] + "/flush_cache", timeout=30).status_code == 401

        launcher.signal(signal.SIGINT)
        assert launcher.proc.wait(120) == 0, launcher.text()[-3000:]
        launcher.wait_for(r"stopped: actors killed, placement group removed", 5, mark)
        left = wait_all_gone(pids, 30)
        assert not left, "left running: " + "; ".join(f"{p}: {cmdline(p)}" for p in left)
        after = ray_driver(ray_head, "print(json.dumps({'actors': ray.util.list_named_actors(all_namespaces=True), "
                                     "'pgs': [v['state'] for v in ray.util.placement_group_table().values()]}))")
        assert after["actors"] == [] and set(after["pgs"]) <= {"REMOVED"}, after
    finally:
        launcher.close()
