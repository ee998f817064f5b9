"""The ``moeflow`` command: ``moeflow train``, ``moeflow bench layer`` (see --help of each)."""

from __future__ import annotations

import argparse
import sys

from moeflow.commands import (bench_command, cluster_command, model_info, simulate_command,
                              train_command)
from moeflow.commands.common import Parser, RanksFailed
from moeflow.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moeflow", description="Mixture-of-Experts training across many devices.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train_command, bench_command, cluster_command, model_info,
                   simulate_command):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError) as err:
        parser.exit(2, f"moeflow {args.command}: error: {err}\n")
    except RanksFailed as err:
        parser.exit(1, f"moeflow {args.command}: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
