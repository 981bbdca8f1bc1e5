"""The loader under the usual limits on open files (issue 59), in a CLI child whose limit is lowered as a
user's shell lowers it (`ulimit -n`): the SmolLM2 pair under 32 and the narrow real-depth pair (40 layers ×
256 experts stored per expert, as the seed's source and pack are) under 1024, the usual Linux default, each
loaded and streamed. A loader holding a descriptor per tensor ended these with "Too many open files": exit 2
blaming the checkpoint, or an internal error (exit 3) in a streamed layer.

SmolLM2 runs under half the issue's 64: a streamed SmolLM2 layer is few enough tensors that the per-tensor
loader held under 64 (not under 32), so 64 would show the fix on the loaded side only. One window is enough:
a loaded side reads every tensor at load, a streamed side every layer in the window's pass."""

from __future__ import annotations

import importlib.util
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import REAL_NARROW_BF16, REAL_NARROW_W4A8
from tests.conftest import FIXTURES, SMOLLM2, TINY, cli_env

ROOT = Path(__file__).parents[2]
SMOLLM2_BF16, SMOLLM2_W4A8 = SMOLLM2
ONE_WINDOW = """
[protocol]
window = 512
starts = { first = 0, step = 4096, count = 1 }
scored = { first = 256, last = 510 }
"""
MODES = {"loaded": (), "streamed": ("--stream",)}
SMOLLM2_OPEN_FILES, NARROW_OPEN_FILES = 32, 1024
# The CLI in a child whose limit of open files is lowered, once it has started, to its lowest free descriptor:
# the next file it opens, wherever that is (a module imported lazily, a checkpoint's config), cannot be.
NO_FILE_LEFT = """
import os, resource, sys
from evalsuite.cli import app as cli
free = os.open(os.devnull, os.O_RDONLY)
os.close(free)
resource.setrlimit(resource.RLIMIT_NOFILE, (free, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(free, resource.getrlimit(resource.RLIMIT_NOFILE)[1], flush=True)
cli.main(sys.argv[1:])
"""


@pytest.fixture(scope="session")
def narrow_pair() -> dict[str, Path]:
    """The narrow real-depth MiniCPM-V 4.7 pair, BF16 and W4A8 (about 31,000 tensors each; read-only)."""
    return build_fixtures(FIXTURES, [REAL_NARROW_BF16, REAL_NARROW_W4A8])


def ppl_under_open_file_limit(
    limit: int, ckpt: Path, ref: Path, out: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """`evalsuite run --tasks ppl` of `ckpt` against `ref` on one window, in a child whose soft limit of open
    files is `limit` (what `ulimit -n LIMIT` sets before the command starts)."""
    spec = out.parent / f"{out.name}-ppl.toml"
    spec.write_text(ONE_WINDOW, encoding="utf-8")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    args = ["run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--corpus", "python-docs",
            "--spec", f"ppl={spec}", "--out", out, "--quiet", *extra]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "evalsuite.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard)),
        timeout=3600,
        check=False,
    )


def assert_ppl_ran(proc: subprocess.CompletedProcess[str], out: Path, mode: str) -> None:
    """The run ended as a run ends (exit 0, or 1 where a threshold failed, which is not what is judged here)
    with both sides' perplexities in results.json, each side executed as `mode` says."""
    assert "Too many open files" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    metrics = json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"]["ppl"]["metrics"]
    assert metrics["n_windows"] == 1 and metrics["n_scored_tokens"] == 255
    assert math.isfinite(metrics["ppl_ref"]) and math.isfinite(metrics["ppl_ckpt"])
    for side in ("ref_execution", "ckpt_execution"):
        assert ("streamed" in metrics[side]) == (mode == "streamed"), metrics[side]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_smollm2_pair_runs_ppl_under_32_open_files(mode, smollm2_pair, tmp_path):
    out = tmp_path / "run"
    pair = (smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16])
    proc = ppl_under_open_file_limit(SMOLLM2_OPEN_FILES, *pair, out, *MODES[mode])
    assert_ppl_ran(proc, out, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_narrow_real_depth_pair_runs_ppl_under_1024_open_files(mode, narrow_pair, tmp_path):
    out = tmp_path / "run"
    proc = ppl_under_open_file_limit(
        NARROW_OPEN_FILES, narrow_pair[REAL_NARROW_W4A8], narrow_pair[REAL_NARROW_BF16], out, *MODES[mode]
    )
    assert_ppl_ran(proc, out, mode)


def test_running_out_of_open_files_is_exit_4_naming_the_limit_not_the_checkpoint(tiny_pair, tmp_path):
    ckpt, ref = (tiny_pair[name] for name in reversed(TINY))
    args = ["run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--corpus", "python-docs",
            "--out", tmp_path / "run", "--quiet"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", NO_FILE_LEFT, *map(str, args)],
        capture_output=True, text=True, env=cli_env(), timeout=600, check=False,
    )  # fmt: skip
    soft, hard = proc.stdout.split()[:2]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("evalsuite: error: out of a system resource: too many open files"), lines
    assert f"limit {soft}" in lines[0] and f"hard limit {hard}" in lines[0] and "`ulimit -n" in lines[0]
    assert str(ckpt) not in lines[0] and str(ref) not in lines[0]


def under_a_hard_limit_of_1024(command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` in a child whose limit of open files is 1024, soft and hard (`ulimit -n 1024`, the usual
    Linux default): below the hard limit of 4096 mlx-lm sets for itself at import."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env(),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)),
        timeout=600,
        check=False,
    )


def test_the_mlx_tiers_are_skipped_with_the_reason_under_a_hard_limit_below_mlx_lms():
    # mlx-lm sets its own limit of open files to (2048, 4096) at import: under a lower hard limit, which a
    # process may not raise, that is a ValueError, not an ImportError. Its tests are skipped, saying why, as
    # for a missing package; collection does not error.
    tiers = ["tests/e2e/test_mlx.py", "tests/e2e/test_mlx_smollm2.py"]
    collect = ["--collect-only", "-q", "-rs", "-p", "no:randomly", "-n", "0"]
    proc = under_a_hard_limit_of_1024([sys.executable, "-m", "pytest", *collect, *tiers])
    said = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "ERROR" not in said, said[-3000:]
    assert f"SKIPPED [{len(tiers)}]" in said and "MLX packs are written by mlx-lm's converter" in said
    assert "ValueError" in said or "ModuleNotFoundError" in said  # what the import raised, said


def test_an_mlx_pack_under_a_hard_limit_below_mlx_lms_is_a_missing_dependency(tmp_path):
    # The converter runs in a child of its own, where mlx-lm's import raises ValueError under this limit: a
    # package that cannot be imported here, said as one (exit 2 from the CLI), not a conversion that failed.
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("mlx-lm is not installed: pip install 'mlx-lm[cpu]'")
    build = (
        "import sys; from pathlib import Path; from evalsuite.fixtures.mlx_packs import build_mlx_pack, "
        "mlx_recipe; build_mlx_pack(Path(sys.argv[1]), mlx_recipe(), Path(sys.argv[2]))"
    )
    (tmp_path / "pack").mkdir()  # the source is never read: the import fails first
    proc = under_a_hard_limit_of_1024([sys.executable, "-c", build, *map(str, [tmp_path / "pack", tmp_path])])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("evalsuite.errors.DependencyError: MLX packs are written by mlx-lm's"), last
    assert "cannot be imported here (ValueError: not allowed to raise maximum limit)" in last
