"""Backend `hf`: the checkpoint run by Transformers, the way its users run it."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import io
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from evalsuite.backends.c_heap import heap_kept_while_loading
from evalsuite.backends.chunked_head import ScoredStates, head_input_kept, scored_states
from evalsuite.backends.drafting import Drafting, drafted_greedy
from evalsuite.backends.greedy import Generation, greedy_batch
from evalsuite.backends.intref_plan import DYNAMIC_INT8_PER_TOKEN
from evalsuite.backends.load_lock import MODEL_LOADS, tensors_read_when_converted
from evalsuite.backends.options import (
    ADD_ACTIVATION_QUANTIZATION,
    DECODED_FORMATS,
    DTYPE_NAMES,
    BackendOptions,
)
from evalsuite.backends.packed_zero_points import zero_points_packed_on_meta
from evalsuite.backends.skeleton import set_generation_config
from evalsuite.backends.token_chunks import mlp_in_chunks
from evalsuite.errors import (
    DependencyError,
    InputError,
    ResourceError,
    is_out_of_memory,
    out_of_memory_line,
)
from evalsuite.files.checkpoint import Checkpoint

DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


def _model_class(config: Any) -> type:
    """Image-text-to-text where Transformers registers the architecture as such, causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", None):
        return AutoModelForCausalLM
    raise InputError(
        f"model type {config.model_type!r} is neither a causal LM nor an image-text-to-text model"
    )


def _device_map(device: str) -> str | None:
    # Options are checked before anything loads (BackendOptions.check): cpu, cuda, cuda:N or auto.
    return None if device == "cpu" else device


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a one-line error
    quotes of a library's multi-line complaint.

    Args:
        exc: the exception.
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def meta_model(config: Any, dtype: torch.dtype, checkpoint: Checkpoint, buffers: bool = True) -> Any:
    """The model of `config` built by Transformers with its parameters on the meta device (buffers such as
    RoPE's are computed), without its quantization config: for a backend that fills the weights itself.

    `buffers=False` puts the buffers on the meta device too: a skeleton of module names and classes only,
    which Transformers then builds without running its weight initialisation (0.05 s against 0.22 s for the
    3 GB MiniCPM-V fixture). One build at a time in the process (`load_lock`)."""
    with MODEL_LOADS:
        return _meta_model(config, dtype, checkpoint, buffers)


def _meta_model(config: Any, dtype: torch.dtype, checkpoint: Checkpoint, buffers: bool) -> Any:
    from accelerate import init_empty_weights
    from transformers.utils import logging as hf_logging

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cls = _model_class(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        device = contextlib.nullcontext() if buffers else torch.device("meta")
        with (
            init_empty_weights(include_buffers=False),
            device,
            contextlib.redirect_stderr(io.StringIO()),
        ):
            return cls.from_config(config, dtype=dtype, trust_remote_code=False)
    except Exception as exc:
        raise InputError(
            f"Transformers cannot build the model from its config: {first_line(exc)}", checkpoint.path
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)


def transformers_config(checkpoint: Checkpoint, options: BackendOptions) -> tuple[Any, dict[str, Any]]:
    """The checkpoint's Transformers config, and the keyword arguments every `from_pretrained` needs."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
    if checkpoint.format == "gguf":
        from transformers import GgufConfig

        kwargs["gguf_file"] = checkpoint.gguf_file.name
        kwargs["quantization_config"] = GgufConfig(gguf_file=checkpoint.gguf_file.name, dequantize=True)
    try:
        config = AutoConfig.from_pretrained(str(checkpoint.path), **kwargs)
    except Exception as exc:
        raise InputError(f"Transformers cannot read the config: {first_line(exc)}", checkpoint.path) from None
    if checkpoint.format == "gguf":
        # A GGUF file's config is parsed from its whole key-value table, the vocabulary included (seconds for
        # a large one): `from_pretrained` takes this one rather than parsing the file again.
        kwargs["config"] = config
    # A pack run from its decoded weights has it added on the decoded modules (`backends.decoded`).
    if options.convention_map.get(ADD_ACTIVATION_QUANTIZATION) and checkpoint.format not in DECODED_FORMATS:
        config.quantization_config = with_activation_quantization(
            getattr(config, "quantization_config", None), checkpoint
        )
        kwargs["config"] = config  # from_pretrained would read the files' config again otherwise
    return config, kwargs


def with_activation_quantization(qc: Any, checkpoint: Checkpoint) -> dict[str, Any]:
    """A copy of a compressed-tensors quantization config whose weight-only groups quantize their input
    activations dynamically per token in INT8 (`DYNAMIC_INT8_PER_TOKEN`); the checkpoint is not touched."""
    import copy

    if not isinstance(qc, dict) or not isinstance(qc.get("config_groups"), dict):
        raise InputError(
            "activation quantization can only be added to a compressed-tensors config with config_groups",
            checkpoint.path,
        )
    qc = copy.deepcopy(qc)
    for group in qc["config_groups"].values():
        if isinstance(group, dict) and not group.get("input_activations"):
            group["input_activations"] = dict(DYNAMIC_INT8_PER_TOKEN)
    return qc


def refuse_partial_load(checkpoint: Checkpoint, info: dict[str, Any]) -> None:
    """Missing weights would be initialised at random and the forward would still run: refuse that, from
    Transformers' own load report (`output_loading_info`)."""
    problems = []
    for kind in ("missing_keys", "unexpected_keys"):
        keys = sorted(info.get(kind) or ())
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            problems.append(f"{len(keys)} {kind.replace('_', ' ')} ({shown})")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, stored, expected = mismatched[0]
        problems.append(f"{len(mismatched)} shape mismatches ({name}: {tuple(stored)} vs {tuple(expected)})")
    if info.get("error_msgs"):
        problems.append(f"load errors ({first_line(Exception(info['error_msgs'][0]))})")
    if problems:
        raise InputError(
            "Transformers would load this checkpoint with randomly initialised weights: "
            + "; ".join(problems),
            checkpoint.path,
        )


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Transformers' load report and progress bars, and compressed-tensors' tqdm bars and log lines, off:
    evalsuite shows its own progress and turns the load report into an error."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        # compressed-tensors draws tqdm bars with an explicit disable=False, which no setting reaches.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def assisted_generation_refusal(checkpoint: Checkpoint, options: BackendOptions) -> str | None:
    """Why Transformers would refuse to draft for this checkpoint's model, from its config alone (None: it
    would not, or its class is only reached by remote code, which says so when it runs): assisted generation
    must roll the cache back past a rejected draft, which a stateful model's recurrent state (a linear-
    attention layer's) cannot do."""
    config, _ = transformers_config(checkpoint, options)
    cls = _registered_class(_model_class(config), config)
    if cls is not None and getattr(cls, "_is_stateful", False):
        return (
            f"Transformers' assisted generation refuses {cls.__name__}, a stateful model (its recurrent "
            "layers cannot roll back a rejected draft)"
        )
    return None


def from_pretrained(
    checkpoint: Checkpoint, options: BackendOptions, config: Any, kwargs: dict[str, Any], device_map: Any
) -> Any:
    """`from_pretrained` by the config's model class, with the load report checked (no random weights)."""
    model, info = from_pretrained_with_report(checkpoint, options, config, kwargs, device_map)
    refuse_partial_load(checkpoint, info)
    return model


def _registered_class(auto_class: type, config: Any) -> type | None:
    """The model class an Auto class maps this config to, None for one it reaches only by remote code."""
    try:
        return auto_class._model_mapping[type(config)]
    except (KeyError, AttributeError):
        return None


def from_pretrained_with_report(
    checkpoint: Checkpoint, options: BackendOptions, config: Any, kwargs: dict[str, Any], device_map: Any
) -> tuple[Any, dict[str, Any]]:
    """`from_pretrained` by the config's model class, and Transformers' load report for the caller."""
    cls = _model_class(config)
    # compressed-tensors' meta skeleton of an asymmetric pack-quantized module does not fit its own files
    # (packed_zero_points): without this such a checkpoint cannot load at all.
    compressed = checkpoint.format == "compressed-tensors"
    fix = zero_points_packed_on_meta() if compressed else contextlib.nullcontext()
    # Transformers maps every shard for the whole load, and mapped pages count as resident memory: a loaded
    # model would peak at its tensors plus every page of its files. The model class is given each tensor as
    # a view whose pages go with it instead (`Checkpoint.open_tensors`), loaded by the same conversions. A
    # GGUF file is Transformers' to read, a load on the meta device reads nothing, and a remote-code class is
    # only reached through its Auto class, which takes no tensors with a folder.
    model_class = _registered_class(cls, config)
    by_handles = checkpoint.format != "gguf" and device_map != "meta" and model_class is not None
    try:
        with quiet_transformers(), fix, tensors_read_when_converted():
            if by_handles:
                settings = {k: v for k, v in kwargs.items() if k not in ("config", "trust_remote_code")}
                with heap_kept_while_loading(), checkpoint.open_tensors(checkpoint.tensors) as handles:
                    model, info = model_class.from_pretrained(
                        None,
                        config=config,
                        state_dict=handles,
                        dtype=DTYPES[options.dtype],
                        device_map=device_map,
                        output_loading_info=True,
                        **settings,
                    )
                model.config._name_or_path = str(checkpoint.path)
                set_generation_config(model, checkpoint)
            else:
                model, info = cls.from_pretrained(
                    str(checkpoint.path),
                    dtype=DTYPES[options.dtype],
                    device_map=device_map,
                    output_loading_info=True,
                    **kwargs,
                )
    except (DependencyError, InputError):
        raise
    except ImportError as exc:
        raise DependencyError(f"loading {checkpoint.path} needs a package: {first_line(exc)}") from None
    except Exception as exc:
        if is_out_of_memory(exc):  # not the checkpoint's fault: the machine's (exit 4, not 2)
            raise ResourceError(f"{checkpoint.path}: loading it ran {out_of_memory_line(exc)}") from exc
        raise InputError(f"Transformers cannot load the model: {first_line(exc)}", checkpoint.path) from None
    return model, info


def check_hf_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Load the model on the meta device, which reads the configs and the safetensors headers but no tensor
    data, and refuse it if Transformers' load report shows missing or unexpected weights."""
    if checkpoint.format == "gguf":
        return  # GGUF is dequantized by reading the file; nothing to decide without doing so
    config, kwargs = transformers_config(checkpoint, options)
    model = from_pretrained(checkpoint, options, config, kwargs, device_map="meta")
    del model


def hf_execution(model_class: str, options: BackendOptions) -> str:
    """Transformers' execution in words, with the activation quantization added where a convention adds it."""
    words = f"Transformers {package_version('transformers')} ({model_class})"
    if options.convention_map.get(ADD_ACTIVATION_QUANTIZATION):
        words += (
            "; compressed-tensors' dynamic per-token INT8 activations added to the weight-only groups, "
            "as intref adds them"
        )
    return words


def package_version(package: str) -> str:
    """The installed version of a distribution, as a backend's `describe()` names its execution.

    Args:
        package: the distribution's name (`transformers`, `exllamav3`).
    """
    from importlib.metadata import version

    return version(package)


def _pooled(out: Any) -> torch.Tensor:
    """One row per visual token from a `get_*_features` output (a tensor, or one per image or frame)."""
    pooled = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state
    if isinstance(pooled, list | tuple):
        pooled = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    return pooled.reshape(-1, pooled.shape[-1])


@torch.inference_mode()
def image_features(
    model: Any, device: torch.device, inputs: dict[str, Any], checkpoint: Checkpoint
) -> torch.Tensor:
    """The vision tower and merger's output for the visual inputs, float32, one row per visual token: the
    images' (`pixel_values`, …), then the video frames' (inputs named `…video…`). Inputs that are not
    tensors are the model's settings for both (MiniCPM-V's `downsample_mode`)."""
    if not hasattr(model, "get_image_features"):
        raise InputError("this model has no vision tower", checkpoint.path)
    text = ("input_ids", "attention_mask", "mm_token_type_ids")
    settings = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in text}
    visual = {k: v.to(device) for k, v in tensors.items()}
    images = {k: v for k, v in visual.items() if "video" not in k}
    videos = {k: v for k, v in visual.items() if "video" in k}
    parts = []
    if images:
        parts.append(_pooled(model.get_image_features(**images, **settings)))
    if videos:
        if not hasattr(model, "get_video_features"):
            raise InputError("this model has no video path", checkpoint.path)
        parts.append(_pooled(model.get_video_features(**videos, **settings)))
    return torch.cat(parts).float().cpu()


class HFBackend:
    """A Transformers model, loaded with no tolerance for missing or unexpected weights. Its `model` and
    `tokenizer` are public (`HFModelAccess`), for tasks that hand the model to a field tool.

    Subclasses change how the model is built (`load_model`) and inherit every primitive, since they all run
    the same Transformers model classes.
    """

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        self.checkpoint = checkpoint
        self.options = options
        self.config, kwargs = transformers_config(checkpoint, options)
        self.model = self.load_model(kwargs)
        self.model.eval()
        # compressed-tensors decompresses at the first forward: do it here, quietly, so that it is part of
        # loading and not of the first measured window.
        with contextlib.redirect_stderr(io.StringIO()), torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=False)
        output_embeddings = self.model.get_output_embeddings()
        self.vocab_size = (
            int(output_embeddings.weight.shape[0])
            if output_embeddings is not None
            else int(self.config.get_text_config().vocab_size)
        )
        # Forwards of the greedy decodings (one per new token for a batch of prompts), as a streamed side
        # counts them: results.json's `model_loads` divides a decoding's seconds by them.
        self.generation_forwards = 0

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, loaded when a task first asks (window logits never do: the windows
        come tokenized)."""
        return self.checkpoint.load_tokenizer(trust_remote_code=self.options.trust_remote_code)

    def describe(self) -> dict[str, Any]:
        """Transformers' own execution of the checkpoint's format."""
        execution = hf_execution(type(self.model).__name__, self.options)
        if self.checkpoint.format == "fp8" and not getattr(self.model, "is_quantized", True):
            # Without a GPU Transformers runs no FP8: it dequantized the pack at load, which the report says.
            execution += f"; FP8 weights dequantized to {self.options.dtype} at load by Transformers"
        if self.checkpoint.format == "mxfp4" and not getattr(self.model, "is_quantized", True):
            # No MXFP4 kernels (Triton) here: Transformers decodes the experts at load.
            execution += f"; MXFP4 experts dequantized to {self.options.dtype} at load by Transformers"
        return {"backend": "hf", "execution": execution, "format": self.checkpoint.format}

    def load_model(self, kwargs: dict[str, Any]) -> Any:
        """`from_pretrained` on the options' device; refuses a load that leaves weights random."""
        return from_pretrained(
            self.checkpoint, self.options, self.config, kwargs, _device_map(self.options.device)
        )

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def window_logits(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """Each window forwarded on its own; logits_to_keep keeps the vocabulary-sized projection to the
        scored positions only."""
        keep = positions.to(self.device)
        for window in windows:
            ids = window.reshape(1, -1).to(self.device)
            with mlp_in_chunks(self.model, length=ids.shape[1]):
                logits = self.model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[0]
            yield logits

    def window_logits_batched(
        self, windows: torch.Tensor, positions: torch.Tensor, per_forward: int
    ) -> Iterator[torch.Tensor]:
        """The reference in another execution (`--execution-floor`): the windows forwarded `per_forward` at
        a time (one batch of equal lengths: no padding), on a CUDA device with cuBLAS's reduced-precision BF16
        reduction the other way round too (`batched_kernel_setting`); each window's logits at `positions`."""
        keep = positions.to(self.device)
        for first in range(0, len(windows), max(per_forward, 1)):
            ids = windows[first : first + per_forward].to(self.device)
            with (
                torch.inference_mode(),
                _other_kernel_setting(self.device),
                mlp_in_chunks(self.model, length=ids.shape[1]),
            ):
                logits = self.model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
            yield from logits

    @property
    def batched_kernel_setting(self) -> str:
        """What `window_logits_batched` changes besides the batch, in words."""
        if self.device.type == "cuda":
            return "cuBLAS's reduced-precision BF16 reduction the other way round"
        return "none (a CPU's kernels follow the shapes)"

    @torch.inference_mode()
    def sequence_logits(self, inputs: dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
        """One sequence forwarded alone (its token ids, and other inputs such as images), the logits at
        `positions` only: (len(positions), vocab)."""
        batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        with mlp_in_chunks(self.model, length=batch["input_ids"].shape[1]):
            out = self.model(**batch, logits_to_keep=positions.to(self.device), use_cache=False)
        return out.logits[0]

    def sequences_logits(self, items: Sequence[tuple[dict[str, Any], torch.Tensor]]) -> list[torch.Tensor]:
        """`sequence_logits` of each (inputs, positions), one sequence at a time."""
        return [self.sequence_logits(inputs, positions) for inputs, positions in items]

    @property
    def logits_dtype(self) -> str:
        """The dtype the model's head computes its logits in (what a tie between two logits is within)."""
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return str(weight.dtype).removeprefix("torch.") if weight is not None else self.options.dtype

    def window_scored_states(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[ScoredStates]:
        """Each window forwarded on its own, the head left out: the final hidden states at `positions`, with
        the head to apply to a few of them at a time (`ScoredStates.chunks`)."""
        keep = positions.to(self.device)
        head = self.model.get_output_embeddings()
        for window in windows:
            ids = window.reshape(1, -1).to(self.device)
            with (
                head_input_kept(self.model) as stand_in,
                mlp_in_chunks(self.model, length=ids.shape[1]),
                torch.inference_mode(),
            ):
                self.model(input_ids=ids, logits_to_keep=keep, use_cache=False)
            yield scored_states(self.model, stand_in, head, self._forward_one_token)

    def _forward_one_token(self) -> torch.Tensor:
        """The model's forward on one token, its `.logits`: what `after_head_of` hands the head's rows
        through."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        return self.model(input_ids=one, use_cache=False).logits

    def generate_greedy(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, top_k: int = 5, full_steps: int = 0
    ) -> Generation:
        """Greedy decoding of one prompt, with the top-k log-probs of every step (`greedy.greedy_batch`)."""
        return self.generate_greedy_batch([inputs], [max_new_tokens], top_k, full_steps)[0]

    def generate_greedy_batch(
        self,
        prompts: Sequence[dict[str, torch.Tensor]],
        max_new_tokens: Sequence[int],
        top_k: int = 5,
        full_steps: int = 0,
    ) -> list[Generation]:
        """Greedy decoding of `prompts` as one batch (`greedy.greedy_batch`), each up to its own length."""
        handle = self.model.register_forward_pre_hook(self._count_forward)
        try:
            return greedy_batch(self.model, self.device, prompts, max_new_tokens, top_k, full_steps)
        finally:
            handle.remove()

    def _count_forward(self, *_: Any) -> None:
        self.generation_forwards += 1

    def generate_drafted(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, drafting: Drafting, top_k: int = 5
    ) -> Generation:
        """Greedy decoding of one prompt with drafting, by Transformers' assisted generation, with its rounds
        (`drafting.drafted_greedy`); timed on a GPU."""
        timed = self.device.type == "cuda"
        return drafted_greedy(self.model, self.device, inputs, max_new_tokens, drafting, top_k, timed)

    def image_features(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The vision tower and merger's output for the visual inputs (see the module's `image_features`)."""
        return image_features(self.model, self.device, inputs, self.checkpoint)

    def close(self) -> None:
        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _other_kernel_setting(device: torch.device) -> Iterator[None]:
    """On a CUDA device, cuBLAS's reduced-precision BF16 reduction the other way round for the block: another
    kernel setting a serving engine may run with; elsewhere nothing changes."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = not before
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
