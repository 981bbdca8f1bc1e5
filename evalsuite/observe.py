"""Phase 2 of a run: the planned observations not already saved under their key, grouped by side and
execution, one model resident at a time, the reference first. Each observation is saved under its key as it
completes, and an interrupted one resumes from what its observer left in its folder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from evalsuite.backends import load_backend, load_pair
from evalsuite.backends.options import BackendOptions
from evalsuite.observation import Observation
from evalsuite.offline import hub_offline
from evalsuite.plan import PlannedObservation, RunPlan, is_saved, recorded_observation, saved_folder
from evalsuite.run_folder import RunFolder
from evalsuite.side import Side
from evalsuite.task import (
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
) -> dict[str, Observation]:
    """Phase 2: every planned observation, loading each (side, execution) once, one model at a time."""
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
    for (role, options, partner_options), todo in groups.items():
        side, partner = todo[0].side, todo[0].partner
        if on_load is not None:
            if partner is not None:
                on_load(partner, partner_options)
            on_load(side, options)
        if partner is not None:
            backend = load_pair(partner.checkpoint, partner_options, side.checkpoint, options)
        else:
            backend = load_backend(side.checkpoint, options)
        try:
            for planned in todo:
                work = folder.observation_work(planned.role, planned.need.observer.name, planned.key, resume)
                label = f"{role} ({options.backend})"

                def labelled(what: str, total: int, label: str = label) -> Callable[[], None]:
                    return progress(f"{label}: {what}", total)

                inputs = planned.inputs
                if planned.consumes:
                    inputs = {**inputs, "observed": {k: observed[key] for k, key in planned.consumes.items()}}
                # An observer that hands the model to a field tool (lm-eval loads its tasks' data again)
                # reads only local caches, unless the run was allowed to download.
                with hub_offline(not plan.allow_download):
                    obs = planned.need.observer.observe(backend, inputs, work, labelled)
                obs.key = planned.key
                obs.meta["tasks"] = sorted(planned.tasks)
                obs.save(work)
                observed[planned.key] = Observation.load(
                    folder.commit_observation(work, saved_folder(folder, planned))
                )
        finally:
            backend.close()
    return observed
