"""Where `compare` runs its candidates: one after another in this process (`local`), or each as a Ray task
(`ray`) asking for the resources its load needs, all writing into the comparison's folder on a file system
the cluster shares. Both give the same results.json per candidate, bit for bit: a Ray task runs with the
driver's torch thread count, the one setting of a worker that changes a forward's arithmetic."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evalsuite.backends.memory import loaded_bytes
from evalsuite.errors import EvalsuiteError, InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_folder import RunFolder
from evalsuite.pipeline.observe import OnLoad
from evalsuite.pipeline.plan import RunRequest
from evalsuite.pipeline.runner import RunResult, run
from evalsuite.protocol.side import open_side
from evalsuite.protocol.task import Progress
from evalsuite.reporting.diff_report import write_reports


def ray_api() -> Any:
    """The `ray` module, or a one-line refusal naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise InputError(
            "--executor ray needs Ray, which is not installed: pip install 'evalsuite[ray]'"
        ) from None
    return ray


def candidate_resources(request: RunRequest, threads: int, gpu_bytes: int | None = None) -> dict[str, Any]:
    """What a candidate's Ray task asks for: as many CPUs as the torch threads it runs with (the driver's:
    fewer would oversubscribe the node, another count would change the arithmetic); on `cuda`/`cuda:N` one
    GPU; on `auto` (accelerate's map over the GPUs it is given, then the CPU) as many GPUs as the model's
    load plan fills at `gpu_bytes` each (the driver's first GPU's memory; one where unknown); on the CPU the
    memory its model fills once loaded (evalsuite.backends.memory's load plan, from the files)."""
    options = request.ckpt_options
    side = open_side("ckpt", request.ckpt, options)
    resources: dict[str, Any] = {"num_cpus": max(1, threads)}
    needed = loaded_bytes(side.checkpoint, side.options) if side.checkpoint is not None else None
    if options.device.startswith("cuda"):
        resources["num_gpus"] = 1
    elif options.device == "auto":
        resources["num_gpus"] = max(1, -(-needed // gpu_bytes)) if needed and gpu_bytes else 1
    elif needed is not None:
        resources["memory"] = needed
    return resources


def in_ray_task(request: RunRequest) -> RunRequest:
    """The request as a Ray task runs it: Ray makes only the GPUs it assigned visible, numbered from 0, so
    `cuda:N` (the driver's numbering) is the task's `cuda:0`."""
    import dataclasses

    options = {}
    for name in ("ckpt_options", "ref_options"):
        side = getattr(request, name)
        if side.device.startswith("cuda:"):
            options[name] = dataclasses.replace(side, device="cuda:0")
    return dataclasses.replace(request, **options) if options else request


def link_reference(reference: Path, out: Path) -> None:
    """The reference's saved observations into a candidate's run folder, as hard links (a copy where the
    file system has none): the candidate's run finds them under their keys and loads no reference."""
    target = RunFolder(out).observations
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(reference.iterdir()) if reference.is_dir() else []:
        if entry.name.startswith(".") or (target / entry.name).exists():
            continue
        work = target / f".{entry.name}.linking"
        shutil.rmtree(work, ignore_errors=True)
        try:
            shutil.copytree(entry, work, copy_function=os.link)
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(entry, work)
        work.rename(target / entry.name)


def run_candidate(
    request: RunRequest, reference: Path, digests: DigestCache | None = None, **kw: Any
) -> RunResult:
    """One candidate's `run`, its reference observations linked in first; results.json and report.md are
    written into its folder as `run` writes them."""
    Path(request.out).mkdir(parents=True, exist_ok=True)
    link_reference(reference, Path(request.out))
    result = run(request, digests=digests, **kw)
    write_reports(result.results, result.folder)
    return result


def _ray_candidate(request: RunRequest, reference: str, threads: int, env: dict[str, str]) -> dict[str, Any]:
    """A Ray task: one candidate's run; returns its results.json document (or raises its one-line error)."""
    import torch

    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        return run_candidate(in_ray_task(request), Path(reference)).results
    except EvalsuiteError as exc:
        # Crosses the process boundary as a plain message: the driver turns it back into one line, exit 2.
        return {"verdict": "error", "error": str(exc)}


def run_candidates(
    requests: dict[str, RunRequest],
    reference: Path,
    executor: str,
    ray_address: str | None,
    digests: DigestCache,
    progress: Progress | None,
    on_load: OnLoad | None,
    on_candidate: Callable[[str], Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every candidate's results.json document, by name, in the order given."""
    if executor == "local":
        docs = {}
        for name, request in requests.items():
            if on_candidate is not None:
                on_candidate(name)
            docs[name] = run_candidate(
                request, reference, digests, progress=progress, on_load=on_load
            ).results
        return docs
    import torch

    ray = ray_api()
    address = ray_address or os.environ.get("RAY_ADDRESS")
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    env = {k: v for k, v in os.environ.items() if k.startswith(("EVALSUITE_", "HF_", "PYTHONPATH"))}
    threads = torch.get_num_threads()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    try:
        task = ray.remote(_ray_candidate)
        futures = {
            name: task.options(**candidate_resources(request, threads, gpu_bytes)).remote(
                request, str(reference), threads, env
            )
            for name, request in requests.items()
        }
        docs = {name: ray.get(future) for name, future in futures.items()}
    finally:
        if started:
            ray.shutdown()
    for name, doc in docs.items():
        if "error" in doc and "tasks" not in doc:
            raise InputError(f"candidate {name}: {doc['error']}")
    return docs
