"""The one exception type for mistakes in what the user asked for."""


class UserError(Exception):
    """Bad input: the CLI prints `error: <message>` on one line and exits 2."""
