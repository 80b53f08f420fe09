"""User-facing errors: the CLI prints their message as one line and exits 2."""


class MarsError(ValueError):
    """Bad input or an unusable model: the message is meant for the user."""
