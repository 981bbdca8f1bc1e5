"""`python -m tests.changing HOW FILE WHEN ARGS…`: run `evalsuite ARGS` and change FILE, from another
process, at a point the run itself reaches: `load` (as the first model is about to load, after every
checkpoint was opened and planned) or `WHAT:N` (the moment its progress reports the Nth completed step of the
bar whose description holds WHAT, as `tests/interrupting.py` does; FILE must then be mapped by the side that
WHAT names).

HOW is what a user's other program does to the file:
- `replace`: writes a changed copy beside it and renames it over the file (as downloads and `cp` do), then
  lets the run go on;
- `rewrite`: opens it to write and changes one byte in place;
- `truncate`: cuts it to half its size.
The last two are what a lease hears of (`evalsuite.files.leases`) where the run has the file mapped: the other
process waits until the run has ended, and the run, waiting for it, must be ended by what it heard. Where
nothing hears it, the change is made and the run goes on with the file as it now is.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from evalsuite.cli import app as cli
from evalsuite.pipeline import observe

_CHANGE = {
    "replace": (
        "import os,sys; p=sys.argv[1]; b=bytearray(open(p,'rb').read()); b[-1]^=1; "
        "open(p+'.new','wb').write(b); os.replace(p+'.new', p)"
    ),
    "rewrite": "import sys; f=open(sys.argv[1],'r+b'); f.seek(-1,2); c=f.read(1); f.seek(-1,2); "
    "f.write(bytes([c[0]^1])); f.close()",
    "truncate": "import os,sys; p=sys.argv[1]; os.truncate(p, os.path.getsize(p)//2)",
}


def change(how: str, path: str) -> None:
    """Change `path` as `how` says, from another process, and wait until it is done. A change that a lease
    holds back is done only once this run has ended (or after the kernel's lease-break time): the run must be
    ended by what it heard while it waits here."""
    subprocess.run([sys.executable, "-c", _CHANGE[how], path], check=True)


def changing_display(how: str, path: str, what: str, n: int) -> Callable:
    """`cli.progress_display`, wrapped: the Nth step of a pass described with `what` changes the file."""
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
                        change(how, path)

                return step

            yield bar

    return display


def changing_load(how: str, path: str) -> None:
    """`observe.load_backend`, wrapped: the first load changes the file first."""
    original = observe.load_backend
    pending = [True]

    def load_backend(*args: object, **kwargs: object) -> object:
        if pending:
            pending.clear()
            change(how, path)
        return original(*args, **kwargs)

    observe.load_backend = load_backend


if __name__ == "__main__":
    how, path, when, *args = sys.argv[1:]
    if not Path(path).is_file():
        raise SystemExit(f"tests.changing: no file {path}")
    if when == "load":
        changing_load(how, path)
    else:
        what, _, n = when.rpartition(":")
        cli.progress_display = changing_display(how, path, what, int(n))
    cli.main(args)
