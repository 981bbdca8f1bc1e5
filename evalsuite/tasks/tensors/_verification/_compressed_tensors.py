"""A compressed-tensors candidate verified: each quantized module's scheme read from its tensors, its weight
decoded by `ct_decode` and measured against the source weight, and decoded again by compressed-tensors on the
rows `library_runs` picks (they must agree bit for bit); then the config's groups and `ignore` list against
what every module stores."""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ModuleKind, ShardReader, as_float32, row_blocks, rows_and_cols
from evalsuite.formats.compressed_tensors import (
    DECODED_FORMATS,
    INDEPENDENT_DECODE_FORMATS,
    CompressedTensors,
    Coverage,
    StoredQuantization,
    decoded_dtype,
    describe_scheme,
    library_decode,
    library_decode_scattered,
    scheme_mismatches,
    stored_quantization,
)
from evalsuite.formats.ct_decode import first_difference, reference_decode, unpack_offset_binary
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow

# Which rows compressed-tensors' decompressor decodes a second time, beside evalsuite's decode of every row:
# "sample" a run of LIBRARY_RUN_ROWS consecutive rows in every LIBRARY_WINDOW_ROWS rows of each tensor, "all"
# every row. The decompressor costs several times evalsuite's decode per weight; a decode rule that differs
# from the library's (nibble order, rounding, group layout, g_idx) shows on any whole row, while the damage
# of a pack (a flipped code, a wrong scale or zero point) shows in evalsuite's measure of every row.
LibraryCheck = Literal["sample", "all"]
LIBRARY_RUN_ROWS = 16
LIBRARY_WINDOW_ROWS = 1024

UNCOVERED_LINEAR = "a Linear left unquantized: no config group targets it and no `ignore` entry names it"


def library_runs(name: str, rows: int, align: int, check: LibraryCheck) -> list[tuple[int, int]]:
    """The rows (r0, r1), in order, of a tensor that compressed-tensors decodes too: every row ("all"), or
    ("sample") in each window of LIBRARY_WINDOW_ROWS rows one run of LIBRARY_RUN_ROWS, both rounded up to
    whole `align`-row blocks (the rest of the tensor when shorter), at an offset drawn from the tensor's name
    and the window's first row (crc32): the same pack is cross-checked on the same rows in every run."""
    if check == "all":
        return [(0, rows)]
    run = math.ceil(LIBRARY_RUN_ROWS / align) * align
    window = math.ceil(max(LIBRARY_WINDOW_ROWS, run) / align) * align
    runs = []
    for start in range(0, rows, window):
        end = min(rows, start + window)
        length = min(run, end - start)
        slots = (end - start - length) // align + 1
        offset = zlib.crc32(f"{name}:{start}".encode()) % slots * align
        runs.append((start + offset, start + offset + length))
    return runs


def runs_within(runs: list[tuple[int, int]], r0: int, r1: int) -> Iterator[tuple[int, int]]:
    """The parts of `runs` (in order, disjoint) inside rows r0..r1."""
    for a, b in runs[bisect.bisect_right(runs, r0, key=lambda run: run[1]) :]:
        if a >= r1:
            return
        yield max(a, r0), min(b, r1)


# Rows of sampled weights held for one call of the library's decoder before it is called early.
LIBRARY_BATCH_ELEMENTS = 1 << 20


@dataclass
class _Sample:
    """Rows a..b of one tensor, as stored and as evalsuite decoded them (copies), waiting for the library."""

    index: int  # of the tensor among those `measure_many` was given
    shape: tuple[int, ...]
    first: int  # the run's first row in the tensor
    weight: np.ndarray
    scale: np.ndarray
    ours: np.ndarray
    global_scale: float | None = None  # NVFP4's, the tensor's one


@dataclass
class LibraryBatch:
    """The rows `library_runs` picks of every weight of one `measure_many` call, decoded by
    compressed-tensors in one call per scheme instead of one per run.

    One decompressor call costs about 0.3 ms before its first weight: a checkpoint of thousands of small
    experts paid more for those calls than for decoding all its weights. Rows of weights stored alike (the
    same `StoredQuantization`, columns and scale dtype) decode as one weight when their scales are per row
    (channel, group or NVFP4's tensor_group strategy) and nothing else is per tensor (no zero points packed
    along rows, no g_idx): those are batched; the others are decoded run by run, as they are met. NVFP4's
    one global scale per tensor goes with each row of the batch (the decompressor divides every group scale
    by it elementwise, so each row is divided by its own tensor's). A batched decode that differs from
    evalsuite's is confirmed by decoding that run again on its own, as the format stores it, before it is
    reported: a batch can never be the cause of a reported difference.
    """

    # (stored, cols, scale dtype) → the samples pending and their element count
    pending: dict[tuple[StoredQuantization, int, str], list[_Sample]] = field(default_factory=dict)
    sizes: dict[tuple[StoredQuantization, int, str], int] = field(default_factory=dict)
    # tensor index → where its decodes first differ (the first run that differs, in row order)
    mismatches: dict[int, str] = field(default_factory=dict)

    def add(self, key: tuple[StoredQuantization, int, str], sample: _Sample) -> None:
        self.pending.setdefault(key, []).append(sample)
        self.sizes[key] = self.sizes.get(key, 0) + sample.ours.size
        if self.sizes[key] >= LIBRARY_BATCH_ELEMENTS:
            self._decode(key)

    def finish(self) -> dict[int, str]:
        """Decode what is pending; the first difference of each tensor whose decodes differ, by index."""
        for key in list(self.pending):
            self._decode(key)
        return self.mismatches

    def _decode(self, key: tuple[StoredQuantization, int, str]) -> None:
        stored, cols, scale_dtype = key
        samples = self.pending.pop(key)
        self.sizes.pop(key)
        weight = np.concatenate([s.weight for s in samples])
        scale = np.concatenate([s.scale for s in samples])
        global_scale = None
        if samples[0].global_scale is not None:
            each = np.array([s.global_scale for s in samples], dtype=np.float32)
            global_scale = np.repeat(each, [s.ours.shape[0] for s in samples]).reshape(-1, 1, 1)
        theirs = library_decode(stored, weight, scale, scale_dtype, cols, global_scale=global_scale)
        at_row = 0
        for s in samples:
            rows = s.ours.shape[0]
            if s.index not in self.mismatches and first_difference(s.ours, theirs[at_row : at_row + rows]):
                alone = library_decode(
                    stored,
                    s.weight,
                    s.scale,
                    scale_dtype,
                    cols,
                    global_scale=None if s.global_scale is None else np.float32([s.global_scale]),
                )
                difference = _difference(s.ours, alone, s.first, s.shape, cols)
                if difference is not None:
                    self.mismatches[s.index] = difference
            at_row += rows


def _difference(
    ours: np.ndarray, theirs: np.ndarray, first: int, shape: tuple[int, ...], cols: int
) -> str | None:
    """Where rows first..first + len(ours) of a tensor of `shape`, decoded by both, first differ; None if
    nowhere."""
    at = first_difference(ours, theirs)
    if at is None:
        return None
    index = [int(i) for i in np.unravel_index((first + at[0]) * cols + at[1], shape)]
    x, y = theirs[at[0], at[1]], ours[at[0], at[1]]
    return f"compressed-tensors and evalsuite decode element {index} differently: {x:.6g} vs {y:.6g}"


class CompressedTensorsVerifier:
    """How a compressed-tensors candidate is verified (see `FormatVerifier`)."""

    threads_only = False

    def __init__(
        self,
        format: CompressedTensors,
        skeleton: dict[str, Any] | None = None,
        library_check: LibraryCheck = "sample",
    ) -> None:
        self.format = format
        self.library_check = library_check
        self.lookup = format.lookup
        # The candidate's modules as Transformers builds them (meta device), by name: targets are matched on
        # them, as compressed-tensors matches them at load; names the skeleton lacks (experts Transformers
        # fuses) fall back to stand-ins.
        self.skeleton = skeleton or {}
        # The config's word on each module, asked once per module in `measure` and again in `check_config`:
        # compressed-tensors' matching is regular expressions in Python, milliseconds per module, which a
        # checkpoint of thousands of small expert weights pays thousands of times (see `FormatVerifier`).
        self.module_matches: dict[tuple[str, ModuleKind], Coverage] = {}

    def before_fork(self) -> None:
        """compressed-tensors' compressors, schemes and matching: `measure_many` imports them on first use."""
        import compressed_tensors.compressors
        import compressed_tensors.quantization
        import compressed_tensors.utils.match  # noqa: F401

    def covering(self, module: str, kind: ModuleKind) -> Coverage:
        """`SchemeLookup.covering` of a module, with the skeleton's instance of it, computed once."""
        key = (module, kind)
        found = self.module_matches.get(key)
        if found is None:
            found = self.module_matches[key] = self.lookup.covering(module, kind, self.skeleton.get(module))
        return found

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Read the module's scheme, decode it block by block (and rows of it by the library too), and
        measure it against the source."""
        return self.measure_many([(source, tensors, row)], reader)[0]

    def measure_many(
        self, modules: Sequence[tuple[TensorInfo, dict[str, TensorInfo], TensorRow]], reader: ShardReader
    ) -> list[list[Problem]]:
        """`measure` of each module, with the library's decodes of their sampled rows batched
        (`LibraryBatch`)."""
        batch = LibraryBatch()
        found = [
            self._measure(i, source, tensors, reader, row, batch)
            for i, (source, tensors, row) in enumerate(modules)
        ]
        for i, mismatch in batch.finish().items():
            modules[i][2].decode_exact = False
            found[i].append(Problem("decode", modules[i][0].name, mismatch))
        return found

    def _measure(
        self,
        tensor_index: int,
        source: TensorInfo,
        tensors: dict[str, TensorInfo],
        reader: ShardReader,
        row: TensorRow,
        batch: LibraryBatch,
    ) -> list[Problem]:
        coverage = self.covering(row.module, row.kind)
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
        mismatch, out_of_range = self._decode(source, tensors, stored, reader, row, tensor_index, batch)
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
        tensor_index: int,
        batch: LibraryBatch,
    ) -> tuple[str | None, str | None]:
        """evalsuite's decode of every row, measured against the source block by block of rows, and the
        library's decode of the rows `library_runs` picks, which must agree with it bit for bit (where
        evalsuite has no decode of the format, the library's decode of every row is measured); returns where
        the decodes first differ and the first stored integer outside the scheme's range (each None when
        there is none). Runs of a weight `LibraryBatch` can batch are left to the batch (the tensor's
        `tensor_index` names them there), which sets `decode_exact` false if they differ."""
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

        def scales_of(r0: int, r1: int) -> slice:
            if stored.strategy == "tensor":
                return slice(0, 1)
            if stored.block:
                return slice(r0 // stored.block[0], math.ceil(r1 / stored.block[0]))
            return slice(r0, r1)

        def stored_zero_points(r0: int, r1: int) -> np.ndarray | None:
            if zp is None:
                return None
            if packed_zp:
                return zp[r0 * stored.num_bits // 32 : math.ceil(r1 * stored.num_bits / 32)]
            return zp[scales_of(r0, r1)]

        def library(block: np.ndarray, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
            """Rows r0..r1 of the block (whose rows are `block`) decoded by compressed-tensors."""
            zero_points = stored_zero_points(r0, r1)
            if g_idx is not None:
                scattered = library_decode_scattered(
                    stored, block, scale[scales_of(r0, r1)], scale_info.dtype, cols, g_idx, zero_points, out
                )
                # A g_idx the library cannot express: NaN differs from every decode, and the note says why.
                return scattered if scattered is not None else np.full(out.shape, np.nan, np.float32)
            return library_decode(
                stored,
                block,
                scale[scales_of(r0, r1)],
                scale_info.dtype,
                cols,
                zero_points,
                out,
                global_scale,
            )

        runs = library_runs(source.name, rows, align, self.library_check) if independent else []
        one_global = global_scale is not None and global_scale.size == 1
        batched = (
            zp is None
            and g_idx is None
            and (
                (stored.strategy in ("channel", "group") and global_scale is None)
                or (stored.strategy == "tensor_group" and one_global)
            )
        )
        key = (stored, cols, scale_info.dtype)
        errors, mismatch, checked = ErrorAccumulator(), None, 0
        for r0, r1 in row_blocks(rows, cols, align):
            block = reader.rows(weight, r0, r1, "weight")
            shape = (r1 - r0, cols)
            if narrow and out_of_range is None and (block.min() < low or block.max() > high):
                at = np.argwhere((block < low) | (block > high))[0]
                index = [int(i) for i in np.unravel_index((r0 + at[0]) * cols + at[1], source.shape)]
                value = int(block[at[0], at[1]])
                out_of_range = (
                    f"holds {value} at {index}, outside the int{stored.num_bits} range {low}..{high} "
                    f"its config group says"
                )
            if not independent:
                decoded = library(block, r0, r1, reader.scratch("decoded", shape, np.float32))
            else:
                zero_points = stored_zero_points(r0, r1)
                if packed_zp:
                    zero_points = unpack_offset_binary(zero_points.T, stored.num_bits, r1 - r0).T
                decoded = reference_decode(
                    stored,
                    block,
                    scale32[scales_of(r0, r1)],
                    decoded_dtype(stored, scale_info.dtype),
                    cols,
                    zero_points,
                    g_idx,
                    reader.scratch,
                    None if global_scale is None else float(global_scale[0]),
                )
            for a, b in runs_within(runs, r0, r1):
                ours = decoded[a - r0 : b - r0]
                checked += b - a
                if batched:
                    rows_ab = slice(a - r0, b - r0)
                    sample = _Sample(
                        tensor_index,
                        source.shape,
                        a,
                        block[rows_ab].copy(),
                        scale[scales_of(a, b)].copy(),
                        ours.copy(),
                        float(global_scale[0]) if one_global else None,
                    )
                    batch.add(key, sample)
                    continue
                theirs = library(
                    block[a - r0 : b - r0], a, b, reader.scratch("library", ours.shape, np.float32)
                )
                if mismatch is None:
                    mismatch = _difference(ours, theirs, a, source.shape, cols)
            ref = reader.scratch("ref", shape, np.float32)
            as_float32(reader.rows(source, r0, r1, "source"), source.dtype, ref)
            errors.add(r0, ref, decoded, reader.scratch("difference", shape, np.float32))
        if independent:
            row.decode_exact = mismatch is None
            row.library_checked_rows = checked
        else:
            row.note = (
                f"{stored.format}: decoded by compressed-tensors only (evalsuite has no decode of its own)"
            )
        errors.fill(row)
        if mismatch and g_idx is not None:
            mismatch += (
                " (columns gathered by the stored weight_g_idx; one that does not give every group its "
            )
            mismatch += "group_size columns decodes to NaN)"
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
            coverage = self.covering(row.module, row.kind)
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
