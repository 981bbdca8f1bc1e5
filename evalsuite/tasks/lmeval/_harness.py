"""The `lmeval` task's side of lm-eval: its spec (which lm-eval tasks, shots and limits), lm-eval's API found
and checked, its task configs loaded (the shipped evalsuite-mini among them) and digested, so that a
recording made on other documents is refused; lm-eval's own logging and environment survey kept quiet."""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import inspect
import itertools
import json
import logging
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import field_validator

from evalsuite.contract.spec import StrictModel, TaskSpec, default_spec_path
from evalsuite.errors import DependencyError, InputError

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


def sha256_json(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def task_digest(leaf: Any, limit: int | None, num_fewshot: int | None) -> str:
    """Identity of what a leaf task asks: its config (prompts, choices, metrics, filters) and the documents
    scored (the first `limit`), with the few-shot documents where few-shot prompts may be built."""
    config = {k: v for k, v in leaf.dump_config().items() if k not in _LOCATION_FIELDS}
    parts = {"config": config, "docs": [sha256_json(doc) for doc in itertools.islice(leaf.eval_docs, limit)]}
    if num_fewshot or leaf.get_config("num_fewshot"):
        fewshot = leaf.fewshot_docs() or []
        parts["fewshot_docs"] = [sha256_json(doc) for doc in fewshot]
    return sha256_json(parts)


def metric_keys(leaf: Any) -> list[str]:
    """The per-document score names of a leaf task: `metric`, or `metric,filter` under a named filter."""
    filters = [f["name"] for f in (leaf.get_config("filter_list") or [])] or ["none"]
    names = list(leaf.higher_is_better())
    return [m if f == "none" else f"{m},{f}" for f in filters for m in names]


# --------------------------------------------------------------------------------------------------------
# Observing: lm-eval on one side, its samples read back
# --------------------------------------------------------------------------------------------------------
