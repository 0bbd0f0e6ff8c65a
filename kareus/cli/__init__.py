"""The `kareus` command line: one entry point, one module per command.

Each command module defines `register(subparsers)`, which adds its parser and sets `func` (a
callable taking the parsed namespace and returning an exit code). Groups (`kareus sim …`,
`kareus plan …`, `kareus clock …`) get their own sub-parsers, into which several modules register.
A `KareusError` ends the command with its one-line message and exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kareus import __version__
from kareus.launcher import dispatch

# (command or group name, module in kareus.cli, group or None). Order is the order of `--help`.
COMMANDS: tuple[tuple[str, str, str | None], ...] = (
    ("run", "run", None),
    ("validate", "validate", None),
    ("profile", "profile", None),
    ("optimize", "optimize", None),
    ("train", "train", None),
    ("export", "export", None),
    ("model", "model", "model"),
    ("compare", "compare", None),
    ("frontier", "frontier", None),
    ("plan", "plan_show", "plan"),
    ("sim", "sim_sweep", "sim"),
    ("sim", "sim_mbo", "sim"),
    ("sim", "sim_straggler", "sim"),
    ("sim", "sim_power_budget", "sim"),
    ("sim", "sim_calibrate", "sim"),
    ("clock", "clock", "clock"),
    ("data", "data", "data"),
    ("dev-cluster", "dev_cluster", None),
    ("report", "report", None),
)

GROUP_HELP = {
    "sim": "explore the simulated GPU",
    "plan": "inspect plans",
    "clock": "talk to the node daemon",
    "model": "model shapes from published models",
    "data": "prepare training data (text in)",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given `argv`, only the invoked command's modules are imported.

    Command modules pull in heavy libraries (torch, xgboost, kopf); importing all of them for
    every invocation would add seconds to `kareus clock status`. `--help` still lists them all.
    """
    parser = argparse.ArgumentParser(prog="kareus", description="Energy-optimal distributed training.")
    parser.add_argument("--version", action="version", version=f"kareus {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = _invoked_command(argv)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, module_name, group in COMMANDS:
        if wanted is not None and name != wanted:
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


def _invoked_command(argv: Sequence[str] | None) -> str | None:
    """The command named first on the command line, if it is a known one."""
    if argv is None:
        return None
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in {name for name, _, _ in COMMANDS} else None


def _usage(parser: argparse.ArgumentParser):
    def show(_args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return dispatch(build_parser(argv), argv)


def stdout_console():
    """A rich console for tables on stdout; off a terminal (pipes, CI logs) rich would squeeze
    them into 80 columns and cut method names, so it gets a wide fixed width there."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 140)


if __name__ == "__main__":
    sys.exit(main())
