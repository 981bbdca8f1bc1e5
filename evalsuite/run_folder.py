"""The run folder: where a run keeps its observations, artifacts and reports, written atomically.

Layout of `reports/NAME/`:
    results.json, report.md            the contract and the diff (replaced atomically)
    artifacts/                         plots and tables the tasks produce
    observations/{ref,ckpt}/TASK/      what each side produced; reused when a run is resumed
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` so that a reader sees either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; a report is an ordinary file, so honour the umask like open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class RunFolder:
    """Paths of one run's outputs."""

    root: Path

    @property
    def results_json(self) -> Path:
        return self.root / "results.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def observation(self, role: str, task: str) -> Path:
        """Folder of one side's observation of one task."""
        return self.root / "observations" / role / task

    def scratch(self, role: str, task: str) -> Path:
        """A fresh folder where an observation is built before it replaces the previous one."""
        folder = self.root / "observations" / role / f".{task}.partial"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def commit_observation(self, role: str, task: str, scratch: Path) -> Path:
        """Move a completed scratch folder into place (replacing an older observation)."""
        final = self.observation(role, task)
        shutil.rmtree(final, ignore_errors=True)
        scratch.rename(final)
        return final
