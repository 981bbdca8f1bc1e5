"""A side of the comparison (`ref` or `ckpt`): its checkpoint files, how it is executed, its tokenizer.

The model itself is held by a `Backend` only while the runner observes this side, so that at most one model
is resident at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from evalsuite.errors import EvalsuiteError, InputError

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.checkpoint import Checkpoint
    from evalsuite.recording import Recording

Role = Literal["ref", "ckpt"]


@dataclass(frozen=True)
class BackendOptions:
    """How a side is executed; part of every observation's key."""

    backend: str = "hf"
    dtype: str = "bfloat16"
    device: str = "cpu"
    trust_remote_code: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "dtype": self.dtype,
            "device": self.device,
            "trust_remote_code": self.trust_remote_code,
        }


@dataclass
class Side:
    """One side of a run: a checkpoint to execute, or (reference only) a recording of one."""

    role: Role
    checkpoint: Checkpoint | None
    options: BackendOptions
    recording: Recording | None = None
    backend: Backend | None = None
    progress: Callable[[str, int], Callable[[], None]] | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def is_recorded(self) -> bool:
        """Whether this side is read from a recording rather than executed."""
        return self.recording is not None

    @property
    def tokenizer(self) -> Any:
        """The side's own tokenizer, loaded from its files (no model)."""
        if self.checkpoint is None:
            raise RuntimeError(f"the {self.role} side is a recording and has no tokenizer")
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            kwargs: dict[str, Any] = {"trust_remote_code": self.options.trust_remote_code}
            if self.checkpoint.format == "gguf":
                kwargs["gguf_file"] = self.checkpoint.gguf_file.name
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(self.checkpoint.path), **kwargs)
            except EvalsuiteError:
                raise
            except Exception as exc:
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise InputError(f"cannot load the tokenizer: {msg}", self.checkpoint.path) from None
        return self._tokenizer

    @property
    def model(self) -> Backend:
        """The loaded backend; only valid inside the runner's observation of this side."""
        if self.backend is None:
            raise RuntimeError(f"the {self.role} side has no model loaded")
        return self.backend

    def steps(self, description: str, total: int) -> Callable[[], None]:
        """A callable to advance by one step of `total`; shown as a progress bar when the runner has one."""
        if self.progress is None:
            return lambda: None
        return self.progress(description, total)

    def fingerprint(self) -> str:
        """What identifies this side's behaviour: its files and how it is executed."""
        import hashlib
        import json

        fingerprint = self.recording.fingerprint if self.recording else self.checkpoint.fingerprint
        doc = {"checkpoint": fingerprint, "options": self.options.to_json()}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
