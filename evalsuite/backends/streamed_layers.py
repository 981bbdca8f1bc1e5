"""Streamed execution's loaders: one decoder layer at a time materialised from the files, per backend
(`hf` through Transformers' own loading function, `intref` through its integer skeleton, `exl3` decoded),
and freed again. How a streamed pass uses them, and why it is bit-identical to a loaded run:
`evalsuite.backends.streamed`.
"""

from __future__ import annotations

import copy
import functools
import re
import time
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
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.skeleton import refuse_mismatch, set_generation_config, tie_weights
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


class TransformersLayers:
    """Backend `hf`, streamed: the skeleton `from_pretrained` builds on the meta device (quantizer applied,
    no tensor data read), its units materialised by Transformers' own loading code (module docstring)."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
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
        self.units = self._plan_units(mapping)
        refuse_partial_load(checkpoint, report)
        self._pristine: nn.Module | None = None
        # The routed-experts hook of the layer read for a decoding step, and its handle, until it is freed.
        self._routed: tuple[_RoutedExperts, Any] | None = None
        # Wall seconds of routed experts read during decoding forwards (`_RoutedExperts`), all layers.
        self.routed_read_seconds = 0.0

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
            target, _ = rename_source_key(name, renamings, converters, prefix_name, expected)
            units.setdefault(unit_of(target, self.prefix, self.text), []).append(name)
            provided.add(target)
            if target not in expected:
                unexpected.append(target)
        missing = [target for target in expected if target not in provided]
        refuse_missing_in_layers(self.checkpoint, self.prefix, missing, unexpected)
        return units

    def _load(self, names: list[str]) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        with (
            self.checkpoint.open_tensors(names) as handles,
            quiet_transformers(),
            heap_kept_while_loading(),
            tensors_read_when_converted(),
        ):
            info, _ = convert_and_load_state_dict_in_model(self.model, handles, self.load_config)
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
        if self.compressor is None:
            return
        from compressed_tensors.compressors import decompress_module
        from compressed_tensors.quantization.utils import is_module_quantized

        with quiet_transformers():
            for module in modules:
                if is_module_quantized(module):
                    decompress_module(module, self.compressor.force_compression_format)

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
        # The meta layer as built: compressed-tensors decompression rewrites a layer's parameters, so the
        # next pass over this layer loads into a fresh copy of the skeleton's.
        self._pristine = self._skeleton_copy(index)
        self._load(self.units.get(index, []))
        modules = list(self.layers[index].modules())
        self._initialise_buffers(modules)
        self._decompress(modules)

    def load_layer_routed(self, index: int, read: list[int]) -> None:
        """Decoder layer `index` as `load_layer` makes it, but for its routed experts where the files store
        each apart: those are read when the layer's experts are first called, and only the experts the call's
        tokens route to (`_RoutedExperts`). Each tensor's bytes read are added to `read` (one element)."""
        experts = _routed_experts(self.layers[index], self.units.get(index, []))
        if experts is None:
            self.load_layer(index)
            read[0] += sum(self.checkpoint.tensors[n].nbytes for n in self.units.get(index, []))
            return
        module, by_expert = experts
        rest = [n for n in self.units.get(index, []) if not any(n in names for names in by_expert.values())]
        self._pristine = self._skeleton_copy(index)
        self._load(rest)
        read[0] += sum(self.checkpoint.tensors[n].nbytes for n in rest)
        modules = list(self.layers[index].modules())
        self._initialise_buffers(modules)
        self._decompress(modules)
        module = self.layers[index].get_submodule(module)
        routed = _RoutedExperts(self, module, by_expert, read)
        self._routed = (routed, module.register_forward_pre_hook(routed))

    def free_layer(self, index: int) -> None:
        if self._routed is not None:
            # The same module serves the next read of this layer (a model without a compressor): its hook
            # goes with this read, and its experts take their full shape and count again.
            routed, handle = self._routed
            handle.remove()
            routed.restore()
            self._routed = None
        # The layer's tensors go now, whatever holds the module (compressed-tensors binds each quantized
        # module's forward to the module: a reference cycle only the garbage collector would break).
        _release_tensors(self.layers[index], keep_computed=False)
        if self._pristine is not None:
            self.layers[index] = self._pristine
            self._pristine = None

    def _skeleton_copy(self, index: int) -> nn.Module | None:
        """A copy of decoder layer `index` as built (meta tensors), for the next read of it, where
        compressed-tensors' decompression will rewrite this one; None without a compressor. Each module's
        quantization scheme and other pydantic settings are shared with the copy rather than copied: they
        are read, never written, and copying them was most of the time a decoding step spent here."""
        if self.compressor is None:
            return None
        from pydantic import BaseModel

        layer = self.layers[index]
        shared = {
            id(value): value
            for module in layer.modules()
            for value in module.__dict__.values()
            if isinstance(value, BaseModel)
        }
        return copy.deepcopy(layer, shared)


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
        self._load(self.units.get(index, []))
        if self.device.type != "cpu":
            self.layers[index].to(self.device)

    def free_layer(self, index: int) -> None:
        # The same modules stay (their integer-path counters with them); the tensors read from the files go
        # back to meta, computed buffers (rotary frequencies) stay.
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


# A routed expert's tensor as the files store it: `…mlp.experts.<index>.<projection>…`.
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _routed_experts(layer: nn.Module, names: list[str]) -> tuple[str, dict[int, list[str]]] | None:
    """The layer's module of fused routed experts (its name in the layer) and the files' tensors of each
    expert, where the files store the experts apart and the module is one whose forward takes the tokens'
    routing (`(hidden_states, top_k_index, top_k_weights)`, as Transformers' MoE experts do); else None."""
    found = [
        (name, module)
        for name, module in layer.named_modules()
        if name.endswith("experts")
        and isinstance(getattr(module, "num_experts", None), int)
        and hasattr(module, "gate_up_proj")
    ]
    if len(found) != 1:
        return None
    name, module = found[0]
    by_expert: dict[int, list[str]] = {}
    for tensor in names:  # the layer's own tensors (`units`): an expert's carries its index after `experts.`
        match = _EXPERT.search(tensor)
        if match:
            by_expert.setdefault(int(match.group(1)), []).append(tensor)
    if len(by_expert) != module.num_experts:
        return None
    return name, by_expert


class _RoutedExperts:
    """A forward pre-hook on a layer's fused experts, for a decoding step: at each call, the experts the
    call's tokens route to that are not yet read are read from the files and converted by Transformers' own
    loading, and the module holds those experts only, in the order of their indices (a row per expert
    read, not one per expert of the model). The call's routing is renumbered to those rows and the module's
    expert count set to theirs: the forward runs each token through the same experts' weights, grouped in
    the same order, as with every expert present, and no tensor of the model's full expert count is made or
    filled. `restore` gives the module back its full shape (on the meta device) and count."""

    def __init__(
        self, loader: TransformersLayers, module: nn.Module, by_expert: dict[int, list[str]], read: list[int]
    ) -> None:
        self.loader, self.module, self.by_expert, self.read = loader, module, by_expert, read
        self.num_experts = int(module.num_experts)
        self.shapes = {k: v.shape for k, v in module.named_parameters(recurse=False)}
        self.dtypes = {k: v.dtype for k, v in module.named_parameters(recurse=False)}
        self.rows: list[int] = []  # the experts read, ascending: row i holds expert rows[i]

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        routed = args[1] if len(args) > 1 else None
        if not isinstance(routed, torch.Tensor):
            raise InputError(
                "the experts' forward did not get the tokens' routing: it cannot be read sparsely"
            )
        wanted = {int(e) for e in routed.reshape(-1).tolist() if 0 <= int(e) < self.num_experts}
        todo = sorted(wanted - set(self.rows))
        if todo:
            self._read(module, todo)
        # Expert e → its row; an index outside the model's experts (a sentinel) stays past the last row.
        table = torch.full((self.num_experts + 1,), len(self.rows), dtype=routed.dtype)
        table[torch.tensor(self.rows, dtype=torch.long)] = torch.arange(len(self.rows), dtype=routed.dtype)
        renumbered = table.to(routed.device)[routed.clamp(0, self.num_experts)]
        module.num_experts = len(self.rows)
        return (args[0], renumbered, *args[2:])

    def _read(self, module: nn.Module, todo: list[int]) -> None:
        before = {k: v for k, v in module.named_parameters(recurse=False)}
        for key in before:
            rows = torch.empty((len(todo), *self.shapes[key][1:]), device="meta", dtype=self.dtypes[key])
            setattr(module, key, nn.Parameter(rows, requires_grad=False))
        names = [n for e in todo for n in self.by_expert[e]]
        started = time.perf_counter()
        self.loader._load(names)
        self.loader.routed_read_seconds += time.perf_counter() - started
        self.read[0] += sum(self.loader.checkpoint.tensors[n].nbytes for n in names)
        if not self.rows:
            self.rows = todo
            return
        # A later call of the same read (a prompt's forward after another's) routes to more experts: the
        # rows are merged in the order of their indices.
        merged = sorted([*self.rows, *todo])
        old_at = torch.tensor([merged.index(e) for e in self.rows], dtype=torch.long)
        new_at = torch.tensor([merged.index(e) for e in todo], dtype=torch.long)
        for key, old in before.items():
            new = getattr(module, key).data
            whole = torch.empty((len(merged), *old.shape[1:]), dtype=new.dtype, device=new.device)
            whole[old_at.to(new.device)] = old.data
            whole[new_at.to(new.device)] = new
            setattr(module, key, nn.Parameter(whole, requires_grad=False))
        self.rows = merged

    def restore(self) -> None:
        """The module's full expert count, and its experts' parameters on the meta device in full shape."""
        self.module.num_experts = self.num_experts
        for key, shape in self.shapes.items():
            empty = torch.empty(shape, device="meta", dtype=self.dtypes[key])
            setattr(self.module, key, nn.Parameter(empty, requires_grad=False))


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
