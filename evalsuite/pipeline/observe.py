"""Phase 2 of a run: the planned observations not already saved under their key, grouped by side and
execution, one model resident at a time, the reference first. Each observation is saved under its key as it
completes, and an interrupted one resumes from what its observer left in its folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from evalsuite.backends import load_backend, load_pair
from evalsuite.backends.c_heap import release_freed_memory
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.observation import Observation
from evalsuite.files import leases as file_leases
from evalsuite.files.run_folder import RunFolder
from evalsuite.inputs.offline import hub_offline
from evalsuite.pipeline.plan import PlannedObservation, RunPlan, is_saved, recorded_observation, saved_folder
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import (
    Progress,
)

# Called with (side, options) just before a model is loaded: the CLI prints one line.
OnLoad = Callable[[Side, BackendOptions], Any]


def observe_all(
    plan: RunPlan,
    folder: RunFolder,
    resume: bool,
    progress: Progress,
    on_load: OnLoad | None,
    log: list[dict[str, Any]] | None = None,
) -> dict[str, Observation]:
    """Phase 2: every planned observation, loading each (side, execution) once, one model at a time; on a
    streamed side, the observations that forward the same windows share one pass over its layers
    (`evalsuite.backends.layer_pass`). `log` receives one entry per model loaded (`_load_entry`)."""
    observed: dict[str, Observation] = {}
    groups: dict[tuple[str, BackendOptions, BackendOptions | None], list[PlannedObservation]] = {}
    for planned in plan.observations.values():
        if planned.side.recording is not None:
            observed[planned.key] = recorded_observation(planned)
            continue
        if resume and is_saved(folder, planned):
            observed[planned.key] = Observation.load(saved_folder(folder, planned))
            continue
        groups.setdefault((planned.role, planned.options, planned.partner_options), []).append(planned)
    # Each shard mapped while a side is observed is leased, so that a process about to change one ends the
    # run first, with one line naming it (`evalsuite.files.leases`).
    with file_leases.watching():
        for (role, options, partner_options), todo in groups.items():
            side, partner = todo[0].side, todo[0].partner
            if on_load is not None:
                if partner is not None:
                    on_load(partner, partner_options)
                on_load(side, options)
            load_started = time.perf_counter()
            if partner is not None:
                backend = load_pair(partner.checkpoint, partner_options, side.checkpoint, options)
            else:
                backend = load_backend(side.checkpoint, options)
            load_seconds = round(time.perf_counter() - load_started, 3)
            try:
                loads_before = getattr(backend, "layer_loads", None)
                forwards_before = getattr(backend, "generation_forwards", 0)
                bytes_before = getattr(backend, "generation_bytes", 0)
                read_before = getattr(backend, "layer_read_seconds", 0.0)
                seconds: dict[str, float] = {}
                for batch in _passes(todo, observed, backend):
                    started = time.perf_counter()
                    _observe_batch(batch, backend, folder, resume, progress, observed, plan.allow_download)
                    names = ", ".join(p.need.observer.name for p in batch)
                    seconds[names] = round(time.perf_counter() - started, 3)
                if log is not None:
                    entry = _load_entry(
                        role, options, todo, backend, loads_before, (forwards_before, bytes_before)
                    )
                    # Wall seconds of each observation (a layer pass names all that rode it): what a bench
                    # divides by a decoding's forwards, or a pass's layers. Not part of any key or verdict.
                    entry["seconds"] = seconds
                    # Its set-up before any observation (a streamed side: the skeleton and what lies outside
                    # the decoder layers), and a streamed side's reading of its layers within `seconds`:
                    # what a pass shared with another execution would not pay again.
                    entry["load_seconds"] = load_seconds
                    if loads_before is not None:
                        entry["layer_read_seconds"] = round(backend.layer_read_seconds - read_before, 3)
                    # The process's peak resident memory so far: a load that raised it is the one whose
                    # observations hold the run's peak (what a bench reads to say where memory goes).
                    entry["peak_rss_bytes"] = peak_rss_bytes()
                    log.append(entry)
            finally:
                backend.close()
                # The next side loads into what this one leaves: its freed heaps go back to the system first.
                release_freed_memory()
    return observed


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes: Linux's VmHWM, which belongs to this process
    image (its `ru_maxrss` carries the parent's peak across fork and exec, so a run started by a large
    process would report that one's); `ru_maxrss` elsewhere (bytes on macOS)."""
    import resource
    import sys

    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def _passes(
    todo: list[PlannedObservation], observed: dict[str, Observation], backend: Any
) -> list[list[PlannedObservation]]:
    """The side's observations in batches made together. On a streamed side, every observation that can
    ride a layer pass (its observer offers a `visitor` and says which sequences it runs) rides one: first the
    observations the pass consumes (a reference's answers, generated before they are forced), then the pass,
    then what consumes the pass; each other observation is a batch of its own, in plan order."""
    from evalsuite.backends.streamed import StreamedBackend

    if not isinstance(backend, StreamedBackend):
        return [[planned] for planned in todo]
    riders = [p for p in todo if _can_ride(p)]
    made = set(observed)
    before: list[PlannedObservation] = []
    waiting = [p for p in todo if p not in riders]
    progressed = True
    while progressed:  # what the pass needs, made first, in plan order
        progressed = False
        for planned in list(waiting):
            if set(planned.consumes.values()) <= made and _needed_by(planned, riders, todo):
                before.append(planned)
                waiting.remove(planned)
                made.add(planned.key)
                progressed = True
    shared = [p for p in riders if set(p.consumes.values()) <= made]
    after = [p for p in todo if p not in before and p not in shared]
    return [[p] for p in before] + ([shared] if shared else []) + [[p] for p in after]


def _needed_by(
    planned: PlannedObservation, riders: list[PlannedObservation], todo: list[PlannedObservation]
) -> bool:
    """Whether a rider of the pass consumes `planned`, directly or through other observations."""
    wanted = {key for rider in riders for key in rider.consumes.values()}
    by_key = {p.key: p for p in todo}
    seen: set[str] = set()
    while wanted - seen:
        key = (wanted - seen).pop()
        seen.add(key)
        if key == planned.key:
            return True
        if key in by_key:
            wanted |= set(by_key[key].consumes.values())
    return False


def _can_ride(planned: PlannedObservation) -> bool:
    """Whether an observation can be made in a layer pass: its observer offers a `visitor` and says which
    sequences it runs (`pass_sequences`), or runs a protocol's windows."""
    observer = planned.need.observer
    if not callable(getattr(observer, "visitor", None)):
        return False
    return callable(getattr(observer, "pass_sequences", None)) or (
        "tokens_sha256" in planned.inputs and "windows" in planned.inputs
    )


def _sequences(planned: PlannedObservation, inputs: dict[str, Any]) -> list[Any]:
    """The sequences an observation runs in a layer pass (`_can_ride`), given its inputs (what it consumes
    among them)."""
    from evalsuite.backends.layer_pass import window_sequences
    from evalsuite.observers.window_logits import window_tensor

    observer = planned.need.observer
    if callable(getattr(observer, "pass_sequences", None)):
        return observer.pass_sequences(inputs)
    return window_sequences(window_tensor(inputs), str(inputs["tokens_sha256"]))


def _observe_batch(
    batch: list[PlannedObservation],
    backend: Any,
    folder: RunFolder,
    resume: bool,
    progress: Progress,
    observed: dict[str, Observation],
    allow_download: bool,
) -> None:
    """Make a batch of `_passes` (one observation, or a layer pass shared by several); save, commit each."""
    label = f"{batch[0].role} ({batch[0].options.backend})"

    def labelled(what: str, total: int) -> Callable[[], None]:
        return progress(f"{label}: {what}", total)

    works = [folder.observation_work(p.role, p.need.observer.name, p.key, resume) for p in batch]
    inputs = [
        {**p.inputs, "observed": {k: observed[key] for k, key in p.consumes.items()}}
        if p.consumes
        else p.inputs
        for p in batch
    ]
    if len(batch) == 1:
        # An observer that hands the model to a field tool (lm-eval loads its tasks' data again) reads only
        # local caches, unless the run was allowed to download.
        with hub_offline(not allow_download):
            made = [batch[0].need.observer.observe(backend, inputs[0], works[0], labelled)]
    else:
        from evalsuite.backends.layer_pass import run_layer_pass

        names = ", ".join(p.need.observer.name for p in batch)
        visitors = [
            (p.need.observer.visitor(backend, i, w), w, _sequences(p, i))
            for p, i, w in zip(batch, inputs, works, strict=True)
        ]
        step = labelled(f"layers ({names})", backend.n_layers)
        made = run_layer_pass(backend, visitors, step)
    # What was observed is saved under the digest of files that must still be those files: one replaced
    # by a rename since its header was read (no lease hears of that) ends the run here, naming it.
    for planned in batch[:1]:
        for side in (planned.side, planned.partner):
            if side is not None and side.checkpoint is not None:
                side.checkpoint.check_unchanged()
    for planned, obs, work in zip(batch, made, works, strict=True):
        obs.key = planned.key
        obs.meta["tasks"] = sorted(planned.tasks)
        if len(batch) > 1:
            obs.meta["layer_pass"] = [p.need.observer.name for p in batch]
        obs.save(work)
        observed[planned.key] = Observation.load(
            folder.commit_observation(work, saved_folder(folder, planned))
        )


def _load_entry(
    role: str,
    options: BackendOptions,
    todo: list[PlannedObservation],
    backend: Any,
    loads_before: int | None,
    before: tuple[int, int],
) -> dict[str, Any]:
    """results.json's account of one model load: which side, how executed, what was observed, and for a
    streamed side how many decoder layers were read from the files (once per layer per pass)."""
    entry: dict[str, Any] = {
        "side": role,
        "backend": options.backend,
        "streamed": loads_before is not None,
        "observations": [p.need.observer.name for p in todo],
    }
    forwards_before, bytes_before = before
    forwards = getattr(backend, "generation_forwards", 0) - forwards_before
    if hasattr(backend, "generation_forwards"):
        # A decoding's forwards (one per new token for a batch of prompts), loaded or streamed: what a
        # decoding's `seconds` divide by.
        entry["generation_forwards"] = forwards
    if loads_before is not None:
        loads = backend.layer_loads - loads_before
        entry["n_layers"] = backend.n_layers
        entry["decoder_layer_loads"] = loads
        # What each read was for: the decoding's forwards and the passes that forward windows and forced
        # answers.
        entry["pass_layer_loads"] = loads - forwards * backend.n_layers
        # Bytes of the files read for the decoder layers: a decoding step reads, of a layer's routed experts,
        # only those its tokens route to; the whole layers' bytes beside it for scale.
        entry["generation_bytes"] = backend.generation_bytes - bytes_before
        entry["decoder_layers_bytes"] = sum(backend.layer_bytes)
        cache = getattr(backend, "decoded_cache", None)
        if cache is not None and cache.hits + cache.misses:
            # Converted weights (routed experts, decompressed projections) kept across a decoding's steps:
            # how often a step found what it needed, the bytes of the files it did not read again.
            entry["decoded_cache"] = cache.figures()
    return entry
