"""What the CLI shows on stderr while a command works: progress (live bars on a terminal, whole lines in a
log), which model loads, and the library log lines it holds back."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from evalsuite.backends.options import BackendOptions
    from evalsuite.protocol.side import Side
    from evalsuite.protocol.task import Progress

# Soft wrap: a piped line is never folded at 80 columns (paths and metric names stay whole for grep).
console = Console(stderr=True, soft_wrap=True)


# Most lines one pass prints to a log (stderr not a terminal): every step up to this many steps (a 40-layer
# pass prints 40), one per 1/64 of the steps beyond (10,000 documents print 64, not 10,000).
PROGRESS_LINES = 64
# The steps the time left is estimated from: the last few, so that steps resumed from a run folder (done at
# once) or a slow first step (a layer read cold from disk) stop weighing on the estimate after a few.
RECENT_STEPS = 8


def _clock(seconds: float) -> str:
    """A duration as the progress bars write it, H:MM:SS."""
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class ProgressLines:
    """Progress written as whole lines, for a log (CI, `2> run.log`): a pass's steps (one per decoder layer
    of a streamed pass), each with the time elapsed and the time left, at most `PROGRESS_LINES` lines a pass.
    A terminal gets live bars instead (`progress_display`)."""

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.clock = clock

    def __call__(self, description: str, total: int) -> Callable[[], None]:
        """The `Progress` protocol: a pass of `total` steps begins; the callable returned marks one done."""
        started = self.clock()
        times = [started]
        every = max(1, -(-total // PROGRESS_LINES))

        def advance() -> None:
            times.append(self.clock())
            done = len(times) - 1
            if done % every and done != total:
                return
            elapsed = times[-1] - started
            if done >= total:
                tail = f"done in {_clock(elapsed)}"
            else:
                recent = times[-(RECENT_STEPS + 1) :]
                per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
                tail = f"{_clock(elapsed)} elapsed, about {_clock(per_step * (total - done))} left"
            share = f" ({100 * done // total}%)" if total else ""
            self.console.print(
                f"{description}: {done}/{total}{share}, {tail}", highlight=False, markup=False, soft_wrap=True
            )

        return advance


@contextlib.contextmanager
def progress_display(quiet: bool) -> Iterator[Progress]:
    """The progress of a command's passes on stderr: nothing with `--quiet`; on a terminal, a live bar per
    pass with its time elapsed and left; otherwise (a log) `ProgressLines`, since rich draws a bar that is not
    on a terminal only once, finished, and a long pass would show nothing for an hour."""
    if quiet:
        from evalsuite.protocol.task import no_progress

        yield no_progress
        return
    if not console.is_terminal:
        yield ProgressLines(console)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bars

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
    )
    with Bars(*columns, console=console) as bars:

        def factory(description: str, total: int) -> Callable[[], None]:
            task_id = bars.add_task(description, total=total)
            return lambda: bars.advance(task_id)

        yield factory


def announce_load(side: Side, options: BackendOptions) -> Any:
    """Say which side loads, how, and why it is streamed (the API's `on_load`); and take what is alive by
    now (imported libraries, the plan, the observations so far) out of the cyclic collector's view: in a
    command's process it stays alive to the end, and the collection that frees each model once observed
    (`HFBackend.close`) would otherwise walk all of it again, a third of a second on a short run."""
    gc.freeze()
    streamed = ""
    if options.stream:
        why = side.stream_reason if side.stream_reason not in (None, "--stream") else ""
        streamed = ", streamed one decoder layer at a time" + (f": {why}" if why else "")
    console.print(
        f"loading {side.role}: {side.checkpoint.path} ({side.checkpoint.format}, backend {options.backend}"
        f"{streamed})"
    )


@contextlib.contextmanager
def third_party_quiet() -> Iterator[list[str]]:
    """Transformers' log lines collected instead of printed (the list yielded): its warnings (kernels
    falling back to reference implementations) are about speed on this machine, not about the result, and
    would bury evalsuite's own lines; compressed-tensors' logger is off (see `main`). EVALSUITE_VERBOSE=1
    shows them all as they come."""
    import logging

    collected: list[str] = []
    if os.environ.get("EVALSUITE_VERBOSE"):
        yield collected
        return
    from transformers.utils import logging as hf_logging

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            collected.append(record.getMessage().splitlines()[0] if record.getMessage() else "")

    handler = Collect(level=logging.WARNING)
    root = hf_logging.get_logger()
    hf_logging.disable_default_handler()
    root.addHandler(handler)
    try:
        yield collected
    finally:
        root.removeHandler(handler)
        hf_logging.enable_default_handler()


def summarise_noise(collected: list[str]) -> None:
    """One line saying how many library log lines `third_party_quiet` held back."""
    if collected:
        distinct = list(dict.fromkeys(collected))
        console.print(
            f"note: {len(collected)} log lines from Transformers / compressed-tensors were held back "
            f"({len(distinct)} distinct, e.g. {distinct[0][:100]!r}); EVALSUITE_VERBOSE=1 shows them",
            highlight=False,
        )
