"""What a streamed decoding step reads of a decoder layer, backend `hf` (`TransformersLayers` inherits it).

Each forward of a decoding reads every decoder layer again (`evalsuite.backends.streamed`). Of a MoE layer
whose experts the files store apart, only the experts the step's tokens route to are read, when the experts
are first called (`routed_experts.RoutedExperts`); what a read converts (those experts, fused; the layer's
compressed-tensors modules, decompressed) is kept across the steps within the side's budget
(`decoded_cache.DecodedCache`), so that a later step neither reads nor converts it again. The layer a step
runs is the module a loaded model holds, value for value: what the cache gives back is a copy of what the
same read converted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evalsuite.backends.decoded_cache import DecodedCache
from evalsuite.backends.routed_experts import FusedReader, RoutedExperts, fused_plan, routed_experts
from evalsuite.files.checkpoint import Checkpoint


@dataclass(frozen=True)
class RoutedLayout:
    """A layer's routed experts as the files store them: the experts module's name in the layer, each expert's
    tensors, the reader that fuses them without Transformers' loading (None: Transformers' loading reads
    them), each expert's bytes in the files, and every expert tensor's name."""

    module: str
    by_expert: dict[int, list[str]]
    reader: FusedReader | None
    file_bytes: dict[int, int]
    expert_names: frozenset[str]


class DecodingReads:
    """The decoding steps' reads of `TransformersLayers` (module docstring). It provides the loader's
    `load_layer_routed` and ends a step's read in `free_routed`; the loader provides the attributes below
    and how it reads tensors (`_load`, `_read_dtype`), keeps a layer's modules as built
    (`_remember_compressed`), initialises its buffers (`_initialise_buffers`) and decompresses its modules
    (`_decompress`)."""

    checkpoint: Checkpoint
    layers: nn.ModuleList
    prefix: str
    device: torch.device
    compressor: Any
    units: dict[Any, list[str]]
    _targets: dict[str, tuple[str, str | None]]
    _converters: dict[str, Any]

    def _start_decoding_reads(self, budget: int) -> None:
        # The routed-experts hook of the layer read for a decoding step, and its handle, until it is freed.
        self._routed: tuple[RoutedExperts, Any] | None = None
        # Wall seconds of routed experts read during decoding forwards (`RoutedExperts`), all layers.
        self.routed_read_seconds = 0.0
        # Per layer, how its routed experts are stored and read (`_routed_layout`), worked out once.
        self._layouts: dict[int, RoutedLayout | None] = {}
        # Per layer, its compressed-tensors modules (names in the layer) and their tensors in the files.
        self._compressed: dict[int, dict[str, list[str]]] = {}
        self.decoded_cache = DecodedCache(budget)

    def load_layer_routed(self, index: int, read: list[int]) -> None:
        """Decoder layer `index` as `load_layer` makes it, but for its routed experts where the files store
        each apart: those are read when the layer's experts are first called, and only the experts the call's
        tokens route to (`RoutedExperts`); and for what the cache holds of it, taken from there. Each tensor's
        bytes read are added to `read` (one element)."""
        layout = self._routed_layout(index)
        compressed = self._compressed_modules(index)
        kept = {}
        for name in compressed:
            found = self.decoded_cache.take(index, name)
            if found is not None:
                kept[name] = found
        skipped = set(layout.expert_names) if layout is not None else set()
        skipped.update(n for name in kept for n in compressed[name])
        rest = [n for n in self.units.get(index, []) if n not in skipped]
        self._remember_compressed(index)
        self._load(rest)
        read[0] += sum(self.checkpoint.tensors[n].nbytes for n in rest)
        layer = self.layers[index]
        for name, state in kept.items():
            _restore_decompressed(layer.get_submodule(name), state)
        modules = list(layer.modules())
        self._initialise_buffers(modules)
        fresh = [layer.get_submodule(name) for name in compressed if name not in kept]
        self._decompress(fresh)
        from compressed_tensors.utils import get_direct_state_dict

        for name, module in zip([n for n in compressed if n not in kept], fresh, strict=True):
            file_bytes = sum(self.checkpoint.tensors[n].nbytes for n in compressed[name])
            self.decoded_cache.keep(index, name, get_direct_state_dict(module), file_bytes)
        if layout is None:
            return
        module = layer.get_submodule(layout.module)
        if layout.reader is not None:
            read_rows = functools.partial(layout.reader.read, device=self.device)
        else:
            read_rows = functools.partial(self._read_experts, module, layout.by_expert)
        routed = RoutedExperts(module, index, read_rows, layout.file_bytes, self.decoded_cache, read)
        self._routed = (routed, module.register_forward_pre_hook(routed))

    def free_routed(self) -> None:
        """The routed-experts hook of the step's read removed, its module given back its full shape."""
        if self._routed is not None:
            # The same module serves the next read of this layer (a model without a compressor): its hook
            # goes with this read, and its experts take their full shape and count again.
            routed, handle = self._routed
            handle.remove()
            routed.restore()
            self.routed_read_seconds += routed.read_seconds
            self._routed = None

    def _compressed_modules(self, index: int) -> dict[str, list[str]]:
        """Layer `index`'s compressed-tensors modules (their names in the layer) and their files' tensors;
        empty without a compressor."""
        if index not in self._compressed:
            from compressed_tensors.quantization.utils import is_module_quantized

            layer = self.layers[index]
            modules = {} if self.compressor is None else dict(layer.named_modules())
            quantized = {n for n, m in modules.items() if n and is_module_quantized(m)}
            by_module: dict[str, list[str]] = {}
            start = f"{self.prefix}.{index}."
            for tensor in self.units.get(index, []):
                owner = self._targets[tensor][0].rpartition(".")[0].removeprefix(start)
                if owner in quantized:
                    by_module.setdefault(owner, []).append(tensor)
            self._compressed[index] = by_module
        return self._compressed[index]

    def _routed_layout(self, index: int) -> RoutedLayout | None:
        """How layer `index` stores its routed experts and how they are read: by `FusedReader` where the
        model's conversion of them is the plain one, else by Transformers' loading; None where they are not
        stored apart (the layer is read whole)."""
        if index in self._layouts:
            return self._layouts[index]
        found = routed_experts(self.layers[index], self.units.get(index, []))
        layout = None
        if found is not None:
            module, by_expert = found
            plan = fused_plan(
                self._converters,
                self._targets.__getitem__,
                self._read_dtype,
                f"{self.prefix}.{index}.{module}",
                self.layers[index].get_submodule(module),
                by_expert[min(by_expert)],
            )
            reader = None if plan is None else FusedReader(self.checkpoint, plan, by_expert)
            tensors = self.checkpoint.tensors
            file_bytes = {e: sum(tensors[n].nbytes for n in names) for e, names in by_expert.items()}
            expert_names = frozenset(n for names in by_expert.values() for n in names)
            layout = RoutedLayout(module, by_expert, reader, file_bytes, expert_names)
        self._layouts[index] = layout
        return layout

    def _read_experts(
        self, module: nn.Module, by_expert: dict[int, list[str]], experts: list[int]
    ) -> dict[str, torch.Tensor]:
        """The fused rows of `experts`, read and converted by Transformers' own loading into the module,
        which holds them after (`RoutedExperts` had kept what it held before)."""
        for key, value in list(module.named_parameters(recurse=False)):
            rows = torch.empty((len(experts), *value.shape[1:]), device="meta", dtype=value.dtype)
            setattr(module, key, nn.Parameter(rows, requires_grad=False))
        self._load([n for e in experts for n in by_expert[e]])
        return {key: value.data for key, value in module.named_parameters(recurse=False)}


def _restore_decompressed(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A compressed-tensors module given the state its decompression left (`decompress_module`: its
    parameters replaced, its status decompressed), flagged as read as Transformers flags what it sets, so
    that the model's weight initialisation leaves it alone."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.utils import replace_direct_state_dict

    replace_direct_state_dict(module, state)
    for param in module.parameters(recurse=False):
        param._is_hf_initialized = True
    module.quantization_status = QuantizationStatus.DECOMPRESSED
