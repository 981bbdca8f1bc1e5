"""Whether a side fits in memory loaded whole, or runs streamed one decoder layer at a time.

`--max-memory SIZE` is the budget (default: the free RAM for `--device cpu`, the free memory of the CUDA
device otherwise). A side whose load would peak above `FIT_FRACTION` of it runs streamed
(`evalsuite.backends.streamed`) without being asked; `--stream` streams it whatever it needs. A load peaks
at the model's weights once loaded plus its largest decoder layer once more (`loaded_peak_bytes`: a layer's
file tensors are held beside what Transformers converts them into, its routed experts fused from per-expert
tensors, a compressed-tensors module beside its decompressed weight); each tensor is a view of its shard's
mapping whose pages are handed back with it, so the files' pages add nothing more (`Checkpoint.open_tensors`).
The estimate is made from the safetensors headers alone, before anything loads:

- backend `hf` holds every weight in the compute dtype: Transformers decompresses compressed-tensors weights
  (a `weight_packed` tensor holds weights of its group's `num_bits`: an INT4 int32 word is eight, an NVFP4 or
  MXFP4 byte two, an 8-bit word four), so a W4A8 or NVFP4 pack needs as much as its BF16 source;
- backend `intref` keeps the packed weights packed: it needs about the files' bytes;
- backend `exl3` (decoded path) holds every EXL3 Linear decoded in the compute dtype: a 4 bpw trellis needs
  four times its stored bytes (`exl3_decoded_bytes`).

A GGUF checkpoint is never streamed (Transformers dequantizes it by reading the whole file), nor is a side on
`--device auto`, whose placement accelerate decides over several devices.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import FLOAT_DTYPES, Checkpoint

# Activations, the vocabulary-sized logits of a window and the allocator's slack need the rest.
FIT_FRACTION = 0.9

_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# A decoder layer's tensors: `….layers.N.` outside the vision tower (whose blocks are small beside them).
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def parse_memory_size(text: str) -> int:
    """`24GB` (10^9 bytes), `24GiB` (2^30), `512MB`, `1.5TB` or a byte count, in bytes; else InputError."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise InputError(
            f"--max-memory {text!r} is not a size: use a number and a unit, e.g. 24GB, 24GiB, 512MB"
        )
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise InputError(f"--max-memory {text!r} is not a positive size")
    return int(size)


def format_bytes(n: float) -> str:
    """Bytes for people, in decimal units (GB = 10^9 bytes), as `--max-memory` reads them."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def loaded_bytes(checkpoint: Checkpoint, options: BackendOptions) -> int:
    """What the model's weights occupy once loaded whole by `options.backend` (see the module docstring)."""
    if options.backend == "intref":
        return checkpoint.total_bytes
    per_weight = _DTYPE_BYTES[options.dtype]
    if options.backend == "exl3" or checkpoint.format == "exl3":
        return exl3_decoded_bytes(checkpoint, per_weight)
    if checkpoint.format == "mlx":
        from evalsuite.formats.mlx import decoded_numel

        return decoded_numel(checkpoint) * per_weight  # decoded into the compute dtype (`backends.decoded`)
    if checkpoint.format in ("gptq", "awq"):
        from evalsuite.formats.gptq import decoded_numel as gptq_numel

        return gptq_numel(checkpoint) * per_weight  # decoded into the compute dtype (`backends.decoded`)
    if checkpoint.format == "modelopt":
        from evalsuite.formats.modelopt import decoded_numel as modelopt_numel

        return modelopt_numel(checkpoint) * per_weight  # decoded into the compute dtype (`backends.decoded`)
    if checkpoint.gguf_file is not None:
        from evalsuite.formats.gguf import read_gguf

        # Transformers dequantizes every GGUF tensor into the compute dtype (its header gives the shapes).
        return sum(t.numel for t in read_gguf(checkpoint.gguf_file).tensors) * per_weight
    bits = _packed_bits(checkpoint)
    total = 0
    for name, info in checkpoint.tensors.items():
        if name.endswith(".weight_shape"):
            continue  # compressed-tensors' record of the logical shape, not a weight
        if checkpoint.format == "mxfp4" and name.endswith(("_blocks", "_scales")):
            # gpt-oss's experts: two FP4 codes a byte, decoded into the compute dtype; the scales fold in.
            total += info.nbytes * 2 * per_weight if name.endswith("_blocks") else 0
            continue
        if name.endswith(".weight_packed"):
            # Packed weights of `bits` each (INT4 eight to an int32 word, NVFP4/MXFP4 two to a byte),
            # decompressed into the compute dtype.
            total += info.nbytes * 8 // bits(name.removesuffix(".weight_packed")) * per_weight
        elif info.dtype in FLOAT_DTYPES or name.endswith(".weight"):
            total += info.numel * per_weight
        elif name.endswith(".weight_scale") and info.dtype == "U8":
            # MXFP4's E8M0 scales: Transformers holds them in the compute dtype once loaded.
            total += info.numel * per_weight
        else:
            total += info.nbytes
    return total


def _packed_bits(checkpoint: Checkpoint) -> Callable[[str], int]:
    """The width of a module's packed weights, as its `quantization_config` group says (compressed-tensors'
    own resolution of targets); 4 where no group says (the width compressed-tensors packs by default)."""
    config = checkpoint.quantization_config
    if not config or not config.get("config_groups"):
        return lambda module: 4
    from evalsuite.formats.compressed_tensors import SchemeLookup

    lookup = SchemeLookup(config, checkpoint.path / "config.json")

    def bits(module: str) -> int:
        scheme = lookup.covering(module, "linear").scheme
        return int(getattr(getattr(scheme, "weights", None), "num_bits", None) or 4)

    return bits


def loaded_peak_bytes(checkpoint: Checkpoint, options: BackendOptions) -> int:
    """What loading the side whole peaks at: `loaded_bytes` plus its largest decoder layer's share of them
    (module docstring)."""
    total = loaded_bytes(checkpoint, options)
    layers = _loaded_layer_bytes(checkpoint, total)
    return total + max(layers) if layers else total


def _loaded_layer_bytes(checkpoint: Checkpoint, total: int) -> list[int]:
    """Each decoder layer's share of the model's `total` loaded bytes: its stored bytes, in the proportion of
    the whole model's loaded bytes to its stored bytes; empty where the files hold no decoder layer."""
    layers: dict[str, int] = {}
    for name, info in checkpoint.tensors.items():
        match = _DECODER_LAYER.search(name)
        if match is not None and "vision" not in name:
            layers[match.group(0)] = layers.get(match.group(0), 0) + info.nbytes
    stored = sum(info.nbytes for info in checkpoint.tensors.values())
    if stored == 0:
        return []
    return [round(n * total / stored) for n in layers.values()]


def streamed_peak_bytes(checkpoint: Checkpoint, options: BackendOptions) -> int:
    """What a streamed side holds at its peak, estimated from the headers as `loaded_peak_bytes` is: what lies
    outside the decoder layers, loaded, and its largest decoder layer twice (the layer as run, and its files'
    tensors or Transformers' fusing of them beside it)."""
    total = loaded_bytes(checkpoint, options)
    layers = _loaded_layer_bytes(checkpoint, total)
    return total - sum(layers) + 2 * max(layers) if layers else total


def decoded_cache_budget(checkpoint: Checkpoint, options: BackendOptions) -> int:
    """The bytes a streamed side may keep converted weights in across a decoding's steps
    (`evalsuite.backends.decoded_cache.DecodedCache`): what the side's budget (`--max-memory`, else the
    device's free memory when the side is set up) leaves, at `FIT_FRACTION`, beside its streamed peak; none
    on `--device auto`."""
    budget = memory_budget(options)
    if budget is None:
        return 0
    return max(0, int(FIT_FRACTION * budget[0]) - streamed_peak_bytes(checkpoint, options))


def memory_budget(options: BackendOptions) -> tuple[int, str] | None:
    """The bytes a side may fill and where that figure comes from; None on `--device auto`."""
    if options.max_memory is not None:
        return options.max_memory, f"--max-memory {format_bytes(options.max_memory)}"
    if options.device == "auto":
        return None
    if options.device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available), "the free RAM"
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(options.device))
    return int(free), f"the free memory of {options.device}"


def streamed_if_needed(
    checkpoint: Checkpoint | None, options: BackendOptions
) -> tuple[BackendOptions, str | None]:
    """The options a side runs with: streamed when asked, or when its model would not fit the budget; with the
    reason it streams (None when it does not)."""
    if options.stream:
        return options, "--stream"
    if checkpoint is None or checkpoint.format == "gguf":
        return options, None
    budget = memory_budget(options)
    if budget is None:
        return options, None
    needed = loaded_peak_bytes(checkpoint, options)
    available, source = budget
    if needed <= FIT_FRACTION * available:
        return options, None
    reason = (
        f"the model needs {format_bytes(needed)} to be loaded whole, more than {source} allows "
        f"({format_bytes(available)})"
    )
    return options.streamed(), reason


def exl3_decoded_bytes(checkpoint: Checkpoint, per_weight: int) -> int:
    """An EXL3 pack's weights decoded into the compute dtype, from the headers alone: each trellis as its
    Linear's padded weight (in/16 · out/16 tiles of 256 weights: an upper bound by the padding, at most 128
    features each way), every other floating-point tensor at `per_weight` bytes, sign vectors and codebook
    markers not at all (the decode consumes them), and nothing for the tensors the model class ignores on
    load (an MTP head), which a loaded model never holds."""
    import re

    from evalsuite.backends.skeleton import ignored_on_load_patterns
    from evalsuite.formats.exl3 import PARAMS, exl3_linears

    patterns = [re.compile(p) for p in ignored_on_load_patterns(checkpoint.config)]
    linears = exl3_linears(checkpoint.tensors)
    total = 0
    for name, info in checkpoint.tensors.items():
        if any(p.search(name) for p in patterns):
            continue
        module, _, param = name.rpartition(".")
        if module in linears and param in PARAMS:
            if param == "trellis" and len(info.shape) == 3:
                total += info.shape[0] * info.shape[1] * 256 * per_weight
        elif info.dtype in FLOAT_DTYPES:
            total += info.numel * per_weight
        else:
            total += info.nbytes
    return total
