"""What one side produced for one observer: JSON metadata, compact arrays, and large side files.

An observation is saved under the run folder (or in a recording) and reused only under the same key: a
digest of everything it depends on (see `evalsuite.pipeline.plan.observation_key`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.errors import InputError
from evalsuite.files.run_folder import atomic_target, write_atomic

OBSERVATION_FILE = "observation.json"
ARRAYS_FILE = "arrays.safetensors"


@dataclass
class Observation:
    """What one side produced: `meta` (JSON), `arrays` (numpy, saved as safetensors), `files` (large files
    the observer wrote into its folder, by name). `key` identifies everything it depends on; `name` is the
    observer's name (`window-logits`, `smoke-generations`, …)."""

    name: str
    key: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        """Write into `folder`; observation.json goes last, so its presence means the rest is complete."""
        from safetensors.numpy import save_file

        # atomic_target gives the file the umask's mode (safetensors writes 0600; a recording is shared).
        with atomic_target(folder / ARRAYS_FILE) as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in self.arrays.items()}, str(tmp))
        files = {}
        for name, path in self.files.items():
            if not path.resolve().is_relative_to(folder.resolve()):
                # A file made elsewhere (a recording of an observation that keeps its large files) is copied
                # in: an observation folder holds everything it names.
                target = folder / "files" / path.name
                target.parent.mkdir(exist_ok=True)
                shutil.copyfile(path, target)
                path = target
            files[name] = path.resolve().relative_to(folder.resolve()).as_posix()
        doc = {"name": self.name, "key": self.key, "meta": self.meta, "files": files}
        write_atomic(folder / OBSERVATION_FILE, json.dumps(doc, indent=1, sort_keys=True))

    @classmethod
    def load(cls, folder: Path) -> Observation:
        """Read an observation saved by `save`; its files must lie inside `folder`."""
        from safetensors.numpy import load_file

        try:
            doc = json.loads((folder / OBSERVATION_FILE).read_text(encoding="utf-8"))
            arrays = load_file(str(folder / ARRAYS_FILE))
        except (OSError, ValueError) as exc:
            raise InputError(f"unreadable observation ({exc})", folder) from None
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
            raise InputError("unreadable observation (no files table)", folder)
        files = {k: folder / rel for k, rel in doc["files"].items()}
        for name, path in files.items():
            if not path.resolve().is_relative_to(folder.resolve()) or not path.is_file():
                raise InputError(f"observation file {name!r} is missing or outside the folder", folder)
        return cls(
            name=doc.get("name", ""),
            key=doc.get("key", ""),
            meta=doc.get("meta", {}),
            arrays=arrays,
            files=files,
        )

    @staticmethod
    def is_complete(folder: Path) -> bool:
        """Whether `folder` holds a saved observation (its observation.json is written last)."""
        return (folder / OBSERVATION_FILE).is_file()
