"""`check_load_plan_once`: a load plan that passed is not checked again for what the check reads (the same
structure for a header-only check, the same bytes for the others) and the same options."""

import json

import pytest

from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_cache import RunCache
from evalsuite.fixtures import TINY_W4A8
from evalsuite.pipeline import plan
from evalsuite.protocol.side import open_side
from tests.conftest import copy_checkpoint, edit_tensors, wrong_scale_copy


@pytest.fixture
def checked(monkeypatch, tmp_path):
    """The checkpoint folders `check_load_plan` was asked about, in order (a folder named `broken*` is
    refused), with this test's own tables of passed plans (in process and on disk)."""
    monkeypatch.setattr(plan, "PASSED_LOAD_PLANS", plan.PassedLoadPlans())
    monkeypatch.setattr(plan, "load_plan_cache", lambda options: RunCache("load-plans", tmp_path / "cache"))
    asked: list[str] = []

    def check(checkpoint, options):
        asked.append(checkpoint.path.name)
        if checkpoint.path.name.startswith("broken"):
            raise InputError("cannot load", checkpoint.path)

    monkeypatch.setattr(plan, "check_load_plan", check)
    return asked


def test_a_plan_is_checked_once_per_structure_and_a_refused_one_every_time(tiny_pair, tmp_path, checked):
    source = tiny_pair[TINY_W4A8]
    good = copy_checkpoint(source, tmp_path / "good")
    rescaled = wrong_scale_copy(source, tmp_path / "rescaled", 1.01)  # other bytes, the same headers
    edited = copy_checkpoint(source, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (edited / "config.json").write_text(json.dumps(config))
    broken = copy_checkpoint(source, tmp_path / "broken")
    edit_tensors(broken, lambda tensors: tensors.pop(next(iter(tensors))))  # a tensor short: another header
    digests, options = DigestCache(), BackendOptions()

    def once(folder, opts=options):
        plan.check_load_plan_once(open_side("ckpt", str(folder), opts.check()), opts.check(), digests)

    for folder in (good, good, rescaled):
        once(folder)
    assert checked == ["good"]  # a recalibrated twin has the plan its structure gives
    once(edited)
    assert checked == ["good", "edited"]  # another config: checked again
    once(good, BackendOptions(dtype="float32"))  # other options: checked again
    assert checked == ["good", "edited", "good"]
    for _ in range(2):
        with pytest.raises(InputError):
            once(broken, BackendOptions(dtype="float32"))
    assert checked == ["good", "edited", "good", "broken", "broken"]


def test_a_check_that_reads_tensor_data_is_keyed_by_the_bytes(tiny_pair, tmp_path, checked):
    source = tiny_pair[TINY_W4A8]
    good = copy_checkpoint(source, tmp_path / "good")
    rescaled = wrong_scale_copy(source, tmp_path / "rescaled", 1.01)
    streamed = BackendOptions(stream=True).check()
    for folder in (good, good, rescaled):
        plan.check_load_plan_once(open_side("ckpt", str(folder), streamed), streamed, DigestCache())
    assert checked == ["good", "rescaled"]


def test_the_table_of_passed_plans_is_bounded_and_safe_to_share_between_threads():
    import threading

    passed = plan.PassedLoadPlans(keep=8)
    options = BackendOptions()

    def add(start: int) -> None:
        for i in range(start, start + 500):
            passed.add((f"structure:{i}", options))

    threads = [threading.Thread(target=add, args=(n * 1000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(passed._passed) == 8
    passed.add(("structure:last", options))
    assert ("structure:last", options) in passed


def test_a_passed_plan_is_kept_on_disk_for_the_next_process_under_the_same_code(
    tiny_pair, tmp_path, checked, monkeypatch
):
    from evalsuite.files import run_cache

    good = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "good")
    options = BackendOptions().check()

    def once_in_a_new_process() -> None:
        monkeypatch.setattr(plan, "PASSED_LOAD_PLANS", plan.PassedLoadPlans())
        plan.check_load_plan_once(open_side("ckpt", str(good), options), options, DigestCache())

    once_in_a_new_process()
    once_in_a_new_process()
    assert checked == ["good"]
    monkeypatch.setattr(run_cache, "code_versions", lambda: "another evalsuite or Transformers")
    once_in_a_new_process()
    assert checked == ["good", "good"]


def test_a_plan_passed_in_this_process_is_refused_once_an_internal_it_calls_goes_missing(
    tiny_pair, tmp_path, checked, monkeypatch
):
    import transformers.core_model_loading

    from evalsuite.errors import DependencyError

    good = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "good")
    streamed = BackendOptions(stream=True).check()
    digests = DigestCache()

    def once() -> None:
        plan.check_load_plan_once(open_side("ckpt", str(good), streamed), streamed, digests)

    once()
    # A caller of `evalsuite.run` that swapped Transformers' internals after an earlier run in its process.
    monkeypatch.delattr(transformers.core_model_loading, "rename_source_key")
    with pytest.raises(DependencyError, match="rename_source_key"):
        once()
    assert checked == ["good"]
