"""Greedy answers of one side decoded with drafting (speculative decoding), each prompt alone, with what the
drafting cost: Transformers' assisted generation (`evalsuite.backends.drafting`) on the side's own model,
drafting by prompt lookup or by a draft checkpoint.

An observation of answers like `greedy_answers`' (tokens, text, per step the top-k as the verification
forward ranked it), each prompt decoded alone (Transformers drafts for one sequence at a time), so that it
pairs with the side's own greedy answers decoded alone (`evalsuite.tasks.answer_pairs`); beside them, per
prompt, the target's forwards (`rounds`: each a verification round, the first also the prompt's prefill) and
the drafted tokens they verified (`drafted`). Where the side runs on a GPU, each prompt is also timed, drafted
and plain, each the side's own decoding (`seconds`, `plain_seconds`); on a CPU shared with other work a wall
time says more about the machine than about the drafting, and neither is taken.

A draft checkpoint is loaded beside the side's model, whole, with the project's own loading code and the
side's dtype and device, once the first prompt needs it: a second model resident for the observation's
length, which speculative decoding needs by its nature. A streamed side drafts too, each of its verification
rounds reading every decoder layer once (`StreamedBackend.generate_drafted`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evalsuite.backends.drafting import Drafting, wall_seconds
from evalsuite.contract.observation import Observation
from evalsuite.errors import DependencyError
from evalsuite.observers.greedy_answers import (
    GreedyAnswers,
    answers_observation,
    configuration_of,
    decoded,
    model_inputs,
)
from evalsuite.protocol.task import Inputs, Progress

if TYPE_CHECKING:
    from evalsuite.backends import Backend

DRAFTED = "drafted"


class DraftedAnswers(GreedyAnswers):
    """Observer: each prompt's greedy answer decoded alone with `drafting` (module docstring). `drafting`
    names what drafts, as the observation's identity keeps it (a draft checkpoint by its content's digest);
    `draft` is where a draft checkpoint lies (None: prompt lookup), `settings` the drafting's numbers."""

    records_itself = True

    def __init__(
        self,
        name: str,
        what: str,
        identity: dict[str, Any],
        top_k: int,
        drafting: dict[str, Any],
        settings: Drafting,
        draft: Path | None = None,
    ) -> None:
        super().__init__(name, what, identity, top_k, 0, 1)
        self.drafting, self.settings, self.draft = drafting, settings, draft

    def identity(self) -> dict[str, Any]:
        return {
            **self._identity,
            "top_k": self.top_k,
            "drafting": self.drafting,
            "decoding": "alone, drafted",
        }

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        if not callable(getattr(backend, "generate_drafted", None)):
            raise DependencyError(
                f"backend {type(backend).__name__} runs no Transformers model to draft for (assisted "
                "generation)"
            )
        prompts = self.prompts(inputs)
        step = progress(f"{self.what}, drafted", len(prompts))
        device = getattr(backend, "device", None)
        timed = device is not None and device.type == "cuda"
        loaded: list[Any] = []  # the draft's backend, once loaded

        def generate(chosen: list[dict[str, Any]]) -> list[Any]:
            if self.draft is not None and not loaded:
                loaded.append(load_draft(self.draft, backend))
            drafting = replace(self.settings, draft=loaded[0].model) if loaded else self.settings
            found = []
            for prompt in chosen:
                x = model_inputs(prompt["ids"], prompt.get("extra"))
                limit = int(prompt["max_new_tokens"])
                generation = backend.generate_drafted(x, limit, drafting, self.top_k)
                if timed:
                    plain = functools.partial(backend.generate_greedy, x, limit, self.top_k)
                    generation.counts["plain_seconds"] = wall_seconds(device, plain)[1]
                found.append(generation)
            return found

        plan = [[i] for i in range(len(prompts))]
        try:
            documents, _ = decoded(backend, prompts, plan, folder, self.top_k, 0, step, DRAFTED, generate)
        finally:
            for draft in loaded:
                draft.close()
        configuration = configuration_of(backend, 1)
        meta = {
            "execution": backend.describe(),
            "configuration": configuration.to_json(),
            "drafting": self.drafting,
            **self.meta(inputs),
        }
        observation = answers_observation(self.name, documents, None, self.top_k, meta)
        for count in ("rounds", DRAFTED):
            observation.arrays[count] = np.asarray([d[count] for d in documents], dtype=np.int64)
        for timing in ("seconds", "plain_seconds"):
            observation.arrays[timing] = np.asarray(
                [np.nan if d.get(timing) is None else d[timing] for d in documents], dtype=np.float64
            )
        return observation


def load_draft(path: Path, backend: Backend) -> Any:
    """The draft checkpoint at `path`, loaded whole by the `hf` backend on the side's dtype and device."""
    from evalsuite.backends import load_backend
    from evalsuite.backends.options import BackendOptions
    from evalsuite.files.checkpoint import Checkpoint

    side = getattr(backend, "options", BackendOptions())
    device = "cpu" if getattr(backend, "device", None) is None else str(backend.device)
    options = BackendOptions(dtype=side.dtype, device=device, trust_remote_code=side.trust_remote_code)
    return load_backend(Checkpoint.open(path), options)
