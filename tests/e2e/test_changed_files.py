"""A weight file that changes while a run reads it ends the run with one line naming it (exit 2), whatever
the change: replaced by a rename between the checkpoint's opening and its load, or during the run (the
identity check when the observation is saved), rewritten in place or cut short while its model is loaded
(the lease's break, heard before the other process may proceed). Each run changes a copy of the tiny W4A8
pack from another process at a point the run itself reports (`tests/changing.py`) and replays the reference
from the session's recording, so that only the candidate loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evalsuite.fixtures import TINY_W4A8

ROOT = Path(__file__).parents[2]
MAPPED = "ckpt (hf): window logits:2"  # the candidate's second window: its model loaded, its shard mapped


@pytest.mark.parametrize(
    ("how", "when", "said"),
    [
        ("replace", "load", "another file now stands at its path"),
        ("replace", MAPPED, "another file now stands at its path"),
        ("rewrite", MAPPED, "another process opened it to write, or cut it short"),
        ("truncate", MAPPED, "another process opened it to write, or cut it short"),
    ],
)
def test_a_shard_changed_during_a_run_ends_it_with_one_line_naming_the_shard(
    tiny_pair, tiny_recording, tmp_path, how, when, said
):
    pack = shutil.copytree(tiny_pair[TINY_W4A8], tmp_path / "w4a8")
    shard = pack / "model.safetensors"
    out = tmp_path / "run"
    args = ["run", "--ckpt", pack, "--ref", tiny_recording, "--tasks", "ppl", "--corpus", "python-docs"]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.changing", how, shard, when, *map(str, args), "--out", out, "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=600,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    said = f"changed while evalsuite ran ({said}); run again once it no longer changes"
    assert last == f"evalsuite: error: {shard}: {said}"
    assert not (out / "results.json").exists()
    # Nothing of the candidate was saved under the digest of a file it no longer is.
    assert not list((out / "observations").glob("ckpt-*"))
