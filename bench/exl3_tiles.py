"""The per-tile check of EXL3 packs: its false alarms on clean packs and its detection of one broken tile.

    python bench/exl3_tiles.py [--fixtures DIR] [--quick] [--results DIR]

For every EXL3 Linear of the clean EXL3 fixtures (tiny MiniCPM-V 4.7 K 2..6, tiny Qwen3.5 MTP K 3..6,
SmolLM2 K 4 and 6) and of Gaussian weights encoded here at every K from 1 to 8, the tiles the `tensors`
task would flag (above `TILE_OUTLIER_RATIO` × the tensor's median tile error and above
`TILE_SIGNAL_FRACTION` × its median tile signal, in the rotated basis), per K: tiles, tiles flagged (the
false-alarm rate), the worst tile's ratio and fraction. Then, for the Gaussian weights at every K, half of
one tile's trellis words inverted: is that tile flagged? Prints a table; the figures go to bench/results/ as
JSON (bench/figures.py). `--quick`: the tiny MiniCPM-V 4.7 pack only, and Gaussian weights of 128 x 256 at
K = 2 and 4 (seconds; checks the bench, its figures say nothing).
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import torch
from figures import add_arguments, recorded

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.exl3_encoder import encode_weight
from evalsuite.formats.exl3 import block_tile_errors, decoded_blocks
from evalsuite.tasks.tensors._verification._exl3 import TILE_OUTLIER_RATIO, TILE_SIGNAL_FRACTION

PAIRS = (
    ("tiny-minicpmv47-bf16", "tiny-minicpmv47-exl3"),
    ("tiny-qwen35moe-mtp-bf16", "tiny-qwen35moe-mtp-exl3"),
    ("smollm2-135m-bf16", "smollm2-135m-exl3"),
)


def tile_scores(stored: dict, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile: error over the median tile's error, and error over the median tile's signal."""
    errors, signal = [], []
    for first, block in decoded_blocks(stored, *weight.shape):
        rows = weight[first : first + block.shape[0]]
        errors.append(block_tile_errors(stored, first, block - rows, weight.shape[1]))
        signal.append(block_tile_errors(stored, first, rows, weight.shape[1]))
    e, s = torch.cat(errors), torch.cat(signal)
    live = ~torch.isnan(e)
    e = e[live]
    return e / e.median(), e / s[live].median()


def flagged(ratio: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
    return (ratio > TILE_OUTLIER_RATIO) & (fraction > TILE_SIGNAL_FRACTION)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = os.environ.get(
        "EVALSUITE_TEST_FIXTURES", Path.home() / ".cache" / "evalsuite" / "test-fixtures"
    )
    parser.add_argument("--fixtures", type=Path, default=Path(default))
    add_arguments(parser)
    options = parser.parse_args()
    torch.set_num_threads(1)
    pairs = PAIRS[:1] if options.quick else PAIRS
    gaussian_bits, gaussian_shape = ((2, 4), (128, 256)) if options.quick else (range(1, 9), (512, 1024))

    rows: dict[tuple[str, int], list] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0])
    names = [name for pair in pairs for name in pair]
    built = build_fixtures(options.fixtures, names, progress=print)
    for source_name, pack_name in pairs:
        pack, source = Checkpoint.open(built[pack_name]), Checkpoint.open(built[source_name])
        for module in sorted({n.removesuffix(".trellis") for n in pack.tensors if n.endswith(".trellis")}):
            stored = {p: pack.read_tensor(f"{module}.{p}") for p in ("trellis", "suh", "svh")}
            stored["mul1"] = None
            name = f"{module}.weight"
            weight = source.read_tensor(
                name if name in source.tensors else "model.embed_tokens.weight"
            ).float()
            ratio, fraction = tile_scores(stored, weight)
            row = rows[pack_name, stored["trellis"].shape[-1] // 16]
            row[0] += 1
            row[1] += ratio.numel()
            row[2] += int(flagged(ratio, fraction).sum())
            row[3], row[4] = max(row[3], float(ratio.max())), max(row[4], float(fraction.max()))

    generator = torch.Generator().manual_seed(0)
    detected = {}
    for bits in gaussian_bits:
        weight = torch.randn(*gaussian_shape, generator=generator)
        stored = encode_weight(weight, bits, "mul1", seed=bits, effort=max(64, 2**bits))
        ratio, fraction = tile_scores(stored, weight)
        row = rows[f"gaussian {gaussian_shape[0]}x{gaussian_shape[1]}", bits]
        row[0], row[1], row[2] = 1, ratio.numel(), int(flagged(ratio, fraction).sum())
        row[3], row[4] = float(ratio.max()), float(fraction.max())
        broken = dict(stored)
        broken["trellis"] = stored["trellis"].clone()
        words = stored["trellis"].shape[-1]
        broken["trellis"][5, 7, : words // 2] ^= -1
        ratio, fraction = tile_scores(broken, weight)
        # Tile (in 5, out 7) of the trellis is row 7, column 5 of the (out tiles, in tiles) scores.
        index = 7 * (weight.shape[1] // 16) + 5
        detected[bits] = (bool(flagged(ratio, fraction)[index]), float(ratio[index]), float(fraction[index]))

    with recorded("exl3_tiles", __doc__, options) as figures:
        print(
            f"tile check: ratio > {TILE_OUTLIER_RATIO:g} × median tile error "
            f"and > {TILE_SIGNAL_FRACTION:g} × median tile signal"
        )
        print(
            f"{'pack':28} {'K':>2} {'tensors':>7} {'tiles':>9} {'flagged':>7} "
            f"{'worst ratio':>11} {'worst frac':>10}"
        )
        total_tiles = total_flagged = 0
        for (pack, bits), (tensors, tiles, hits, ratio, fraction) in sorted(rows.items()):
            total_tiles, total_flagged = total_tiles + tiles, total_flagged + hits
            print(f"{pack:28} {bits:>2} {tensors:>7} {tiles:>9} {hits:>7} {ratio:>11.2f} {fraction:>10.4f}")
        print(f"false alarms: {total_flagged} of {total_tiles} clean tiles")
        figures.add("clean tiles", total_tiles)
        figures.add("false alarms on clean tiles", total_flagged, goal="<= 0")
        print("half of one tile's words inverted (Gaussian weights):")
        for bits, (hit, ratio, fraction) in detected.items():
            print(f"  K={bits}: flagged {hit}  ratio {ratio:.1f}  fraction {fraction:.3f}")
            figures.add(f"half a tile inverted, K={bits}: flagged", hit)
            figures.add(f"half a tile inverted, K={bits}: ratio to the median tile", ratio)
        return 0 if total_flagged == 0 and all(hit for hit, _, _ in detected.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
