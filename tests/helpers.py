"""Test helpers shared across test folders: tiny engines, checkpoints written with transformers, and servers
started as real processes on loopback."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_hf_checkpoint(out: Path, arch: str, *, tie: bool = False, shard: bool = False,
                        rope_scaling: dict | None = None, seed: int = 0) -> Path:
    """A tiny random checkpoint of ``arch`` (llama | qwen2 | qwen3) saved by transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.1, tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=1,
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
    return out


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
