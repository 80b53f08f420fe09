"""User-facing errors: the CLI prints their message as one line and exits 2."""

from __future__ import annotations


class MarsError(ValueError):
    """Bad input or an unusable model: the message is meant for the user.

    A broken rule of a setting (:mod:`mars_local.core.defaults`) carries ``field``, the
    setting's name (``"repeat_penalty"``), and ``subject``, the words the message names it
    with (``"repeat-penalty"``), so that a front end can name it in its own vocabulary
    (:meth:`naming`).
    """

    field: str | None = None
    subject: str | None = None

    def __init__(self, message: str = "", *, field: str | None = None, subject: str | None = None):
        super().__init__(message)
        self.field = field
        self.subject = subject

    def naming(self, name: str) -> "MarsError":
        """This error with ``name`` (a flag as typed, a JSON parameter) as its subject:
        "--repeat-penalty must be > 0 ...".  A subject that is a description
        ("the number of tokens to generate") is kept after the name."""
        msg, subject = str(self), self.subject
        if subject and msg.startswith(subject + " ") and " " not in subject:
            msg = f"{name}{msg[len(subject):]}"
        else:
            msg = f"{name}: {msg}"
        return MarsError(msg, field=self.field, subject=name)
