"""The `kareus` command line: one entry point, one module per command.

Each command module defines `register(subparsers)`, which adds its parser and sets `func` (a
callable taking the parsed namespace and returning an exit code). Groups (`kareus sim …`,
`kareus plan …`, `kareus clock …`) get their own sub-parsers, into which several modules register.
A `KareusError` ends the command with its one-line message and exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from kareus import __version__
from kareus.errors import KareusError

# (module in kareus.cli, group or None). Order is the order of `kareus --help`.
COMMANDS: tuple[tuple[str, str | None], ...] = (
    ("run", None),
    ("validate", None),
    ("profile", None),
    ("optimize", None),
    ("train", None),
    ("compare", None),
    ("frontier", None),
    ("plan_show", "plan"),
    ("sim_sweep", "sim"),
    ("sim_mbo", "sim"),
    ("clock", "clock"),
    ("dev_cluster", None),
)

GROUP_HELP = {
    "sim": "explore the simulated GPU",
    "plan": "inspect plans",
    "clock": "talk to the node daemon",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kareus", description="Energy-optimal distributed training.")
    parser.add_argument("--version", action="version", version=f"kareus {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for module_name, group in COMMANDS:
        if importlib.util.find_spec(f"kareus.cli.{module_name}") is None:  # DEV-ONLY: removed at integration
            continue
        module = importlib.import_module(f"kareus.cli.{module_name}")
        if group is None:
            module.register(top)
            continue
        if group not in groups:
            group_parser = top.add_parser(group, help=GROUP_HELP[group])
            groups[group] = group_parser.add_subparsers(dest=f"{group}_command", metavar="COMMAND")
            group_parser.set_defaults(func=_usage(group_parser))
        module.register(groups[group])
    return parser


def _usage(parser: argparse.ArgumentParser):
    def show(_args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KareusError as error:
        print(f"kareus: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("kareus: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
