"""A GGUF candidate verified: every tensor of the file named by the source tensor it stands for, decoded in
blocks of rows by the `gguf` package and measured against the source; its ggml blocks judged against each
other; its metadata's claims (file type, hyperparameters) against what it stores and against the source.

Names: gguf's tensor map for the file's architecture (`gguf.get_tensor_name_map`, what Transformers' GGUF
loader maps with, `get_gguf_hf_weights_map`) gives each source tensor's GGUF name. llama.cpp's converter
permutes the rows of a Llama's query and key projections; Transformers' tensor processor for the
architecture (`TENSOR_PROCESSORS`) undoes it, and is asked here for the row order it produces rather than
trusted to be the identity, so that any architecture it permutes is undone too.

The engine pairs by name, so the candidate is given a view of the file (`gguf_view`): a float tensor kept in
the source's order (F32 norms, an F16 or BF16 embedding) under the source's name, where `compare_same` checks
it value-equal to the source; every other tensor as `<module>.ggml`, with its ggml type as dtype and its
byte range in the file, which this verifier decodes. A tensor the map does not name stays under its GGUF
name: unexpected.

Decoding is cross-checked against llama.cpp's own: where xllamacpp's wheel is installed, llama.cpp's
`dequantize_row_<type>` (`formats.ggml_library`) decodes the rows the spec's `library_check` names (a run of
rows in every window of rows, or every row) beside the `gguf` package, and the two must agree bit for bit
(`decode_exact`). Without the wheel it stays unmeasured.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.formats import BLOCK_ELEMENTS, ShardReader, as_float32, split_at_last_dot
from evalsuite.formats.ct_decode import first_difference
from evalsuite.formats.ggml_library import ggml_dequantize, llama_cpp_decodes
from evalsuite.formats.gguf import (
    FLOAT_TYPES,
    MARKS,
    PARAM,
    PARAMS,
    GgufFile,
    as_claimed,
    bits_per_weight,
    block_shape,
    claimed_type,
    config_claims,
    decode_rows,
    file_type_name,
    nominal_bits,
    read_gguf,
    row_bytes,
)
from evalsuite.tasks.tensors._verification._compressed_tensors import LibraryCheck, library_runs, runs_within
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow

# A ggml block is broken when its largest error, over the larger of its own largest source weight and the
# tensor's median block's, exceeds BLOCK_OUTLIER_RATIO × the tensor's median block's (itself taken as at least
# MIN_BLOCK_REL_ERR, so that a type that stores some tensors losslessly still has a yardstick). A block's
# grid step follows its largest weight, and rounding errs by at most about a step in every block of a tensor;
# a damaged scale multiplies its whole block, a damaged code moves one weight by many steps. The largest error
# is the statistic, not the block's error norm: one weight moved far is diluted in a norm over 32 weights,
# and hides among the blocks whose weights all sit between two steps. The SmolLM2 packs' worst clean blocks
# are the slow tier's `worst_tile_ratio`.
BLOCK_OUTLIER_RATIO = 5.0
MIN_BLOCK_REL_ERR = 2e-3


@dataclasses.dataclass(frozen=True)
class GgufFormat:
    """GGUF as the engine's `QuantizedFormat`: a quantized module stores `X.ggml`."""

    name: str = "gguf"
    params: frozenset[str] = PARAMS
    marks: frozenset[str] = MARKS

    @staticmethod
    def split(name: str) -> tuple[str, str] | None:
        """`X.ggml` as (`X`, `ggml`)."""
        return split_at_last_dot(name)


@dataclasses.dataclass(frozen=True)
class GgufTensorView:
    """Where a view tensor came from: its GGUF name and the row order that undoes the converter's
    permutation (None: rows as stored)."""

    gguf_name: str
    order: np.ndarray | None


def _architecture(gguf_file: GgufFile) -> Any:
    import gguf

    by_name = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    arch = by_name.get(gguf_file.architecture or "")
    if arch is None:
        raise InputError(
            f"general.architecture {gguf_file.architecture!r} is not an architecture the gguf package maps",
            gguf_file.path,
        )
    return arch


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _row_order(processor: Any, gguf_name: str, rows: int) -> np.ndarray | None:
    """Transformers' processor applied to the row numbers of a tensor: where each source row is stored, or
    None when it keeps the order (or does something other than reorder rows, which is not undone here)."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    try:
        done = processor.process(weights=index, name=gguf_name, tensor_key_mapping={}, parsed_parameters={})
    except Exception:  # a processor that needs the whole model's mapping (fused experts): not a reordering
        return None
    order = getattr(done, "weights", None)
    if not isinstance(order, np.ndarray) or order.size != rows:
        return None
    order = order.reshape(rows)
    if np.array_equal(order, index[:, 0]) or not np.array_equal(np.sort(order), index[:, 0]):
        return None
    return order


def gguf_names(source: Checkpoint, gguf_file: GgufFile) -> dict[str, str]:
    """GGUF tensor name → the source tensor it stands for, by gguf's tensor map (a head the source ties to
    its embedding is named `lm_head.weight`, which the engine pairs with the embedding)."""
    import gguf

    config = _text_config(source.config)
    layers = gguf_file.arch_value("block_count") or config.get("num_hidden_layers") or 0
    names = gguf.get_tensor_name_map(_architecture(gguf_file), int(layers))
    found: dict[str, str] = {}
    for name in [*source.tensors, "lm_head.weight"]:
        stem, _, suffix = name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is not None:
            found.setdefault(f"{mapped}.{suffix}", name)
    return found


def gguf_view(source: Checkpoint, candidate: Checkpoint) -> tuple[Checkpoint, GgufFile, dict[str, Any]]:
    """The candidate as the engine pairs it (see the module's docstring), its file, and per view tensor
    its `GgufTensorView`."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    assert candidate.gguf_file is not None
    gguf_file = read_gguf(candidate.gguf_file)
    to_source = gguf_names(source, gguf_file)
    processor = TENSOR_PROCESSORS.get(gguf_file.architecture or "", TensorProcessor)(
        config=_text_config(source.config)
    )
    tensors: dict[str, TensorInfo] = {}
    origins: dict[str, GgufTensorView] = {}
    for tensor in gguf_file.tensors:
        name = to_source.get(tensor.name)
        order = _row_order(processor, tensor.name, tensor.shape[0]) if len(tensor.shape) == 2 else None
        if name is None:
            view_name, dtype = tensor.name, tensor.type_name
        elif tensor.type_name in FLOAT_TYPES and order is None:
            view_name, dtype = name, FLOAT_TYPES[tensor.type_name]
        elif name.endswith(".weight"):
            view_name, dtype = f"{name.removesuffix('.weight')}.{PARAM}", tensor.type_name
        else:  # a quantized bias: no module stores one, so it is reported against its source as it is
            view_name, dtype = name, tensor.type_name
        if view_name in tensors:
            raise InputError(
                f"two tensors stand for {view_name} ({tensor.name} is the second)", gguf_file.path
            )
        tensors[view_name] = TensorInfo(
            view_name, gguf_file.path, dtype, tensor.shape, tensor.data_begin, tensor.data_end
        )
        origins[view_name] = GgufTensorView(tensor.name, order)
    view = dataclasses.replace(candidate, tensors=dict(sorted(tensors.items())), shards=[gguf_file.path])
    return view, gguf_file, origins


def _row_blocks(rows: int, cols: int, order: np.ndarray | None) -> Iterator[tuple[int, int]]:
    """(r0, r1) blocks of about `BLOCK_ELEMENTS` weights, each closed under the row order (the rows stored
    in r0..r1 are the source's rows r0..r1: whole heads of a permuted projection)."""
    ends = (
        np.arange(1, rows + 1)
        if order is None
        else np.flatnonzero(np.maximum.accumulate(order) == np.arange(rows)) + 1
    )
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    r0 = 0
    while r0 < rows:
        r1 = int(ends[min(np.searchsorted(ends, min(rows, r0 + step)), len(ends) - 1)])
        yield r0, r1
        r0 = r1


class GgufVerifier(OneByOneVerifier):
    """How a GGUF candidate is verified (see `FormatVerifier`); `candidate` is the view the engine pairs."""

    # llama.cpp stores norms in F32 whatever the source's dtype, and an F16 file every weight in F16: kept
    # values, equal to the source's cast.
    protected_casts: ClassVar[dict[tuple[str, str], str]] = {
        (src, dst): f"stored {dst} as llama.cpp stores a tensor it leaves unquantized: value-equal to the "
        f"source cast to {dst}"
        for src in ("BF16", "F16", "F32")
        for dst in ("F32", "F16", "BF16")
        if src != dst
    }

    def __init__(
        self, source: Checkpoint, candidate: Checkpoint, library_check: LibraryCheck = "sample"
    ) -> None:
        super().__init__(GgufFormat())
        self.candidate, self.file, self.origins = gguf_view(source, candidate)
        self.source_config = source.config
        self.library_check = library_check

    def before_fork(self) -> None:
        """Import what decoding imports, once, before the workers fork."""
        import gguf.quants  # noqa: F401
        import torch  # noqa: F401

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """The stored type and its bits; the decoded weight against the source weight, and its blocks
        against each other."""
        stored = tensors[PARAM]
        origin = self.origins[stored.name]
        row.format = stored.dtype.lower()
        row.bits = nominal_bits(stored.dtype)
        row.bits_per_weight = bits_per_weight(stored.dtype)
        row.note = f"GGUF {origin.gguf_name}" + (", rows unpermuted" if origin.order is not None else "")
        if stored.shape != source.shape:
            row.note += ": not decoded"
            detail = f"stored {stored.dtype} {list(stored.shape)}, the source is {list(source.shape)}"
            return [Problem("config", source.name, detail)]
        try:
            return self._measure_decoded(source, stored, origin, reader, row)
        except NotImplementedError as exc:
            row.note += ": not decoded"
            return [Problem("decode", source.name, f"the gguf package cannot decode {stored.dtype} ({exc})")]

    def _measure_decoded(
        self,
        source: TensorInfo,
        stored: TensorInfo,
        origin: GgufTensorView,
        reader: ShardReader,
        row: TensorRow,
    ) -> list[Problem]:
        rows, cols = (source.shape[0], source.shape[1]) if len(source.shape) == 2 else (1, source.shape[0])
        block_size, _ = block_shape(stored.dtype)
        stride = row_bytes(stored.dtype, cols)
        errors = ErrorAccumulator()
        block_err, block_sig = [], []
        # Stored rows llama.cpp decodes too (in the file's order: the comparison is of two decodes).
        runs = (
            library_runs(source.name, rows, 1, self.library_check) if llama_cpp_decodes(stored.dtype) else []
        )
        checked, mismatch = 0, None
        for r0, r1 in _row_blocks(rows, cols, origin.order):
            raw = reader.tensor_bytes(stored, r0 * stride, (r1 - r0) * stride).reshape(r1 - r0, stride)
            decoded = decode_rows(raw, stored.dtype, cols)
            for a, b in runs_within(runs, r0, r1):
                theirs = ggml_dequantize(raw[a - r0 : b - r0], stored.dtype, cols)
                at = first_difference(decoded[a - r0 : b - r0], theirs)
                checked += b - a
                if at is not None and mismatch is None:
                    ours = decoded[a - r0 + at[0], at[1]]
                    mismatch = (
                        f"llama.cpp and the gguf package decode stored row {a + at[0]}, weight {at[1]} "
                        f"differently: {theirs[at]:.6g} vs {ours:.6g}"
                    )
            if origin.order is not None:
                # The source's row r is stored at order[r]; this block holds exactly rows r0..r1 of both.
                decoded = decoded[origin.order[r0:r1] - r0]
            shape = (r1 - r0, cols)
            ref = as_float32(
                reader.rows(source, r0, r1, "source").reshape(shape),
                source.dtype,
                reader.scratch("ref", shape, "f4"),
            )
            work = reader.scratch("difference", shape, "f4")
            errors.add(r0, ref, np.ascontiguousarray(decoded), work)
            block_err.append(np.abs(work.reshape(r1 - r0, -1, block_size)).max(axis=-1))
            block_sig.append(np.abs(ref.reshape(r1 - r0, -1, block_size)).max(axis=-1))
        errors.fill(row)
        row.decode_exact = mismatch is None if checked else None
        row.library_checked_rows = checked if runs else None
        problems = [Problem("decode", source.name, mismatch)] if mismatch else []
        return problems + _block_outliers(
            np.concatenate(block_err), np.concatenate(block_sig), block_size, source, row
        )

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """`general.file_type` against the type most Linear weights are stored in; the architecture's
        hyperparameters against the source's config; the per-tensor mix the file carries."""
        where = self.file.path.name
        problems: list[Problem] = []
        mix = Counter(t.type_name for t in self.file.tensors)
        linear = Counter(r.format.upper() for r in rows if r.kind == "linear" and r.format)
        raw_type = self.file.metadata.get("general.file_type")
        claims: dict[str, Any] = {
            "architecture": self.file.architecture,
            "file_type": file_type_name(raw_type) if raw_type is not None else None,
            "tensor_types": dict(sorted(mix.items())),
        }
        claimed = claimed_type(raw_type) if raw_type is not None else None
        if raw_type is None:
            problems.append(Problem("config", f"{where}: general.file_type", "no general.file_type"))
        elif claimed is None:
            problems.append(
                Problem("config", f"{where}: general.file_type", f"{raw_type!r} is no llama.cpp file type")
            )
        elif (
            linear
            and claimed != (most := linear.most_common(1)[0][0])
            and not self._fallback_mix(rows, claimed)
        ):
            detail = (
                f"says {claims['file_type']} ({claimed}), but most Linear weights ({linear[most]} of "
                f"{sum(linear.values())}) are {most}"
            )
            problems.append(Problem("config", f"{where}: general.file_type", detail))
        for key, ours, theirs in config_claims(self.file, self.source_config):
            problems.append(
                Problem("config", f"{where}: {key}", f"says {ours}, the source's config.json says {theirs}")
            )
        return problems, claims

    @staticmethod
    def _fallback_mix(rows: list[TensorRow], claimed: str) -> bool:
        """Whether most Linear weights are in the claimed type once llama.cpp's fallback is counted as it
        (a Q4_K_M file of a model 576 wide holds its 576-wide projections in Q5_0)."""
        linear = [r for r in rows if r.kind == "linear" and r.format]
        held = sum(as_claimed(r.format.upper(), r.shape[-1], claimed) for r in linear)  # type: ignore[union-attr]
        return 2 * held > len(linear)


def _block_outliers(
    err: np.ndarray, sig: np.ndarray, block_size: int, source: TensorInfo, row: TensorRow
) -> list[Problem]:
    """The tensor's ggml blocks against its median block (`BLOCK_OUTLIER_RATIO`), written into the row's
    tile fields (a ggml block is GGUF's tile); a problem naming how many are broken and the worst, by row and
    first column. `err` / `sig`: per block (rows, blocks per row), the largest error and source weight."""
    yardstick = np.maximum(sig, float(np.median(sig)))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(err == 0, 0.0, err / yardstick)
    rel = np.where(np.isfinite(rel), rel, np.inf)  # a NaN or infinite decode is the worst block there is
    median = max(float(np.median(rel)), MIN_BLOCK_REL_ERR)
    ratio = rel / median
    worst = int(np.argmax(ratio))
    r, b = divmod(worst, ratio.shape[1])
    row.worst_tile = f"row {r}, weights {b * block_size}..{(b + 1) * block_size - 1}"
    row.worst_tile_ratio = float(ratio.max())
    broken = ratio > BLOCK_OUTLIER_RATIO
    row.tile_outliers = int(broken.sum())
    if not row.tile_outliers:
        return []
    detail = (
        f"{row.tile_outliers} of its {ratio.size} {block_size}-weight blocks decode with a largest error "
        f"above {BLOCK_OUTLIER_RATIO:g}× its median block's; the worst, {row.worst_tile}, at "
        f"{row.worst_tile_ratio:.1f}× the median"
    )
    return [Problem("block", source.name, detail)]


def check_gguf_source(source: Checkpoint, candidate: Checkpoint) -> None:
    """Refuse a GGUF file that cannot be a copy of `source` before anything is decoded: a header that does
    not parse, an architecture gguf does not map, or one whose tensor map names none of the source's tensors.

    Raises:
        InputError: naming the GGUF file.
    """
    assert candidate.gguf_file is not None
    gguf_file = read_gguf(candidate.gguf_file)
    stored = {t.name for t in gguf_file.tensors}
    if not stored & gguf_names(source, gguf_file).keys():
        raise InputError(
            f"none of its {len(stored)} tensors is named for a tensor of the reference "
            f"({gguf_file.architecture} against {source.model_type}): not a copy of that source",
            gguf_file.path,
        )
