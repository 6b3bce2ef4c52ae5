"""What the chart renders fits together the way the running programs need: the router's own parser and validator
accept its command line, its discovery selectors pick exactly the worker pods, the bootstrap annotation carries the
prefill pods' real bootstrap port, only the router is exposed, the probes hit the right endpoints, and the PD-at-scale
example asks for GPUs, RDMA devices, /dev/shm, the model PVC and the API key Secret the way its values say."""
from __future__ import annotations

import base64

import pytest

from router import _router
from router.config import DEFAULTS, parse_args
from tests.deploy.chart import CHART, container, find, render

PD_AT_SCALE = CHART / "ci" / "pd-at-scale-values.yaml"
AUTOSCALING = CHART / "ci" / "autoscaling-values.yaml"


def router_args(docs) -> list[str]:
    c = container(find(docs, "Deployment", "-router"), "router")
    assert c["command"] == ["python", "-m", "router.launch_router"]
    return list(c["args"])


def matches(selector: list[str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (s.split("=", 1) for s in selector))


@pytest.mark.parametrize("values", [None, PD_AT_SCALE, AUTOSCALING], ids=["default", "pd-at-scale", "autoscaling"])
def test_router_command_line_is_accepted_and_finds_exactly_the_workers(values) -> None:
    docs = render(values)
    args = parse_args(router_args(docs))
    _router.validate_config(args.to_json())  # raises ValueError naming the flag on a bad config
    assert args.pd_disaggregation and args.service_discovery and args.service_discovery_namespace == "serving"
    assert args.k8s_api_url.startswith("http://127.0.0.1:")
    proxy = container(find(docs, "Deployment", "-router"), "kube-api-proxy")
    assert f"--port={args.k8s_api_url.rsplit(':', 1)[1]}" in proxy["args"]

    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"] for d in docs if d["kind"] == "Deployment"}
    for role, selector in (("prefill", args.prefill_selector), ("decode", args.decode_selector)):
        chosen = [name for name, meta in pods.items() if matches(selector, meta["labels"])]
        assert chosen == [f"rel-splitserve-{role}"], f"{role} selector {selector} picks {chosen}"
        worker = container(find(docs, "Deployment", f"-{role}"), role)
        http = next(p for p in worker["ports"] if p["name"] == "http")
        assert http["containerPort"] == args.service_discovery_port

    prefill = find(docs, "Deployment", "-prefill")
    annotation = prefill["spec"]["template"]["metadata"]["annotations"][DEFAULTS["bootstrap_port_annotation"]]
    bootstrap = next(p for p in container(prefill, "prefill")["ports"] if p["name"] == "bootstrap")
    assert int(annotation) == bootstrap["containerPort"]
    assert f"--bootstrap-port={bootstrap['containerPort']}" in container(prefill, "prefill")["args"]


@pytest.mark.parametrize("values", [None, PD_AT_SCALE, AUTOSCALING], ids=["default", "pd-at-scale", "autoscaling"])
def test_only_the_router_is_reachable_from_outside_and_probes_hit_the_right_endpoints(values) -> None:
    docs = render(values)
    for role in ("prefill", "decode"):
        svc = find(docs, "Service", f"-{role}")
        assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["clusterIP"] == "None"
        pod = find(docs, "Deployment", f"-{role}")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        c = container(find(docs, "Deployment", f"-{role}"), role)
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health_generate"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert all("hostPort" not in p for p in c["ports"])
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    router = container(find(docs, "Deployment", "-router"), "router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
    role = find(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = find(docs, "RoleBinding")
    sa = find(docs, "Deployment", "-router")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == sa and binding["roleRef"]["name"] == role["metadata"]["name"]


def test_pd_at_scale_asks_for_gpus_rdma_shm_model_and_api_key() -> None:
    docs = render(PD_AT_SCALE)
    for role, replicas in (("prefill", 4), ("decode", 8)):
        dep = find(docs, "Deployment", f"-{role}")
        assert dep["spec"]["replicas"] == replicas
        pod = dep["spec"]["template"]["spec"]
        c = container(dep, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        for flag in ("--transfer-backend=mooncake", "--transfer-protocol=rdma", "--transfer-device-name=mlx5_0,mlx5_1",
                     "--transfer-hostname=$(POD_IP)", "--model-path=/models/Qwen3-32B",
                     "--served-model-name=qwen3-32b", "--device=cuda", "--transfer-rpc-port-min=20000"):
            assert flag in c["args"], f"{role} lacks {flag}"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
        token = next(e for e in c["env"] if e["name"] == "SPLITSERVE_CLUSTER_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "splitserve-cluster-token", "key": "cluster-token"}
        assert not [a for a in c["args"] if "cluster-token" in a], "the token stays off the command line"
        key = next(e for e in c["env"] if e["name"] == "SPLITSERVE_API_KEY")
        assert key["valueFrom"]["secretKeyRef"] == {"name": "splitserve-worker-key", "key": "worker-api-key"}
        model = next(v for v in pod["volumes"] if v["name"] == "model")
        assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "32Gi"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert find(docs, "PodDisruptionBudget", "-decode")["spec"]["maxUnavailable"] == 2
    router = find(docs, "Deployment", "-router")
    key = next(e for e in container(router, "router")["env"] if e["name"] == "SPLITSERVE_ROUTER_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "splitserve-api-key", "key": "api-key"}
    assert not [a for a in container(router, "router")["args"] if "api-key" in a], "the key stays off the command line"
    assert not [d for d in docs if d["kind"] == "Secret"], "an existing Secret was named; the chart must not make one"
    assert find(docs, "Service", "-router")["spec"]["type"] == "LoadBalancer"
    monitor = find(docs, "ServiceMonitor")
    router_ep = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "router-http")
    assert router_ep["authorization"]["credentials"]["name"] == "splitserve-api-key"
    ports = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


def test_autoscaling_hands_replicas_to_the_hpa_and_the_chart_keeps_the_key_in_a_secret() -> None:
    docs = render(AUTOSCALING)
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", f"-{role}")
        assert "replicas" not in dep["spec"], "with an HPA the Deployment must not pin replicas"
        hpa = find(docs, "HorizontalPodAutoscaler", f"-{role}")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": dep["metadata"]["name"]}
        init = dep["spec"]["template"]["spec"]["initContainers"][0]
        assert {"name": "MODEL_DIR", "value": "/models/Qwen3-0.6B"} in init["env"]
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    secret = find(docs, "Secret", "-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "change-me"
    # the cluster token: a random one in the chart's own Secret, handed to every worker in the environment
    token = find(docs, "Secret", "-cluster-token")
    assert len(base64.b64decode(token["data"]["cluster-token"])) == 32
    for role in ("prefill", "decode"):
        env = container(find(docs, "Deployment", f"-{role}"), role)["env"]
        ref = next(e for e in env if e["name"] == "SPLITSERVE_CLUSTER_TOKEN")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": token["metadata"]["name"], "key": "cluster-token"}
    # the workers' key: likewise random, in the workers' environment and the router's, which alone presents it
    worker_key = find(docs, "Secret", "-worker-key")
    assert len(base64.b64decode(worker_key["data"]["worker-api-key"])) == 32
    ref = {"name": worker_key["metadata"]["name"], "key": "worker-api-key"}
    for role, var in (("prefill", "SPLITSERVE_API_KEY"), ("decode", "SPLITSERVE_API_KEY"),
                      ("router", "SPLITSERVE_WORKER_API_KEY")):
        env = container(find(docs, "Deployment", f"-{role}"), role)["env"]
        assert next(e for e in env if e["name"] == var)["valueFrom"]["secretKeyRef"] == ref, role
    assert find(docs, "Service", "-router")["spec"]["ports"][0]["nodePort"] == 30080


@pytest.mark.parametrize("source, flag", [("builtin", None), ("tiny", "--model-path=tiny")])
def test_built_in_model_sources_need_no_volume(source: str, flag: str | None) -> None:
    """builtin serves the default model the image carries (no --model-path), tiny the random test model."""
    docs = render(None, f"model.source={source}")
    for role in ("prefill", "decode"):
        dep = find(docs, "Deployment", f"-{role}")
        args = [a for a in container(dep, role)["args"] if a.startswith("--model-path")]
        assert args == ([flag] if flag else [])
        assert not [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
        assert not [m for m in container(dep, role)["volumeMounts"] if m["name"] == "model"]
