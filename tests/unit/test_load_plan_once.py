"""`check_load_plan_once`: a load plan that passed is not checked again for the same bytes and options."""

from types import SimpleNamespace

import pytest

from evalsuite import plan
from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError


def test_a_passed_load_plan_is_checked_once_and_a_refused_one_every_time(monkeypatch):
    monkeypatch.setattr(plan, "_LOADABLE", {})
    checked = []

    def check(checkpoint, options):
        checked.append(checkpoint)
        if checkpoint == "broken":
            raise InputError("cannot load")

    monkeypatch.setattr(plan, "check_load_plan", check)
    good = SimpleNamespace(checkpoint="good", content_sha256=lambda digests: "aaa")
    copy = SimpleNamespace(checkpoint="copy", content_sha256=lambda digests: "aaa")  # the same bytes
    broken = SimpleNamespace(checkpoint="broken", content_sha256=lambda digests: "bbb")
    options = BackendOptions()
    for side in (good, good, copy):
        plan.check_load_plan_once(side, options, None)
    assert checked == ["good"]
    plan.check_load_plan_once(good, BackendOptions(dtype="float32"), None)  # other options: checked again
    assert checked == ["good", "good"]
    for _ in range(2):
        with pytest.raises(InputError):
            plan.check_load_plan_once(broken, options, None)
    assert checked == ["good", "good", "broken", "broken"]
