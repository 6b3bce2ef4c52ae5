"""The ``splitserve`` command: ``splitserve tiny-model --out DIR``, ``splitserve bench ...`` (the load tool,
benchmarks/bench_serving.py), ``splitserve up`` (the whole cluster here, deploy/local/up.py); more subcommands join
as the cluster grows."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every flag after "bench" belongs to the load tool
        try:
            from benchmarks.bench_serving import main as bench_main
        except ModuleNotFoundError as e:
            raise SystemExit(f"splitserve bench needs {e.name}: pip install aiohttp matplotlib tqdm "
                             "(or the 'bench' extra: pip install 'splitserve[bench]')") from None
        bench_main(argv[1:], prog="splitserve bench")
        return
    if argv[:1] == ["up"]:  # every flag after "up" belongs to deploy/local/up.py
        from deploy.local.up import main as up_main
        raise SystemExit(up_main(argv[1:]))
    parser = argparse.ArgumentParser(prog="splitserve", description="SplitServe command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", add_help=False, help="load-test an endpoint (splitserve bench --help for its flags)")
    tiny = sub.add_parser("tiny-model", help="write the built-in tiny model (a Hugging Face folder)")
    tiny.add_argument("--out", required=True, type=Path, help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=None, help="weight seed (default: the built-in model's)")
    sub.add_parser("up", add_help=False, help="run the whole cluster (router, prefill and decode workers) here "
                                              "(splitserve up --help for its flags)")
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        from engine.tiny_model import DEFAULT_SEED, write_tiny_model  # torch loads only when it is needed
        out = write_tiny_model(args.out, seed=DEFAULT_SEED if args.seed is None else args.seed)
        print(f"wrote the tiny model to {out}")
