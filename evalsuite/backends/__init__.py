"""Backends: how a side is executed. A backend exposes the few primitives tasks need.

`hf` runs the checkpoint through Transformers as users run it (bf16, or compressed-tensors as Transformers
executes it); `intref` is the integer W4A8 reference execution; `exl3` runs an EXL3 pack through exllamav3
on CUDA, or anywhere as its Transformers model with the EXL3 weights decoded; `llamacpp` runs a GGUF file's
decoder through llama.cpp (xllamacpp), never streamed. The first three also run streamed,
one decoder layer resident at a time, for a model larger than memory (`streamed`; `memory` decides when).
Backends are loaded by the runner for one side at a time and closed before another loads. Before anything
loads, `check_load_plan` decides from the files whether a backend can load a checkpoint (a checkpoint
Transformers would fill with random weights is refused then, not after the reference's hour-long
observation).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from evalsuite.backends.load_lock import MODEL_LOADS
from evalsuite.backends.options import BACKEND_NAMES, DECODED_FORMATS, RUNTIME_BACKENDS, BackendOptions

if TYPE_CHECKING:
    import numpy as np
    import torch

    from evalsuite.backends.chunked_head import ScoredStates
    from evalsuite.backends.streamed import StreamedPair
    from evalsuite.files.checkpoint import Checkpoint


class Backend(Protocol):
    """The primitives a task may ask of a loaded model."""

    vocab_size: int
    tokenizer: Any

    def window_logits(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """For each row of `windows` (token ids, one sequence per row), in order, the logits at `positions`:
        shape (len(positions), vocab), the model's output dtype. Row i scores the token at `positions[i] + 1`
        given the tokens up to `positions[i]`."""
        ...

    def generate_greedy(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, top_k: int = 5, full_steps: int = 0
    ) -> Generation:
        """Greedy decoding of one prompt with the top-k log-probs of every step."""
        ...

    def image_features(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The vision tower and merger's output for the visual inputs (images, then video frames), float32,
        one row per visual token; inputs that are not tensors are model settings (`downsample_mode`)."""
        ...

    def describe(self) -> dict[str, Any]:
        """How this side actually ran (the execution path, what ran in integers): kept in its observations."""
        ...

    def close(self) -> None:
        """Free the model (and the accelerator memory it holds)."""
        ...


@runtime_checkable
class ChunkedHead(Protocol):
    """Optional capability: the final hidden states at the scored positions, with the head to apply to a chunk
    of them at a time, so that a long window never holds its [positions × vocabulary] logits at once. `hf`,
    `intref` and their streamed forms have it; check with `isinstance` once loaded."""

    def window_scored_states(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[ScoredStates]:
        """For each row of `windows`, in order, its final hidden states at `positions` (`ScoredStates`):
        `chunks(rows)` gives the same logits as `window_logits`, `rows` positions at a time."""
        ...


@runtime_checkable
class HFModelAccess(Protocol):
    """Optional capability: the loaded Transformers model and its tokenizer, for a field tool that drives the
    model itself (lm-eval's `HFLM`). `hf` and `intref` have it; check with `isinstance` once loaded, or with
    `exposes_model(name)` before anything loads."""

    model: Any
    tokenizer: Any


# The backends whose loaded form is an `HFModelAccess`: known by name, so that a task that needs the raw model
# on a backend without one is skipped before any model loads.
# `exl3` on its decoded path (the only one on a CPU) is a Transformers model; its exllamav3 path is not, and
# a task that needs the model refuses it once it is loaded (`isinstance(backend, HFModelAccess)`).
MODEL_ACCESS_BACKENDS = frozenset({"hf", "intref", "exl3"})


def exposes_model(backend: str) -> bool:
    """Whether the backend named `backend` hands tasks its Transformers model and tokenizer."""
    return backend in MODEL_ACCESS_BACKENDS


class Generation(Protocol):
    """A greedy generation: the new tokens, per step the top-k ids and log-probs, and optionally the full
    log-prob rows of the first steps."""

    tokens: list[int]
    top_ids: np.ndarray  # (steps, k) int64
    top_logp: np.ndarray  # (steps, k) float32
    full_logp: np.ndarray  # (min(full_steps, steps), vocab) float32


def load_backend(checkpoint: Checkpoint, options: BackendOptions) -> Backend:
    """Load `checkpoint` with the backend `options.backend` names (options already checked); streamed, one
    decoder layer resident at a time, when `options.stream`. One load at a time in the process
    (`MODEL_LOADS`)."""
    with MODEL_LOADS:
        return _load_backend(checkpoint, options)


def _load_backend(checkpoint: Checkpoint, options: BackendOptions) -> Backend:
    if options.stream and options.backend in BACKEND_NAMES:
        from evalsuite.backends.streamed import StreamedBackend

        return StreamedBackend(checkpoint, options)
    if options.backend == "hf" and checkpoint.format in DECODED_FORMATS:
        from evalsuite.backends.decoded import DecodedBackend

        return DecodedBackend(checkpoint, options)
    if options.backend == "hf":
        from evalsuite.backends.hf import HFBackend

        return HFBackend(checkpoint, options)
    if options.backend == "intref":
        from evalsuite.backends.intref import IntrefBackend

        return IntrefBackend(checkpoint, options)
    if options.backend == "exl3":
        from evalsuite.backends.exl3 import load_exl3_backend

        return load_exl3_backend(checkpoint, options)
    if options.backend == "llamacpp":
        from evalsuite.backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend(checkpoint, options)
    options.check()  # raises for an unknown backend
    raise AssertionError(options.backend)


def load_pair(
    ref: Checkpoint, ref_options: BackendOptions, ckpt: Checkpoint, ckpt_options: BackendOptions
) -> StreamedPair:
    """Both sides streamed, for an observation that runs a layer of each in lockstep (`Need` role `pair`)."""
    from evalsuite.backends.streamed import StreamedBackend, StreamedPair

    with MODEL_LOADS:
        reference = StreamedBackend(ref, ref_options)
        try:
            return StreamedPair(ref=reference, ckpt=StreamedBackend(ckpt, ckpt_options))
        except BaseException:
            reference.close()
            raise


def check_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, from the files alone, a checkpoint the backend could not load faithfully (InputError). A
    check that builds the model on the meta device is a load (`MODEL_LOADS`)."""
    with MODEL_LOADS:
        _check_load_plan(checkpoint, options)


def check_load_internals(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse a load whose library internals are not there (DependencyError): the part of `check_load_plan`
    that depends on the installed libraries, not on the files. None for a format's own runtime (llamacpp)."""
    from evalsuite.backends.transformers_internals import check_internals

    if options.backend not in RUNTIME_BACKENDS:
        check_internals(options, checkpoint.format)


def _check_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    if checkpoint.gguf_file is not None:
        from evalsuite.formats.gguf import read_gguf

        # Transformers reads a GGUF file's tensor table with its own reader, which holds it to no layout:
        # the file is refused here, for every backend, where llama.cpp would refuse it (formats.gguf).
        read_gguf(checkpoint.gguf_file)
    if options.backend == "llamacpp":
        from evalsuite.backends.llamacpp import check_llamacpp_load_plan

        check_llamacpp_load_plan(checkpoint, options)
        return
    check_load_internals(checkpoint, options)
    if checkpoint.format in DECODED_FORMATS and options.backend != "intref":
        from evalsuite.backends.decoded import check_decoded_load_plan

        check_decoded_load_plan(checkpoint, options)
        return
    if options.stream and options.backend in BACKEND_NAMES:
        from evalsuite.backends.streamed import check_streamed_load_plan

        check_streamed_load_plan(checkpoint, options)
    elif options.backend == "hf":
        from evalsuite.backends.hf import check_hf_load_plan

        check_hf_load_plan(checkpoint, options)
    elif options.backend == "intref":
        from evalsuite.backends.intref import check_intref_load_plan

        check_intref_load_plan(checkpoint, options)
    elif options.backend == "exl3":
        from evalsuite.backends.exl3 import check_exl3_load_plan

        check_exl3_load_plan(checkpoint, options)
