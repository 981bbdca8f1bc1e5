"""An EXL3 candidate verified: each quantized Linear's trellis, sign vectors and codebook marker checked
against its source weight's shape (padded to multiples of 128, as exllamav3 stores it), its weight decoded on
the CPU block by block of output channels and measured against the source; then `tensor_storage` and the
config's bit and codebook claims against what the files hold.

The decode is `evalsuite.formats.exl3_decode`, whose W_hat is bit-exact to exllamav3's reconstruction; there
is no second CPU decoder to compare it with, so `decode_exact` stays unmeasured for EXL3."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from evalsuite.files.checkpoint import EXL3_CONFIG_FILE, TensorInfo
from evalsuite.formats import ShardReader, as_float32
from evalsuite.formats.exl3 import (
    PART_CLAIMS,
    Exl3,
    block_tile_errors,
    codebook,
    decoded_blocks,
    linear_problems,
    storage_problems,
    stored_bits,
)
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow

# What the decode reads of a Linear (the markers only by their presence).
_DECODED = ("trellis", "suh", "su", "svh", "sv")
# A tile is broken when its error in the rotated basis is an outlier against its own tensor's tiles (above
# TILE_OUTLIER_RATIO × the median tile's error) and as large as a signal (above TILE_SIGNAL_FRACTION × the
# median tile's source energy: a relative error of 0.5). Quantization noise is about equal across the tiles
# of a tensor (the rotation spreads every weight over a 128×128 block); a tile whose trellis words were
# damaged decodes values unrelated to its source, an error of the order of the signal at any K. The ratio
# alone does not do: at K=6 the CPU encoder's worst clean tiles reach 33× their median (a relative error of
# 0.2), while at K=2 a half-destroyed tile is only about 13× its median. The clean fixtures' worst tiles and
# the false-alarm rate are in the README ("EXL3 packs").
TILE_OUTLIER_RATIO = 8.0
TILE_SIGNAL_FRACTION = 0.25


class Exl3Verifier(OneByOneVerifier):
    """How an EXL3 candidate is verified (see `FormatVerifier`)."""

    # exllamav3 stores a Linear it does not quantize (routers, gates, Gated DeltaNet's in_proj_a/b) as FP16
    # (`modules/linear.py:247`, `loader/safetensors.py:842`, `modules/quant/fp16.py:62-66`): protected, and
    # value-equal to the source cast to FP16.
    protected_casts: ClassVar[dict[tuple[str, str], str]] = {
        ("BF16", "F16"): "stored FP16 as exllamav3 stores a Linear it leaves unquantized: value-equal to the "
        "source cast to FP16",
    }

    format: Exl3

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Bits from the trellis shape; the stored tensors against the source's shape; the decoded weight
        against the source weight."""
        row.format, row.codebook = "exl3", None
        row.decode_exact = None
        if len(source.shape) != 2:
            return [Problem("config", source.name, f"a trellis for a {len(source.shape)}-D source tensor")]
        out_features, in_features = source.shape

        def marker_value(info: TensorInfo) -> int | None:
            return int(reader.tensor(info).reshape(-1).view(np.uint32)[0]) if info.nbytes == 4 else None

        found = linear_problems(tensors, out_features, in_features, marker_value)
        bits = stored_bits(tensors["trellis"])
        if bits is not None:
            row.bits = row.bits_per_weight = bits
        row.codebook = codebook(tensors)
        if found:
            row.note = "not decoded: its stored tensors do not form an EXL3 Linear of the source's shape"
            return [Problem("config", source.name, p) for p in found]
        return self._measure_decoded(source, tensors, reader, row)

    @staticmethod
    def _measure_decoded(
        source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        import torch

        stored = {p: torch.from_numpy(reader.tensor(info)) for p, info in tensors.items() if p in _DECODED}
        stored.update({p: info for p, info in tensors.items() if p not in _DECODED})  # markers: presence
        out_features, in_features = source.shape
        errors = ErrorAccumulator()
        tiles, signal = [], []
        for r0, block in decoded_blocks(stored, out_features, in_features):
            r1 = r0 + block.shape[0]
            shape = (r1 - r0, in_features)
            ref = as_float32(
                reader.rows(source, r0, r1, "source"), source.dtype, reader.scratch("ref", shape, "f4")
            )
            errors.add(r0, ref, block.numpy(), reader.scratch("difference", shape, "f4"))
            source_rows = torch.from_numpy(ref)
            tiles.append(block_tile_errors(stored, r0, block - source_rows, in_features))
            signal.append(block_tile_errors(stored, r0, source_rows, in_features))
        errors.fill(row)
        return _tile_outliers(torch.cat(tiles), torch.cat(signal), source.name, row)

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """tensor_storage against the tensors and the trellis bitrates; codebook and per-part bit claims."""
        config, storage_problem = self.format.config, self.format.storage_problem
        problems: list[Problem] = []
        if storage_problem:
            problems.append(Problem("config", EXL3_CONFIG_FILE, storage_problem))
        claimed_codebook = config.get("codebook")
        seen_codebooks = set()
        row_of_trellis = {}
        for row in rows:
            if row.format != "exl3" or row.codebook is None:
                continue
            row_of_trellis[f"{row.module}.trellis"] = row.name
            seen_codebooks.add(row.codebook)
            if claimed_codebook is not None and row.codebook != claimed_codebook:
                problems.append(
                    Problem(
                        "config",
                        row.name,
                        f"stores the {row.codebook} codebook, the config says {claimed_codebook}",
                    )
                )
            claim_key = PART_CLAIMS.get(row.part)
            claim = config.get(claim_key) if claim_key else None
            if claim is not None and row.bits is not None and row.bits != claim:
                problems.append(Problem("config", row.name, f"{row.bits} bpw, but {claim_key} is {claim}"))
        if claimed_codebook is None and len(seen_codebooks) > 1:
            problems.append(
                Problem("config", "config.json", f"codebooks differ across tensors: {sorted(seen_codebooks)}")
            )
        if not storage_problem:
            # A module's own problems are listed under its source weight's row, where the reader looks.
            problems += [
                Problem("config", row_of_trellis.get(name, name), detail)
                for name, detail in storage_problems(self.format.storage, self.format.candidate.tensors)
            ]
        claims = {k: config[k] for k in ("bits", "head_bits", "codebook") if k in config}
        return problems, claims


def _tile_outliers(mse: Any, energy: Any, name: str, row: TensorRow) -> list[Problem]:
    """The tensor's tiles against its median tile (`TILE_OUTLIER_RATIO`, `TILE_SIGNAL_FRACTION`): a problem
    naming how many tiles are broken and the worst of them, by its trellis index (input tile, output tile).
    `mse` / `energy`: per tile (output tiles, input tiles), the error's and the source's mean square in the
    rotated basis."""
    import torch

    live = ~torch.isnan(mse)
    median = float(mse[live].median()) if live.any() else 0.0
    if median <= 0.0:
        return []  # nothing decodes with an error: no tile stands out
    floor = TILE_SIGNAL_FRACTION * float(energy[live].median())
    ratio = torch.nan_to_num(mse / median, nan=0.0)
    worst = int(ratio.argmax())
    out_tile, in_tile = divmod(worst, ratio.shape[1])
    row.worst_tile = f"trellis[{in_tile}, {out_tile}]: inputs {16 * in_tile}.., outputs {16 * out_tile}.."
    row.worst_tile_ratio = float(ratio.max())
    broken = (ratio > TILE_OUTLIER_RATIO) & (torch.nan_to_num(mse, nan=0.0) > floor)
    row.tile_outliers = int(broken.sum())
    if row.tile_outliers == 0:
        return []
    scores = torch.where(broken, ratio, torch.zeros_like(ratio))
    out_tile, in_tile = divmod(int(scores.argmax()), ratio.shape[1])
    detail = (
        f"{row.tile_outliers} of its {int(live.sum())} 16×16 tiles decode with an error above "
        f"{TILE_OUTLIER_RATIO:g}× its median tile's and above {TILE_SIGNAL_FRACTION:g}× its median tile's "
        f"signal (rotated basis); the worst, trellis[{in_tile}, {out_tile}] (inputs {16 * in_tile}.., "
        f"outputs {16 * out_tile}..), at {float(scores.max()):.1f}× the median"
    )
    return [Problem("tile", name, detail)]
