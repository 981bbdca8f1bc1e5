"""A compressed-tensors candidate verified: each quantized module's scheme read from its tensors, its weight
decoded both by compressed-tensors and by `ct_decode` (they must agree bit for bit) and measured against the
source weight; then the config's groups and `ignore` list against what every module stores."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from evalsuite.checkpoint import TensorInfo
from evalsuite.formats import ModuleKind, ShardReader, as_float32, row_blocks, rows_and_cols
from evalsuite.formats.compressed_tensors import (
    DECODED_FORMATS,
    INDEPENDENT_DECODE_FORMATS,
    CompressedTensors,
    StoredQuantization,
    decoded_dtype,
    describe_scheme,
    library_decode,
    scheme_mismatches,
    stored_quantization,
)
from evalsuite.formats.ct_decode import first_difference, reference_decode, unpack_offset_binary
from evalsuite.tasks.tensor_verification._rows import ErrorAccumulator, Problem, TensorRow

UNCOVERED_LINEAR = "a Linear left unquantized: no config group targets it and no `ignore` entry names it"


class CompressedTensorsVerifier:
    """How a compressed-tensors candidate is verified (see `FormatVerifier`)."""

    def __init__(self, format: CompressedTensors, skeleton: dict[str, Any] | None = None) -> None:
        self.format = format
        self.lookup = format.lookup
        # The candidate's modules as Transformers builds them (meta device), by name: targets are matched on
        # them, as compressed-tensors matches them at load; names the skeleton lacks (experts Transformers
        # fuses) fall back to stand-ins.
        self.skeleton = skeleton or {}

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Read the module's scheme, decode it both ways block by block, and measure it against the source."""
        coverage = self.lookup.covering(row.module, row.kind, self.skeleton.get(row.module))
        row.group = coverage.group
        hint = coverage.scheme.weights if coverage.scheme is not None else None
        stored, problems = stored_quantization(source, tensors, hint, reader, coverage.format)
        found = [Problem("config", source.name, p) for p in problems]
        if stored is None:
            row.format = "unreadable"
            return found
        row.stored, row.format, row.strategy = stored, stored.format, stored.strategy
        row.bits = row.bits_per_weight = stored.num_bits
        if stored.format not in DECODED_FORMATS:
            row.note = f"{stored.format} is not decoded here"
            return found
        mismatch, out_of_range = self._decode(source, tensors, stored, reader, row)
        if out_of_range:
            found.append(Problem("config", source.name, out_of_range))
        if mismatch:
            found.append(Problem("decode", source.name, mismatch))
        return found

    def _decode(
        self,
        source: TensorInfo,
        tensors: dict[str, TensorInfo],
        stored: StoredQuantization,
        reader: ShardReader,
        row: TensorRow,
    ) -> tuple[str | None, str | None]:
        """Both decodes (the library's alone where evalsuite has none) and the error of the library's against
        the source, block by block of rows; returns where the decodes first differ and the first stored
        integer outside the scheme's range (each None when there is none)."""
        rows, cols = rows_and_cols(source.shape)
        weight = tensors.get("weight_packed") or tensors["weight"]
        scale_info = tensors["weight_scale"]
        scale = reader.tensor(scale_info)
        scale = scale.reshape(rows_and_cols(scale.shape))
        scale32 = as_float32(scale, scale_info.dtype)
        zp_info, g_info = tensors.get("weight_zero_point"), tensors.get("weight_g_idx")
        zp = reader.tensor(zp_info) if zp_info is not None else None
        zp = zp.reshape(rows_and_cols(zp.shape)) if zp is not None else None
        g_idx = reader.tensor(g_info).astype(np.int64).reshape(-1) if g_info is not None else None
        gs_info = tensors.get("weight_global_scale")
        global_scale = reader.tensor(gs_info).astype(np.float32).reshape(-1) if gs_info is not None else None
        independent = stored.format in INDEPENDENT_DECODE_FORMATS
        # Integers stored wider than the scheme's bits (int4 in int8) must lie in the scheme's range.
        narrow = stored.format == "int-quantized" and stored.num_bits < 8
        low, high = -(1 << (stored.num_bits - 1)), (1 << (stored.num_bits - 1)) - 1
        out_of_range = None
        packed_zp = zp is not None and stored.format == "pack-quantized"
        # Blocks of rows must start where scales (and zero points packed along rows) start.
        align = stored.block[0] if stored.block else 32 if packed_zp else 1
        errors, mismatch = ErrorAccumulator(), None
        for r0, r1 in row_blocks(rows, cols, align):
            block = reader.rows(weight, r0, r1, "weight")
            s0, s1 = (0, 1) if stored.strategy == "tensor" else (r0, r1)
            if stored.block:
                s0, s1 = r0 // stored.block[0], math.ceil(r1 / stored.block[0])
            theirs_zp = ours_zp = None
            if zp is not None:
                if packed_zp:
                    bits = stored.num_bits
                    theirs_zp = zp[r0 * bits // 32 : math.ceil(r1 * bits / 32)]
                    ours_zp = unpack_offset_binary(theirs_zp.T, bits, r1 - r0).T
                else:
                    theirs_zp = ours_zp = zp[s0:s1]
            shape = (r1 - r0, cols)
            if narrow and out_of_range is None and (block.min() < low or block.max() > high):
                at = np.argwhere((block < low) | (block > high))[0]
                index = [int(i) for i in np.unravel_index((r0 + at[0]) * cols + at[1], source.shape)]
                value = int(block[at[0], at[1]])
                out_of_range = (
                    f"holds {value} at {index}, outside the int{stored.num_bits} range {low}..{high} "
                    f"its config group says"
                )
            decoded = library_decode(
                stored,
                block,
                scale[s0:s1],
                scale_info.dtype,
                cols,
                theirs_zp,
                reader.scratch("decoded", shape, np.float32),
                global_scale,
            )
            if not independent:
                ours = decoded
            else:
                ours = reference_decode(
                    stored,
                    block,
                    scale32[s0:s1],
                    decoded_dtype(stored, scale_info.dtype),
                    cols,
                    ours_zp,
                    g_idx,
                    reader.scratch,
                    None if global_scale is None else float(global_scale[0]),
                )
            if independent and mismatch is None and (at := first_difference(ours, decoded)) is not None:
                index = [int(i) for i in np.unravel_index((r0 + at[0]) * cols + at[1], source.shape)]
                a, b = decoded[at[0], at[1]], ours[at[0], at[1]]
                mismatch = (
                    f"compressed-tensors and evalsuite decode element {index} differently: {a:.6g} vs {b:.6g}"
                )
            ref = reader.scratch("ref", shape, np.float32)
            as_float32(reader.rows(source, r0, r1, "source"), source.dtype, ref)
            errors.add(r0, ref, decoded, reader.scratch("difference", shape, np.float32))
        row.decode_exact = mismatch is None if independent else None
        if not independent:
            row.note = (
                f"{stored.format}: decoded by compressed-tensors only (evalsuite has no decode of its own)"
            )
        errors.fill(row)
        if mismatch and g_idx is not None:
            mismatch += " (the weight stores weight_g_idx, which the decompressor does not apply)"
        return mismatch, out_of_range

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """Every module a group targets is stored in its format, bits and strategy; every module in `ignore`
        is stored as in the source; no Linear is left unquantized without being ignored; every target matches
        some module."""
        problems: list[Problem] = []
        modules: dict[str, ModuleKind] = {}
        for row in rows:
            if not row.name.endswith(".weight"):
                continue
            modules[row.module] = row.kind
            if row.tensor_class == "missing" or row.format == "unreadable":
                continue  # already a problem of its own
            coverage = self.lookup.covering(row.module, row.kind, self.skeleton.get(row.module))
            quantized = row.tensor_class == "quantized"
            stored = f"stored as {row.format}" if quantized else "stored unquantized"
            if coverage.scheme is not None and row.stored is None:
                said = describe_scheme(coverage.scheme, coverage.format)
                problems.append(
                    Problem(
                        "config",
                        row.name,
                        f"config group `{coverage.group}` says {said}, but it is {stored} ({row.dtype})",
                    )
                )
            elif coverage.scheme is not None:
                problems += [Problem("config", row.name, p) for p in scheme_mismatches(row.stored, coverage)]
            elif quantized:
                why = "it is in `ignore`" if coverage.ignored else "no config group targets it"
                problems.append(Problem("config", row.name, f"{stored}, but {why}"))
            elif row.kind == "linear" and not coverage.ignored and row.tensor_class == "protected":
                problems.append(Problem("config", row.name, UNCOVERED_LINEAR))
        for group, target in self.lookup.unmatched_targets(modules, self.skeleton):
            problems.append(
                Problem("config", f"config_groups.{group}", f"target {target!r} matches no source module")
            )
        config = self.lookup.config
        claims = {"config_format": config.format, "config_groups": len(config.config_groups)}
        return problems, claims
