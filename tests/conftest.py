"""Session fixtures: the project's own offline test checkpoints, built once and cached by recipe hash."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from evalsuite.backends.hf import HFBackend
from evalsuite.fixtures import (
    SMOLLM2_BF16,
    SMOLLM2_EXL3,
    SMOLLM2_W4A8,
    TINY_BF16,
    TINY_EXL3,
    TINY_W4A8,
    build_fixtures,
)

FIXTURES = Path(
    os.environ.get("EVALSUITE_TEST_FIXTURES", Path.home() / ".cache" / "evalsuite" / "test-fixtures")
)
TINY = (TINY_BF16, TINY_W4A8)
SMOLLM2 = (SMOLLM2_BF16, SMOLLM2_W4A8)


@pytest.fixture(scope="session")
def tiny_pair() -> dict[str, Path]:
    """The tiny MiniCPM-V 4.7 BF16 source and its W4A8 copy (read-only: copy before changing)."""
    return build_fixtures(FIXTURES, list(TINY))


@pytest.fixture(scope="session")
def smollm2_pair() -> dict[str, Path]:
    """SmolLM2-135M-Instruct in BF16 and its W4A8 copy (read-only: copy before changing)."""
    return build_fixtures(FIXTURES, list(SMOLLM2))


@pytest.fixture(scope="session")
def tiny_exl3_pair() -> dict[str, Path]:
    """The tiny MiniCPM-V 4.7 BF16 source and its EXL3 copy (mixed K 2..6; read-only)."""
    return build_fixtures(FIXTURES, [TINY_BF16, TINY_EXL3])


@pytest.fixture(scope="session")
def smollm2_exl3_pair() -> dict[str, Path]:
    """SmolLM2-135M-Instruct in BF16 and its EXL3 copy (4 bpw, head 6 bpw; read-only)."""
    return build_fixtures(FIXTURES, [SMOLLM2_BF16, SMOLLM2_EXL3])


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("evalsuite: error:")]


def run_cli(
    *args: str | Path, cwd: Path | None = None, timeout: float = 1200, env: dict[str, str] | None = None
) -> CliResult:
    """Run `evalsuite ARGS` as a subprocess, the way users and CI run it (`env` adds variables)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "evalsuite.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A writable copy of a fixture checkpoint, for building a broken variant of it."""
    shutil.copytree(src, dst)
    return dst


def edit_tensors(folder: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite a checkpoint's one shard with `edit(tensors)` applied to the name → tensor dict (in place)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shard = folder / "model.safetensors"
    with safe_open(str(shard), "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata=metadata)


def wrong_scale_copy(src: Path, dst: Path, factor: float = 4.0) -> Path:
    """A copy of a compressed-tensors checkpoint with every `weight_scale` multiplied by `factor`."""
    copy_checkpoint(src, dst)
    edit_tensors(dst, lambda t: t.update({k: v * factor for k, v in t.items() if k.endswith("weight_scale")}))
    return dst


class Models:
    """What the models were asked: loads and forwarded windows per (checkpoint folder, backend)."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []
        self.windows: Counter[tuple[str, str]] = Counter()

    def watch(self, mp: pytest.MonkeyPatch) -> Models:
        """Wrap HFBackend (and so IntrefBackend) to count loads and windows."""
        init, window_logits = HFBackend.__init__, HFBackend.window_logits

        def counting_init(backend, checkpoint, options):
            self.loads.append((checkpoint.path.name, options.backend))
            init(backend, checkpoint, options)

        def counting_window_logits(backend, windows, positions):
            for logits in window_logits(backend, windows, positions):
                self.windows[backend.checkpoint.path.name, backend.options.backend] += 1
                yield logits

        mp.setattr(HFBackend, "__init__", counting_init)
        mp.setattr(HFBackend, "window_logits", counting_window_logits)
        return self
