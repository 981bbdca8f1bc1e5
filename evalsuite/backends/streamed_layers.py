"""Streamed execution's loaders: one decoder layer at a time materialised from the files, per backend
(`hf` through Transformers' own loading function, `intref` through its integer skeleton, `exl3` decoded),
and freed again. How a streamed pass uses them, and why it is bit-identical to a loaded run:
`evalsuite.backends.streamed`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from evalsuite.backends.c_heap import heap_kept_while_loading
from evalsuite.backends.hf import (
    DTYPES,
    first_line,
    from_pretrained_with_report,
    quiet_transformers,
    refuse_partial_load,
    transformers_config,
)
from evalsuite.backends.load_lock import tensors_read_when_converted
from evalsuite.backends.memory import decoded_cache_budget
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.skeleton import refuse_mismatch, set_generation_config, tie_weights
from evalsuite.backends.step_reads import DecodingReads
from evalsuite.backends.stream_units import (
    REST,
    VISION,
    Unit,
    refuse_missing_in_layers,
    text_modules,
    unit_of,
    vision_modules,
)
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint


def decoder_layers(model: nn.Module, checkpoint: Checkpoint) -> tuple[nn.ModuleList, str]:
    """The model's decoder layers and their module name: the list of `num_hidden_layers` modules under the
    model's decoder (`get_decoder()`, the language model of an image-text-to-text model)."""
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(text_config, "num_hidden_layers", None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    names = {id(module): name for name, module in model.named_modules()}
    if isinstance(count, int) and count > 0:
        for module in decoder.modules():
            if isinstance(module, nn.ModuleList) and len(module) == count and id(module) in names:
                return module, names[id(module)]
    raise InputError(
        f"the decoder layers of {type(model).__name__} cannot be found (no list of num_hidden_layers={count} "
        f"modules under its decoder, {type(decoder).__name__}): streamed execution cannot run this model",
        checkpoint.path,
    )


def share_quantizer_ops(mapping: list[Any]) -> None:
    """Make the conversion operations that hold the quantizer be shared, not copied, by the copies
    Transformers' loading makes of their converter. `convert_and_load_state_dict_in_model` deep-copies a
    converter once per tensor it is given, so that each target collects its own tensors; an operation that
    decompresses a pack holds the quantizer (its whole compressed-tensors config, pydantic models) and
    reads it only, yet it was copied with it: a streamed layer's thousands of expert tensors made as many
    copies of the config at every forward of a decoding (most of a W4A8 step's Python time at the seed's
    widths). The operations are this model's own (`get_model_conversion_mapping` builds them for it)."""
    from transformers.core_model_loading import WeightConverter

    for converter in mapping:
        if not isinstance(converter, WeightConverter):
            continue
        for op in converter.operations:
            if getattr(op, "hf_quantizer", None) is not None and hasattr(op, "__dict__"):
                op.__deepcopy__ = functools.partial(_itself, op)


def _itself(obj: Any, memo: dict[int, Any]) -> Any:
    """`copy.deepcopy`'s hook for an object shared by every copy of what holds it."""
    memo[id(obj)] = obj
    return obj


class TransformersLayers(DecodingReads):
    """Backend `hf`, streamed: the skeleton `from_pretrained` builds on the meta device (quantizer applied,
    no tensor data read), its units materialised by Transformers' own loading code (module docstring)."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
        from transformers.modeling_utils import LoadStateDictConfig

        if checkpoint.format == "gguf":
            raise InputError(
                "streamed execution reads safetensors shards; a GGUF checkpoint can only be loaded whole",
                checkpoint.path,
            )
        self.checkpoint = checkpoint
        self.device = torch.device(options.device)
        config, kwargs = transformers_config(checkpoint, options)
        self.model, report = from_pretrained_with_report(
            checkpoint, options, config, kwargs, device_map="meta"
        )
        self.quantizer = getattr(self.model, "hf_quantizer", None)
        self.compressor = getattr(self.quantizer, "compressor", None)
        if self.compressor is not None:
            # compressed-tensors decompresses the whole model at its first forward; here each unit is
            # decompressed when it is materialised, by the same per-module function.
            self.compressor.remove_decompression_hook(self.model)
        self.layers, self.prefix = decoder_layers(self.model, checkpoint)
        self.text = text_modules(self.model)
        dtype = DTYPES[options.dtype]
        mapping = get_model_conversion_mapping(self.model, None, self.quantizer)
        share_quantizer_ops(mapping)
        self.load_config = LoadStateDictConfig(
            device_map={"": options.device},
            dtype=dtype,
            dtype_plan=self.model._get_dtype_plan(dtype),
            hf_quantizer=self.quantizer,
            weight_mapping=mapping,
        )
        # Each file tensor's target in the model and the source pattern of the converter that takes it, as
        # Transformers renames it (`_plan_units`), and the converters by source pattern.
        self._targets: dict[str, tuple[str, str | None]] = {}
        self._converters = {
            p: c for c in mapping if isinstance(c, WeightConverter) for p in c.source_patterns
        }
        self.units = self._plan_units(mapping)
        refuse_partial_load(checkpoint, report)
        # Per decoder layer, its compressed-tensors modules' parameters as built (`_remember_compressed`).
        self._built: dict[int, dict[str, tuple[dict[str, Any], Any]]] = {}
        # The dtype plan's patterns, compiled once (`_read_dtype`); whether tensors no converter takes are set
        # by `_load_renamed` (not where a quantizer quantizes what it reads: Transformers' loop does that).
        self._dtype_plan: tuple[Any, dict[str, str]] | None = None
        self._renamed_apart = self.quantizer is None or bool(self.quantizer.pre_quantized)
        # A decoding's reads (`DecodingReads`): what they convert is kept within what the budget leaves.
        self._start_decoding_reads(decoded_cache_budget(checkpoint, options))

    def _plan_units(self, mapping: list[Any]) -> dict[Unit, list[str]]:
        """The files' tensor names by unit, placed by the names Transformers' own renaming gives them; a layer
        whose tensors are missing from the files (or in excess) is refused, naming the layer."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        expected = self.model.state_dict()
        prefix_name = self.model.base_model_prefix
        units: dict[Unit, list[str]] = {}
        provided: set[str] = set()
        unexpected: list[str] = []
        for name in self.checkpoint.tensors:
            target, pattern = rename_source_key(name, renamings, converters, prefix_name, expected)
            self._targets[name] = (target, pattern)
            units.setdefault(unit_of(target, self.prefix, self.text), []).append(name)
            provided.add(target)
            if target not in expected:
                unexpected.append(target)
        missing = [target for target in expected if target not in provided]
        refuse_missing_in_layers(self.checkpoint, self.prefix, missing, unexpected)
        return units

    def _load(self, names: list[str]) -> None:
        """The tensors `names` into the model, as Transformers' loading puts them there: those a converter
        takes (fused experts, a dequantization) by `convert_and_load_state_dict_in_model`; those only renamed
        by `_load_renamed`, which does for them what that function does, without its per-tensor machinery."""
        renamed = [n for n in names if self._targets[n][1] is None] if self._renamed_apart else []
        converted = [n for n in names if self._targets[n][1] is not None] if renamed else names
        if renamed:
            self._load_renamed(renamed)
        if not converted:
            return
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        with (
            self.checkpoint.open_tensors(converted) as handles,
            quiet_transformers(),
            heap_kept_while_loading(),
            tensors_read_when_converted(),
        ):
            info, _ = convert_and_load_state_dict_in_model(self.model, handles, self.load_config)
        self._refuse_problems(info)

    def _load_renamed(self, names: list[str]) -> None:
        """Tensors that no converter takes, each read as Transformers materialises it (`_materialize_copy`:
        on the device, cast to `_read_dtype`'s dtype) and set by its `set_param_for_module`.

        Why not through `convert_and_load_state_dict_in_model`: for each tensor it builds a `WeightRenaming`
        whose patterns are compiled regular expressions of the tensor's own name, and Python keeps the 512
        latest. A streamed pass reads each layer's tensors again at every forward: the SmolLM2 pair's W4A8
        copy (19 tensors a layer, 570 in all) missed that cache on every tensor, 0.5 ms each, where its BF16
        source (270) hit it. The function also takes the whole model's state dict at each call."""
        from transformers.core_model_loading import _materialize_copy, set_param_for_module
        from transformers.utils.loading_report import LoadStateDictInfo

        info = LoadStateDictInfo(
            missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), conversion_errors={},
            error_msgs=[], skipped_pp_keys=set(),
        )  # fmt: skip
        with self.checkpoint.open_tensors(names) as handles, heap_kept_while_loading():
            for name in names:
                target = self._targets[name][0]
                handle = handles[name]
                dtype = self._read_dtype(target, handle.get_dtype().startswith(("F", "BF")))
                value = _materialize_copy(handle, self.load_config.device_map[""], dtype)
                set_param_for_module(self.model, target, value, info, self.quantizer)
        self._refuse_problems(info)

    def _refuse_problems(self, info: Any) -> None:
        """A tensor whose shape is not the model's, or a conversion that failed: one line naming it."""
        errors = list(info.conversion_errors.values()) + list(info.error_msgs)
        if info.mismatched_keys or errors:
            what = next(iter(info.mismatched_keys), None) or first_line(Exception(str(errors[0])))
            raise InputError(f"Transformers cannot load these tensors: {what}", self.checkpoint.path)

    def _initialise_buffers(self, modules: list[nn.Module]) -> None:
        """Non-persistent buffers (rotary frequencies, position ids) computed by the model's own
        `_init_weights`, as `from_pretrained` does after loading; loaded weights are flagged, left alone."""
        for module in modules:
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and name in module._non_persistent_buffers_set:
                    module._buffers[name] = torch.empty_like(buffer, device=self.device)
                    module._is_hf_initialized = False
        self.model.initialize_weights()

    def _decompress(self, modules: list[nn.Module]) -> None:
        """What compressed-tensors' `decompress_module` does to each quantized module, the modules stored
        alike decompressed together (`evalsuite.formats.ct_batch`)."""
        if self.compressor is None:
            return
        from compressed_tensors.quantization.utils import is_module_quantized

        from evalsuite.formats.ct_batch import decompress_modules

        with quiet_transformers():
            quantized = [m for m in modules if is_module_quantized(m)]
            decompress_modules(quantized, self.compressor.force_compression_format)

    def load_rest(self) -> None:
        """The text path outside the decoder layers, tied weights tied."""
        self._load(self.units.get(REST, []))
        apart = {id(m) for m in [*self.layers.modules(), *vision_modules(self.model, self.text)]}
        outside = [m for m in self.model.modules() if id(m) not in apart]
        self._initialise_buffers(outside)
        self.model.tie_weights()
        self._decompress(outside)

    def load_vision(self) -> None:
        """What the text path never runs (`stream_units.VISION`), until `free_vision`."""
        self._load(self.units.get(VISION, []))
        modules = vision_modules(self.model, self.text)
        self._initialise_buffers(modules)
        self._decompress(modules)

    def free_vision(self) -> bool:
        """The vision tower's tensors back to the meta device, to be read again by `load_vision`; False
        (nothing freed) where the pack quantizes a vision module: its decompression rewrote the module, which
        the files' tensors no longer fit."""
        from compressed_tensors.quantization.utils import is_module_quantized

        modules = vision_modules(self.model, self.text)
        if self.compressor is not None and any(is_module_quantized(m) for m in modules):
            return False
        for module in modules:
            _release_tensors(module, keep_computed=True)
        return True

    def load_layer(self, index: int) -> None:
        """Decoder layer `index`, as a loaded model holds it."""
        self._remember_compressed(index)
        self._load(self.units.get(index, []))
        modules = list(self.layers[index].modules())
        self._initialise_buffers(modules)
        self._decompress(modules)

    def _read_dtype(self, target: str, floating: bool = True) -> Any:
        """The dtype Transformers' loading casts a tensor of `target` to when it reads it, where no converter
        takes it: the load's dtype, a dtype plan's where one matches, else the skeleton's where it differs; a
        pre-quantized model's quantizer has the last word (none for a tensor that is not floating point)."""
        from transformers.core_model_loading import build_glob_alternation

        dtype, plan = self.load_config.dtype, self.load_config.dtype_plan or {}
        if plan and self._dtype_plan is None:
            self._dtype_plan = build_glob_alternation(list(plan))[:2]
        match = self._dtype_plan[0].search(target) if plan and self._dtype_plan else None
        if match is not None and self._dtype_plan is not None:
            dtype = plan[self._dtype_plan[1][match.lastgroup]]
        else:
            module, _, leaf = target.rpartition(".")
            empty = getattr(self.model.get_submodule(module), leaf)
            if empty is not None and empty.dtype != dtype:
                dtype = empty.dtype
        if self.quantizer is not None and self.quantizer.pre_quantized:
            return dtype if floating else None
        return dtype

    def free_layer(self, index: int) -> None:
        self.free_routed()
        # The layer's tensors go now, whatever holds the module (compressed-tensors binds each quantized
        # module's forward to the module: a reference cycle only the garbage collector would break).
        layer = self.layers[index]
        _release_tensors(layer, keep_computed=False)
        if index in self._built:
            from compressed_tensors.utils import replace_direct_state_dict

            for name, (params, status) in self._built[index].items():
                module = layer.get_submodule(name)
                built = {
                    k: None if v is None else torch.empty(v[0], dtype=v[1], device="meta")
                    for k, v in params.items()
                }
                replace_direct_state_dict(module, built)
                module.quantization_status = status

    def _remember_compressed(self, index: int) -> None:
        """Before decoder layer `index` is first read: each compressed-tensors module's parameters as built
        (on the meta device) and its status. Its decompression rewrites them (the packed weight replaced by
        the decompressed one), and `free_layer` gives them back, so that the next read of the layer loads
        into the layer as built, as the first did.

        Why not a copy of the layer as built, swapped in at each free: deep-copying a layer's modules, at
        every read of every layer, was most of what a W4A8 decoding step spent outside the decompression
        (the SmolLM2 pair: 5 ms a layer, more than the BF16 side's whole read of it)."""
        if self.compressor is None or index in self._built:
            return
        from compressed_tensors.quantization.utils import is_module_quantized
        from compressed_tensors.utils import get_direct_state_dict

        self._built[index] = {
            name: (
                {k: v if v is None else (v.shape, v.dtype) for k, v in get_direct_state_dict(module).items()},
                module.quantization_status,
            )
            for name, module in self.layers[index].named_modules()
            if is_module_quantized(module)
        }  # fmt: skip


class IntegerLayers:
    """Backend `intref`, streamed: the integer skeleton, its tensors loaded by name one unit at a time."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        from evalsuite.backends.intref import IntegerSkeleton

        self.checkpoint = checkpoint
        self.device = torch.device(options.device)
        self.skeleton = IntegerSkeleton(checkpoint, options)
        self.model = self.skeleton.model
        self.layers, self.prefix = decoder_layers(self.model, checkpoint)
        missing, unexpected = self.skeleton.expected_tensors()
        refuse_missing_in_layers(checkpoint, self.prefix, missing, unexpected)
        refuse_mismatch(checkpoint, missing, unexpected)
        self.text = text_modules(self.model)
        self.units: dict[Unit, list[str]] = {}
        for name in checkpoint.tensors:
            if not (
                name.endswith(".weight_shape") and name.removesuffix(".weight_shape") in self.skeleton.plan
            ):
                self.units.setdefault(unit_of(name, self.prefix, self.text), []).append(name)

    def _load(self, names: list[str]) -> None:
        self.skeleton.load_named(self.model, self.skeleton.plan, self.skeleton.dtype, names)

    def load_rest(self) -> None:
        self._load(self.units.get(REST, []))
        tie_weights(self.model)
        set_generation_config(self.model, self.checkpoint)
        _move_outside_layers(self.model, self.layers, self.device)

    def load_vision(self) -> None:
        self._load(self.units.get(VISION, []))
        _move_outside_layers(self.model, self.layers, self.device)

    def load_layer(self, index: int) -> None:
        from evalsuite.backends._intlinear import IntExperts, IntLinear

        self._load(self.units.get(index, []))
        if self.device.type != "cpu":
            self.layers[index].to(self.device)
        # Resident for one pass over every window: each packed weight unpacked once for all of them, a
        # layer's routed experts together (`IntExperts.unpack_together`).
        for module in self.layers[index].modules():
            if isinstance(module, IntLinear):
                module.keep_unpacked = True
            elif isinstance(module, IntExperts):
                module.unpack_together()

    def free_layer(self, index: int) -> None:
        from evalsuite.backends._intlinear import IntLinear

        # The same modules stay (their integer-path counters with them); the tensors read from the files go
        # back to meta, computed buffers (rotary frequencies) stay.
        for module in self.layers[index].modules():
            if isinstance(module, IntLinear):
                module.drop_unpacked()
        _release_tensors(self.layers[index], keep_computed=True)


class DecodedExl3Layers:
    """Backend `exl3`, streamed: the pack's Transformers model on the meta device (`DecodedSkeleton`), each
    unit's EXL3 Linears decoded and its other tensors loaded by name when it is materialised; the tensors
    the model class ignores on load (an MTP head) are left in the files, as in a whole load."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        from evalsuite.backends.exl3 import DecodedSkeleton

        self.checkpoint = checkpoint
        self.device = torch.device(options.device)
        self.skeleton = DecodedSkeleton(checkpoint, options)
        self.model = self.skeleton.model
        self.layers, self.prefix = decoder_layers(self.model, checkpoint)
        refuse_missing_in_layers(checkpoint, self.prefix, self.skeleton.missing(), self.skeleton.unexpected)
        self.skeleton.refuse_problems()
        ignored = set(self.skeleton.ignored)
        self.text = text_modules(self.model)
        self.units: dict[Unit, set[str]] = {}
        for name in checkpoint.tensors:
            if name not in ignored:
                self.units.setdefault(unit_of(name, self.prefix, self.text), set()).add(name)

    def load_rest(self) -> None:
        self.skeleton.load_tensors(self.units.get(REST, set()))
        tie_weights(self.model)
        set_generation_config(self.model, self.checkpoint)
        _move_outside_layers(self.model, self.layers, self.device)

    def load_vision(self) -> None:
        self.skeleton.load_tensors(self.units.get(VISION, set()))
        _move_outside_layers(self.model, self.layers, self.device)

    def load_layer(self, index: int) -> None:
        self.skeleton.load_tensors(self.units.get(index, set()))
        if self.device.type != "cpu":
            self.layers[index].to(self.device)

    def free_layer(self, index: int) -> None:
        # Decoded weights go back to meta; computed buffers (rotary frequencies) stay.
        _release_tensors(self.layers[index], keep_computed=True)


def _release_tensors(layer: nn.Module, keep_computed: bool) -> None:
    """Every parameter and buffer of `layer` replaced by a meta tensor of its shape (memory freed now);
    non-persistent buffers (computed, not read from the files) stay when `keep_computed`."""
    for module in layer.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None and not (keep_computed and name in module._non_persistent_buffers_set):
                module._buffers[name] = buffer.to("meta")


def _move_outside_layers(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """The tensors read so far outside the decoder layers, onto `device` (a no-op on the CPU)."""
    if device.type == "cpu":
        return
    inside = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) not in inside:
            _move_own_tensors(module, device)


def _move_own_tensors(module: nn.Module, device: torch.device) -> None:
    for name, param in module._parameters.items():
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to(device), requires_grad=False)
    for name, buffer in module._buffers.items():
        if buffer is not None and not buffer.is_meta:
            module._buffers[name] = buffer.to(device)


def layer_loader(
    checkpoint: Checkpoint, options: BackendOptions
) -> TransformersLayers | IntegerLayers | DecodedExl3Layers:
    """The loader of the side's backend: `hf`, `intref` or `exl3` (always its decoded path when streamed)."""
    if options.backend == "intref":
        return IntegerLayers(checkpoint, options)
    if options.backend == "exl3":
        return DecodedExl3Layers(checkpoint, options)
    return TransformersLayers(checkpoint, options)
