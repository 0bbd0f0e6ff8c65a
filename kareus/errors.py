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


# Exit codes that mean "running again cannot help", which the operator's pod failure policy turns
# into an immediate Job failure instead of spending the backoff limit on them.
EXIT_USAGE = 2  # bad input: a manifest, a plan or a flag that does not validate
EXIT_CONFIG = 78  # EX_CONFIG: the environment cannot do what was asked (no GPU where one is required)
NON_RETRYABLE_EXIT_CODES = (EXIT_USAGE, EXIT_CONFIG)
