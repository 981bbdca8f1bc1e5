"""The `tensors` task's outlier rule on clean packs: its false alarms, and how close the clean packs come.

    python bench/outliers.py [--fixtures DIR] [--pair SOURCE:PACK ...] [--quick] [--results DIR]

For every clean quantized pack among the fixtures (the tiny Llama's and SmolLM2's llm-compressor packs, GPTQ
included, the tiny MiniCPM-V 4.7 and SmolLM2 W4A8 copies, the EXL3 fixtures; those built in the cache) and
every `--pair` given, `verify_tensors` judges each output channel against its tensor's channels and each
tensor against its siblings (`tensor_verification/_outliers.py`). Per pack: channels and tensors judged,
those flagged (false alarms: every pack here is clean), the largest robust z of each, and the closest
approach to the rule: max over channels (tensors) of min(z / Z, ratio / R), 1 or more being an outlier.
Prints a table; the figures go to bench/results/ as JSON (bench/figures.py), every pack's row under `data`.
`--quick` judges the tiny MiniCPM-V 4.7 W4A8 copy alone (seconds; checks the bench).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from figures import TEST_FIXTURES, Figures, add_arguments, recorded

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import TINY_BF16, TINY_W4A8
from evalsuite.tasks.tensors._verification import ModuleRules, verify_tensors
from evalsuite.tasks.tensors._verification._outliers import TENSOR_RATIO, TENSOR_Z

PAIRS = (
    ("tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"),
    ("tiny-minicpmv47-bf16", "tiny-minicpmv47-exl3"),
    ("tiny-qwen35moe-mtp-bf16", "tiny-qwen35moe-mtp-exl3"),
    ("smollm2-135m-bf16", "smollm2-135m-w4a8"),
    ("smollm2-135m-bf16", "smollm2-135m-exl3"),
    ("minicpmv47-35b-a3b-narrow", "minicpmv47-35b-a3b-narrow-w4a8"),
)
# Fixtures holding one pack per scheme in sub-folders (evalsuite.fixtures.llmcompressor_packs).
PACK_FOLDERS = (("tiny-llama-bf16", "tiny-llama-llmc"), ("smollm2-135m-bf16", "smollm2-135m-llmc"))


def clean_pairs(fixtures: Path) -> list[tuple[Path, Path]]:
    """(source, pack) of every clean pack built in the fixture cache."""
    found = [(fixtures / s, fixtures / c) for s, c in PAIRS if (fixtures / c / "config.json").is_file()]
    for source, folder in PACK_FOLDERS:
        if (fixtures / folder).is_dir():
            packs = sorted(p for p in (fixtures / folder).iterdir() if (p / "config.json").is_file())
            found += [(fixtures / source, p) for p in packs]
    return found


def judge(source: Path, pack: Path) -> dict:
    """One pack's figures under the rule."""
    found = verify_tensors(Checkpoint.open(source), Checkpoint.open(pack), ModuleRules())
    values = found.summary()
    quantized = [r for r in found.tensors if r.tensor_class == "quantized"]
    channels = [r.channel_judgement for r in quantized if r.channel_judgement is not None]
    siblings = [r for r in quantized if r.sibling_z is not None]
    nearest_tensor = max(
        (min(r.sibling_z / TENSOR_Z, r.sibling_ratio / TENSOR_RATIO) for r in siblings), default=None
    )
    return {
        "source": source.name,
        "pack": f"{pack.parent.name}/{pack.name}" if pack.parent.name.endswith("-llmc") else pack.name,
        "quantized_tensors": len(quantized),
        "channels_judged": sum(c.judged for c in channels),
        "outlier_channels": values.get("outlier_channels"),
        "worst_channel_z": values.get("worst_channel_z"),
        "worst_channel_z_tensor": values.get("worst_channel_z_tensor"),
        "nearest_channel": max((c.nearest for c in channels), default=None),
        "tensors_judged": len(siblings),
        "outlier_tensors": values.get("outlier_tensors"),
        "worst_sibling_z": values.get("worst_sibling_z"),
        "worst_sibling_z_tensor": values.get("worst_sibling_z_tensor"),
        "worst_sibling_ratio": max((r.sibling_ratio for r in siblings), default=None),
        "nearest_tensor": nearest_tensor,
        "false_alarms": [p.to_json() for p in found.problems if p.check == "outlier"],
    }


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "inf" if np.isinf(value) else f"{value:.2f}"
    return "–" if value is None else str(value)


COLUMNS = (
    "pack",
    "channels_judged",
    "outlier_channels",
    "worst_channel_z",
    "nearest_channel",
    "tensors_judged",
    "outlier_tensors",
    "worst_sibling_z",
    "nearest_tensor",
)


def print_row(row: dict[str, Any]) -> None:
    print(" | ".join(_cell(row[c]) for c in COLUMNS), flush=True)


def report(rows: list[dict[str, Any]], figures: Figures) -> None:
    """The totals over every pack's row (`judge`), and each pack's closest approach to the rule."""
    channels = sum(r["channels_judged"] for r in rows)
    flagged = sum(r["outlier_channels"] or 0 for r in rows)
    tensors = sum(r["tensors_judged"] for r in rows)
    flagged_tensors = sum(r["outlier_tensors"] or 0 for r in rows)
    print(f"false alarms: {flagged} of {channels} channels, {flagged_tensors} of {tensors} tensors")
    figures.add("clean packs judged", len(rows))
    figures.add("channels judged", channels)
    figures.add("false alarms: channels", flagged, goal="== 0")
    figures.add("tensors judged", tensors)
    figures.add("false alarms: tensors", flagged_tensors, goal="== 0")
    for row in rows:
        for key, what in (("nearest_channel", "channels"), ("nearest_tensor", "tensors")):
            if row[key] is not None:
                figures.add(f"{row['pack']}: closest approach of its {what} (1 is an outlier)", row[key])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fixtures", type=Path, default=TEST_FIXTURES)
    parser.add_argument("--pair", action="append", default=[], help="SOURCE:PACK, another clean pack")
    add_arguments(parser)
    options = parser.parse_args()
    if options.quick:
        built = build_fixtures(TEST_FIXTURES, [TINY_BF16, TINY_W4A8])
        pairs = [(built[TINY_BF16], built[TINY_W4A8])]
    else:
        pairs = clean_pairs(options.fixtures)
    pairs += [(Path(a), Path(b)) for a, b in (p.split(":", 1) for p in options.pair)]
    with recorded("outliers", __doc__, options) as figures:
        print(" | ".join(COLUMNS))
        rows = []
        for source, pack in pairs:
            rows.append(judge(source, pack))
            print_row(rows[-1])
        report(rows, figures)
        figures.data = {"packs": rows}
    return 0


if __name__ == "__main__":
    sys.exit(main())
