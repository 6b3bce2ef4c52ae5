"""The ``splitserve`` command: ``splitserve tiny-model --out DIR`` (more subcommands join as the cluster grows)."""
from __future__ import annotations

import argparse
from pathlib import Path

from engine.tiny_model import DEFAULT_SEED, write_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitserve", description="SplitServe command line")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny-model", help="write the built-in tiny model (a Hugging Face folder)")
    tiny.add_argument("--out", required=True, type=Path, help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        out = write_tiny_model(args.out, seed=args.seed)
        print(f"wrote the tiny model to {out}")


if __name__ == "__main__":
    main()
