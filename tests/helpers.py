"""Test helpers shared across test folders: tiny engines, checkpoints written with transformers, and servers
started as real processes on loopback."""
from __future__ import annotations

import json
import os
import select
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from deploy.mooncake_master import MooncakeMaster  # noqa: F401 - the tests' Mooncake Store

REPO = Path(__file__).resolve().parent.parent


def wait_until(pred: Any, timeout: float = 10.0, step: float = 0.02, what: str = "condition") -> bool:
    """Polls ``pred`` until it is true (then True) or ``timeout`` s pass (then AssertionError naming ``what``); a
    connection error while polling counts as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return True
        except (httpx.HTTPError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def free_port() -> int:
    """A free loopback port never handed out before in this test session (see ``deploy.process.free_ports``)."""
    from deploy.process import free_ports
    return free_ports(1)[0]


def write_hf_checkpoint(out: Path, arch: str, *, tie: bool = False, shard: bool = False,
                        rope_scaling: dict | None = None, seed: int = 0, vocab_size: int = 512,
                        init: float = 0.1, tokenizer_from: Path | None = None) -> Path:
    """A tiny random checkpoint of ``arch`` (llama | qwen2 | qwen3) saved by transformers itself (``init``: the
    weights' standard deviation; larger gives peakier next-token distributions), with the tokenizer files of
    ``tokenizer_from`` (a model folder) copied in when given."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=init, tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_scaling=rope_scaling, rope_theta=10000.0)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=10000.0)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16, rope_theta=10000.0)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # give norms and biases non-trivial values so bugs in them show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, max_shard_size="100KB" if shard else "5GB", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") if tokenizer_from else ():
        shutil.copy(tokenizer_from / name, out / name)
    return out


GGUF_DIMS = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=256)  # K-quant rows: 256k
# Where each K-quant block keeps its float16 scales (d, dmin), as gguf's dequantizer reads them.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_tensor(rng, shape: tuple[int, ...], qtype: str):  # noqa: ANN001, ANN202
    """Random data stored as ``qtype``: quantized with gguf's quantizer, or for K-quants (which gguf-py cannot
    quantize) random blocks with sane float16 scales."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
    t = GGMLQuantizationType[qtype]
    if qtype in _K_SCALES:
        block, size = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
        scale = np.array([0.01], dtype=np.float16).view(np.uint8)
        for off in _K_SCALES[qtype]:
            raw[..., off:off + 2] = scale
        return raw.reshape(*shape[:-1], -1), t
    data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return (data, t) if qtype == "F32" else (quants.quantize(data, t), t)


def write_gguf(path: Path, arch: str = "llama", qtype: str = "Q8_0", *, tokenizer: bool = True, tie: bool = True,
               seed: int = 0) -> Path:
    """A small random GGUF of ``arch`` (llama | qwen2 | qwen3) whose matrices are stored as ``qtype`` (norms in
    F32, as llama.cpp stores them), written with the gguf package's own writer."""
    import numpy as np
    from gguf import GGUFWriter
    d = GGUF_DIMS
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(d["layers"])
    w.add_context_length(1024)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["intermediate"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    # Qwen3 keeps heads wider than hidden/heads (and transformers assumes its default of 128 for them)
    head_dim = 128 if arch == "qwen3" else d["hidden"] // d["heads"]
    if arch == "qwen3":
        w.add_key_length(head_dim)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"<t{i}>" for i in range(d["vocab"])])
        w.add_token_types([1] * d["vocab"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    matrices = {"token_embd.weight": (d["vocab"], d["hidden"])}
    if not tie:
        matrices["output.weight"] = (d["vocab"], d["hidden"])
    vectors = {"output_norm.weight": d["hidden"]}
    for i in range(d["layers"]):
        b = f"blk.{i}."
        matrices |= {b + "attn_q.weight": (d["heads"] * head_dim, d["hidden"]),
                     b + "attn_k.weight": (d["kv_heads"] * head_dim, d["hidden"]),
                     b + "attn_v.weight": (d["kv_heads"] * head_dim, d["hidden"]),
                     b + "attn_output.weight": (d["hidden"], d["heads"] * head_dim),
                     b + "ffn_gate.weight": (d["intermediate"], d["hidden"]),
                     b + "ffn_up.weight": (d["intermediate"], d["hidden"]),
                     b + "ffn_down.weight": (d["hidden"], d["intermediate"])}
        vectors |= {b + "attn_norm.weight": d["hidden"], b + "ffn_norm.weight": d["hidden"]}
        if arch == "qwen2":
            vectors |= {b + "attn_q.bias": d["heads"] * head_dim, b + "attn_k.bias": d["kv_heads"] * head_dim,
                        b + "attn_v.bias": d["kv_heads"] * head_dim}
        if arch == "qwen3":
            vectors |= {b + "attn_q_norm.weight": head_dim, b + "attn_k_norm.weight": head_dim}
    for name, shape in matrices.items():
        data, t = _gguf_tensor(rng, shape, qtype)
        w.add_tensor(name, data, raw_dtype=t)
    for name, n in vectors.items():
        w.add_tensor(name, (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def record_logits(core) -> dict[str, list]:  # noqa: ANN001 - an EngineCore
    """Keep every sampled row's logits per request id (instrumentation around the engine's real runner)."""
    seen: dict[str, list] = {}
    forward = core.runner.forward

    def wrapped(batch):  # noqa: ANN001, ANN202
        out = forward(batch)
        for row, seq in zip(out.logits, out.sampled):
            seen.setdefault(seq.req.rid, []).append(row.clone())
        return out
    core.runner.forward = wrapped
    return seen


def check_against_reference(model, req, logits: list, tol: float) -> float:  # noqa: ANN001
    """``req``'s sampled logits equal the transformers ``model``'s on the same tokens within ``tol`` (max abs), and
    its greedy output equals ``model.generate``'s; returns the largest difference."""
    import torch
    seq = req.prompt_ids + req.output_ids
    with torch.no_grad():
        ref = model(torch.tensor([seq[:-1]])).logits[0]
    start = len(req.prompt_ids) - 1
    assert len(logits) == len(req.output_ids)
    diff = (torch.stack(logits) - ref[start:start + len(logits)]).abs().max().item()
    assert diff <= tol, f"{req.rid}: max abs logit diff {diff:.2e} > {tol}"
    with torch.no_grad():
        expect = model.generate(torch.tensor([req.prompt_ids]), max_new_tokens=len(req.output_ids),
                                do_sample=False, pad_token_id=0)[0, len(req.prompt_ids):].tolist()
    assert req.output_ids == expect, f"{req.rid}: greedy output differs from model.generate"
    return diff


class ServerProcess:
    """A server (``python -m engine`` or a worker role) as a real child process on 127.0.0.1."""

    def __init__(self, module: str, args: list[str], port: int | None = None, env: dict | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-test-{module}-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 120.0, path: str = "/health") -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the process to exit on its own (e.g. after a signal the test sent)."""
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def post_chunked(url: str, path: str, total: int, chunk: int = 1 << 16, timeout: float = 30.0) -> tuple[int, dict, int]:
    """POST ``total`` bytes as a chunked body (no Content-Length) over a raw socket, stopping as soon as the server
    answers or stops reading; (status, JSON body, bytes sent). For body-limit tests: a client that keeps sending."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"[" + b"1," * (chunk // 2 - 1)
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent = 0
        sock.settimeout(2.0)  # a server that stopped reading blocks sendall: then read its answer
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(piece)
            if sent >= total:
                sock.sendall(b"0\r\n\r\n")
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(timeout)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
                more = sock.recv(1 << 16)
                if not more:
                    break
                data += more
        except ConnectionResetError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    try:
        parsed = json.loads(body[:_content_length(data)] or b"null")
    except ValueError:
        parsed = {"unparsed": body[:200].decode("latin-1")}
    return status, parsed, sent


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 62 if b"\r\n\r\n" not in data else 0

