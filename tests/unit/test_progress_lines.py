"""Progress in a log (stderr not a terminal): a line per step of a pass with the time left, a bounded number
of lines however many steps, and an estimate that forgets steps done at once (resumed from a run folder)."""

from __future__ import annotations

import io

from rich.console import Console

from evalsuite.cli.app import PROGRESS_LINES, ProgressLines


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines_of(steps: list[float], total: int | None = None) -> list[str]:
    """The lines printed for a pass whose steps take these many seconds each."""
    out = io.StringIO()
    clock = Clock()
    step = ProgressLines(Console(file=out, width=80), clock)("ckpt (hf): layers", total or len(steps))
    for seconds in steps:
        clock.now += seconds
        step()
    return out.getvalue().splitlines()


def test_every_layer_of_a_forty_layer_pass_is_a_line_with_the_time_left():
    lines = lines_of([30.0] * 40)
    assert len(lines) == 40
    assert lines[0] == "ckpt (hf): layers: 1/40 (2%), 0:00:30 elapsed, about 0:19:30 left"
    assert lines[9] == "ckpt (hf): layers: 10/40 (25%), 0:05:00 elapsed, about 0:15:00 left"
    assert lines[-1] == "ckpt (hf): layers: 40/40 (100%), done in 0:20:00"


def test_ten_thousand_steps_print_a_bounded_number_of_lines_and_the_last():
    lines = lines_of([0.01] * 10_000)
    assert len(lines) <= PROGRESS_LINES + 1
    assert lines[-1].startswith("ckpt (hf): layers: 10000/10000 (100%), done in")


def test_steps_resumed_at_once_stop_counting_in_the_time_left():
    # Ten layers found done in the run folder, then layers of a minute each.
    lines = lines_of([0.0] * 10 + [60.0] * 10, total=40)
    assert lines[-1] == "ckpt (hf): layers: 20/40 (50%), 0:10:00 elapsed, about 0:20:00 left"
