"""GGUF (llama.cpp) on disk: the tensor table and metadata of one `.gguf` file, read by the `gguf` package's
`GGUFReader`, each tensor's byte range checked against the file, and the decode of rows of any ggml type
by `gguf.quants.dequantize`.

A GGUF tensor is stored row-major with its dimensions listed fastest first (`ne`); seen as numpy sees it
(the order reversed) a Linear's weight has the source's (out, in) shape. Each row is a run of blocks of
`block_size` weights in `type_size` bytes, scales included (`gguf.GGML_QUANT_SIZES`): a type's bits per
weight are 8 × type_size / block_size, as llama.cpp counts them, and a row decodes on its own. llama.cpp
stores the float tensors it leaves unquantized (norms, always F32) as plain arrays.

What the file claims of itself is metadata: `general.architecture`, `general.file_type` (the llama.cpp
"ftype" a quantizer was asked for: the type of most Linear weights, the rest of its per-tensor mix its own
rules), and the architecture's hyperparameters. The header is input from whoever published the file: any
failure to parse it, a tensor whose bytes leave the file, or a type the `gguf` package does not know is an
`InputError` naming the file.

The layout is held to llama.cpp's rule (`gguf_init_from_file` in ggml's gguf.cpp): the tensors' data lie in
the tensor table's order, each beginning where the one before it ends padded to the file's alignment
(`general.alignment`, 32 when absent), the first at the data section's start. llama.cpp refuses any other
file, so one whose tensors share bytes (two names aliasing one range, or overlapping) or leave gaps is
refused here too, naming the tensors, before any task or backend judges what it reads there.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.errors import DependencyError, InputError
from evalsuite.files.identity import FileIdentity

# What a quantized module `X` stores in the candidate's view of a GGUF file: `X.ggml`, holding the GGUF
# tensor's bytes with its ggml type as dtype (`gguf_view` in the tensors task pairs names with the source's).
PARAM = "ggml"
PARAMS = frozenset({PARAM})
MARKS = PARAMS
# ggml types that are plain little-endian arrays, by the safetensors dtype of the same bytes.
FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF name, ggml type name, shape as numpy sees it (the source's order),
    and the absolute byte range of its data."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data_begin: int
    data_end: int

    @property
    def numel(self) -> int:
        """Number of weights."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's tensors (in file order) and metadata (key → value, arrays of more than
    `MAX_LISTED` items left out: the tokenizer's vocabulary is not configuration)."""

    path: Path
    tensors: list[GgufTensor]
    metadata: dict[str, Any]

    @property
    def architecture(self) -> str | None:
        """`general.architecture` (llama, qwen3moe, …)."""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def arch_value(self, key: str) -> Any:
        """The architecture's own key (`llama.block_count` for key `block_count`), or None."""
        return self.metadata.get(f"{self.architecture}.{key}")


# Metadata arrays longer than this are the tokenizer's tables, never configuration: not kept.
MAX_LISTED = 1024


# Files read in this process, by path and identity: `gguf.GGUFReader` builds a view of every metadata item
# (seconds for a vocabulary of 50,000 tokens), and one run reads the same file for its memory plan, its load
# check, its backend and `tensors`. A file changed since is another key, so it is read again.
_READ: OrderedDict[tuple[str, FileIdentity], GgufFile] = OrderedDict()
_READ_LOCK = threading.Lock()
_READ_KEEP = 8


def read_gguf(path: Path) -> GgufFile:
    """The file's tensor table and metadata through `gguf.GGUFReader`, each tensor checked: a type the
    package knows, a byte range inside the file whose size is its shape's blocks. A file read before in
    this process, unchanged (the same identity on disk), is not parsed again.

    Raises:
        InputError: the file does not parse, or a tensor's header disagrees with the file.
        DependencyError: the gguf package is not installed.
    """
    try:
        before = FileIdentity.of(path.stat())
    except OSError as exc:
        raise InputError(f"cannot read the file: {exc.strerror}", path) from None
    key = (str(path.resolve()), before)
    with _READ_LOCK:
        if key in _READ:
            _READ.move_to_end(key)
            return _READ[key]
    read = _parse_gguf(path)
    if FileIdentity.of(path.stat()) == before:  # a file that changed while parsed is never kept
        with _READ_LOCK:
            _READ[key] = read
            while len(_READ) > _READ_KEEP:
                _READ.popitem(last=False)
    return read


def _parse_gguf(path: Path) -> GgufFile:
    try:
        import gguf
    except ImportError:
        raise DependencyError(
            f"reading {path.name} needs the gguf package: pip install -e '.[demo]'"
        ) from None

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises whatever numpy does on a bad header
        raise InputError(f"not a readable GGUF file: {_first_line(exc)}", path) from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or len(field.data) > MAX_LISTED:
            continue
        try:
            metadata[key] = field.contents()
        except Exception:  # a value the reader cannot show (a nested array) is not configuration either
            continue
    tensors = []
    alignment, data_start = int(reader.alignment), int(reader.data_offset)
    expected = 0  # where llama.cpp expects the next tensor's data, from the data section's start
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if not shape or shape[-1] % block_size:
            raise InputError(
                f"tensor {tensor.name!r}: {type_name} rows of {shape[-1] if shape else 0} weights are no "
                f"whole number of {block_size}-weight blocks",
                path,
            )
        nbytes = math.prod(shape) // block_size * type_size
        begin = int(tensor.data_offset)
        if begin - data_start != expected:
            _refuse_layout(path, tensors, tensor.name, begin, nbytes, data_start + expected)
        if begin + nbytes > size:
            raise InputError(f"tensor {tensor.name!r} ends past the end of the file ({size} bytes)", path)
        tensors.append(GgufTensor(tensor.name, type_name, shape, begin, begin + nbytes))
        expected += -(-nbytes // alignment) * alignment
    del reader  # its memory map of the whole file
    return GgufFile(path, tensors, metadata)


def _refuse_layout(
    path: Path, earlier: list[GgufTensor], name: str, begin: int, nbytes: int, expected: int
) -> None:
    """Raise the one line for tensor `name` whose data begin at `begin` rather than at `expected`: the
    earlier tensor whose bytes it shares where there is one (llama.cpp's check names only the offsets)."""
    shared = next((t for t in earlier if t.data_begin < begin + max(nbytes, 1) and begin < t.data_end), None)
    if shared is not None:
        raise InputError(
            f"tensors {shared.name!r} and {name!r} share bytes (data at bytes {shared.data_begin}.."
            f"{shared.data_end} and {begin}..{begin + nbytes}): llama.cpp refuses a file whose tensors "
            "alias or overlap",
            path,
        )
    where = (
        f"where {earlier[-1].name!r} ends, padded to the file's alignment" if earlier else "the data's start"
    )
    raise InputError(
        f"tensor {name!r} has its data at byte {begin}, not at {expected} ({where}): llama.cpp refuses "
        "tensors out of the table's order or with gaps between them",
        path,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _quant_type(type_name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[type_name]


def block_shape(type_name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[_quant_type(type_name)]


def row_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row of `cols` weights."""
    block_size, type_size = block_shape(type_name)
    return cols // block_size * type_size


def bits_per_weight(type_name: str) -> float:
    """Bits a ggml type stores per weight, its block's scales included (Q4_0: 4.5), as llama.cpp counts."""
    block_size, type_size = block_shape(type_name)
    return 8 * type_size / block_size


def nominal_bits(type_name: str) -> int | None:
    """The bits a type's name gives its codes (Q4_K: 4, IQ2_XXS: 2, MXFP4: 4, BF16: 16), None for none."""
    digits = "".join(ch if ch.isdigit() else " " for ch in type_name).split()
    return int(digits[0]) if digits else None


def decode_rows(raw: np.ndarray, type_name: str, cols: int) -> np.ndarray:
    """Rows of a tensor from their stored bytes (uint8, rows × `row_bytes`), as float32 (rows, cols), by the
    `gguf` package's `dequantize` (NotImplementedError for a type it cannot decode)."""
    from gguf.quants import dequantize

    decoded = dequantize(raw, _quant_type(type_name))
    return np.asarray(decoded, dtype=np.float32).reshape(raw.shape[0], cols)


# llama.cpp quantizes a tensor whose rows are no whole number of 256-weight super-blocks to a fallback type
# instead of the k-quant asked for (`llama_tensor_get_type` in llama-quant.cpp).
K_QUANT_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
SUPER_BLOCK = 256


def as_claimed(type_name: str, cols: int, claimed: str) -> bool:
    """Whether a Linear weight of rows of `cols` stored as `type_name` is what a file of type `claimed`
    holds: the claimed type, or llama.cpp's fallback for it where rows are no whole super-block."""
    return type_name == claimed or (cols % SUPER_BLOCK != 0 and K_QUANT_FALLBACK.get(claimed) == type_name)


# File types whose name is no ggml type with a size suffix taken off: llama.cpp's quantizer gives their
# Linear weights this type (`default_type` in llama-quant.cpp), the rest of the mix its own rules.
MIX_DEFAULT_TYPES = {"IQ3_XS": "IQ3_S", "IQ3_M": "IQ3_S", "IQ2_M": "IQ2_S"}


def claimed_type(file_type: Any) -> str | None:
    """The ggml type most Linear weights have under `general.file_type` (llama.cpp's `LlamaFileType`:
    MOSTLY_Q4_K_M → Q4_K), or None when the value is no known file type."""
    import gguf

    try:
        name = gguf.LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return None
    name = {"ALL_F32": "F32"}.get(name, name.removeprefix("MOSTLY_"))
    name = MIX_DEFAULT_TYPES.get(name, name)
    types = gguf.GGMLQuantizationType.__members__
    while name and name not in types:  # the size suffixes of a mix: _S, _M, _L, _XS, _MOE
        name = name.rpartition("_")[0]
    return name or None


def file_type_name(file_type: Any) -> str | None:
    """`general.file_type` by its llama.cpp name (MOSTLY_Q4_0), or None."""
    import gguf

    try:
        return gguf.LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return None


def config_claims(gguf_file: GgufFile, source_config: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The file's hyperparameters against the source's config.json, through Transformers' GGUF mapping of
    metadata keys to config keys (`GGUF_CONFIG_MAPPING`): (GGUF key, its value, the source's) for
    each that differs. Keys the mapping or either side lacks are not compared."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = gguf_file.architecture
    mapping = GGUF_CONFIG_MAPPING.get(arch or "", {})
    text = source_config.get("text_config")
    config = text if isinstance(text, dict) else source_config
    differ = []
    for key, config_key in mapping.items():
        ours, theirs = gguf_file.arch_value(key), config.get(config_key) if config_key else None
        if ours is None or theirs is None or isinstance(ours, list):
            continue
        if isinstance(ours, float) or isinstance(theirs, float):
            same = math.isclose(float(ours), float(theirs), rel_tol=1e-6)
        else:
            same = ours == theirs
        if not same:
            differ.append((f"{arch}.{key}", ours, theirs))
    return differ
