"""The evalsuite-mini items, read from the JSONL files beside this module wherever it is installed.

lm-eval resolves a task's relative `data_files` against the working directory, not the YAML's folder, so
the tasks load their data through this `custom_dataset` hook instead: the same YAML then works from a
checkout, from the wheel (`evalsuite/_task_specs/lmeval/`) and through `lm_eval --include_path`.
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _split(name: str) -> datasets.Dataset:
    lines = (HERE / name).read_text(encoding="utf-8").splitlines()
    return datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])


def multiple_choice(**_: object) -> datasets.DatasetDict:
    """The 100 multiple-choice items (`test`) and the worked examples for few-shot prompts (`dev`)."""
    return datasets.DatasetDict({"test": _split("mc_test.jsonl"), "dev": _split("mc_dev.jsonl")})


def generation(**_: object) -> datasets.DatasetDict:
    """The short-answer items scored by exact match (`test`) and their few-shot examples (`dev`)."""
    return datasets.DatasetDict({"test": _split("gen_test.jsonl"), "dev": _split("gen_dev.jsonl")})
