"""Downstream accuracy, paired: lm-eval tasks run on both sides, compared document by document.

lm-eval does the evaluating: each side's loaded model is handed to its `HFLM` and its `simple_evaluate` runs
the tasks of `tasks/lmeval.toml` with per-document samples kept. This module only reads those samples back
(scores, per-choice log-likelihoods, answers) and compares the two sides on the same documents with
`evalsuite.metrics`: accuracy of each side, the paired difference and its paired standard error, recovery,
flips and McNemar's exact test, and for multiple choice the KL divergence between the two sides' distributions
over the choices. Same accuracy can hide many changed answers; the paired view shows them.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import hashlib
import inspect
import itertools
import json
import logging
from collections.abc import Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import field_validator

from evalsuite import metrics
from evalsuite.backends import HFModelAccess, exposes_model
from evalsuite.errors import DependencyError, InputError
from evalsuite.observation import Observation
from evalsuite.offline import hub_offline
from evalsuite.run_folder import write_atomic
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec, default_spec_path
from evalsuite.task import Inputs, Need, Progress, RunContext, TaskResult, TaskSkipped, task

if TYPE_CHECKING:
    from evalsuite.backends import Backend

OBSERVER_NAME = "lmeval-samples"
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
MIN_LM_EVAL = "0.4.13"


class CompareOptions(StrictModel):
    max_flipped_rows: int = 20  # flipped documents listed in report.md per lm-eval task
    text_chars: int = 160  # of each question and answer shown there


class LmEvalSpec(TaskSpec):
    """The lm-eval tasks (names, groups or tags) and how lm-eval runs them."""

    tasks: list[str]
    num_fewshot: int | None = None  # None: each task's own default
    limit: int | None = None  # documents per task, the first ones (None: all)
    batch_size: int = 1
    include_path: str | None = None  # lm-eval's option: a folder of your own task YAMLs
    compare: CompareOptions = CompareOptions()

    @field_validator("tasks")
    @classmethod
    def _named_once(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one lm-eval task")
        if len(set(value)) != len(value):
            raise ValueError(f"tasks named twice: {sorted({t for t in value if value.count(t) > 1})}")
        return value

    @field_validator("num_fewshot")
    @classmethod
    def _non_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("must be 0 or more")
        return value

    @field_validator("limit", "batch_size")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be 1 or more")
        return value


# --------------------------------------------------------------------------------------------------------
# lm-eval: its API, its task index, quietly
# --------------------------------------------------------------------------------------------------------


def lm_eval_api() -> tuple[Any, Any, Any, str]:
    """`simple_evaluate`, `HFLM`, `TaskManager` and lm-eval's version; DependencyError when lm-eval is missing
    or lacks what this task calls (checked on the API itself, not on a version number)."""
    try:
        import lm_eval
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise DependencyError(
            f"the lmeval task needs lm-eval >= {MIN_LM_EVAL} (pip install 'evalsuite[lmeval]'): {exc}"
        ) from None
    found = getattr(lm_eval, "__version__", None) or _installed_version()
    needed = {
        "simple_evaluate(task_manager=, log_samples=)": {"task_manager", "log_samples", "limit"}
        <= set(inspect.signature(simple_evaluate).parameters),
        "TaskManager(include_defaults=)": "include_defaults" in inspect.signature(TaskManager).parameters,
        "TaskManager.load": callable(getattr(TaskManager, "load", None)),
    }
    missing = [name for name, ok in needed.items() if not ok]
    if missing:
        raise DependencyError(
            f"lm-eval {found} lacks {', '.join(missing)}; the lmeval task needs lm-eval >= {MIN_LM_EVAL}"
        )
    return simple_evaluate, HFLM, TaskManager, str(found)


def _installed_version() -> str:
    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's info and warning lines off (evalsuite reports what matters); errors still show."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def without_environment_survey() -> Iterator[None]:
    """`simple_evaluate` without the survey of the machine it appends to every result: lm-eval has no switch
    for it, and it runs `git`, `pip`, `conda` and `nvidia-smi` in subprocesses (torch's `collect_env`) for
    keys evalsuite never reads (`pretty_env_info`, `git_hash`, `upper_git_hash`); what evalsuite records of
    the machine is its own `machine` block. Where a later lm-eval moves these functions, its survey simply
    runs."""
    import lm_eval.evaluator as evaluator

    no_ops = {"add_env_info": lambda storage: None, "get_git_commit_hash": lambda: None}
    saved = {name: getattr(evaluator, name) for name in no_ops if hasattr(evaluator, name)}
    for name in saved:
        setattr(evaluator, name, no_ops[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(evaluator, name, value)


def shipped_task_folder() -> Path:
    """`tasks/lmeval/` (evalsuite-mini), beside the shipped spec in a checkout and in the wheel alike."""
    return default_spec_path("lmeval").with_suffix("")


@functools.cache
def _task_manager(folders: tuple[str, ...], defaults: bool) -> Any:
    # Indexing lm-eval's own 14,000 task configs takes tens of seconds: once per process at most, and only
    # when a task outside `folders` is asked for.
    _, _, TaskManager, _ = lm_eval_api()
    with quiet_lm_eval():
        return TaskManager(include_path=list(folders), include_defaults=defaults)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_tasks(
    names: list[str], folders: tuple[str, ...], allow_download: bool
) -> tuple[Any, dict[str, Any]]:
    """The task manager that knows `names` and the leaf tasks they load to, by name; unknown names are an
    InputError, tasks that cannot load (their data not in the datasets cache) a DependencyError."""
    hint = "" if allow_download else " (is its data in the datasets cache? else --allow-download)"
    small = _task_manager(folders, False)
    if all(n in small.all_tasks for n in names):
        # A group of these folders may name one of lm-eval's own tasks: then index those too.
        with contextlib.suppress(KeyError):
            return small, _leaves(small, names, hint)
    manager = _task_manager(folders, True)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        where = f" or in {', '.join(folders)}" if folders else ""
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InputError(f"unknown lm-eval task {unknown[0]!r} (not among lm-eval's tasks{where}){hint}")
    try:
        return manager, _leaves(manager, names, hint)
    except KeyError as exc:
        raise InputError(f"an lm-eval task names a task lm-eval does not know: {_first_line(exc)}") from None


def _leaves(manager: Any, names: list[str], hint: str) -> dict[str, Any]:
    leaves: dict[str, Any] = {}
    for name in names:
        try:
            with quiet_lm_eval():
                leaves.update(manager.load([name])["tasks"])
        except KeyError:
            raise
        except Exception as exc:
            reason = f"lm-eval task {name!r} cannot be loaded{hint}: {_first_line(exc)}"
            raise DependencyError(reason) from None
    return leaves


# Task config fields that say where the data lies, not what is asked: the documents are hashed instead.
_LOCATION_FIELDS = ("custom_dataset", "dataset_kwargs", "metadata")


def _sha256_json(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def task_digest(leaf: Any, limit: int | None, num_fewshot: int | None) -> str:
    """Identity of what a leaf task asks: its config (prompts, choices, metrics, filters) and the documents
    scored (the first `limit`), with the few-shot documents where few-shot prompts may be built."""
    config = {k: v for k, v in leaf.dump_config().items() if k not in _LOCATION_FIELDS}
    parts = {"config": config, "docs": [_sha256_json(doc) for doc in itertools.islice(leaf.eval_docs, limit)]}
    if num_fewshot or leaf.get_config("num_fewshot"):
        fewshot = leaf.fewshot_docs() or []
        parts["fewshot_docs"] = [_sha256_json(doc) for doc in fewshot]
    return _sha256_json(parts)


def metric_keys(leaf: Any) -> list[str]:
    """The per-document score names of a leaf task: `metric`, or `metric,filter` under a named filter."""
    filters = [f["name"] for f in (leaf.get_config("filter_list") or [])] or ["none"]
    names = list(leaf.higher_is_better())
    return [m if f == "none" else f"{m},{f}" for f in filters for m in names]


# --------------------------------------------------------------------------------------------------------
# Observing: lm-eval on one side, its samples read back
# --------------------------------------------------------------------------------------------------------


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
            "docs_sha256": _sha256_json(
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
            "lmeval_tasks_sha256": _sha256_json(digests),
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
                "ref": _pm(v, f"{p}.ref"),
                "ckpt": _pm(v, f"{p}.ckpt"),
                "Δ (paired)": _pm(v, f"{p}.delta"),
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
                row["choice KLD"] = _pm(v, f"{p}.choice_kld_mean")
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
                    "question": _tail(ckpt["questions"][i], chars),
                    "ref answer": _head(_side_answer(ref, i, key), chars),
                    "ckpt answer": _head(_side_answer(ckpt, i, key), chars),
                    "gold": _head(ckpt["gold"][i], chars),
                }
            )
        if len(order) > limit:
            rows.append({"table": table, "doc": "…", "question": f"{len(order) - limit} more not shown"})
        return rows


def compare_task(
    name: str, ref: Observation, ckpt: Observation
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The paired statistics of one lm-eval task, `<task>.<metric>.<stat>`, and per binary metric the flips
    per document (−1 correct → wrong, +1 wrong → correct, 0 unchanged)."""
    entry, ref_entry = ckpt.meta["lm_eval_tasks"][name], ref.meta["lm_eval_tasks"][name]
    values: dict[str, Any] = {}
    flips: dict[str, np.ndarray] = {}
    multiple_choice = f"{name}/lls" in ref.arrays and f"{name}/lls" in ckpt.arrays
    choice = _choice_statistics(name, ref, ckpt) if multiple_choice else None
    for key in entry["per_document"]:
        if key not in ref_entry["per_document"]:
            continue
        a, b = ref.arrays[f"{name}/{key}"], ckpt.arrays[f"{name}/{key}"]
        p = f"{name}.{key}"
        est_ref, est_ckpt = metrics.mean_with_stderr(a), metrics.mean_with_stderr(b)
        delta = metrics.paired_difference(a, b)
        values.update(
            {
                f"{p}.n": int(a.size),
                f"{p}.ref": est_ref.value,
                f"{p}.ref_stderr": est_ref.stderr,
                f"{p}.ckpt": est_ckpt.value,
                f"{p}.ckpt_stderr": est_ckpt.stderr,
                f"{p}.delta": delta.value,
                f"{p}.delta_stderr": delta.stderr,
                f"{p}.recovery": metrics.recovery(est_ref.value, est_ckpt.value),
            }
        )
        metric = key.split(",")[0]
        binary = np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all()
        if binary and entry["higher_is_better"].get(metric, True):
            f = metrics.flip_counts(a, b)
            values.update(
                {
                    f"{p}.flips_c2w": f.c2w,
                    f"{p}.flips_w2c": f.w2c,
                    f"{p}.flip_rate": f.rate,
                    f"{p}.mcnemar_p": metrics.mcnemar_exact_p(f.c2w, f.w2c),
                }
            )
            flips[key] = (b - a).astype(np.int64)
        if choice is not None:
            kld, changed = choice
            values[f"{p}.choice_kld_mean"] = kld.value
            values[f"{p}.choice_kld_mean_stderr"] = kld.stderr
            values[f"{p}.choice_change_rate"] = changed
    return values, flips


def _choice_statistics(name: str, ref: Observation, ckpt: Observation) -> tuple[metrics.Estimate, float]:
    """Mean KL divergence between the sides' softmax distributions over each document's choices, and the
    share of documents whose most likely choice changed, right or wrong."""
    counts = ref.arrays[f"{name}/n_choices"]
    if not np.array_equal(counts, ckpt.arrays[f"{name}/n_choices"]):
        raise InputError(f"the sides were given different choices in {name!r}")
    ends = np.cumsum(counts)
    a = np.split(ref.arrays[f"{name}/lls"], ends[:-1])
    b = np.split(ckpt.arrays[f"{name}/lls"], ends[:-1])
    kld = [metrics.choice_kl_divergence(x, y) for x, y in zip(a, b, strict=True)]
    changed = [int(np.argmax(x)) != int(np.argmax(y)) for x, y in zip(a, b, strict=True)]
    return metrics.mean_with_stderr(kld), float(np.mean(changed))


def _side_answer(entry: dict[str, Any], i: int, key: str) -> str:
    """What a side answered: its most likely choice, or its generated text (under the metric's filter)."""
    if "choices" in entry:
        chosen = entry["chosen"][i]
        return entry["choices"][i][chosen.get(key.split(",")[0], chosen["acc"])].strip()
    filter_name = key.split(",")[1] if "," in key else "none"
    return entry["answers"].get(filter_name, [""] * (i + 1))[i].strip()


def _pm(values: dict[str, Any], name: str) -> str:
    value, err = values.get(name), values.get(f"{name}_stderr")
    if not isinstance(value, float):
        return "" if value is None else str(value)
    text = f"{value:.4g}"
    return f"{text} ± {err:.2g}" if isinstance(err, float) and np.isfinite(err) else text


def _tail(text: str, chars: int) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def _head(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + "…"
