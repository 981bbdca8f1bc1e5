"""lmeval's refusals: exit 2, one line, decided before any model loads, no report written."""

from __future__ import annotations

from tests.conftest import assert_refused, cli_in_process, run_cli

SPEC = 'tasks = ["evalsuite-mini"]\nlimit = 2\n'

# A task of the user's own whose data set lives on the hub and was never downloaded here.
NOT_CACHED = """task: not-cached
dataset_path: evalsuite-tests/never-downloaded
output_type: multiple_choice
test_split: test
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: answer
"""

# An lm-eval from before TaskManager.load and simple_evaluate(task_manager=, log_samples=).
OLD_LM_EVAL = {
    "lm_eval/__init__.py": '__version__ = "0.3.0"\ndef simple_evaluate(model, tasks=None): ...\n',
    "lm_eval/models/__init__.py": "",
    "lm_eval/models/huggingface.py": "class HFLM:\n    pass\n",
    "lm_eval/tasks/__init__.py": "class TaskManager:\n    def __init__(self, include_path=None): ...\n",
}


def run_lmeval(
    tiny_pair, tmp_path, spec_text: str, *extra: str, in_process: bool = True
) -> tuple[int, list[str]]:
    """Exit code and stderr lines of an lmeval run on the tiny pair (through the CLI's entry point in this
    process, or as a child process where the environment must differ)."""
    spec = tmp_path / "lmeval.toml"
    spec.write_text(spec_text)
    args = (
        "run",
        "--ckpt",
        tiny_pair["tiny-minicpmv47-w4a8"],
        "--ref",
        tiny_pair["tiny-minicpmv47-bf16"],
        "--tasks",
        "lmeval",
        "--spec",
        f"lmeval={spec}",
        "--out",
        tmp_path / "out",
        "--quiet",
        *extra,
    )
    if in_process:
        code, lines, _ = cli_in_process(*args)
    else:
        res = run_cli(*args)
        code, lines = res.returncode, res.error_lines
    assert not any(line.startswith("loading") for line in lines)  # refused before any model loads
    assert not (tmp_path / "out" / "results.json").exists()
    return code, lines


def test_an_unknown_lm_eval_task_is_refused(tiny_pair, tmp_path):
    res = run_lmeval(tiny_pair, tmp_path, 'tasks = ["evalsuite-mnii"]\n')
    assert_refused(*res, "unknown lm-eval task 'evalsuite-mnii'", "did you mean 'evalsuite-mini'?")


def test_a_task_whose_data_is_not_in_the_cache_is_refused(tiny_pair, tmp_path):
    folder = tmp_path / "my-tasks"
    folder.mkdir()
    (folder / "not-cached.yaml").write_text(NOT_CACHED)
    res = run_lmeval(tiny_pair, tmp_path, f'tasks = ["not-cached"]\ninclude_path = "{folder}"\n')
    assert_refused(*res, "lm-eval task 'not-cached' cannot be loaded", "--allow-download")


def test_an_lm_eval_without_the_needed_api_is_refused(tiny_pair, tmp_path, monkeypatch):
    for name, text in OLD_LM_EVAL.items():
        (tmp_path / "old" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "old" / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "old"))
    res = run_lmeval(tiny_pair, tmp_path, SPEC, in_process=False)
    assert_refused(*res, "lm-eval 0.3.0 lacks", "TaskManager.load", "needs lm-eval >= 0.4.13")


def test_a_threshold_on_a_metric_lm_eval_does_not_report_is_refused(tiny_pair, tmp_path):
    # A dotted key, as users write it; the other misnamed thresholds are refused the same way (unit tests).
    thresholds = tmp_path / "thresholds.toml"
    thresholds.write_text("[lmeval]\nevalsuite-mini.accuracy.recovery = { min = 0.9 }\n")
    res = run_lmeval(tiny_pair, tmp_path, SPEC, "--thresholds", str(thresholds))
    assert_refused(*res, "`evalsuite-mini` reports acc, acc_norm")
