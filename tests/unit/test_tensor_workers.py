"""The `tensors` task's workers: processes forked from the run (where the platform forks) and threads of it
measure the same rows, problems and claims, on good packs and on one built to fail."""

from __future__ import annotations

import sys

import pytest

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16, TINY_EXL3, TINY_W4A8
from evalsuite.tasks.tensors._verification import verify_tensors
from evalsuite.tasks.tensors._verification._engine import default_worker_kind
from tests.conftest import copy_checkpoint, edit_tensors, wrong_scale_copy
from tests.unit.test_formats import RULES


def test_more_than_one_worker_forks_on_linux_and_one_is_a_thread():
    assert default_worker_kind(1) == "thread"
    assert default_worker_kind(2) == ("process" if sys.platform == "linux" else "thread")


def flipped_norm_copy(src, dst):
    """A copy whose first RMSNorm weight (a protected tensor) has one element's sign flipped."""
    copy_checkpoint(src, dst)

    def flip(tensors):
        name = next(n for n in sorted(tensors) if n.endswith("input_layernorm.weight"))
        tensors[name] = tensors[name].clone()
        tensors[name][0] = -tensors[name][0]

    edit_tensors(dst, flip)
    return dst


@pytest.fixture(params=["w4a8", "w4a8-wrong-scale", "w4a8-flipped-norm", "exl3"])
def pair(request, tiny_pair, tiny_exl3_pair, tmp_path_factory) -> tuple[Checkpoint, Checkpoint]:
    source = Checkpoint.open(tiny_pair[TINY_BF16])
    if request.param == "exl3":
        return source, Checkpoint.open(tiny_exl3_pair[TINY_EXL3])
    candidate = tiny_pair[TINY_W4A8]
    if request.param == "w4a8-wrong-scale":
        candidate = wrong_scale_copy(candidate, tmp_path_factory.mktemp("wrong") / "w4a8")
    if request.param == "w4a8-flipped-norm":
        candidate = flipped_norm_copy(candidate, tmp_path_factory.mktemp("flipped") / "w4a8")
    return source, Checkpoint.open(candidate)


@pytest.mark.skipif(default_worker_kind(2) != "process", reason="this platform does not fork")
def test_forked_workers_measure_what_threads_measure(pair, request):
    source, candidate = pair
    found = {
        kind: verify_tensors(source, candidate, RULES, workers=2, worker_kind=kind)
        for kind in ("process", "thread")
    }
    seen = {
        kind: (v.rows, [(p.check, p.tensor, p.detail) for p in v.problems], v.claims, v.summary())
        for kind, v in found.items()
    }
    assert seen["process"] == seen["thread"]
    quantized = [row for row in found["process"].rows if row["tensor_class"] == "quantized"]
    assert quantized and all(row["rel_err"] is not None for row in quantized)
    # The two packs built to fail are told apart the same way by both: a verdict, not two empty lists.
    case = request.node.callspec.id
    worst = seen["process"][3]["worst_rel_err"]
    assert (worst > 1) == ("wrong-scale" in case), worst
    protected = [p for p in found["process"].problems if p.check == "protected"]
    assert bool(protected) == ("flipped-norm" in case), protected


def test_the_pass_reports_each_batch_measured_to_its_progress(tiny_pair):
    source, candidate = Checkpoint.open(tiny_pair[TINY_BF16]), Checkpoint.open(tiny_pair[TINY_W4A8])
    passes: list[tuple[str, int]] = []
    steps: list[int] = []

    def progress(label: str, total: int):
        passes.append((label, total))
        return lambda: steps.append(len(steps) + 1)

    found = verify_tensors(source, candidate, RULES, workers=1, progress=progress)
    ((label, total),) = passes
    assert label == f"tensors ({len(found.tensors):,} source tensors, in batches)"
    assert total >= 1 and steps == list(range(1, total + 1))
