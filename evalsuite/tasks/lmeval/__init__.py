"""Downstream accuracy, paired: lm-eval tasks run on both sides, compared document by document.

lm-eval does the evaluating: each side's loaded model is handed to its `HFLM` and its `simple_evaluate` runs
the tasks of `tasks/lmeval.toml` with per-document samples kept. This module only reads those samples back
(scores, per-choice log-likelihoods, answers) and compares the two sides on the same documents with
`evalsuite.stats.metrics`: accuracy of each side, the paired difference and its paired standard error,
recovery, flips and McNemar's exact test, and for multiple choice the KL divergence between the two sides'
distributions over the choices. Same accuracy can hide many changed answers; the paired view shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from evalsuite.backends import exposes_model
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import TaskSpec
from evalsuite.errors import InputError
from evalsuite.inputs.offline import hub_offline
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Difference, Inputs, Need, RunContext, TaskResult, TaskSkipped, task
from evalsuite.stats import claims
from evalsuite.tasks.lmeval._harness import (
    LmEvalSpec,
    lm_eval_api,
    load_tasks,
    metric_keys,
    quiet_lm_eval,
    sha256_json,
    shipped_task_folder,
    task_digest,
    without_environment_survey,
)
from evalsuite.tasks.lmeval._pairing import compare_task, plus_minus, side_answer, text_head, text_tail
from evalsuite.tasks.lmeval._samples import (
    OBSERVER_NAME,
    LmEvalSamples,
    chosen_answers,
    read_samples,
    samples_observation,
)

# Names of lmeval_harness, lmeval_samples and lmeval_pairing that callers have always imported from here.
__all__ = [
    "OBSERVER_NAME",
    "STATS",
    "LmEval",
    "LmEvalSpec",
    "chosen_answers",
    "compare_task",
    "read_samples",
    "samples_observation",
    "shipped_task_folder",
    "without_environment_survey",
]

# The per-(task, metric) statistics, in the order the report shows them; `<task>.<metric>.<stat>`.
STATS = (
    "n",
    "ref",
    "ckpt",
    "delta",
    "delta_stderr",
    "recovery",
    "flips_c2w",
    "flips_w2c",
    "flip_rate",
    "mcnemar_p",
    "choice_kld_mean",
    "choice_change_rate",
)


@task("lmeval")
class LmEval:
    """lm-eval tasks on both sides, per document: accuracy, paired Δ, recovery, flips, McNemar p, choice KLD.

    Each statistic is named `<lm-eval task>.<metric>.<stat>` (see `STATS`); for multiple choice the KLD is
    between the two sides' softmax distributions over a question's choices."""

    spec_model: ClassVar[type[TaskSpec]] = LmEvalSpec
    # Named per lm-eval task and metric (`arc_easy.acc.recovery`): thresholds name them in full.
    metric_names: ClassVar[tuple[str, ...]] = tuple(f"*.{stat}" for stat in STATS)

    def __init__(self, spec: LmEvalSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """lm-eval found, the tasks known and loaded (their data in the cache), thresholds checked against
        the metrics they report, and what each side is asked hashed: all before any model loads."""
        for side in (ref, ckpt):
            if not side.is_recorded and not exposes_model(side.options.backend):
                raise TaskSkipped(
                    f"the {side.role} side runs on backend {side.options.backend!r}, which does not give "
                    "lm-eval a Transformers model"
                )
        lm_eval_api()
        folders = [shipped_task_folder()]
        if self.spec.include_path:
            user = Path(self.spec.include_path).expanduser().resolve()
            if not user.is_dir():
                raise InputError("include_path is not a folder of lm-eval task YAMLs", user)
            folders.append(user)
        with hub_offline(not self.context.allow_download):
            manager, leaves = load_tasks(
                list(self.spec.tasks), tuple(map(str, folders)), self.context.allow_download
            )
        for name, leaf in leaves.items():
            if getattr(leaf, "MULTIMODAL", False):
                raise InputError(f"lm-eval task {name!r} needs images or audio; lmeval runs text tasks only")
            if getattr(leaf, "UNSAFE_CODE", False):
                raise InputError(f"lm-eval task {name!r} executes model-written code; lmeval does not run it")
        self.check_threshold_names({name: metric_keys(leaf) for name, leaf in leaves.items()})
        with quiet_lm_eval():
            digests = {
                name: task_digest(leaf, self.spec.limit, self.spec.num_fewshot)
                for name, leaf in leaves.items()
            }
        return {
            "task_manager": manager,
            "lmeval_tasks": ",".join(leaves),
            "lmeval_versions": ",".join(f"{name}={leaf.VERSION}" for name, leaf in leaves.items()),
            "lmeval_tasks_sha256": sha256_json(digests),
        }

    def check_threshold_names(self, keys: dict[str, list[str]]) -> None:
        """Every threshold and regression tolerance names `<task>.<metric>.<stat>` of a task and metric this
        spec evaluates (InputError otherwise, before any model loads)."""
        valid = {f"{name}.{key}.{stat}" for name, ks in keys.items() for key in ks for stat in STATS}
        for name in [*self.spec.thresholds, *self.spec.regression]:
            if name in valid:
                continue
            task_name = next((t for t in keys if name.startswith(f"{t}.")), None)
            if task_name is None:
                raise InputError(
                    f"threshold {name!r} names no lm-eval task this spec runs (leaf tasks: {', '.join(keys)})"
                )
            raise InputError(
                f"threshold {name!r}: `{task_name}` reports {', '.join(keys[task_name])}; a threshold is "
                f"`{task_name}.METRIC.STAT` with STAT one of {', '.join(STATS)}"
            )

    def needs(self) -> list[Need]:
        observer = LmEvalSamples(self.spec)
        return [Need("ref", "ref", observer), Need("ckpt", "ckpt", observer)]

    def paired_differences(self, values: dict[str, Any]) -> list[Difference]:
        """Each lm-eval task and metric, the candidate against the reference on the same documents: McNemar's
        exact test of the flips for a right-or-wrong metric, else the paired t of the per-document
        differences (documents − 1 degrees of freedom). What reports name where significant, whether or not
        a check covers them."""
        found = []
        for prefix in [k.removesuffix(".n") for k, v in values.items() if k.endswith(".n") and v]:
            delta, figure = values.get(f"{prefix}.delta"), Difference.figure
            said = f"{figure(values.get(f'{prefix}.ref'))} → {figure(values.get(f'{prefix}.ckpt'))}"
            covers = tuple(f"{prefix}.{stat}" for stat in STATS)
            worse = isinstance(delta, int | float) and delta < 0
            if isinstance(values.get(f"{prefix}.mcnemar_p"), int | float):
                c2w, w2c = values[f"{prefix}.flips_c2w"], values[f"{prefix}.flips_w2c"]
                said += f", {c2w} documents correct → wrong against {w2c} wrong → correct"
                test = "McNemar's exact test of the flips, two-sided"
                p = float(values[f"{prefix}.mcnemar_p"])
            else:
                n, stderr = values[f"{prefix}.n"], values.get(f"{prefix}.delta_stderr")
                if not isinstance(delta, int | float) or not isinstance(stderr, int | float):
                    continue
                test = f"paired by document, t with {n - 1} degrees of freedom"
                p = claims.two_sided_p(float(delta), float(stderr), int(n))
            found.append(Difference(f"`{prefix}`", said, test, p, worse, covers))
        return found

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ckpt = observed["ref"], observed["ckpt"]
        if ref.meta["lmeval_tasks_sha256"] != ckpt.meta["lmeval_tasks_sha256"]:
            raise InputError("the sides ran lm-eval tasks with other configs or documents")
        values: dict[str, Any] = {
            "lm_eval_version": ckpt.meta["lm_eval_version"],
            "ref_lm_eval_version": ref.meta["lm_eval_version"],
            "lmeval_tasks": ",".join(ckpt.meta["lm_eval_tasks"]),
            "lmeval_tasks_sha256": ckpt.meta["lmeval_tasks_sha256"],
            "num_fewshot": "task default" if self.spec.num_fewshot is None else self.spec.num_fewshot,
            "limit": "all documents" if self.spec.limit is None else self.spec.limit,
        }
        null_reasons: dict[str, str] = {}
        details: list[dict[str, Any]] = []
        for name, entry in ckpt.meta["lm_eval_tasks"].items():
            ref_entry = ref.meta["lm_eval_tasks"].get(name)
            if ref_entry is None or ref_entry["docs_sha256"] != entry["docs_sha256"]:
                raise InputError(f"the sides were evaluated on different documents or prompts of {name!r}")
            task_values, flips = compare_task(name, ref, ckpt)
            for key, value in task_values.items():
                if key.endswith(".recovery") and not np.isfinite(value):
                    null_reasons[key] = "the reference scores 0: recovery is undefined"
            values.update(task_values)
            details += self.summary_rows(name, entry, task_values)
            details += self.flipped_rows(name, ref_entry, entry, flips)
        values["n_documents"] = sum(len(e["doc_ids"]) for e in ckpt.meta["lm_eval_tasks"].values())
        checks, not_measured = self.spec.threshold_checks(values)
        result = TaskResult.from_checks(values, checks, details=details, null_reasons=null_reasons)
        result.not_measured = not_measured
        return result

    def summary_rows(self, name: str, entry: dict[str, Any], v: dict[str, Any]) -> list[dict[str, Any]]:
        """One row per metric of the task, for its table in report.md."""
        table = (
            f"lm-eval `{name}`: {len(entry['doc_ids'])} documents, {entry['n_shot']}-shot, "
            f"version {entry['version']}"
        )
        rows = []
        for key in entry["per_document"]:
            p = f"{name}.{key}"
            row = {
                "table": table,
                "metric": key,
                "ref": plus_minus(v, f"{p}.ref"),
                "ckpt": plus_minus(v, f"{p}.ckpt"),
                "Δ (paired)": plus_minus(v, f"{p}.delta"),
                "recovery": v.get(f"{p}.recovery"),
            }
            if f"{p}.flips_c2w" in v:
                row.update(
                    {
                        "correct → wrong": v[f"{p}.flips_c2w"],
                        "wrong → correct": v[f"{p}.flips_w2c"],
                        "flip rate": v[f"{p}.flip_rate"],
                        "McNemar p": v[f"{p}.mcnemar_p"],
                    }
                )
            if f"{p}.choice_kld_mean" in v:
                row["choice KLD"] = plus_minus(v, f"{p}.choice_kld_mean")
                row["answer changed"] = v[f"{p}.choice_change_rate"]
            rows.append(row)
        return rows

    def flipped_rows(
        self, name: str, ref: dict[str, Any], ckpt: dict[str, Any], flips: dict[str, np.ndarray]
    ) -> list[dict[str, Any]]:
        """The flipped documents of a task (correct → wrong first), truncated to the spec's row count."""
        limit, chars = self.spec.compare.max_flipped_rows, self.spec.compare.text_chars
        # Correct → wrong first: those are what a reader of a quantized model's card must see.
        order = sorted(
            ((int(d), key) for key, change in flips.items() for d in np.flatnonzero(change)),
            key=lambda item: (flips[item[1]][item[0]] > 0, item[0], item[1]),
        )
        table = f"flipped documents: `{name}`"
        rows = []
        for i, key in order[:limit]:
            rows.append(
                {
                    "table": table,
                    "doc": ckpt["doc_ids"][i],
                    "metric": key,
                    "flip": "correct → wrong" if flips[key][i] < 0 else "wrong → correct",
                    "question": text_tail(ckpt["questions"][i], chars),
                    "ref answer": text_head(side_answer(ref, i, key), chars),
                    "ckpt answer": text_head(side_answer(ckpt, i, key), chars),
                    "gold": text_head(ckpt["gold"][i], chars),
                }
            )
        if len(order) > limit:
            rows.append({"table": table, "doc": "…", "question": f"{len(order) - limit} more not shown"})
        return rows
