"""The `radixserve` command line.

up (the local disaggregated cluster), serve (HTTP API on an in-process engine),
prefill | decode | gateway | kvstore | autoscaler (one service, configured by
RADIXSERVE_* settings, as compose and Kubernetes run them), probe and stop (a
container's health check and pre-stop hook), generate, chat, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from radixserve.cli import engine, launch
from radixserve.errors import RadixServeError
from radixserve.logging import setup_logging


def make_parser() -> argparse.ArgumentParser:
    from radixserve.bench.cli_flags import add_command as add_bench

    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    engine.add_commands(sub)
    add_bench(sub)
    launch.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", None))
    try:
        return args.func(args)
    except RadixServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"error: invalid setting: {problems}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
