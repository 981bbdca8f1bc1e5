"""The options the commands share, as typed annotations, and how their strings become a run's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from evalsuite.errors import InputError


def task_names(tasks: str) -> list[str]:
    """`--tasks a,b,c` as a list of names."""
    return [t.strip() for t in tasks.split(",") if t.strip()]


def parse_specs(items: list[str] | None) -> dict[str, Path]:
    """`--spec TASK=PATH` (repeatable): a spec file that replaces the shipped tasks/TASK.toml."""
    specs = {}
    for item in items or []:
        task, sep, path = item.partition("=")
        if not sep or not task or not path:
            raise InputError(f"--spec takes TASK=PATH, not {item!r}")
        specs[task.strip()] = Path(path)
    return specs


CorpusPath = Annotated[
    Path | None,
    typer.Option(
        help="A local copy of WikiText-2's raw test split (parquet file, datasets save_to_disk folder, or "
        "wiki.test.raw), checked to be that split."
    ),
]
SpecOption = Annotated[
    list[str] | None, typer.Option("--spec", help="TASK=PATH: use this spec file for TASK (repeatable).")
]
ChatsOption = Annotated[
    Path | None,
    typer.Option(
        "--chats",
        help='Score ppl on these chats through the chat template (JSONL: {"messages": [...], "tag": ...} '
        "per line) instead of a text.",
    ),
]
CalibrationOption = Annotated[
    Path | None,
    typer.Option(
        help="The candidate's calibration data (text, JSONL, a JSON array, parquet or Arrow; documents or "
        "chats): ppl's windows and chats, smoke's prompts and vision's questions it holds are flagged, and "
        "the verdicts given without them too."
    ),
]


Dtype = Annotated[str, typer.Option(help="Compute dtype: bfloat16, float16 or float32.")]
Device = Annotated[str, typer.Option(help="cpu, cuda, cuda:N, or auto (accelerate's device_map).")]
Stream = Annotated[
    bool, typer.Option(help="Run both sides one decoder layer at a time (for models larger than memory).")
]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        help="Memory a side may fill, e.g. 24GB or 30GiB [default: the device's free memory]; a side whose "
        "model needs more runs streamed."
    ),
]
ExecutionFloor = Annotated[
    bool,
    typer.Option(
        "--execution-floor/--no-execution-floor",
        help="Also run the reference's ppl windows batched (on CUDA with another kernel setting too) and "
        "report that difference from itself: a candidate's difference within it is no finding.",
    ),
]
DraftOption = Annotated[Path | None, typer.Option(help="A draft checkpoint for specdec; else prompt lookup.")]
