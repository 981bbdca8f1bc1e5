"""`python -m tests.interrupting WHAT N ARGS…`: run `evalsuite ARGS` and press Ctrl-C at a point the run
itself reports: a real SIGINT, raised in the process the moment its progress reports the Nth completed step
of the bar whose description holds WHAT ("window logits", "smoke prompts").

The signal is raised synchronously in the main thread (`signal.raise_signal`), so it lands after exactly N
steps whatever the machine's speed: no poll of the run's files and no clock to race. Everything else is the
CLI's own code; only its progress reporter is wrapped, to count.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator

from evalsuite.cli import app as cli


def interrupting_display(what: str, n: int) -> Callable:
    """`cli.progress_display`, wrapped: the Nth step of a pass described with `what` raises SIGINT."""
    original = cli.progress_display

    @contextlib.contextmanager
    def display(quiet: bool) -> Iterator[Callable]:
        with original(quiet) as progress:

            def bar(description: str, total: int) -> Callable[[], None]:
                advance = progress(description, total)
                if what not in description:
                    return advance
                done = 0

                def step() -> None:
                    nonlocal done
                    advance()
                    done += 1
                    if done == n:
                        signal.raise_signal(signal.SIGINT)

                return step

            yield bar

    return display


if __name__ == "__main__":
    what, n, *args = sys.argv[1:]
    # Ctrl-C reaches a run in the foreground. A test session started as a background job (`cmd &` in a
    # script, nohup) hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: the raised signal would vanish and the run finish with 0, as a run from such a CI did.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cli.progress_display = interrupting_display(what, int(n))
    cli.main(args)
