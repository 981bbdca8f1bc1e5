"""What a benchmark writes beside its printed table: its figures as JSON, with the machine and the commit.

Every `bench/*.py` script records the figures it prints (the ratios it is judged by, with their goals) into
one JSON file per run, `bench/results/<bench>-<UTC time>.json` (or under `--results DIR`):

    {"schema": "evalsuite.bench/1", "bench": "digest", "script": "bench/digest.py", "title": "...",
     "mode": "full" | "quick",
     "date": "2026-12-03T16:50:00Z", "commit": "10450de...", "dirty": false,
     "machine": {"cpu_model", "cpu_flags", "torch_cpu_capability", "onednn_isa", "cores", "memory_bytes",
                 ...},
     "argv": [...], "load_average": {"start": [...], "end": [...]},
     "figures": [{"name", "value", "unit", "goal": {"op", "value"} | null, "met": bool | null}],
     "printed": ["the lines the bench printed", ...],
     "data": {...},  # optional: the bench's own measurements, from which it prints and resumes
     "note": "..."}  # optional: where a document came from when no run of the bench wrote it as it stands

`scripts/render_benchmarks.py` renders docs/benchmarks.md from the latest file of each bench. `--quick`
runs a bench in seconds on the tiny fixtures (`tests/conftest.py`'s), to check the bench itself: its
figures say nothing about the tool and are marked so. A bench that runs in pieces (bench/real_shape.py) keeps
its measurements under `data` and resumes from its latest document (`latest`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SCHEMA = "evalsuite.bench/1"
# Where `--quick` finds (and builds, once) the tiny fixtures: the test suite's cache.
TEST_FIXTURES = Path(
    os.environ.get("EVALSUITE_TEST_FIXTURES", Path.home() / ".cache" / "evalsuite" / "test-fixtures")
)
OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "==": lambda a, b: a == b}
# When and under what load the bench started: it imports this module first.
STARTED = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
LOAD_AT_START = list(os.getloadavg())


# Linux carries a process's high-water RSS across fork and exec into the child's ru_maxrss (with vfork, the
# parent's own peak): a bench that built its fixtures in its own process would lend its peak to every run it
# starts. A fresh small interpreter forks the measured command instead and reports that command's own peak.
_OWN_PEAK_LAUNCHER = r"""
import json, os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump({"peak_rss": usage.ru_maxrss * 1024}, out)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def with_own_peak(command: list[str], usage_file: Path) -> list[str]:
    """`command` started through the launcher, which writes the command's own peak RSS into `usage_file`
    (`own_peak`) and exits with its status."""
    return [sys.executable, "-S", "-c", _OWN_PEAK_LAUNCHER, str(usage_file), *command]


def own_peak(usage_file: Path) -> int:
    """The peak RSS in bytes the launcher wrote (the kernel's count, as `/usr/bin/time -v` reads it); 0 when
    the command could not be started."""
    return json.loads(usage_file.read_text())["peak_rss"] if usage_file.exists() else 0


def launched_pid(launcher_pid: int) -> int | None:
    """The measured command's pid under a running launcher, None before it has forked or after it ended."""
    try:
        children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def fastest(run: Callable[[], object], repeats: int, warm_up: bool = True) -> float:
    """Wall seconds of the fastest of `repeats` calls of `run`, after one call not counted (`warm_up`)."""
    if warm_up:
        run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--quick` (seconds, on the tiny fixtures) and `--results DIR` (where the JSON goes)."""
    parser.add_argument(
        "--quick", action="store_true", help="seconds-long mode on the tiny fixtures: checks the bench itself"
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the figures' JSON goes")


def quick_ppl_spec(folder: Path, windows: int = 2) -> Path:
    """tasks/ppl.toml with only its first `windows` windows, written into `folder`: `--quick`'s protocol."""
    text = (REPO / "tasks" / "ppl.toml").read_text(encoding="utf-8")
    assert "count = 8 }" in text, "tasks/ppl.toml's window count moved: update bench/figures.py"
    path = folder / "ppl-quick.toml"
    path.write_text(text.replace("count = 8 }", f"count = {windows} }}"), encoding="utf-8")
    return path


def git_commit(repo: Path = REPO) -> tuple[str | None, bool]:
    """The commit checked out in `repo` and whether tracked files differ from it (None, False outside git).
    A copy of the tree without .git (the lent GPU machine's) names its commit in EVALSUITE_BENCH_COMMIT."""
    if os.environ.get("EVALSUITE_BENCH_COMMIT"):
        return os.environ["EVALSUITE_BENCH_COMMIT"], False
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return head, bool(status.strip())


def bench_machine() -> dict[str, Any]:
    """The CPU a bench ran on (evalsuite.machine's description: model, kernel flags, the ISA torch's and
    oneDNN's kernels use, overrides in the environment), its cores, and its GPU where it has one."""
    from evalsuite.machine import describe_machine

    machine = describe_machine("cpu")
    if machine.get("gpu") is None:
        machine.pop("gpu", None)
    machine["cores"] = os.cpu_count()
    machine["cores_usable"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    machine["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return machine


def latest(bench: str, results: Path, quick: bool) -> dict[str, Any] | None:
    """The latest document `bench` wrote under `results` in the same mode (`--quick` or not), or None."""
    mode = "quick" if quick else "full"
    docs = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(results.glob(f"{bench}-*.json"))]
    docs = [d for d in docs if d.get("schema") == SCHEMA and (d.get("bench"), d.get("mode")) == (bench, mode)]
    return max(docs, key=lambda d: d["date"], default=None)


def _without_results(argv: list[str]) -> list[str]:
    """The command line without `--results DIR` (where the JSON went is no part of what was measured)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--results":
            skip = True
        elif not arg.startswith("--results="):
            kept.append(arg)
    return kept


class _Tee(io.TextIOBase):
    """A stdout that also keeps what is written to it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class Figures:
    """The figures of one run of a bench, written as JSON when the run ends (`recorded`)."""

    def __init__(self, bench: str, title: str, args: argparse.Namespace) -> None:
        self.bench = bench
        # The docstring's first paragraph, on one line.
        self.title = " ".join(title.strip().split("\n\n")[0].split())
        self.quick = bool(getattr(args, "quick", False))
        self.results = Path(getattr(args, "results", RESULTS))
        self.figures: list[dict[str, Any]] = []
        # The bench's own measurements, written beside the figures when set.
        self.data: dict[str, Any] | None = None
        self.tee: _Tee | None = None
        self.started = STARTED
        self.load_start = LOAD_AT_START

    def add(self, name: str, value: Any, unit: str = "", goal: str | None = None) -> None:
        """One figure; `goal` like `"<= 1.1"`, met or not by `value`."""
        parsed = None
        met = None
        if goal is not None:
            op, _, bound = goal.partition(" ")
            parsed = {"op": op, "value": float(bound)}
            met = bool(OPS[op](value, parsed["value"])) if isinstance(value, int | float) else None
        if isinstance(value, float):
            value = float(f"{value:.6g}")
        self.figures.append({"name": name, "value": value, "unit": unit, "goal": parsed, "met": met})

    def document(self, printed: str) -> dict[str, Any]:
        commit, dirty = git_commit()
        data = {} if self.data is None else {"data": self.data}
        return {
            "schema": SCHEMA,
            "bench": self.bench,
            "script": f"bench/{Path(sys.argv[0]).name}",
            "title": self.title,
            "mode": "quick" if self.quick else "full",
            "date": self.started.isoformat().replace("+00:00", "Z"),
            "commit": commit,
            "dirty": dirty,
            "machine": bench_machine(),
            "argv": _without_results(sys.argv[1:]),
            "load_average": {"start": self.load_start, "end": list(os.getloadavg())},
            "figures": self.figures,
            "printed": printed.splitlines(),
            **data,
        }

    def write(self, printed: str) -> Path:
        self.results.mkdir(parents=True, exist_ok=True)
        stamp = self.started.strftime("%Y%m%dT%H%M%SZ")
        path = self.results / f"{self.bench}-{stamp}{'-quick' if self.quick else ''}.json"
        path.write_text(json.dumps(self.document(printed), indent=2) + "\n", encoding="utf-8")
        return path

    def save(self) -> Path:
        """Write the document as it stands, with what the bench has printed so far (inside `recorded`): a
        long bench keeps what it measured should a later step fail. The end of the run rewrites the file."""
        assert self.tee is not None, "save() inside `recorded`"
        return self.write(self.tee.kept.getvalue())


@contextlib.contextmanager
def recorded(bench: str, title: str, args: argparse.Namespace) -> Iterator[Figures]:
    """`title`: the bench's docstring (its first paragraph is kept). Keep what the bench prints inside the
    block and, when the block ends without an exception, write its figures beside it (the JSON's path is
    printed last)."""
    figures = Figures(bench, title, args)
    tee = figures.tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield figures
    path = figures.write(tee.kept.getvalue())
    print(f"figures: {path}")
