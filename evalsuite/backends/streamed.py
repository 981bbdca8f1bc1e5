"""Streamed execution: a model larger than memory, run one decoder layer at a time.

The model is Transformers' own, built on the meta device: no weight is in memory until it is needed. The text
path outside the decoder layers (embeddings, final norm, head) is materialised once, as one unit; a vision
tower and its projector at the first image (`stream_units`), set aside again while only text runs; each
decoder layer is materialised from the safetensors files (only its own tensors, read through
`Checkpoint.open_tensors`), every window's hidden states are pushed through it, and it is freed before the
next one is read. On CUDA the layer is materialised on the device and the hidden states stay there.

How the windows go through, with nothing but Transformers' own code computing:

1. **capture**: the model's own forward runs on each window with every decoder layer replaced by a recorder,
   which keeps the hidden states the first layer receives (the embeddings, after whatever the model does to
   them) and the arguments the forward hands each layer: its attention mask (hybrid models build one per layer
   type), rotary position embeddings, position ids and the rest. This is the "catcher" of GPTQ
   implementations and of llm-compressor's sequential pipeline, applied to every layer rather than the first.
   The last recorder stops the forward.
2. **layers**: layer by layer, each window's hidden states go through the real layer with the arguments
   recorded for it (`forward_layer`).
3. **head**: the model's own forward runs once more with every layer replaced by a stand-in that hands back
   the last layer's output: the final norm, the head on the scored positions only (`logits_to_keep`) and
   whatever the model does after it run as in a loaded run (`head_logits`); or, for long windows, the
   head left out and applied a chunk of positions at a time (`head_states`, see `chunked_head`).

Materialising a layer, backend `hf`: the layer's file tensors go through Transformers' own loading function
(`convert_and_load_state_dict_in_model`) with the model's own weight conversions (routed experts fused into
3-D tensors from per-expert files, a compressed-tensors expert dequantized on the way) and its quantizer;
non-persistent buffers are computed by the model's own `_init_weights`, as `from_pretrained` does; and each
compressed-tensors module is decompressed by compressed-tensors' `decompress_module`, the very function its
first-forward hook applies to every module of a loaded model. The layer is then the module a loaded model
holds, so a streamed run is bit-identical to a loaded one: the same functions on the same tensors (checked on
both fixture pairs, bf16 and W4A8). Backend `intref`: the integer skeleton (`IntegerSkeleton`) loads the
layer's tensors by name, as it loads a whole model.

Transformers' loading internals used here (`convert_and_load_state_dict_in_model`, `LoadStateDictConfig`,
`get_model_conversion_mapping`, `rename_source_key`, `_get_dtype_plan`, `initialize_weights`) are those of the
5.x series the project pins.

Backend `exl3`: the pack's Transformers model from `DecodedSkeleton`, each unit's EXL3 Linears decoded on the
CPU when it is materialised, as a whole load decodes them (`DecodedExl3Layers`).

Generation (`generate_greedy_batch`): the model's own `generate`, each decoder layer read from the files for
each of its forwards, one per new token for a whole batch of prompts (`evalsuite.backends.greedy`); with
drafting (`generate_drafted`), one per verification round of one prompt (`evalsuite.backends.drafting`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from evalsuite.backends.c_heap import release_freed_memory
from evalsuite.backends.chunked_head import ScoredStates, head_input_kept, scored_states
from evalsuite.backends.drafting import Drafting, drafted_greedy
from evalsuite.backends.greedy import Generation, greedy_batch
from evalsuite.backends.hf import (
    hf_execution,
    image_features,
)
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed_layers import TransformersLayers, decoder_layers, layer_loader
from evalsuite.backends.token_chunks import mlp_in_chunks
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint

# Names of streamed_layers that callers have always imported (or patched) here.
__all__ = [
    "StreamedBackend",
    "StreamedPair",
    "TransformersLayers",
    "WindowCall",
    "check_streamed_load_plan",
    "decoder_layers",
]

# What replaces a decoder layer's output on a window (`window_scored_states`): (states, call, layer index).
AfterLayer = Callable[[torch.Tensor, "WindowCall", int], torch.Tensor]


@dataclass
class WindowCall:
    """One window as the model's own forward hands it to its decoder layers: the token ids, the first
    layer's input, and each layer's other arguments (positional after the hidden states, and keyword)."""

    window: torch.Tensor
    hidden: torch.Tensor | None = None
    layer_args: list[tuple[tuple, dict[str, Any]] | None] = field(default_factory=list)


class _StopForward(Exception):
    """Raised by the last recorder: the capture needs nothing past the decoder layers."""


class _StandIn(nn.Module):
    """Takes a decoder layer's place during the model's own forward. Attribute reads it does not answer go to
    the layer it replaces (a forward may read, e.g., a layer's attention type to pick its mask)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.__dict__["_replaced"] = layer  # not a child: the stand-in owns no parameters

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_replaced"], name)


class _Recorder(_StandIn):
    def __init__(self, layer: nn.Module, index: int, call: WindowCall, last: bool) -> None:
        super().__init__(layer)
        self.index, self.call, self.last = index, call, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.index == 0:
            self.call.hidden = hidden_states
        self.call.layer_args[self.index] = (args, kwargs)
        if self.last:
            raise _StopForward
        return hidden_states


class _Replay(_StandIn):
    def __init__(self, layer: nn.Module, output: Any) -> None:
        super().__init__(layer)
        self.output = output

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return hidden_states if self.output is None else self.output


class _ReadPerCall(_StandIn):
    """Stands for decoder layer `index` during the model's own forward (its `generate`), materialising the
    layer from the files for each call, then freeing it: a forward reads each layer once."""

    def __init__(self, layer: nn.Module, index: int, backend: StreamedBackend) -> None:
        super().__init__(layer)
        self.__dict__["_backend"] = backend
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        backend, index = self.__dict__["_backend"], self.index
        if index == 0:
            backend.generation_forwards += 1
            # The model merged its images' features before its first decoder layer, and a decoding's later
            # forwards take no images: the tower is not run again in this decoding.
            backend.set_aside_vision()
        # The loader materialises the module the model holds at this place: the layer itself, for the call.
        backend.layers[index] = self.__dict__["_replaced"]
        try:
            with backend.resident(index, routed=True) as layer, torch.inference_mode():
                return layer(hidden_states, *args, **kwargs)
        finally:
            # Freeing may have put a fresh skeleton in the layer's place (`TransformersLayers.free_layer`).
            self.__dict__["_replaced"] = backend.layers[index]
            backend.layers[index] = self


@contextlib.contextmanager
def _decoding_as_loaded(model: nn.Module, device: torch.device) -> Iterator[None]:
    """The decoding steps of `generate` run the MoE experts' implementation a loaded model on `device` runs.

    Transformers switches a model's experts from `grouped_mm` to `batched_mm` for the decoding steps unless
    the model is on the CPU, and asks the model's first parameter where it is: a streamed model's is often
    still on the meta device (a vision tower read at the first image), so on the CPU it switched where a
    loaded model does not. `batched_mm` gathers each routed expert's weights once per token (1.5 GB a layer
    for a step of 32 prompts at MiniCPM-V 4.7's widths) and need not give `grouped_mm`'s bits. On the CPU
    the switch is left out, as it is for a loaded model; elsewhere both switch."""
    if device.type != "cpu":
        yield
        return
    # An instance attribute shadows the method for this model alone (`transformers_internals` checks it).
    model._optimize_model_for_decode = contextlib.nullcontext
    try:
        yield
    finally:
        del model._optimize_model_for_decode


class StreamedBackend:
    """A side executed one decoder layer at a time (module docstring), by backend `hf`, `intref` or `exl3`.

    Besides the `Backend` primitives that teacher-forced tasks use (`window_logits`), it exposes the steps,
    for tasks that look inside the model (`layers`, `attribution`): `capture` a window, hold a layer
    `resident`, `forward_layer` hidden states through it, and `head_logits` of the last layer's output.
    """

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        self.checkpoint = checkpoint
        self.options = options
        self.loader = layer_loader(checkpoint, options)
        self.model = self.loader.model
        self.model.eval()
        self.layers, self.prefix = self.loader.layers, self.loader.prefix
        self.device = self.loader.device
        with contextlib.redirect_stderr(io.StringIO()):
            self.loader.load_rest()
        self._vision_loaded = False
        self._tuple_output = False
        output_embeddings = self.model.get_output_embeddings()
        text_config = self.model.config.get_text_config()
        self.vocab_size = (
            int(output_embeddings.weight.shape[0])
            if output_embeddings is not None
            else int(text_config.vocab_size)
        )
        # Decoder layers read from the files so far: a run shows that its observations shared their passes.
        self.layer_loads = 0
        # Forwards of a decoding (`generate_greedy_batch`), each reading every layer once, and the bytes read.
        self.generation_forwards = 0
        self.generation_bytes = 0
        self.bytes_read = 0
        # Wall seconds spent reading decoder layers from the files (and materialising them: conversion,
        # decompression), routed experts read during a decoding's forwards included.
        self.layer_read_seconds = 0.0
        units = getattr(self.loader, "units", {})
        self.layer_bytes = [
            sum(checkpoint.tensors[n].nbytes for n in units.get(i, ()) if n in checkpoint.tensors)
            for i in range(self.n_layers)
        ]

    @property
    def decoded_cache(self) -> Any:
        """The converted weights kept across a decoding's steps (`decoded_cache.DecodedCache`), where the
        loader keeps them (backend `hf`); else None."""
        return getattr(self.loader, "decoded_cache", None)

    @property
    def n_layers(self) -> int:
        """How many decoder layers the model has."""
        return len(self.layers)

    def layer_kinds(self) -> list[str]:
        """A short description of each decoder layer: the config's layer type (`full_attention`,
        `linear_attention`…) where the config names them, the layer's class otherwise."""
        types = getattr(self.model.config.get_text_config(), "layer_types", None)
        if isinstance(types, list) and len(types) == self.n_layers:
            return [str(t) for t in types]
        return [type(layer).__name__ for layer in self.layers]

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, loaded when a task first asks (window logits never do: the windows
        come tokenized)."""
        return self.checkpoint.load_tokenizer(trust_remote_code=self.options.trust_remote_code)

    def describe(self) -> dict[str, Any]:
        """How this side ran: its backend's execution, streamed layer by layer."""
        if self.options.backend == "intref":
            from evalsuite.backends.intref import integer_execution

            doc = integer_execution(self.model, self.loader.skeleton.activations, self.checkpoint)
        elif self.options.backend == "exl3":
            from evalsuite.backends.exl3 import decoded_execution

            doc = decoded_execution(self.loader.skeleton.summary(), self.model, self.checkpoint)
        else:
            doc = {
                "backend": "hf",
                "execution": hf_execution(type(self.model).__name__, self.options),
                "format": self.checkpoint.format,
            }
        doc["execution"] += ", streamed one decoder layer at a time"
        doc["streamed"] = True
        return doc

    @contextlib.contextmanager
    def _standing_in(self, make: Callable[[int, nn.Module], nn.Module]) -> Iterator[None]:
        real = list(self.layers)
        for i, layer in enumerate(real):
            self.layers[i] = make(i, layer)
        try:
            yield
        finally:
            for i, layer in enumerate(real):
                self.layers[i] = layer

    def capture(self, window: torch.Tensor) -> WindowCall:
        """Run the model's own forward on one window (token ids) up to its decoder layers, recording what it
        hands each of them."""
        return self._capture(window, {"input_ids": window.reshape(1, -1)})

    def capture_inputs(self, inputs: dict[str, Any]) -> WindowCall:
        """`capture` of a sequence the model takes with other inputs than its token ids (a question about an
        image, processed): the vision tower read first, the model's own forward merging its features."""
        self._load_vision()
        return self._capture(inputs["input_ids"].reshape(-1), inputs)

    def _capture(self, window: torch.Tensor, inputs: dict[str, Any]) -> WindowCall:
        call = WindowCall(window=window, layer_args=[None] * self.n_layers)
        model_inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        last = self.n_layers - 1
        with (
            self._standing_in(lambda i, layer: _Recorder(layer, i, call, i == last)),
            torch.inference_mode(),
            contextlib.suppress(_StopForward),
        ):
            self.model(**model_inputs, use_cache=False)
        if call.hidden is None or any(args is None for args in call.layer_args):
            raise InputError(
                f"the forward of {type(self.model).__name__} did not call each of its decoder layers once: "
                "streamed execution cannot run this model",
                self.checkpoint.path,
            )
        return call

    @contextlib.contextmanager
    def resident(self, index: int, routed: bool = False) -> Iterator[nn.Module]:
        """Decoder layer `index` materialised from the files for the duration of the block, then freed.
        `routed`: of its routed experts only those its tokens route to, where the loader can (a decoding
        step's few tokens route to few experts: `TransformersLayers.load_layer_routed`)."""
        read = [0]
        started = time.perf_counter()
        routed_before = getattr(self.loader, "routed_read_seconds", 0.0)
        with contextlib.redirect_stderr(io.StringIO()):
            if routed and hasattr(self.loader, "load_layer_routed"):
                self.loader.load_layer_routed(index, read)
            else:
                self.loader.load_layer(index)
                read[0] = self.layer_bytes[index]
        self.layer_read_seconds += time.perf_counter() - started
        self.layer_loads += 1
        try:
            yield self.layers[index]
        finally:
            # What the block read, routed experts included (they are read during the forward).
            self.bytes_read += read[0]
            if routed:
                self.generation_bytes += read[0]
            self.loader.free_layer(index)
            self.layer_read_seconds += getattr(self.loader, "routed_read_seconds", 0.0) - routed_before
            release_freed_memory()

    def forward_layer(
        self, layer: nn.Module, index: int, hidden: torch.Tensor, call: WindowCall
    ) -> torch.Tensor:
        """One window's hidden states through `layer` (decoder layer `index`, or a module standing for it)
        with the arguments the model's forward gives layer `index`."""
        args, kwargs = call.layer_args[index]
        with torch.inference_mode():
            out = layer(hidden, *args, **kwargs)
        if isinstance(out, tuple):  # older layer classes return (hidden_states, …)
            self._tuple_output = True
            out = out[0]
        return out

    def head_logits(self, hidden: torch.Tensor, call: WindowCall, positions: torch.Tensor) -> torch.Tensor:
        """The logits at `positions` of one window whose last decoder layer output `hidden`: the model's own
        forward after its layers (final norm, head on the kept positions), shape (len(positions), vocab)."""
        output = (hidden,) if self._tuple_output else hidden
        ids = call.window.reshape(1, -1).to(self.device)
        keep = positions.to(self.device)
        with (
            self._standing_in(lambda i, layer: _Replay(layer, output if i == 0 else None)),
            torch.inference_mode(),
        ):
            return self.model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[0]

    @property
    def logits_dtype(self) -> str:
        """The dtype the model's head computes its logits in."""
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        dtype = getattr(weight, "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else self.options.dtype

    def sequence_logits(self, inputs: dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
        """One sequence through every layer, the logits at `positions` (`sequences_logits`)."""
        return self.sequences_logits([(inputs, positions)])[0]

    def sequences_logits(self, items: Sequence[tuple[dict[str, Any], torch.Tensor]]) -> list[torch.Tensor]:
        """Sequences (their inputs, the positions to score) through every layer in one pass, each layer read
        once for all of them; the logits at each one's positions. (A task that runs many sequences beside
        other observations rides the shared pass instead, `evalsuite.backends.layer_pass`.)"""
        # A sequence with inputs beside its ids and mask (an image) is captured through them.
        calls = [
            self.capture_inputs(inputs) if len(inputs) > 2 else self.capture(inputs["input_ids"].reshape(-1))
            for inputs, _ in items
        ]
        self.set_aside_vision()  # the captures merged the images' features; the layers never run the tower
        states = [call.hidden for call in calls]
        for index in range(self.n_layers):
            with self.resident(index) as layer:
                states = [self.forward_layer(layer, index, h, c) for h, c in zip(states, calls, strict=True)]
        return [self.head_logits(h, c, p) for h, c, (_, p) in zip(states, calls, items, strict=True)]

    def window_logits(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """The `Backend` primitive: every window through every layer, one layer resident at a time; the logits
        come once the last layer has run."""
        for hidden, call in self._final_states(windows):
            yield self.head_logits(hidden, call, positions)

    def _final_states(
        self, windows: torch.Tensor, after_layer: AfterLayer | None = None
    ) -> list[tuple[torch.Tensor, WindowCall]]:
        calls = [self.capture(window) for window in windows]
        states = [call.hidden for call in calls]
        for index in range(self.n_layers):
            # As a loaded model runs a long window (`HFBackend`): the MLP a chunk of positions at a time.
            with self.resident(index) as layer, mlp_in_chunks(layer, length=int(windows.shape[-1])):
                states = [self.forward_layer(layer, index, h, c) for h, c in zip(states, calls, strict=True)]
            if after_layer is not None:
                states = [after_layer(h, c, index) for h, c in zip(states, calls, strict=True)]
        return list(zip(states, calls, strict=True))

    def head_states(self, hidden: torch.Tensor, call: WindowCall, positions: torch.Tensor) -> ScoredStates:
        """What `head_logits` computes, stopped at the head: the final hidden states at `positions` (the
        model's own final norm applied), with the head to apply to a few rows at a time."""
        output = (hidden,) if self._tuple_output else hidden
        ids = call.window.reshape(1, -1).to(self.device)
        keep = positions.to(self.device)
        head = self.model.get_output_embeddings()
        with (
            self._standing_in(lambda i, layer: _Replay(layer, output if i == 0 else None)),
            head_input_kept(self.model) as stand_in,
            torch.inference_mode(),
        ):
            self.model(input_ids=ids, logits_to_keep=keep, use_cache=False)
        return scored_states(self.model, stand_in, head, self._forward_one_token)

    def _forward_one_token(self) -> torch.Tensor:
        """The model's forward on one token, its layers standing in (none is resident here), its `.logits`:
        what `after_head_of` hands the head's rows through."""
        width = int(self.model.config.get_text_config().hidden_size)
        hidden = torch.zeros((1, 1, width), dtype=getattr(torch, self.options.dtype), device=self.device)
        output = (hidden,) if self._tuple_output else hidden
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with self._standing_in(lambda i, layer: _Replay(layer, output if i == 0 else None)):
            return self.model(input_ids=one, use_cache=False).logits

    def window_scored_states(
        self, windows: torch.Tensor, positions: torch.Tensor, after_layer: AfterLayer | None = None
    ) -> Iterator[ScoredStates]:
        """The chunked-head primitive (`ChunkedHead`): every window through every layer, one layer resident
        at a time, then each window's final hidden states at `positions`. `after_layer(states, call, index)`
        replaces each layer's output (the noise floor's perturbation)."""
        for hidden, call in self._final_states(windows, after_layer):
            yield self.head_states(hidden, call, positions)

    def generate_greedy(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, top_k: int = 5, full_steps: int = 0
    ) -> Generation:
        """Greedy decoding of one prompt (`generate_greedy_batch`)."""
        return self.generate_greedy_batch([inputs], [max_new_tokens], top_k, full_steps)[0]

    def generate_greedy_batch(
        self,
        prompts: Sequence[dict[str, Any]],
        max_new_tokens: Sequence[int],
        top_k: int = 5,
        full_steps: int = 0,
    ) -> list[Generation]:
        """Greedy decoding of `prompts` as one batch by the model's own `generate` (`greedy.greedy_batch`),
        each decoder layer materialised from the files for each forward and freed after it: the prompts'
        first forward, then one per new token for the whole batch, each reading every layer once (counted in
        `layer_loads`). The caches (attention's keys and values, a linear-attention layer's recurrent and
        convolution states) are Transformers' own, kept between forwards as in a loaded model's generation;
        the layer is the module a loaded model holds, so the answers are a loaded run's of the same batch."""
        with self._reading_per_forward(prompts):
            return greedy_batch(self.model, self.device, prompts, max_new_tokens, top_k, full_steps)

    def generate_drafted(
        self, inputs: dict[str, Any], max_new_tokens: int, drafting: Drafting, top_k: int = 5
    ) -> Generation:
        """Greedy decoding of one prompt with drafting, by Transformers' assisted generation
        (`drafting.drafted_greedy`), each decoder layer read from the files for each of the target's
        forwards as in `generate_greedy_batch`: a verification round reads every layer once, whatever the
        number of drafted tokens it verifies. A draft model runs loaded beside it. Timed on a GPU."""
        timed = self.device.type == "cuda"
        with self._reading_per_forward([inputs]):
            return drafted_greedy(self.model, self.device, inputs, max_new_tokens, drafting, top_k, timed)

    @contextlib.contextmanager
    def _reading_per_forward(self, prompts: Sequence[dict[str, Any]]) -> Iterator[None]:
        """The model's own `generate` with each decoder layer materialised from the files for each forward
        and freed after it (`_ReadPerCall`), the vision tower read first where a prompt has an image."""
        if any("pixel_values" in p or any("video" in k for k in p) for p in prompts):
            self._load_vision()  # set aside again at the first decoder layer (`_ReadPerCall`)
        real = list(self.layers)
        for index, layer in enumerate(real):
            self.layers[index] = _ReadPerCall(layer, index, self)
        try:
            with _decoding_as_loaded(self.model, self.device):
                yield
        finally:
            for index in range(self.n_layers):
                stand_in = self.layers[index]
                if isinstance(stand_in, _ReadPerCall):
                    self.layers[index] = stand_in.__dict__["_replaced"]

    def image_features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The vision tower and merger's output: read at the first image, resident until set aside."""
        self._load_vision()
        return image_features(self.model, self.device, inputs, self.checkpoint)

    def _load_vision(self) -> None:
        if not self._vision_loaded:
            with contextlib.redirect_stderr(io.StringIO()):
                self.loader.load_vision()
            self._vision_loaded = True

    def set_aside_vision(self) -> None:
        """Free the vision tower while only text runs (the decoder layers of a pass or of `sequences_logits`,
        once the sequences are captured; a decoding, once its first forward has merged the images'
        features), to be read again at the next image. At the seed's shape it is as large as a decoder
        layer, and a W4A8 candidate's layers, where a streamed run peaks, are held decompressed beside it.
        A loader that cannot read it again keeps it."""
        free = getattr(self.loader, "free_vision", None)
        if self._vision_loaded and callable(free) and free():
            self._vision_loaded = False
            release_freed_memory()

    def close(self) -> None:
        del self.model, self.layers, self.loader
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass
class StreamedPair:
    """Both sides streamed in lockstep, for an observation that needs a layer of each at once (one layer of
    each side resident at a time)."""

    ref: StreamedBackend
    ckpt: StreamedBackend

    def describe(self) -> dict[str, Any]:
        return {"ref": self.ref.describe(), "ckpt": self.ckpt.describe()}

    def close(self) -> None:
        self.ref.close()
        self.ckpt.close()


def check_streamed_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, from the files and the skeleton alone, a side that cannot be streamed: a model whose decoder
    layers cannot be found, a layer whose tensors the files lack, anything a whole load would refuse."""
    if options.backend == "exl3":
        from evalsuite.backends.exl3 import check_exl3_load_plan

        check_exl3_load_plan(checkpoint, options)  # the pack's own claims, as for a whole load
    layer_loader(checkpoint, options)
