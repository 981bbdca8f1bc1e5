"""How a side is executed: the backend, its dtype and device, and the conventions a task hands it.

Part of every observation's key: the same checkpoint under another dtype, device, backend, convention or
execution mode (loaded whole, or streamed one decoder layer at a time) is another observation. The memory
budget that decides streaming (`max_memory`) is not: it changes how a side fits, not what it computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from evalsuite.errors import DependencyError, InputError

DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}
BACKEND_NAMES = ("hf", "intref", "exl3")
# Backends of a format's own runtime, which loads the file itself: never streamed by evalsuite.
RUNTIME_BACKENDS = ("llamacpp",)
# Formats whose runtime does not run here, run by `hf` from their decoded weights (`backends.decoded`).
DECODED_FORMATS = frozenset({"mlx", "gptq", "awq", "modelopt"})
# `auto`: the candidate's format decides (exl3 for an EXL3 pack, hf otherwise), once its files are open.
AUTO_BACKEND = "auto"


# Where a streamed side runs under `--device auto` (`BackendOptions.streamed`).
STREAMED_AUTO_DEVICE = "cuda:0"


# Convention of backend `hf`, set by the `intref` task for a weight-only candidate: the config groups that
# keep 16-bit activations run with dynamic per-token INT8 activation quantization, as intref runs them, so
# that both executions compute the one W·A8 model.
ADD_ACTIVATION_QUANTIZATION = "add_activation_quantization"


@dataclass(frozen=True)
class BackendOptions:
    """How one side runs. `conventions` are backend-specific settings (intref's activation divisor and
    rounding) that the task running the side takes from its spec; no backend reads a spec file."""

    backend: str = "hf"
    dtype: str = "bfloat16"
    device: str = "cpu"
    trust_remote_code: bool = False
    conventions: tuple[tuple[str, Any], ...] = ()
    # Streamed execution (`evalsuite.backends.streamed`): one decoder layer resident at a time. Set by
    # `--stream`, by a need that asks for it, or when the model does not fit `max_memory` (bytes; None: the
    # free memory of the device), see `evalsuite.backends.memory`.
    stream: bool = False
    max_memory: int | None = None

    def with_backend(self, backend: str, conventions: Mapping[str, Any] | tuple = ()) -> BackendOptions:
        """The same options on another backend with its conventions."""
        items = tuple(sorted(conventions.items())) if isinstance(conventions, Mapping) else tuple(conventions)
        return replace(self, backend=backend, conventions=items)

    @property
    def convention_map(self) -> dict[str, Any]:
        return dict(self.conventions)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "backend": self.backend,
            "dtype": self.dtype,
            "device": self.device,
            "trust_remote_code": self.trust_remote_code,
        }
        if self.conventions:
            doc["conventions"] = dict(self.conventions)
        if self.stream:
            doc["stream"] = True
        return doc

    def streamed(self) -> BackendOptions:
        """These options streamed one decoder layer at a time. A streamed side runs on one device: `auto`
        (accelerate's map over every GPU and the CPU) becomes the first CUDA device, which holds one layer
        at a time and the hidden states; `cpu`, `cuda` and `cuda:N` stay as they are."""
        device = STREAMED_AUTO_DEVICE if self.device == "auto" else self.device
        return replace(self, stream=True, device=device)

    def for_format(self, format: str) -> BackendOptions:
        """`auto` resolved for a checkpoint of `format`: exl3 for an EXL3 pack, hf for anything else."""
        if self.backend != AUTO_BACKEND:
            return self
        return replace(self, backend="exl3" if format == "exl3" else "hf")

    def check(self) -> BackendOptions:
        """Refuse options that cannot run on this machine, before anything loads; returns the options with
        the dtype spelled canonically."""
        if self.backend not in (*BACKEND_NAMES, *RUNTIME_BACKENDS, AUTO_BACKEND):
            raise InputError(
                f"unknown backend {self.backend!r}; known backends: "
                f"{', '.join((*BACKEND_NAMES, *RUNTIME_BACKENDS))} "
                f"(or {AUTO_BACKEND})"
            )
        if self.dtype not in DTYPE_NAMES:
            raise InputError(f"unknown dtype {self.dtype!r}; use bfloat16, float16 or float32")
        check_device(self.device)
        if self.max_memory is not None and self.max_memory <= 0:
            raise InputError(f"--max-memory must be a positive size, not {self.max_memory} bytes")
        checked = replace(self, dtype=DTYPE_NAMES[self.dtype])
        return checked.streamed() if self.stream else checked


def check_device(device: str) -> None:
    """`cpu`, `cuda`, `cuda:N` or `auto`; the CUDA ones only where CUDA is available."""
    if device == "cpu":
        return
    index = device.removeprefix("cuda:")
    if device not in ("cuda", "auto") and not (device.startswith("cuda:") and index.isdigit()):
        raise InputError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")
    import torch

    if not torch.cuda.is_available():
        raise DependencyError(f"--device {device} needs CUDA, and this machine has none")
    if device.startswith("cuda:") and int(index) >= torch.cuda.device_count():
        raise DependencyError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices")
