"""A side of the comparison (`ref` or `ckpt`): its files (a checkpoint, or for the reference a recording of
one) and how it is executed. A description only: the model itself is loaded by the runner and handed to the
observers, one side at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.protocol.recording import Recording, is_recording

Role = Literal["ref", "ckpt"]


@dataclass
class Side:
    """One side of a run: a checkpoint to execute, or (reference only) a recording of one."""

    role: Role
    options: BackendOptions
    checkpoint: Checkpoint | None = None
    recording: Recording | None = None
    # Why this side runs streamed, one decoder layer at a time (`--stream`, or the memory it would need
    # loaded whole); None when it is loaded whole.
    stream_reason: str | None = None
    _tokenizer: Any = field(default=None, repr=False)
    _content: str | None = field(default=None, repr=False)

    @property
    def is_recorded(self) -> bool:
        """Whether this side is read from a recording rather than executed."""
        return self.recording is not None

    @property
    def path(self) -> Path:
        """The folder this side reads."""
        return self.recording.path if self.recording is not None else self.checkpoint.path

    @property
    def tokenizer(self) -> Any:
        """The side's own tokenizer, loaded from its files (no model); a recording has none."""
        if self.checkpoint is None:
            raise RuntimeError(f"the {self.role} side is a recording and has no tokenizer")
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.load_tokenizer(trust_remote_code=self.options.trust_remote_code)
        return self._tokenizer

    def content_sha256(self, cache: DigestCache | None = None) -> str:
        """The digest of every byte the side's backend reads (a recording: the recorded checkpoint's)."""
        if self._content is None:
            if self.recording is not None:
                self._content = self.recording.content_sha256
            else:
                self._content = self.checkpoint.content_sha256(cache)
        return self._content

    def describe(self) -> dict[str, Any]:
        """results.json's description of the side."""
        if self.recording is not None:
            return self.recording.to_json()
        ckpt = self.checkpoint
        doc: dict[str, Any] = {"path": str(ckpt.path), "format": ckpt.format, "fingerprint": ckpt.fingerprint}
        if self._content is not None:
            doc["content_sha256"] = self._content
        return doc


def open_side(role: Role, source: str | Path, options: BackendOptions) -> Side:
    """A checkpoint side, or for the reference a recording of one. A backend `auto` is resolved here, from
    the checkpoint's format."""
    if is_recording(source):
        if role != "ref":
            raise InputError("a recording can only be the reference (--ref), not the candidate", source)
        return Side(role, options.for_format("bf16"), recording=Recording.open(source))
    checkpoint = Checkpoint.open(source)
    return Side(role, options.for_format(checkpoint.format), checkpoint=checkpoint)
