"""The `lmeval` task's observation: lm-eval run on one side's loaded model with per-document samples kept,
and those samples read back (scores, per-choice log-likelihoods, answers), the part a report and a pairing
need and nothing else."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evalsuite.backends import HFModelAccess
from evalsuite.contract.observation import Observation
from evalsuite.errors import DependencyError, InputError
from evalsuite.files.run_folder import write_atomic
from evalsuite.protocol.task import Inputs, Progress
from evalsuite.tasks.lmeval._harness import (
    LmEvalSpec,
    lm_eval_api,
    quiet_lm_eval,
    sha256_json,
    without_environment_survey,
)

if TYPE_CHECKING:
    from evalsuite.backends import Backend

OBSERVER_NAME = "lmeval-samples"


def _number(value: Any) -> float | None:
    if isinstance(value, bool | int | float | np.number):
        return float(value)
    return None


def _choice(argument: Any, delimiter: str) -> str:
    """A choice as the task wrote it: the continuation scored, without the target delimiter before it."""
    text = str(argument[1]) if isinstance(argument, list | tuple) and len(argument) > 1 else ""
    return text.removeprefix(delimiter)


def _question(prompt: str, config: Mapping[str, Any], n_shot: Any) -> str:
    """The document's own question: the prompt after its few-shot examples, if it has any."""
    delimiter = config.get("fewshot_delimiter") or "\n\n"
    return prompt.rsplit(delimiter, 1)[-1] if n_shot and delimiter in prompt else prompt


def chosen_answers(lls: list[float], choices: list[str]) -> dict[str, int]:
    """The choice each of lm-eval's multiple-choice metrics picks: the highest log-likelihood (`acc`), per
    character (`acc_norm`), per UTF-8 byte (`acc_bytes`); the rule is lm-eval's, restated for the report."""
    ll = np.asarray(lls, dtype=np.float64)
    chars = np.asarray([max(len(c), 1) for c in choices], dtype=np.float64)
    nbytes = np.asarray([max(len(c.encode("utf-8")), 1) for c in choices], dtype=np.float64)
    return {
        "acc": int(np.argmax(ll)),
        "acc_norm": int(np.argmax(ll / chars)),
        "acc_bytes": int(np.argmax(ll / nbytes)),
    }


def read_samples(results: Mapping[str, Any], text_chars: int = 400) -> dict[str, dict[str, Any]]:
    """Per leaf task, lm-eval's per-document samples as evalsuite keeps them (JSON): document ids and hashes,
    the end of each prompt, the gold answer, the answers given, the per-document scores by `metric[,filter]`,
    and for multiple choice the per-choice log-likelihoods and choices. Texts are cut to `text_chars`, enough
    for any report (which cuts them further), few enough to keep a recording of a large benchmark small."""
    out: dict[str, dict[str, Any]] = {}
    for name, samples in results["samples"].items():
        config = results["configs"].get(name, {})
        by_filter: dict[str, list[dict[str, Any]]] = {}
        for sample in samples:
            by_filter.setdefault(sample["filter"], []).append(sample)
        for rows in by_filter.values():
            rows.sort(key=lambda s: s["doc_id"])
        first = next(iter(by_filter.values()))
        multiple_choice = config.get("output_type") == "multiple_choice"
        entry: dict[str, Any] = {
            "version": results["versions"].get(name),
            "n_shot": results["n-shot"].get(name),
            "output_type": config.get("output_type"),
            "higher_is_better": results.get("higher_is_better", {}).get(name, {}),
            "lm_eval_results": {
                k: float(v) for k, v in results["results"].get(name, {}).items() if _number(v) is not None
            },
            "doc_ids": [int(s["doc_id"]) for s in first],
            "docs_sha256": sha256_json(
                [[s.get("doc_hash"), s.get("prompt_hash"), s.get("target_hash")] for s in first]
            ),
            "questions": [
                _question(str(s["arguments"][0][0]), config, results["n-shot"].get(name))[-text_chars:]
                for s in first
            ],
            "scores": {},
            "answers": {},
        }
        if multiple_choice:
            delimiter = config.get("target_delimiter", " ")
            choices = [[_choice(a, delimiter) for a in s["arguments"]] for s in first]
            entry["lls"] = [[float(r[0]) for r in s["filtered_resps"]] for s in first]
            entry["chosen"] = [chosen_answers(ll, c) for ll, c in zip(entry["lls"], choices, strict=True)]
            entry["choices"] = [[c[:text_chars] for c in row] for row in choices]
            entry["gold"] = [_gold(s["target"], row) for s, row in zip(first, entry["choices"], strict=True)]
        else:
            entry["gold"] = [_gold(s["target"], None)[:text_chars] for s in first]
        for filter_name, rows in by_filter.items():
            if [int(s["doc_id"]) for s in rows] != entry["doc_ids"]:
                raise InputError(f"lm-eval returned other documents under filter {filter_name!r} of {name!r}")
            if not multiple_choice:
                entry["answers"][filter_name] = [_answer(s["filtered_resps"])[:text_chars] for s in rows]
            for metric in rows[0]["metrics"]:
                key = metric if filter_name == "none" else f"{metric},{filter_name}"
                entry["scores"][key] = [_number(s.get(metric)) for s in rows]
        out[name] = entry
    return out


def _gold(target: Any, choices: list[str] | None) -> str:
    """The gold answer in words: the choice a multiple-choice index names, or the target text."""
    if choices is not None:
        indices = target if isinstance(target, list) else [target]
        words = [choices[i] if isinstance(i, int) and 0 <= i < len(choices) else str(i) for i in indices]
        return " | ".join(words)
    return " | ".join(map(str, target)) if isinstance(target, list) else str(target)


def _answer(filtered: Any) -> str:
    first = filtered[0] if isinstance(filtered, list | tuple) and filtered else filtered
    return str(first)


class LmEvalSamples:
    """Observer: the spec's lm-eval tasks run by lm-eval on the loaded model, their per-document samples kept.

    Each spec task is saved as it completes, so an interrupted observation resumes at the next one.
    """

    name = OBSERVER_NAME

    def __init__(self, spec: LmEvalSpec) -> None:
        self.spec = spec

    def identity(self) -> dict[str, Any]:
        # What lm-eval is asked to do; the task versions, configs and documents are in the inputs' hashes.
        return {
            "tasks": list(self.spec.tasks),
            "num_fewshot": self.spec.num_fewshot,
            "limit": self.spec.limit,
            "batch_size": self.spec.batch_size,
        }

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        simple_evaluate, HFLM, _, lm_eval_version = lm_eval_api()
        if not isinstance(backend, HFModelAccess):
            raise DependencyError(f"backend {type(backend).__name__} does not expose a Transformers model")
        step = progress("lm-eval tasks", len(self.spec.tasks))
        lm = None
        entries: dict[str, Any] = {}
        for i, name in enumerate(self.spec.tasks):
            saved = folder / f"task-{i:03d}.json"
            if not saved.is_file():
                if lm is None:
                    with quiet_lm_eval():
                        # A copy: lm-eval may give the tokenizer a pad token; the backend's stays as it is.
                        lm = HFLM(
                            pretrained=backend.model,
                            tokenizer=copy.deepcopy(backend.tokenizer),
                            batch_size=self.spec.batch_size,
                        )
                # lm-eval draws its own progress bars (explicitly enabled): they go to a log beside the
                # samples, evalsuite shows one step per task.
                folder.mkdir(parents=True, exist_ok=True)
                with (
                    quiet_lm_eval(),
                    without_environment_survey(),
                    open(folder / "lm-eval.log", "a", encoding="utf-8") as log,
                    contextlib.redirect_stderr(log),
                ):
                    results = simple_evaluate(
                        model=lm,
                        tasks=[name],
                        num_fewshot=self.spec.num_fewshot,
                        limit=self.spec.limit,
                        task_manager=inputs["task_manager"],
                        log_samples=True,
                        bootstrap_iters=0,  # evalsuite computes every error bar itself
                    )
                write_atomic(saved, json.dumps(read_samples(results)))
            entries.update(json.loads(saved.read_text(encoding="utf-8")))
            step()
        return samples_observation(entries, lm_eval_version, backend.describe(), inputs)

    def record(self, obs: Observation, folder: Path) -> Observation:
        """The samples are already compact (per document: scores, choice log-likelihoods, short texts)."""
        return Observation(name=obs.name, key=obs.key, meta=obs.meta, arrays=obs.arrays)


def samples_observation(
    entries: dict[str, dict[str, Any]], lm_eval_version: str, execution: dict[str, Any], inputs: Inputs
) -> Observation:
    """The observation of one side: numbers as arrays (`TASK/METRIC`, `TASK/lls` with `TASK/n_choices`),
    texts and lm-eval's own summary in the metadata."""
    arrays: dict[str, np.ndarray] = {}
    tasks_meta: dict[str, Any] = {}
    for name, entry in entries.items():
        entry = dict(entry)
        arrays[f"{name}/doc_id"] = np.asarray(entry["doc_ids"], dtype=np.int64)
        per_document = []
        for key, values in entry.pop("scores").items():
            if all(v is not None for v in values):
                arrays[f"{name}/{key}"] = np.asarray(values, dtype=np.float64)
                per_document.append(key)
        entry["per_document"] = per_document
        if "lls" in entry:
            lls = entry.pop("lls")
            arrays[f"{name}/lls"] = np.asarray([v for row in lls for v in row], dtype=np.float64)
            arrays[f"{name}/n_choices"] = np.asarray([len(row) for row in lls], dtype=np.int64)
        tasks_meta[name] = entry
    return Observation(
        name=OBSERVER_NAME,
        meta={
            "lm_eval_version": lm_eval_version,
            "lmeval_tasks_sha256": inputs["lmeval_tasks_sha256"],
            "lm_eval_tasks": tasks_meta,  # (meta["tasks"] is the runner's: the evalsuite tasks served)
            "execution": execution,
        },
        arrays=arrays,
    )


# --------------------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------------------
