"""The `radixserve` command line.

up (the local disaggregated cluster), serve (HTTP API on an in-process engine),
prefill | decode | gateway | kvstore | autoscaler (one service, configured by
RADIXSERVE_* settings, as compose and Kubernetes run them), probe and stop (a
container's health check and pre-stop hook), generate, chat, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

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


def _problem(error: Any) -> str:
    """One validation error: the setting it is about (none for one across settings) and
    the message, without pydantic's "Value error, " prefix."""
    where = ".".join(map(str, error["loc"]))
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", None))
    try:
        return args.func(args)
    except RadixServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        print(f"error: invalid setting: {problems}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
