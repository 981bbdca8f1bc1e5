"""What every task does on every backend, device and streaming choice, read off the run's own planning.

`support_table` runs phase 1 of `evalsuite run` (`plan.plan_run`: options checked, sides opened, memory plan,
tasks prepared, observations planned; no weight read) for each combination on a pair of the tiny fixtures,
on a machine made to look like one with `gpus` CUDA devices of `gpu_bytes` each (`fake_gpus`; the
load-plan check, which reads the files the same whatever the device, is left out). Each cell says what the
plan decided: the side runs loaded or streamed, and where; the task is skipped (and why); or the run is
refused (the one line it prints). `docs/devices.md` is this table (scripts/render_devices.py); a test
renders it again and compares.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from evalsuite.backends.options import BackendOptions
from evalsuite.errors import DependencyError, EvalsuiteError
from evalsuite.files.digest import DigestCache
from evalsuite.protocol.task import RunContext

BACKENDS = ("hf", "intref", "exl3")
DEVICES = ("cpu", "cuda", "cuda:1", "auto")
# The candidate each backend executes, against the tiny BF16 reference (fixture names).
CANDIDATE_OF = {
    "hf": "tiny-minicpmv47-w4a8",
    "intref": "tiny-minicpmv47-w4a8",
    "exl3": "tiny-minicpmv47-exl3",
}
REFERENCE = "tiny-minicpmv47-bf16"


@dataclass(frozen=True)
class Cell:
    """What phase 1 decided for one task, backend, device and `--stream` choice."""

    verdict: str  # "runs", "streams", "skipped" or "refused"
    detail: str  # where the sides run, the reason skipped, or the line the refusal prints


@contextlib.contextmanager
def fake_gpus(gpus: int, gpu_bytes: int) -> Iterator[None]:
    """Planning as on a machine with `gpus` CUDA devices of `gpu_bytes` free each: the device names and the
    memory budget are answered so, and the load-plan check (which reads the files, whatever the device) is
    left out. torch itself is left alone: nothing may run or allocate."""
    from evalsuite.backends import memory, options

    def check_device(device: str) -> None:
        index = device.removeprefix("cuda:")
        if device.startswith("cuda:") and index.isdigit() and int(index) >= gpus:
            raise DependencyError(f"--device {device}: this machine has {gpus} CUDA devices")
        if device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and index.isdigit()):
            options_check_device(device)  # the real one's refusal of an unknown name

    def memory_budget(chosen: BackendOptions) -> tuple[int, str] | None:
        if chosen.device.startswith("cuda"):
            return gpu_bytes, f"the free memory of {chosen.device}"
        return real_budget(chosen)

    options_check_device, real_budget = options.check_device, memory.memory_budget
    with (
        mock.patch.object(options, "check_device", check_device),
        mock.patch.object(memory, "memory_budget", memory_budget),
        mock.patch("evalsuite.pipeline.plan.check_load_plan_once", lambda *args: None),
    ):
        yield


def plan_cells(
    fixtures: Path,
    tasks: list[str],
    backend: str,
    device: str,
    stream: bool,
    context: RunContext | None = None,
) -> dict[str, Cell]:
    """Phase 1 of `evalsuite run --tasks TASKS --backend BACKEND --device DEVICE [--stream]` on the tiny pair,
    each task's cell read off the one plan; where the plan of them all is refused, each task is planned
    alone, so that a refusal is the cell of the task it comes from. `context` shares the corpus's
    tokenization between plans."""
    from evalsuite.pipeline.plan import RunRequest, plan_run

    with tempfile.TemporaryDirectory() as out:
        request = RunRequest(
            ckpt=str(fixtures / CANDIDATE_OF[backend]),
            ref=str(fixtures / REFERENCE),
            tasks=tasks,
            out=Path(out) / "run",
            context=context or RunContext(corpus_name="python-docs"),
            ckpt_options=BackendOptions(backend=backend, device=device, stream=stream),
            ref_options=BackendOptions(device=device, stream=stream),
        )
        try:
            plan = plan_run(request, DigestCache())
        except EvalsuiteError as exc:
            if len(tasks) > 1:
                alone = (plan_cells(fixtures, [task], backend, device, stream, context) for task in tasks)
                return {task: cell for cells in alone for task, cell in cells.items()}
            return {tasks[0]: Cell("refused", str(exc).splitlines()[0])}
    cells = {}
    for task in tasks:
        if task in plan.skipped:
            cells[task] = Cell("skipped", plan.skipped[task].reason or "")
            continue
        placements = sorted(
            {
                f"{p.role} {'streamed' if p.options.stream else 'loaded'} on {p.options.device}"
                + (f" ({p.options.backend})" if p.options.backend not in ("hf", "auto") else "")
                for p in plan.observations.values()
                if task in p.tasks
            }
        )
        if not placements:
            cells[task] = Cell("runs", "reads the files only")
        else:
            streamed = all("streamed" in p for p in placements)
            cells[task] = Cell("streams" if streamed else "runs", "; ".join(placements))
    return cells


Table = dict[tuple[str, str, str, bool], Cell]


def support_table(fixtures: Path, tasks: list[str], gpus: int = 2, gpu_bytes: int = 80 * 10**9) -> Table:
    """Every (task, backend, device, stream) cell, planned as on a machine with `gpus` CUDA devices of
    `gpu_bytes` each."""
    context = RunContext(corpus_name="python-docs")
    table = {}
    with fake_gpus(gpus, gpu_bytes):
        for backend in BACKENDS:
            for device in DEVICES:
                for stream in (False, True):
                    for task, cell in plan_cells(fixtures, tasks, backend, device, stream, context).items():
                        table[task, backend, device, stream] = cell
    return {key: table[key] for key in sorted(table, key=lambda k: tasks.index(k[0]))}


def render_markdown(table: Table) -> str:
    """The table as docs/devices.md's body: one section per task, a row per backend and `--stream` choice,
    a column per device; each cell its verdict and what it means. Paths are left out (the fixtures' folder
    is the machine's)."""
    lines = []
    for task in dict.fromkeys(key[0] for key in table):
        lines += [f"### {task}", "", "| backend | --stream | " + " | ".join(DEVICES) + " |"]
        lines.append("| --- | --- | " + " | ".join("---" for _ in DEVICES) + " |")
        for backend in BACKENDS:
            for stream in (False, True):
                cells = []
                for device in DEVICES:
                    cell = table[task, backend, device, stream]
                    detail = cell.detail.split(": ", 1)[1] if cell.detail.startswith("/") else cell.detail
                    cells.append(f"**{cell.verdict}**: {detail}".replace("|", "\\|"))
                lines.append(f"| {backend} | {'yes' if stream else 'no'} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
