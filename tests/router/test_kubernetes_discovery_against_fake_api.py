"""Kubernetes service discovery, against a fake API server (no cluster can run here): Ready
pods matching the selector become workers; un-Ready, deleted or non-matching pods do not; a
dropped watch is followed by a re-list that catches up."""
from __future__ import annotations

import httpx
from harness import HERE, Cluster

from tests.helpers import free_port, wait_until


def fake_api(cluster: Cluster) -> str:
    port = free_port()
    cluster.spawn("fake-k8s", str(HERE / "fake_k8s_api.py"), "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/_stats", timeout=1).status_code == 200, what="fake API server")
    return url


def pod(api: str, name: str, ip: str, ready: bool = True, **kw: object) -> None:
    httpx.post(f"{api}/_pod", json={"name": name, "ip": ip, "ready": ready, **kw}).raise_for_status()


def urls(r) -> set[str]:
    return {w["url"] for w in httpx.get(f"{r.url}/workers").json()["workers"] if w["state"] == "active"}


def test_ready_pods_are_routed_and_others_removed(cluster: Cluster) -> None:
    api = fake_api(cluster)
    port = free_port()
    a = cluster.worker(host="127.0.0.2", port=port, name="pod-a")
    b = cluster.worker(host="127.0.0.3", port=port, name="pod-b")
    labels = {"app": "splitserve", "role": "worker"}
    pod(api, "pod-a", "127.0.0.2", labels=labels)
    pod(api, "pod-pending", "127.0.0.9", labels=labels, phase="Pending")
    pod(api, "pod-other", "127.0.0.4", labels={"app": "other"})
    r = cluster.router("--service-discovery", "--selector", "app=splitserve", "role=worker",
                       "--service-discovery-port", str(port), "--k8s-api-url", api,
                       "--discovery-relist-interval-secs", "30", ready=False)
    wait_until(lambda: urls(r) == {a.url}, what="pod-a discovered")
    assert httpx.post(f"{r.url}/generate", json={"text": "x"}).json()["worker"] == "pod-a"
    pod(api, "pod-b", "127.0.0.3", labels=labels)  # ADDED through the watch
    wait_until(lambda: urls(r) == {a.url, b.url}, what="pod-b added")
    pod(api, "pod-a", "127.0.0.2", ready=False, labels=labels)  # MODIFIED: not Ready
    wait_until(lambda: urls(r) == {b.url}, what="un-Ready pod-a removed")
    for i in range(3):
        assert httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] == "pod-b"
    httpx.delete(f"{api}/_pod/pod-b").raise_for_status()  # DELETED
    wait_until(lambda: urls(r) == set(), what="deleted pod-b removed")
    assert httpx.post(f"{r.url}/generate", json={"text": "x"}).status_code == 503


def test_dropped_watch_is_followed_by_a_relist(cluster: Cluster) -> None:
    api = fake_api(cluster)
    port = free_port()
    a = cluster.worker(host="127.0.0.5", port=port, name="pod-a")
    b = cluster.worker(host="127.0.0.6", port=port, name="pod-b")
    labels = {"app": "s"}
    pod(api, "pod-a", "127.0.0.5", labels=labels)
    r = cluster.router("--service-discovery", "--selector", "app=s", "--service-discovery-port", str(port),
                       "--k8s-api-url", api, ready=False)
    wait_until(lambda: urls(r) == {a.url}, what="pod-a discovered")
    wait_until(lambda: httpx.get(f"{api}/_stats").json()["open_watches"] == 1, what="watch open")
    lists = httpx.get(f"{api}/_stats").json()["lists"]
    # Changes nobody is told about, then the watch drops: only a re-list can see them.
    pod(api, "pod-b", "127.0.0.6", labels=labels, notify=False)
    httpx.delete(f"{api}/_pod/pod-a", params={"notify": "false"}).raise_for_status()
    httpx.post(f"{api}/_drop_watches").raise_for_status()
    wait_until(lambda: urls(r) == {b.url}, what="re-list caught up")
    assert httpx.get(f"{api}/_stats").json()["lists"] > lists


def test_pd_discovery_reads_the_bootstrap_port_annotation(cluster: Cluster) -> None:
    api = fake_api(cluster)
    port, bport = free_port(), free_port()
    p = cluster.worker("prefill", host="127.0.0.7", port=port, bootstrap_port=bport, name="prefill-pod")
    d = cluster.worker("decode", host="127.0.0.8", port=port, name="decode-pod")
    pod(api, "prefill-pod", "127.0.0.7", labels={"component": "prefill"},
        annotations={"splitserve.io/bootstrap-port": str(bport)})
    pod(api, "decode-pod", "127.0.0.8", labels={"component": "decode"})
    r = cluster.router("--pd-disaggregation", "--service-discovery", "--prefill-selector", "component=prefill",
                       "--decode-selector", "component=decode", "--service-discovery-port", str(port),
                       "--k8s-api-url", api)
    listed = {w["url"]: w for w in httpx.get(f"{r.url}/workers").json()["workers"]}
    assert listed[p.url]["role"] == "prefill" and listed[p.url]["bootstrap_port"] == bport
    assert listed[d.url]["role"] == "decode"
    resp = httpx.post(f"{r.url}/generate", json={"text": "x"})
    assert resp.status_code == 200 and resp.json()["worker"] == "decode-pod"
    assert p.requests()[0]["body"]["bootstrap_host"] == "127.0.0.7"
