"""What a quantized checkpoint stores, proved from its files against its source, and per-format knowledge.

A candidate tensor pairs with a source tensor in one of two ways: under the same name (a tensor kept as it
was: *protected*, and it must be byte-identical), or as one of the tensors a format stores for a quantized
module `X` in place of the source's `X.weight` (*quantized*). A source tensor with neither is *missing*; a
candidate tensor that pairs with nothing is *unexpected*. `verify_tensors` streams both checkpoints to put
every source tensor in exactly one class and to measure each pair; the format modules say what a quantized
module stores, how it decodes and how its config is checked against the tensors: `compressed_tensors` and
`exl3`.

Memory is bounded by a block of rows, not by the tensor: every tensor is read in row blocks from its shard,
into buffers that are reused, so the largest tensor of the checkpoint never has to fit in memory at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol

import numpy as np

from evalsuite import metrics
from evalsuite.checkpoint import DTYPE_SIZES, FLOAT_DTYPES, Checkpoint, TensorInfo
from evalsuite.spec import StrictModel

ModuleKind = Literal["linear", "embedding", "router", "state", "norm", "other"]
Part = Literal["text", "head", "vision", "mtp"]

# Elements per block of rows: 1 MB per float32 array keeps a block's arithmetic in a core's L2 cache (measured
# fastest among 2^16..2^20), and float32 sums over blocks this size are accurate to about 1e-6.
BLOCK_ELEMENTS = 1 << 18
# Bytes per block when a protected tensor is compared and hashed.
BLOCK_BYTES = 16 << 20

# How stored bytes are viewed: bf16 has no numpy dtype, so its raw 16 bits are kept and widened by hand.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}
DTYPE_BITS = {"BF16": 16, "F16": 16, "F32": 32, "F64": 64}
# Integer weight formats, counted by their bits (quantized_int4, quantized_int8); anything else is "other".
INTEGER_FORMATS = frozenset({"pack-quantized", "int-quantized", "naive-quantized"})


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    # compressed-tensors' own rule for a target: "re:" + a regex matched at the start, or an exact name.
    from compressed_tensors.utils.match import match_name

    return any(match_name(name, pattern) for pattern in patterns)


class ModuleRules(StrictModel):
    """How a module is told apart from its name and its source weight, since no model is ever built.

    A Linear is a module whose source `.weight` is 2-D, unless its name matches `embedding` (token and
    position tables), `router` (MoE gates: Linear layers whose few outputs pick experts, never quantized by
    a sound recipe) or `state` (linear-attention projections that feed the recurrent state, kept at source
    precision like the other state tensors). 1-D weights are norms; other shapes (convolutions) are `other`.
    `head`, `vision` and `mtp` say which part of the model a module belongs to; the rest is the text backbone.
    Patterns are compressed-tensors targets: `re:` + a regex matched at the start of the name, or a name.
    """

    embedding: tuple[str, ...] = ()
    router: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    head: tuple[str, ...] = ()
    vision: tuple[str, ...] = ()
    mtp: tuple[str, ...] = ()

    def kind(self, name: str, shape: tuple[int, ...]) -> ModuleKind:
        """The kind of module a source tensor's module is, from the tensor's name and shape."""
        if not name.endswith(".weight"):
            return "other"
        module = name.removesuffix(".weight")
        if len(shape) == 1:
            return "norm"
        if len(shape) != 2:
            return "other"
        for kind, patterns in (("embedding", self.embedding), ("router", self.router), ("state", self.state)):
            if _matches(module, patterns):
                return kind
        return "norm" if module.rsplit(".", 1)[-1].endswith("norm") else "linear"

    def part(self, module: str) -> Part:
        """Which part of the model a module belongs to."""
        for part, patterns in (("head", self.head), ("vision", self.vision), ("mtp", self.mtp)):
            if _matches(module, patterns):
                return part
        return "text"


_LAYER = re.compile(r"\.(?:layers|h|blocks|block)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def layer_and_projection(module: str, part: Part) -> tuple[int | None, str]:
    """The layer index of a module (None outside the layer stacks) and its projection name, with the expert
    index replaced by `*` and, outside the text backbone, its part in front (`vision:mlp.fc1`)."""
    match = _LAYER.search(f".{module}.")
    if match is None:
        return None, module
    projection = _EXPERT.sub(".experts.*.", f".{module[match.end() - 1 :]}.").strip(".")
    return int(match.group(1)), projection if part == "text" else f"{part}:{projection}"


@dataclass(frozen=True)
class Pair:
    """A source tensor and the candidate tensors it pairs with.

    `how` is `same` (`candidate` = {"": the tensor of the same name}), `quantized` (`candidate` maps each
    stored parameter of the module, e.g. "weight_packed", to its tensor) or `missing` (no candidate tensor).
    """

    source: str
    module: str
    how: Literal["same", "quantized", "missing"]
    candidate: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Problem:
    """One thing the files disagree on, named: `check` is protected, missing, unexpected, config or decode."""

    check: str
    tensor: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "tensor": self.tensor, "detail": self.detail}


class ShardReader:
    """Byte ranges of tensors read from their shards, one open file per shard, into reused buffers.

    Offsets come from headers that `Checkpoint` parsed and checked, so every range lies inside its file.
    """

    def __init__(self) -> None:
        self._files: dict[Path, BinaryIO] = {}
        self._buffers: dict[str, np.ndarray] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def _read(self, info: TensorInfo, begin: int, out: np.ndarray) -> np.ndarray:
        handle = self._files.get(info.shard)
        if handle is None:
            handle = self._files[info.shard] = info.shard.open("rb", buffering=0)
        handle.seek(info.data_begin + begin)
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:])
            if not got:
                raise EOFError(f"{info.shard}: tensor {info.name!r} ends past the end of the file")
            done += got
        return out

    def buffer(self, slot: str, nbytes: int) -> np.ndarray:
        """A reused uint8 buffer of `nbytes` (valid until the next call for the same slot).

        Reuse is what makes block arithmetic cheap: a fresh multi-megabyte array costs more in page faults
        than the arithmetic done in it.
        """
        buf = self._buffers.get(slot)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[slot] = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        return buf[:nbytes]

    def scratch(self, slot: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A reused array of `shape` and `dtype` (contents undefined; valid until the slot's next use)."""
        dtype = np.dtype(dtype)
        return self.buffer(slot, int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)

    def tensor_bytes(self, info: TensorInfo, begin: int, n: int) -> np.ndarray:
        """`n` bytes of the tensor's data from `begin` (a new array)."""
        return self._read(info, begin, np.empty(n, dtype=np.uint8))

    def tensor(self, info: TensorInfo) -> np.ndarray:
        """A whole tensor as a (new) array of its dtype; for the small tensors beside a weight."""
        out = np.empty(info.nbytes, dtype=np.uint8)
        return self._read(info, 0, out).view(NUMPY_DTYPES[info.dtype]).reshape(info.shape)

    def rows(self, info: TensorInfo, r0: int, r1: int, slot: str) -> np.ndarray:
        """Rows r0..r1 of the tensor seen as 2-D (leading dims flattened), in a reused buffer."""
        cols = info.shape[-1] if info.shape else 1
        itemsize = NUMPY_DTYPES[info.dtype].itemsize
        row_bytes = cols * itemsize
        out = self.buffer(slot, (r1 - r0) * row_bytes)
        self._read(info, r0 * row_bytes, out)
        return out.view(NUMPY_DTYPES[info.dtype]).reshape(r1 - r0, cols)

    def blocks(self, info: TensorInfo, slot: str, block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
        """The tensor's bytes in successive blocks (uint8), each valid until the next."""
        for begin in range(0, info.nbytes, block_bytes):
            n = min(block_bytes, info.nbytes - begin)
            yield self._read(info, begin, self.buffer(slot, n))


def rows_and_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor seen as a matrix: leading dims flattened into rows (a scalar is one row of one)."""
    if not shape:
        return 1, 1
    cols = shape[-1]
    return (int(np.prod(shape[:-1])) if len(shape) > 1 else 1), cols


def row_blocks(rows: int, cols: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """(r0, r1) blocks of about `BLOCK_ELEMENTS` elements, each a multiple of `align` rows but the last."""
    step = max(align, (BLOCK_ELEMENTS // max(cols, 1)) // align * align)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def as_float32(values: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Stored floating-point values as float32 (into `out` when given); bf16, kept as its raw uint16 bits,
    is widened exactly by a shift."""
    if out is None:
        out = np.empty(values.shape, dtype=np.float32)
    if dtype == "BF16":
        np.left_shift(values, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = values
    return out


class ErrorAccumulator:
    """Error statistics of a decoded tensor against its source, added up block by block of rows.

    It adds up the sums of `metrics.error_sums` (computed here per row, in reused buffers), and keeps the
    worst output channel (row): the largest ‖x_r − w_r‖ / ‖w_r‖. A channel above 1 decodes further from its
    source than zeros would.
    """

    def __init__(self) -> None:
        self.sums = metrics.ErrorSums(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.worst_channel = -1
        self.worst_channel_rel_err = 0.0

    def add(self, r0: int, ref: np.ndarray, cand: np.ndarray, work: np.ndarray | None = None) -> None:
        """Add rows r0.. of the source (`ref`) and of the decoded tensor (`cand`), float32 (rows, cols);
        `work` is a float32 buffer of the same shape for the difference."""
        d = np.subtract(cand, ref, out=work)
        # float32 sums over one row, float64 across rows: the rounding stays near 1e-6 relative.
        err = np.einsum("ij,ij->i", d, d).astype(np.float64)
        norm = np.einsum("ij,ij->i", ref, ref).astype(np.float64)
        flat_ref, flat_cand = ref.reshape(-1), cand.reshape(-1)
        block = metrics.ErrorSums(
            n=d.size,
            ref_sq=float(norm.sum()),
            err_sq=float(err.sum()),
            cand_sq=float(np.dot(flat_cand, flat_cand)),
            dot=float(np.dot(flat_ref, flat_cand)),
            max_abs=float(max(d.max(), -d.min())) if d.size else 0.0,
        )
        self.sums = self.sums + block
        if not err.size:
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(err == 0, 0.0, np.sqrt(err / norm))
        i = int(np.argmax(rel))
        if rel[i] > self.worst_channel_rel_err:
            self.worst_channel, self.worst_channel_rel_err = r0 + i, float(rel[i])

    def fill(self, row: dict[str, Any]) -> None:
        """Write the statistics into a tensors.json row."""
        s = self.sums
        row.update(
            rel_err=s.relative_frobenius_error,
            sqnr_db=s.sqnr_db,
            cosine=s.cosine,
            max_abs_err=s.max_abs,
            worst_channel=self.worst_channel if self.worst_channel >= 0 else None,
            worst_channel_rel_err=self.worst_channel_rel_err,
        )


class FormatHandler(Protocol):
    """Per-format knowledge: what a quantized module stores, how it is measured, how the config is checked."""

    name: str
    params: frozenset[str]  # every tensor a quantized module may store, by its parameter name
    marks: frozenset[str]  # a module storing any of these is quantized

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: dict[str, Any]
    ) -> list[Problem]:
        """Fill the row of a quantized module (format, bits, decode, error against the source weight) and
        return what its stored tensors get wrong."""
        ...

    def check_config(self, rows: list[dict[str, Any]]) -> tuple[list[Problem], dict[str, Any]]:
        """The config's claims against the tensors (the rows of every tensor), and the claims themselves."""
        ...


def pair_tensors(
    source: dict[str, TensorInfo], candidate: dict[str, TensorInfo], handler: FormatHandler | None
) -> tuple[list[Pair], list[str]]:
    """Pair every source tensor (in source order) and list the candidate tensors that pair with nothing."""
    quantized: dict[str, dict[str, str]] = {}
    if handler is not None:
        by_module: dict[str, dict[str, str]] = {}
        for name in candidate:
            module, _, param = name.rpartition(".")
            if param in handler.params:
                by_module.setdefault(module, {})[param] = name
        quantized = {m: params for m, params in by_module.items() if handler.marks & params.keys()}
    pairs, used = [], set()
    for name in source:
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in quantized:
            pairs.append(Pair(name, module, "quantized", quantized[module]))
            used.update(quantized[module].values())
        elif name in candidate:
            pairs.append(Pair(name, module, "same", {"": name}))
            used.add(name)
        else:
            pairs.append(Pair(name, module, "missing"))
    return pairs, [name for name in candidate if name not in used]


def _value_text(raw: np.ndarray, dtype: str) -> str:
    """One stored element (its raw bytes, uint8) as a number, with its bits for floating-point dtypes (only
    the bits for a dtype numpy cannot read, e.g. FP8)."""
    bits = f"0x{int.from_bytes(raw.tobytes(), 'little'):0{2 * raw.size}x}"
    if dtype not in NUMPY_DTYPES:
        return bits
    value = raw.view(NUMPY_DTYPES[dtype])[:1]
    if dtype in FLOAT_DTYPES:
        return f"{float(as_float32(value, dtype)[0]):.6g} ({bits})"
    return str(value[0].item())


def compare_same(
    source: TensorInfo, candidate: TensorInfo, reader: ShardReader, row: dict[str, Any]
) -> list[Problem]:
    """A tensor kept under its name: protected when dtype and shape are kept (its bytes must be identical),
    a cast when only a floating-point dtype changed (measured like a decode, classed as quantized)."""
    if source.shape != candidate.shape or source.dtype != candidate.dtype:
        if source.shape == candidate.shape and {source.dtype, candidate.dtype} <= DTYPE_BITS.keys():
            bits = DTYPE_BITS[candidate.dtype]
            row.update(
                tensor_class="quantized", format=candidate.dtype.lower(), bits=bits, bits_per_weight=bits
            )
            _measure_cast(source, candidate, reader, row)
            return []
        row.update(tensor_class="protected", identical=False)
        what = f"{source.dtype} {list(source.shape)} → {candidate.dtype} {list(candidate.shape)}"
        row["first_difference"] = what
        return [Problem("protected", source.name, f"stored as {what}")]
    row["tensor_class"] = "protected"
    src_hash, cand_hash = hashlib.sha256(), None
    offset, first = 0, None
    cand_blocks = reader.blocks(candidate, "same-candidate")
    for block in reader.blocks(source, "same-source"):
        other = next(cand_blocks)
        if cand_hash is None and not np.array_equal(block, other):
            # Up to here both sides held the same bytes: the candidate's digest starts from the source's.
            cand_hash = src_hash.copy()
            byte = int(np.flatnonzero(block != other)[0])
            first = offset + byte
        src_hash.update(block)
        if cand_hash is not None:
            cand_hash.update(other)
        offset += block.size
    row["sha256"] = src_hash.hexdigest()
    row["identical"] = cand_hash is None
    if cand_hash is None:
        return []
    row["candidate_sha256"] = cand_hash.hexdigest()
    itemsize = DTYPE_SIZES[source.dtype]
    element = first // itemsize
    index = [int(i) for i in np.unravel_index(element, source.shape)] if source.shape else []
    begin = element * itemsize
    values = [
        _value_text(reader.tensor_bytes(info, begin, itemsize), source.dtype) for info in (source, candidate)
    ]
    row["first_difference"] = f"element {index}: {values[0]} → {values[1]}"
    digests = f"sha256 {row['sha256'][:12]}… → {row['candidate_sha256'][:12]}…"
    detail = f"bytes differ ({digests}); first differing {row['first_difference']}"
    return [Problem("protected", source.name, detail)]


def _measure_cast(
    source: TensorInfo, candidate: TensorInfo, reader: ShardReader, row: dict[str, Any]
) -> None:
    rows, cols = rows_and_cols(source.shape)
    errors = ErrorAccumulator()
    for r0, r1 in row_blocks(rows, cols):
        shape = (r1 - r0, cols)
        ref = as_float32(
            reader.rows(source, r0, r1, "source"), source.dtype, reader.scratch("ref", shape, "f4")
        )
        cand = reader.rows(candidate, r0, r1, "candidate")
        cand = as_float32(cand, candidate.dtype, reader.scratch("decoded", shape, "f4"))
        errors.add(r0, ref, cand, reader.scratch("difference", shape, "f4"))
    errors.fill(row)


@dataclass
class Verification:
    """What `verify_tensors` found: one row per source tensor then per unexpected candidate tensor, the
    problems (each naming its tensor), the config's claims, and the candidate's tensor bytes."""

    rows: list[dict[str, Any]]
    problems: list[Problem]
    claims: dict[str, Any]
    payload_bytes: int
    source_params: int

    def summary(self) -> dict[str, Any]:
        """The counts and statistics of the rows, under the `tensors` task's metric names (None where a
        statistic has nothing to measure, e.g. no decoded tensor in an EXL3 candidate)."""
        source = [r for r in self.rows if r["tensor_class"] != "unexpected"]
        quantized = [r for r in source if r["tensor_class"] == "quantized"]
        protected = [r for r in source if r["tensor_class"] == "protected"]
        integer = [r for r in quantized if r["format"] in INTEGER_FORMATS]
        decoded = [r["decode_exact"] for r in quantized if r["decode_exact"] is not None]
        measured = [r for r in quantized if r["rel_err"] is not None]
        worst = max(measured, key=lambda r: r["rel_err"], default=None)
        worst_channel = max(measured, key=lambda r: r["worst_channel_rel_err"], default=None)
        backbone = [r for r in quantized if r["part"] == "text" and r["bits_per_weight"] is not None]
        backbone_numel = sum(r["numel"] for r in backbone)
        avg_bits = (
            sum(r["numel"] * r["bits_per_weight"] for r in backbone) / backbone_numel if backbone else None
        )
        values: dict[str, Any] = {
            "source_tensors": len(source),
            "protected_total": len(protected),
            "protected_identical": sum(1 for r in protected if r["identical"]),
            "quantized_int4": sum(1 for r in integer if r["bits"] == 4),
            "quantized_int8": sum(1 for r in integer if r["bits"] == 8),
            "quantized_other": len(quantized) - sum(1 for r in integer if r["bits"] in (4, 8)),
            "decode_exact": all(decoded) if decoded else None,
            "missing": sum(1 for r in source if r["tensor_class"] == "missing"),
            "unexpected": len(self.rows) - len(source),
            "config_mismatches": sum(1 for p in self.problems if p.check == "config"),
            "payload_bytes": self.payload_bytes,
            "avg_bits_per_weight": avg_bits,
            "avg_bits_per_weight_all": 8 * self.payload_bytes / self.source_params
            if self.source_params
            else None,
            "worst_rel_err": worst["rel_err"] if worst else None,
            "worst_rel_err_tensor": worst["name"] if worst else None,
            "worst_channel_rel_err": worst_channel["worst_channel_rel_err"] if worst_channel else None,
            "worst_channel_rel_err_tensor": (
                f"{worst_channel['name']} (output channel {worst_channel['worst_channel']})"
                if worst_channel
                else None
            ),
        }
        if "bits" in self.claims:
            claimed = self.claims["bits"]
            values["claimed_bits"] = claimed
            values["bpw_claim_error"] = abs(avg_bits - claimed) if avg_bits is not None else None
        return values


def handler_for(candidate: Checkpoint) -> FormatHandler | None:
    """The format handler of a candidate; None for a dense (unquantized) candidate."""
    if candidate.format == "compressed-tensors":
        from evalsuite.formats.compressed_tensors import CompressedTensors

        return CompressedTensors(candidate)
    if candidate.format == "exl3":
        from evalsuite.formats.exl3 import Exl3

        return Exl3(candidate)
    return None


def _base_row(pair: Pair, info: TensorInfo, rules: ModuleRules) -> dict[str, Any]:
    part = rules.part(pair.module)
    layer, projection = layer_and_projection(pair.module, part)
    return {
        "name": pair.source,
        "tensor_class": "missing",
        "module": pair.module,
        "kind": rules.kind(pair.source, info.shape),
        "part": part,
        "layer": layer,
        "projection": projection,
        "dtype": info.dtype,
        "shape": list(info.shape),
        "numel": info.numel,
        "candidate_tensors": sorted(pair.candidate.values()),
        "payload_bytes": 0,
        "format": None,
        "group": None,
        "strategy": None,
        "bits": None,
        "bits_per_weight": None,
        "identical": None,
        "sha256": None,
        "candidate_sha256": None,
        "first_difference": None,
        "decode_exact": None,
        "rel_err": None,
        "sqnr_db": None,
        "cosine": None,
        "max_abs_err": None,
        "worst_channel": None,
        "worst_channel_rel_err": None,
        "note": None,
        "problems": [],
    }


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    # The blocks are small: a second OpenMP thread adds a barrier to every operation, which costs
    # milliseconds whenever the other core is busy, far more than it saves.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _measure_pair(
    pair: Pair,
    source: Checkpoint,
    candidate: Checkpoint,
    handler: FormatHandler | None,
    rules: ModuleRules,
    reader: ShardReader,
) -> tuple[dict[str, Any], list[Problem]]:
    info = source.tensors[pair.source]
    row = _base_row(pair, info, rules)
    if pair.how == "same":
        problems = compare_same(info, candidate.tensors[pair.candidate[""]], reader, row)
    elif pair.how == "quantized":
        row["tensor_class"] = "quantized"
        tensors = {param: candidate.tensors[name] for param, name in pair.candidate.items()}
        problems = handler.measure(info, tensors, reader, row)
    else:
        problems = [Problem("missing", pair.source, "not in the candidate under any stored form")]
    row["payload_bytes"] = sum(candidate.tensors[n].nbytes for n in row["candidate_tensors"])
    return row, problems


def verify_tensors(
    source: Checkpoint, candidate: Checkpoint, rules: ModuleRules, workers: int | None = None
) -> Verification:
    """Stream the source tensor by tensor (shard by shard, in file order) with the candidate tensors each one
    pairs with; classify and measure every pair, then check the candidate's config against the tensors.

    `workers` threads (default: the CPU count, at most 4) measure consecutive tensors at once, each with its
    own reader and buffers, so memory grows by a few blocks per worker, never by a tensor. The arithmetic
    (numpy, torch, hashlib, file reads) releases the GIL.
    """
    handler = handler_for(candidate)
    pairs, unexpected = pair_tensors(source.tensors, candidate.tensors, handler)
    shard_order = {shard: i for i, shard in enumerate(source.shards)}
    # Source order: each shard read once, front to back.
    where = {name: (shard_order[info.shard], info.data_begin) for name, info in source.tensors.items()}
    pairs.sort(key=lambda p: where[p.source])
    workers = workers or min(4, os.cpu_count() or 1)
    local, readers = threading.local(), []

    def measure(pair: Pair) -> tuple[dict[str, Any], list[Problem]]:
        reader = getattr(local, "reader", None)
        if reader is None:
            reader = local.reader = ShardReader()
            readers.append(reader)
        return _measure_pair(pair, source, candidate, handler, rules, reader)

    rows: list[dict[str, Any]] = []
    problems: list[Problem] = []
    try:
        with _one_torch_thread(), ThreadPoolExecutor(workers, thread_name_prefix="tensors") as pool:
            for row, found in pool.map(measure, pairs):
                rows.append(row)
                problems += found
    finally:
        for reader in readers:
            reader.__exit__()
    rows.sort(key=lambda r: r["name"])
    for name in unexpected:
        info = candidate.tensors[name]
        shape = list(info.shape)
        rows.append({"name": name, "tensor_class": "unexpected", "dtype": info.dtype, "shape": shape})
        problems.append(Problem("unexpected", name, f"{info.dtype} {shape} pairs with no source tensor"))
    claims: dict[str, Any] = {}
    if handler is not None:
        config_problems, claims = handler.check_config(rows)
        problems += config_problems
    by_tensor: dict[str, list[str]] = {}
    for problem in problems:
        by_tensor.setdefault(problem.tensor, []).append(f"{problem.check}: {problem.detail}")
    for row in rows:
        row["problems"] = by_tensor.get(row["name"], [])
    return Verification(
        rows=rows,
        problems=problems,
        claims=claims,
        payload_bytes=sum(info.nbytes for info in candidate.tensors.values()),
        source_params=sum(info.numel for info in source.tensors.values()),
    )
