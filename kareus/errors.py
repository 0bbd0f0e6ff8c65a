"""Errors a user can cause and fix.

A `KareusError` carries a message meant for people; the CLI prints it as one line and exits with
`exit_code` instead of showing a traceback. Anything else escaping is a bug in Kareus.
"""


class KareusError(Exception):
    """An error caused by input or environment, reported to the user without a traceback."""

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
