"""The one small error hierarchy of evalsuite.

The CLI maps every `EvalsuiteError` to exit code 2 and prints its message as one line; anything else is a
bug and may show its traceback.
"""

from __future__ import annotations

from pathlib import Path


class EvalsuiteError(Exception):
    """A run that cannot be done: the message is one line a user can act on."""


class InputError(EvalsuiteError):
    """A bad checkpoint, spec, recording, text file or option.

    `path` names the file (or folder) at fault; the message is prefixed with it.
    """

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        super().__init__(f"{path}: {message}" if path is not None else message)


class DependencyError(EvalsuiteError):
    """A missing package, device or network resource that this run needs."""
