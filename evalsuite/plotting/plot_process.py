"""Plots drawn in a process of their own, started as a command begins: matplotlib's import then happens while
the command's own start-up, which runs on one core, leaves the other idle, instead of after its last forward,
when every core has waited for it (bench/ppl.py).

A process, not a thread: importing and drawing hold the interpreter's lock the start-up needs. Spawned, not
forked, so that nothing of the parent's state (torch's threads, open models) is copied into it. A plot
function marked `drawn_here_or_there` runs in that process where one was started (`start`), and here
otherwise or if the process died; either way the call returns once the file is written, and raises here
what it raised there. Only the command line starts one: a program that imports evalsuite draws in its own
process, as before.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_pool: ProcessPoolExecutor | None = None


def _bound_to_the_command() -> None:
    """The plot process's set-up: it ends with the command, whichever way the command ends."""
    # Ctrl-C reaches the terminal's whole process group: the command reports the interrupt in its one line
    # and ends this process; a KeyboardInterrupt here would print a worker's traceback beside that line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A command killed outright (SIGTERM, SIGKILL) cannot end it: it would live on, holding the command's
    # stdout and stderr open, and whoever waits for them (a CI job) would wait for ever.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_after, args=(parent,), daemon=True).start()


def _exit_after(parent: Any) -> None:
    parent.join()
    os._exit(0)


def _import_matplotlib() -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    # What every plot draws on, and most of the import's time.
    import matplotlib.figure


def start() -> None:
    """Start the plot process (once per process) and have it import matplotlib now; where no process can be
    started (no semaphores, no spawning on this system), plots are drawn here."""
    global _pool
    if _pool is None:
        try:
            pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_bound_to_the_command,
            )
            pool.submit(_import_matplotlib)
        except (OSError, RuntimeError, ImportError):
            return
        _pool = pool


def stop() -> None:
    """End the plot process, if one was started (a later plot is drawn here)."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def drawn_here_or_there(plot: Callable[P, R]) -> Callable[P, R]:
    """Mark a plot function (arrays and a path in, a file out) to run in the plot process: at its definition
    in a module, where the plot process finds it by its name."""

    @functools.wraps(plot)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        pool = _pool
        if pool is not None:
            try:
                # `call` itself goes over (pickled by its name): in the plot process no pool is started, so
                # there it draws.
                return pool.submit(call, *args, **kwargs).result()
            except BrokenProcessPool:
                stop()
        return plot(*args, **kwargs)

    return call
