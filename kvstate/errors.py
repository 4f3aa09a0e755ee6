"""The one exception type that reaches the user as a one-line message (CLI exit code 2)."""


class KvstateError(ValueError):
    """Bad input from the user: a file, a field, an argument. Printed without a traceback."""
