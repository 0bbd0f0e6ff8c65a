"""The one way every Kareus console script runs a parsed command and fails.

`kareus` and `kareus-operator` differ in their commands, not in how a user error one line `PROG: error: MESSAGE` on stderr and the error's exit code, never a traceback. This
module is that rule and nothing else, so an entry point can use it without importing another
entry point's commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kareus.errors import KareusError


def dispatch(parser: argparse.ArgumentParser, argv: Sequence[str] | None, prog: str = "kareus") -> int:
    """Parse `argv` and run the chosen command; user errors end as one line on stderr.

    `args.func(args)` returns the exit code; a parser with no command chosen prints its help.
    """
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KareusError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130

