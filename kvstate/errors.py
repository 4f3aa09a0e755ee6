"""The exceptions that reach the user as a one-line message (CLI exit code 2), and the warning a
prompt the checkpoint cannot read raises."""


class KvstateError(ValueError):
    """Bad input from the user: a file, a field, an argument. Printed without a traceback."""


class ConfigFieldError(KvstateError):
    """A config.json field that is missing, mistyped or out of range; `field` is its dotted name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnknownTokenWarning(UserWarning):
    """A prompt has words the checkpoint's tokenizer maps to its unknown token (the model reads `<unk>`)."""
