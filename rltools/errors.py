"""User-facing errors: raised for bad input, printed without a traceback, exit code 2.

Anything the user can fix by editing a file or a flag is a `UserError` whose message says what is
wrong and what to change. Programmer errors stay ordinary exceptions (and keep their traceback).
"""


class UserError(Exception):
    """Bad input the user can fix; the CLI prints `error: <message>` and exits with code 2."""

    exit_code = 2
