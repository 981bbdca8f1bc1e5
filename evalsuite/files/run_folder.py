"""The run folder: where a run keeps its observations, artifacts and reports, written atomically.

Layout of `reports/NAME/`:
    results.json, report.md            the contract and the diff (replaced atomically)
    artifacts/                         plots and tables the tasks produce
    observations/ROLE-NAME-KEY/        what each side produced, under its key; reused when a run is resumed
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_target(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A fresh temporary file beside `path` for a writer that takes a file name (safetensors' `save_file`,
    numpy's `save`: give it `suffix=".npy"`); once the block completes it replaces `path` in one rename, so
    a reader, or a resumed run, sees either the old file or the whole new one; if the block fails it is
    removed. The name is unique, so two writers of one path never write into each other's file.

    Args:
        path: the file to replace.
        suffix: the temporary file's suffix (a writer that appends its own suffix needs that one).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates 0600; a report or an observation is an ordinary file (recordings are shared), so
        # honour the umask like open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read without setting it: os.umask can only read it by changing it, and a file
    another thread creates in between would get the temporary mask."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022  # no /proc (not Linux): the common default


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` so that a reader sees either the old file or the whole new one."""
    with atomic_target(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Every row of a table a report only summarises (one per expert, one per tensor), as CSV with a header
    of every key in the order first seen: the artifact a person opens in a spreadsheet or greps, atomically.
    None is an empty cell, a float keeps every digit (repr), a list is its items joined by spaces."""

    def cell(value: Any) -> Any:
        if value is None:
            return ""
        if isinstance(value, list | tuple):
            return " ".join(str(v) for v in value)
        return repr(value) if isinstance(value, float) else value

    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([cell(row.get(c)) for c in columns] for row in rows)
    write_atomic(path, out.getvalue())


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

    @property
    def observations(self) -> Path:
        return self.root / "observations"

    def observation(self, role: str, name: str, key: str) -> Path:
        """Folder of one saved observation: the side, what was observed, and its key (abbreviated)."""
        return self.observations / f"{role}-{name}-{key[:16]}"

    def observation_work(self, role: str, name: str, key: str, resume: bool) -> Path:
        """The folder an observation is made in before it is committed. An interrupted observation left its
        work here under the same key: kept when resuming (its observer continues from it), else cleared."""
        work = self.observations / f".{role}-{name}-{key[:16]}.partial"
        if not resume:
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        return work

    def commit_observation(self, work: Path, final: Path) -> Path:
        """Move a completed work folder into place (replacing an older observation there)."""
        shutil.rmtree(final, ignore_errors=True)
        work.rename(final)
        return final

    def prune_observations(self, keep: set[str]) -> None:
        """Remove saved or partial observations whose key is not in `keep` (made for other weights, specs or
        inputs: they would never be reused, and each can be a gigabyte)."""
        if not self.observations.is_dir():
            return
        prefixes = {key[:16] for key in keep}
        for entry in self.observations.iterdir():
            stem = entry.name.removeprefix(".").removesuffix(".partial")
            if stem.rsplit("-", 1)[-1] not in prefixes:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def remove_observations(self) -> None:
        """Remove every observation of the run (the reports stay)."""
        shutil.rmtree(self.observations, ignore_errors=True)
