"""`evalsuite compare`: many candidates against one reference, the comparison a publisher picks a recipe by.

1. The reference is observed once, into `DIR/reference/observations` (a recording is read instead), with the
   `ppl` noise floor (the reference again with BF16-sized noise on its decoder layers) unless asked not to.
2. Each candidate is an ordinary `run` into `DIR/<candidate>/`, its reference observations hard links to the
   ones of step 1, so that no candidate forwards the reference again; a candidate whose observations are
   saved resumes without a model. Candidates run one after another in this process, or as Ray tasks
   (`evalsuite.candidates.executors`).
3. The comparison (`evalsuite.candidates.side_by_side`) reads every candidate's results.json and per-token
arrays and
   writes `DIR/compare.json`, `DIR/compare.md` and the plots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalsuite.backends.options import BackendOptions
from evalsuite.candidates.executors import ray_api, run_candidates
from evalsuite.candidates.side_by_side import write_comparison
from evalsuite.errors import InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_folder import RunFolder
from evalsuite.pipeline.observe import OnLoad, observe_all
from evalsuite.pipeline.plan import RunRequest, plan_run
from evalsuite.protocol.recording import is_recording
from evalsuite.protocol.task import Progress, RunContext, no_progress

REFERENCE_FOLDER = "reference"
EXECUTORS = ("local", "ray")


@dataclass
class CompareRequest:
    """Everything `evalsuite compare` was asked to do."""

    ref: str
    ckpts: list[str]
    tasks: list[str]
    out: Path
    context: RunContext = field(default_factory=RunContext)
    ckpt_options: BackendOptions = field(default_factory=BackendOptions)
    ref_options: BackendOptions = field(default_factory=BackendOptions)
    thresholds: dict[str, dict[str, Any]] = field(default_factory=dict)
    thresholds_file: Path | None = None
    specs: dict[str, Path] = field(default_factory=dict)
    noise_floor: bool = True
    executor: str = "local"
    ray_address: str | None = None


def candidate_names(ckpts: list[str]) -> list[str]:
    """A folder name per candidate, unique within the comparison (`name`, `name-2`, …)."""
    names: list[str] = []
    for source in ckpts:
        base = Path(source.rstrip("/")).name or "candidate"
        name, n = base, 1
        while name in names or name == REFERENCE_FOLDER:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def candidate_request(request: CompareRequest, ckpt: str, out: Path) -> RunRequest:
    """The `run` a candidate gets: the comparison's tasks, specs, thresholds and options, the noise floor on
    in `ppl` where the reference is a checkpoint (a recording cannot be run again with noise)."""
    overrides: dict[str, dict[str, Any]] = {}
    if request.noise_floor and "ppl" in request.tasks and not is_recording(request.ref):
        overrides["ppl"] = {"noise_floor": {"enabled": True}}
    return RunRequest(
        ckpt=ckpt,
        ref=request.ref,
        tasks=list(request.tasks),
        out=out,
        context=request.context,
        ckpt_options=request.ckpt_options,
        ref_options=request.ref_options,
        thresholds=request.thresholds,
        thresholds_file=request.thresholds_file,
        specs=request.specs,
        resume=True,
        spec_overrides=overrides,
    )


def observe_reference(
    request: CompareRequest,
    digests: DigestCache,
    progress: Progress | None = None,
    on_load: OnLoad | None = None,
) -> Path:
    """Every observation the candidates' runs need of the reference, made once into DIR/reference (the
    first candidate's plan names them: the reference's keys do not depend on the candidate)."""
    folder = RunFolder(Path(request.out) / REFERENCE_FOLDER)
    first = candidate_request(request, request.ckpts[0], folder.root)
    plan = plan_run(first, digests)
    reference = {k: p for k, p in plan.observations.items() if p.role == "ref"}
    observe_all(
        dataclasses.replace(plan, observations=reference), folder, True, progress or no_progress, on_load
    )
    folder.prune_observations(keep=set(reference))
    return folder.observations


@dataclass
class CompareResult:
    """The comparison document (compare.json) and every candidate's results.json, by candidate name."""

    comparison: dict[str, Any]
    candidates: dict[str, dict[str, Any]]
    out: Path

    @property
    def exit_code(self) -> int:
        """0 when every candidate passed, 1 when one failed a check, 2 when one could not be compared."""
        verdicts = {doc["verdict"] for doc in self.candidates.values()}
        return 2 if "error" in verdicts else 1 if "fail" in verdicts else 0


def compare(
    request: CompareRequest,
    progress: Progress | None = None,
    on_load: OnLoad | None = None,
    digests: DigestCache | None = None,
    on_candidate: Callable[[str], Any] | None = None,
) -> CompareResult:
    """Observe the reference once, run every candidate against it, and write the comparison."""

    if not request.ckpts:
        raise InputError("compare needs at least one --ckpt")
    if request.executor not in EXECUTORS:
        raise InputError(f"unknown executor {request.executor!r}; use {' or '.join(EXECUTORS)}")
    out = Path(request.out)
    if out.exists() and not out.is_dir():
        raise InputError("--out is a file, not a folder for the comparison", out)
    digests = digests or DigestCache.default()
    names = candidate_names(request.ckpts)
    requests = {
        name: candidate_request(request, ckpt, out / name)
        for name, ckpt in zip(names, request.ckpts, strict=True)
    }
    if request.executor == "ray":
        ray_api()  # a missing Ray is refused before the reference is observed
    reference = observe_reference(request, digests, progress, on_load)
    candidates = run_candidates(
        requests, reference, request.executor, request.ray_address, digests, progress, on_load, on_candidate
    )
    comparison = write_comparison(out, request.ref, names, candidates, request.context.plots)
    return CompareResult(comparison, candidates, out)
