"""``meshrl`` command line: one sub-module per command, each adding its parser to the tree."""

from __future__ import annotations

import argparse
import logging
import sys

from meshrl import __version__
from meshrl.cli import (
    census_cmd,
    coach_cmd,
    compare_cmd,
    demo_cmd,
    doctor_cmd,
    eval_cmd,
    export_cmd,
    mei_cmd,
    probe_cmd,
    report_cmd,
    sweep_cmd,
    train_cmd,
)
from meshrl.errors import MissingDependency
from meshrl.kernel_caches import bound_kernel_caches

COMMANDS = [demo_cmd, train_cmd, eval_cmd, compare_cmd, sweep_cmd, report_cmd, coach_cmd, mei_cmd,
            census_cmd, probe_cmd, export_cmd, doctor_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshrl",
        description="RL with verifiable rewards for language models that does not collapse.",
    )
    parser.add_argument("--version", action="version", version=f"meshrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    bound_kernel_caches()  # first: oneDNN reads its cache sizes once, when it builds its first kernel
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, MissingDependency) as e:  # bad input or a missing extra: one clear line, no traceback
        print(f"meshrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
