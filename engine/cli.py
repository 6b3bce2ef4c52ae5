"""The ``splitserve`` command: ``splitserve tiny-model --out DIR``, ``splitserve up`` (more subcommands join as the
cluster grows)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.tiny_model import DEFAULT_SEED, write_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitserve", description="SplitServe command line")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny-model", help="write the built-in tiny model (a Hugging Face folder)")
    tiny.add_argument("--out", required=True, type=Path, help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed (default: %(default)s)")
    # `up` lives in deploy/ and parses its own flags (`splitserve up --help`); listed here for `splitserve --help`.
    sub.add_parser("up", add_help=False, help="run the whole cluster (router, prefill and decode workers) here")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:
        from deploy.local.up import main as up_main
        raise SystemExit(up_main(argv[1:]))
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        out = write_tiny_model(args.out, seed=args.seed)
        print(f"wrote the tiny model to {out}")


if __name__ == "__main__":
    main()
