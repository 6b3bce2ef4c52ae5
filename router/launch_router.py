"""`launch_router` / `python -m router.launch_router`: parse the CLI and run the Rust router.

Examples:
  launch_router --worker-urls http://127.0.0.1:30000 http://127.0.0.1:30001 --policy cache_aware --port 8000
  launch_router --pd-disaggregation --prefill http://127.0.0.1:30100 8998 --decode http://127.0.0.1:30200 --port 8000
"""
from __future__ import annotations

import sys

from router import _router
from router.config import RouterArgs, parse_args


def launch(args: RouterArgs) -> None:
    """Validates `args` (ValueError names the flag to fix) and serves until SIGTERM/SIGINT."""
    _router.run(args.to_json())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _router.validate_config(args.to_json())
    except ValueError as e:
        print(f"launch_router: {e}", file=sys.stderr)
        return 2
    try:
        launch(args)
    except (ValueError, RuntimeError) as e:
        print(f"launch_router: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
