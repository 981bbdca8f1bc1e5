"""Transformers reads a load's tensors as its conversions reach them
(`load_lock.tensors_read_when_converted`), whatever nests or overlaps, and a user's own choice of
Transformers' switch stands."""

from __future__ import annotations

import os
import threading

from evalsuite.backends.load_lock import tensors_read_when_converted

SWITCH = "HF_DEACTIVATE_ASYNC_LOAD"


def test_the_switch_is_on_while_any_load_runs_and_off_after_the_last(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[str | None] = []

    def second() -> None:
        first_in.wait()
        with tensors_read_when_converted():
            second_in.set()
            first_out.wait()
            seen.append(os.environ.get(SWITCH))  # the first load ended: this one still reads in order

    thread = threading.Thread(target=second)
    thread.start()
    with tensors_read_when_converted():
        with tensors_read_when_converted():
            seen.append(os.environ.get(SWITCH))
        seen.append(os.environ.get(SWITCH))
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join()
    assert seen == ["1", "1", "1"]
    assert SWITCH not in os.environ


def test_a_users_own_setting_is_left_as_it_was(monkeypatch):
    monkeypatch.setenv(SWITCH, "0")
    with tensors_read_when_converted():
        assert os.environ[SWITCH] == "0"
    assert os.environ[SWITCH] == "0"
