"""EXL3 (exllamav3) on disk: what a quantized Linear stores, its bits per weight, the config's claims, and
the decode of one Linear, whole or in blocks of output channels.

As exllamav3 writes it (`modules/quant/exl3.py`, `modules/linear.py`, `conversion/quant_config.py`,
`conversion/compile.py`): a quantized Linear `X` with `in` input and `out` output features is padded with
zeros to multiples of 128 in both (`Linear(pad_to=128)`: in_p, out_p) before it is quantized, and stores
`X.trellis`, int16 of shape (in_p/16, out_p/16, 16·K): one 16×16 tile in 256·K bits, so K = shape[-1] / 16
bits per weight (16·K + 8 words for the half-integer rates, which need the mul1 codebook); `X.suh` / `X.svh`
(float16 sign-and-scale vectors of the padded lengths in_p and out_p) or their packed forms `X.su` / `X.sv`
(int16, one bit per padded feature); `X.mcg` or `X.mul1`, an int32 scalar holding the codebook's multiplier,
whose presence selects that codebook (none: the 3INST codebook; exllamav3 1.6 refuses a marker holding
another value); `X.bias`, float16 of the padded length, when the Linear has one. config.json's
`quantization_config` claims `bits`, `head_bits`, `codebook` and, where set, `vision_bits` / `mtp_bits`;
`quantization_config.json` repeats it with `tensor_storage`: per module (exllamav3's leaf modules, by key)
its `stored_tensors` (shape, n_bytes, dtype as `str(torch dtype)`), and for an EXL3 module its
`quant_format`, `bits_per_weight` and codebook multiplier. exllamav3 stores the head apart from the
embedding even where the source tied them (`tie_word_embeddings` becomes false).

The tensors task checks the stored tensors and these claims against each other and against the source
(`evalsuite.tasks.tensors._verification`); the `exl3` backend runs the decoded weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from evalsuite.files.checkpoint import EXL3_CONFIG_FILE, Checkpoint, TensorInfo
from evalsuite.formats import split_at_last_dot
from evalsuite.formats.exl3_decode import (
    BLOCK_ELEMENTS,
    CODEBOOK_MULTIPLIERS,
    HADAMARD_SIZE,
    bits_of_width,
    decode_weight,
    padded,
    rotated_tile_errors,
)

if TYPE_CHECKING:
    import torch

PARAMS = frozenset({"trellis", "suh", "svh", "su", "sv", "mcg", "mul1"})
MARKS = frozenset({"trellis"})
# The dtype strings exllamav3 writes into tensor_storage (str(torch dtype)) for safetensors dtypes.
TORCH_DTYPE_NAMES = {
    "BF16": "torch.bfloat16",
    "F16": "torch.float16",
    "F32": "torch.float32",
    "I16": "torch.int16",
    "I32": "torch.int32",
    "I64": "torch.int64",
    "I8": "torch.int8",
    "U8": "torch.uint8",
}
# Parts of the model whose bits have a claim of their own in the config.
PART_CLAIMS = {"head": "head_bits", "vision": "vision_bits", "mtp": "mtp_bits"}
# What a quantized Linear may store beside its trellis (the bias is kept, padded, in float16).
LINEAR_PARAMS = PARAMS | {"bias"}
# Elements of a block of decoded output channels: 4 MB of float32, at least one 128-channel block.
_BLOCK_ELEMENTS = BLOCK_ELEMENTS


def bits_per_weight(trellis_shape: tuple[int, ...]) -> float | int | None:
    """K of a trellis shape (`exl3_decode.bits_of_width` of its last dimension), None for no EXL3 width."""
    return bits_of_width(trellis_shape[-1])


class Exl3:
    """EXL3 as a `QuantizedFormat`, with the candidate's claims: `config` (config.json's
    `quantization_config`, else quantization_config.json's top level) and `storage` (`tensor_storage`), or
    `storage_problem` saying why there is none."""

    name = "exl3"
    params = PARAMS
    marks = MARKS
    split = staticmethod(split_at_last_dot)

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        self.config = candidate.quantization_config or {}
        path = candidate.path / EXL3_CONFIG_FILE
        self.storage_problem: str | None = None
        self.storage: dict[str, Any] = {}
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            self.storage_problem = f"no {EXL3_CONFIG_FILE}: the per-tensor bitrates cannot be checked"
        except ValueError as exc:
            self.storage_problem = f"{EXL3_CONFIG_FILE} is not valid JSON ({exc})"
        else:
            storage = document.get("tensor_storage") if isinstance(document, dict) else None
            if isinstance(storage, dict):
                self.storage = storage
            else:
                self.storage_problem = f"{EXL3_CONFIG_FILE} has no tensor_storage object"
            if not self.config and isinstance(document, dict):
                self.config = {k: v for k, v in document.items() if k != "tensor_storage"}


def exl3_linears(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """Every module that stores a trellis, with what it stores beside it: parameter name → tensor.

    Every tensor `X.p` of a module `X` with a trellis is listed, whatever `p` is, so that a tensor no
    exllamav3 Linear stores (an unknown codebook marker, a dense weight beside the trellis) is seen there.
    """
    modules = {name.removesuffix(".trellis") for name in tensors if name.endswith(".trellis")}
    found: dict[str, dict[str, TensorInfo]] = {module: {} for module in modules}
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        if module in found:
            found[module][param] = info
    return found


def stored_bits(trellis: TensorInfo) -> float | int | None:
    """K of a trellis from its header, or None when its shape is no EXL3 bitrate."""
    if trellis.dtype != "I16" or len(trellis.shape) != 3:
        return None
    return bits_of_width(trellis.shape[-1])


def linear_problems(
    stored: Mapping[str, TensorInfo],
    out_features: int,
    in_features: int,
    marker_value: Callable[[TensorInfo], int | None],
) -> list[str]:
    """What is wrong with one EXL3 Linear's stored tensors for an (out_features, in_features) weight, each
    a sentence; empty when exllamav3 and `decode_weight` can read it. `marker_value` reads a codebook
    marker's 32 bits (None when the tensor is not one 32-bit value)."""
    found: list[str] = []
    in_p, out_p = padded(in_features), padded(out_features)
    unknown = sorted(set(stored) - LINEAR_PARAMS)
    if unknown:
        found.append(
            f"stores {', '.join(unknown)} beside its trellis, which no EXL3 Linear stores "
            "(an unknown codebook marker?)"
        )
    trellis = stored["trellis"]
    if trellis.dtype != "I16" or len(trellis.shape) != 3:
        found.append(f"trellis is {trellis.dtype} {list(trellis.shape)}, not a 3-D I16 tensor")
    else:
        tiles = (in_p // 16, out_p // 16)
        if tuple(trellis.shape[:2]) != tiles:
            found.append(
                f"trellis {list(trellis.shape)} does not tile the weight (out={out_features}, "
                f"in={in_features}) padded to multiples of 128: expected [{tiles[0]}, {tiles[1]}, 16·K]"
            )
        bits = stored_bits(trellis)
        if bits is None:
            found.append(
                f"trellis width {trellis.shape[-1]} words is no EXL3 bitrate "
                "(16·K words for K in 1..8, or 24, 40, 56 for K 1.5, 2.5, 3.5)"
            )
        elif isinstance(bits, float) and "mul1" not in stored:
            found.append(f"half-integer bitrate {bits} without the mul1 codebook")
    for full, packed, n in (("suh", "su", in_p), ("svh", "sv", out_p)):
        if full in stored:
            info, want = stored[full], ("F16", (n,))
        elif packed in stored:
            info, want = stored[packed], ("I16", (n // 16,))
        else:
            found.append(f"neither {full} nor {packed} is stored")
            continue
        if (info.dtype, info.shape) != want:
            found.append(
                f"{info.name.rsplit('.', 1)[-1]} is {info.dtype} {list(info.shape)}, expected "
                f"{want[0]} {list(want[1])} (padded to a multiple of 128)"
            )
    markers = [m for m in CODEBOOK_MULTIPLIERS if m in stored]
    if len(markers) > 1:
        found.append("stores both the mcg and the mul1 codebook markers")
    for marker in markers:
        value = marker_value(stored[marker])
        if value != CODEBOOK_MULTIPLIERS[marker]:
            shown = "not one 32-bit value" if value is None else f"{value:#010x}"
            found.append(f"{marker} marker holds {shown}, not {CODEBOOK_MULTIPLIERS[marker]:#010x}")
    bias = stored.get("bias")
    if bias is not None and (len(bias.shape) != 1 or bias.shape[0] not in (out_features, out_p)):
        found.append(f"bias is {bias.dtype} {list(bias.shape)}, expected ({out_p},) or ({out_features},)")
    return found


def codebook(stored: Mapping[str, Any]) -> str:
    """The codebook a Linear's stored tensors (by parameter name) select: mcg, mul1 or 3inst."""
    markers = [m for m in CODEBOOK_MULTIPLIERS if m in stored]
    return markers[0] if len(markers) == 1 else "3inst" if not markers else "mixed"


def decode_linear(stored: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
    """The dense weight of one EXL3 Linear, float32 (out_features, in_features), from its stored tensors by
    parameter name (trellis, suh or su, svh or sv, the marker)."""
    return decode_weight(
        stored["trellis"],
        stored["suh"] if "suh" in stored else stored["su"],
        stored["svh"] if "svh" in stored else stored["sv"],
        codebook(stored),
        in_features,
        out_features,
    )


def decoded_blocks(
    stored: Mapping[str, torch.Tensor], out_features: int, in_features: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """The dense weight of one EXL3 Linear in blocks of output channels: (first channel, float32 block of
    (channels, in_features)). Each block is decoded from its own columns of the trellis, so memory is the
    trellis and one block of about 4 MB, not the dense weight."""
    trellis = stored["trellis"]
    suh = stored["suh"] if "suh" in stored else stored["su"]
    svh, packed = (stored["svh"], False) if "svh" in stored else (stored["sv"], True)
    name = codebook(stored)
    out_p = padded(out_features)
    step = max(HADAMARD_SIZE, _BLOCK_ELEMENTS // padded(in_features) // HADAMARD_SIZE * HADAMARD_SIZE)
    for first in range(0, out_features, step):
        count = min(step, out_features - first)
        end = min(first + step, out_p)  # the last block takes the padding of the output channels with it
        signs = svh[first // 16 : end // 16] if packed else svh[first:end]
        block = trellis[:, first // 16 : end // 16]
        yield first, decode_weight(block, suh, signs, name, in_features, count)


def block_tile_errors(
    stored: Mapping[str, torch.Tensor], first: int, error: torch.Tensor, in_features: int
) -> torch.Tensor:
    """Per-tile mean squared error in the rotated basis (`exl3_decode.rotated_tile_errors`) of the error of
    one block of `decoded_blocks` starting at output channel `first`: (out tiles of the block, in tiles)."""
    suh = stored["suh"] if "suh" in stored else stored["su"]
    svh, packed = (stored["svh"], False) if "svh" in stored else (stored["sv"], True)
    end = first + padded(error.shape[0])
    signs = svh[first // 16 : end // 16] if packed else svh[first:end]
    return rotated_tile_errors(error, suh, signs, in_features)


def storage_problems(storage: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> list[tuple[str, str]]:
    """`tensor_storage` against the files: (tensor or module named, what disagrees) for every listed tensor
    that is missing or whose shape, size or dtype differs, and every EXL3 module whose entry is absent or
    disagrees with its trellis (quant_format, bits_per_weight, codebook multiplier). The module's problems
    name its `.trellis` tensor."""
    problems: list[tuple[str, str]] = []
    for module, entry in storage.items():
        listed = entry.get("stored_tensors") if isinstance(entry, dict) else None
        if not isinstance(listed, dict):
            problems.append((module, "tensor_storage entry without stored_tensors"))
            continue
        for name, meta in listed.items():
            info = tensors.get(name)
            if info is None:
                problems.append((name, f"listed in tensor_storage[{module!r}], not stored"))
                continue
            real = {
                "shape": list(info.shape),
                "n_bytes": info.nbytes,
                "dtype": TORCH_DTYPE_NAMES.get(info.dtype, info.dtype),
            }
            meta = meta if isinstance(meta, dict) else {}
            for key in ("shape", "n_bytes", "dtype"):
                if key in meta and meta[key] != real[key]:
                    problems.append((name, f"tensor_storage says {key} {meta[key]}, stored {real[key]}"))
    for module, stored in exl3_linears(tensors).items():
        entry = storage.get(module)
        where = f"{module}.trellis"
        if not isinstance(entry, dict):
            problems.append((where, f"quantized, but {module} is not in tensor_storage"))
            continue
        said_format = entry.get("quant_format")
        if said_format != "exl3":
            problems.append((where, f"tensor_storage says quant_format {said_format!r}, the files hold exl3"))
        bits = stored_bits(stored["trellis"])
        claimed = entry.get("bits_per_weight")
        if claimed != bits:
            problems.append((where, f"tensor_storage says {claimed} bpw, the trellis shape gives {bits} bpw"))
        held = codebook(stored)
        for marker, multiplier in CODEBOOK_MULTIPLIERS.items():
            said = entry.get(f"{marker}_multiplier")
            if (held == marker) != (said is not None) or said not in (None, multiplier):
                problems.append(
                    (
                        where,
                        f"tensor_storage {marker}_multiplier is {said!r}, the files "
                        f"{'hold' if held == marker else 'lack'} the {marker} marker",
                    )
                )
    return problems
