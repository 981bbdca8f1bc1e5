"""What machine the numbers were computed on, and whether two runs' machines compute the same numbers.

The same weights give other logits on another CPU or GPU: torch picks its kernels by the instruction set it
finds (`torch.backends.cpu.get_cpu_capability()`), oneDNN and MKL pick theirs by theirs (and obey
`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`, `MKL_ENABLE_INSTRUCTIONS`), and a GPU's result depends on its
model, CUDA and cuBLAS. `describe_machine` records all of that for results.json and recordings;
`execution_differences` names what differs between a recording's machine and this run's, so that a replay
that mixes another machine's drift into the comparison says so (with the drift measured by
`bench/drift.py`, kept in `measured_drift.json` beside this module).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import tempfile
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# Environment variables that choose which kernels run (and so change the last bits of the logits).
KERNEL_OVERRIDES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "CUBLAS_WORKSPACE_CONFIG",
)
# CPU flags (/proc/cpuinfo) that decide the kernels torch, oneDNN and MKL can choose.
_KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)
# The cuBLAS wheels a CUDA build of torch runs with, newest naming first.
_CUBLAS_PACKAGES = ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas-cu11")
# The keys of `environment` (results.json, recordings) whose difference changes what the kernels compute.
EXECUTION_KEYS = ("device", "device_name", "dtype", "packages.torch", "machine")
DRIFT_FILE = "measured_drift.json"


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform says; else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# Where Linux describes the caches of the first core: index*/{level,type,size}.
CACHE_FOLDER = "/sys/devices/system/cpu/cpu0/cache"
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@functools.cache
def largest_cache_bytes(folder: str = CACHE_FOLDER) -> int | None:
    """The size of the largest data cache the first core uses (its last level, shared between cores), as
    Linux's sysfs gives it; None where none is given (another platform, or a machine that hides it)."""
    sizes = []
    for index in Path(folder).glob("index*"):
        try:
            kind = (index / "type").read_text(encoding="ascii").strip()
            text = (index / "size").read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        unit = _SIZE_UNITS.get(text[-1:].upper(), 1)
        digits = text[:-1] if text[-1:].upper() in _SIZE_UNITS else text
        if kind != "Instruction" and digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def _cpuinfo() -> tuple[str | None, list[str]]:
    """The CPU's model name and the kernel-relevant flags it has, from /proc/cpuinfo (None, [] elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return platform.processor() or None, []
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, [flag for flag in _KERNEL_FLAGS if flag in flags]


@functools.cache
def onednn_isa() -> str | None:
    """The instruction set oneDNN dispatches to in this process (its verbose header), None if not found.

    oneDNN prints the ISA it chose only in its verbose mode, to the C-level stdout, once per process: the
    header is caught by pointing file descriptor 1 at a temporary file for one tiny reorder.
    """
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    try:
        with tempfile.TemporaryFile() as capture:
            sys.stdout.flush()
            saved = os.dup(1)
            try:
                os.dup2(capture.fileno(), 1)
                with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                    torch.zeros(1, 1).to_mkldnn().to_dense()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
    except (OSError, RuntimeError):
        return None
    for line in text.splitlines():
        if ",cpu,isa:" in line:
            return line.split(",cpu,isa:", 1)[1].strip()
    return None


def _cublas_version() -> str | None:
    for package in _CUBLAS_PACKAGES:
        try:
            return version(package)
        except PackageNotFoundError:
            continue
    return None


def describe_machine(device: str) -> dict[str, Any]:
    """The CPU (model, flags, the ISA torch's and oneDNN's kernels use, overrides in the environment) and,
    for a CUDA device, the GPU (name, compute capability, CUDA, cuBLAS and cuDNN versions)."""
    import torch

    model, flags = _cpuinfo()
    doc: dict[str, Any] = {
        "cpu_model": model,
        "cpu_flags": flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa(),
        "kernel_overrides": {name: os.environ[name] for name in KERNEL_OVERRIDES if name in os.environ},
        "gpu": None,
    }
    if device != "cpu" and torch.cuda.is_available():
        index = (torch.device(device).index or 0) if device.startswith("cuda") else 0
        major, minor = torch.cuda.get_device_capability(index)
        doc["gpu"] = {
            "name": torch.cuda.get_device_name(index),
            "compute_capability": f"{major}.{minor}",
            "cuda": torch.version.cuda,
            "cublas": _cublas_version(),
            "cudnn": torch.backends.cudnn.version(),
        }
    return doc


def _value(environment: dict[str, Any], dotted: str) -> Any:
    value: Any = environment
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def execution_differences(recorded: dict[str, Any] | None, here: dict[str, Any]) -> dict[str, list[Any]]:
    """What differs, among `EXECUTION_KEYS`, between a recording's environment and this run's: key →
    [recorded, here]. A machine the recording does not describe counts as different (None)."""
    recorded = recorded or {}
    differences: dict[str, list[Any]] = {}
    for key in EXECUTION_KEYS:
        if key == "machine":
            machine_here, machine_then = here.get("machine") or {}, recorded.get("machine")
            if not isinstance(machine_then, dict):
                differences["machine"] = [None, machine_here or None]
                continue
            for field in sorted(set(machine_here) | set(machine_then)):
                if machine_then.get(field) != machine_here.get(field):
                    differences[f"machine.{field}"] = [machine_then.get(field), machine_here.get(field)]
        elif _value(recorded, key) != _value(here, key):
            differences[key] = [_value(recorded, key), _value(here, key)]
    return differences


def measured_drift() -> dict[str, Any] | None:
    """What `bench/drift.py` last measured (the reference against itself under other kernels), or None."""
    try:
        text = resources.files("evalsuite").joinpath(DRIFT_FILE).read_text(encoding="utf-8")
        doc = json.loads(text)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return "not recorded" if value is None else str(value)


def replay_caveat(differences: dict[str, list[Any]], drift: dict[str, Any] | None) -> str:
    """One sentence (no final stop): the reference was recorded under another environment, what differs,
    and the drift of a reference against itself between kernels on one machine, as `bench/drift.py` measured
    it (or that it was not measured)."""
    if "machine" in differences:
        changed = "its machine was not recorded"
    else:
        changed = "; ".join(
            f"{key}: recorded {_short(then)}, here {_short(now)}" for key, (then, now) in differences.items()
        )
    sentence = (
        f"the reference is a recording made under another execution environment ({changed}): its logits "
        "carry that environment's kernels, and the comparison counts their drift as the candidate's"
    )
    variants = (drift or {}).get("variants")
    if not isinstance(variants, dict) or not variants:
        return sentence + "; that drift was not measured here (bench/drift.py)"
    measured = "; ".join(
        f"{name}: kld_mean {row['kld_mean']:.2g}, ppl {row['ppl_ref']:.4f} recorded, "
        f"{row['ppl_ckpt']:.4f} run"
        for name, row in variants.items()
    )
    where = (drift or {}).get("measured_on", {}).get("cpu_model") or "one machine"
    return (
        f"{sentence}; for scale, bench/drift.py measured the SmolLM2-135M BF16 reference against its own "
        f"recording made under the default kernels, on {where}: {measured}"
    )
