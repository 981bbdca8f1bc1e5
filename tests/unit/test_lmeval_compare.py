"""The lmeval task without a model: its comparison of constructed per-document results, its spec, its refusals
before anything loads. lm-eval itself runs in tests/e2e/test_lmeval.py."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from evalsuite.backends import HFModelAccess, exposes_model
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.spec import flat_metric_tables, load_spec
from evalsuite.errors import DependencyError, InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.pipeline.runner import build_tasks
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import RunContext, TaskSkipped
from evalsuite.reporting.diff_report import render_markdown
from evalsuite.tasks.lmeval import (
    LmEval,
    LmEvalSpec,
    chosen_answers,
    read_samples,
    samples_observation,
    shipped_task_folder,
)

# Ten documents, equal accuracy (5 of 10) and six flips: 0-2 correct → wrong, 5-7 wrong → correct.
REF = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
CKPT = [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
INPUTS = {"lmeval_tasks_sha256": "0" * 64}


def entry(correct: list[int], lls: list[list[float]]) -> dict[str, Any]:
    """A leaf task's samples as the observer keeps them: questions with a choice per log-likelihood, the gold
    answer always choice 0."""
    n, choices = len(correct), ["yes", "no", "maybe"][: len(lls[0])]
    return {
        "version": 1.0,
        "n_shot": 0,
        "output_type": "multiple_choice",
        "higher_is_better": {"acc": True},
        "lm_eval_results": {"acc,none": sum(correct) / n},
        "doc_ids": list(range(n)),
        "docs_sha256": "d" * 64,
        "questions": [f"Question: is {i} the answer?\nAnswer:" for i in range(n)],
        "choices": [choices] * n,
        "gold": ["yes"] * n,
        "answers": {},
        "scores": {"acc": [float(c) for c in correct]},
        "lls": lls,
        "chosen": [chosen_answers(ll, choices) for ll in lls],
    }


def observation(correct: list[int]) -> Any:
    # The most likely choice decides correctness: choice 0 (the gold) when correct.
    lls = [[-1.0, -2.0] if c else [-2.0, -1.0] for c in correct]
    return samples_observation({"toy": entry(correct, lls)}, "0.4.13", {"backend": "hf"}, INPUTS)


def lmeval_task(**spec: Any) -> LmEval:
    return LmEval(LmEvalSpec.model_validate({"tasks": ["toy"], **spec}), RunContext())


def test_equal_accuracy_with_many_flips_gives_the_hand_computed_statistics(tmp_path):
    result = lmeval_task().compare({"ref": observation(REF), "ckpt": observation(CKPT)}, tmp_path)
    m = result.metrics
    assert m["toy.acc.ref"] == m["toy.acc.ckpt"] == 0.5
    assert m["toy.acc.delta"] == 0.0
    assert m["toy.acc.delta_stderr"] == pytest.approx(math.sqrt(0.6 / 9), rel=1e-15)
    assert (m["toy.acc.flips_c2w"], m["toy.acc.flips_w2c"], m["toy.acc.flip_rate"]) == (3, 3, 0.6)
    assert m["toy.acc.mcnemar_p"] == 1.0
    assert m["toy.acc.recovery"] == 1.0
    # Each flip changed the chosen answer, and P = (0.731, 0.269) became (0.269, 0.731): KL = 0.4621 nats.
    p = 1 / (1 + math.exp(-1))
    kl = p * math.log(p / (1 - p)) + (1 - p) * math.log((1 - p) / p)
    assert m["toy.acc.choice_change_rate"] == 0.6
    assert m["toy.acc.choice_kld_mean"] == pytest.approx(0.6 * kl, rel=1e-12)
    assert m["n_documents"] == 10


def test_flipped_documents_are_listed_correct_to_wrong_first_and_truncated(tmp_path):
    task = lmeval_task(compare={"max_flipped_rows": 4, "text_chars": 12})
    result = task.compare({"ref": observation(REF), "ckpt": observation(CKPT)}, tmp_path)
    flipped = [row for row in result.details if row["table"] == "flipped documents: `toy`"]
    assert [row["doc"] for row in flipped] == [0, 1, 2, 5, "…"]
    assert [row["flip"] for row in flipped[:4]] == ["correct → wrong"] * 3 + ["wrong → correct"]
    assert flipped[0]["ref answer"] == "yes" and flipped[0]["ckpt answer"] == "no"
    assert flipped[0]["question"] == "…wer?\nAnswer:"  # the end of the prompt: 12 characters
    assert flipped[-1]["question"] == "2 more not shown"


def test_report_renders_one_table_per_lm_eval_task_and_one_of_flips(tmp_path):
    result = lmeval_task().compare({"ref": observation(REF), "ckpt": observation(CKPT)}, tmp_path)
    doc = {
        "verdict": result.status,
        "ckpt": {"path": "c", "format": "bf16"},
        "ref": {"path": "r", "format": "bf16"},
        "environment": {"device": "cpu", "device_name": "cpu", "dtype": "bfloat16", "packages": {}},
        "tasks": {"lmeval": result.to_json()},
    }
    md = render_markdown(doc)
    assert "### lm-eval `toy`: 10 documents, 0-shot, version 1.0" in md
    assert "| metric | ref | ckpt | Δ (paired) | recovery | correct → wrong |" in md
    assert "### flipped documents: `toy`" in md
    assert "| doc | metric | flip | question | ref answer | ckpt answer | gold |" in md


def test_sides_evaluated_on_other_documents_are_refused(tmp_path):
    other = observation(CKPT)
    other.meta["lm_eval_tasks"]["toy"]["docs_sha256"] = "e" * 64
    with pytest.raises(InputError, match="different documents"):
        lmeval_task().compare({"ref": observation(REF), "ckpt": other}, tmp_path)


def test_a_zero_reference_score_makes_recovery_null_with_its_reason(tmp_path):
    result = lmeval_task().compare({"ref": observation([0] * 4), "ckpt": observation([1, 0, 0, 0])}, tmp_path)
    doc = result.to_json()
    assert doc["metrics"]["toy.acc.recovery"] is None
    assert "reference scores 0" in doc["null_reasons"]["toy.acc.recovery"]


def test_thresholds_with_dotted_names_are_read_as_one_name(tmp_path):
    spec = tmp_path / "lmeval.toml"
    spec.write_text(
        'tasks = ["toy"]\n[thresholds]\ntoy.acc.recovery = { min = 0.9 }\n"toy.acc.delta" = { min = -0.1 }\n'
    )
    loaded = load_spec(LmEvalSpec, spec)
    assert set(loaded.thresholds) == {"toy.acc.recovery", "toy.acc.delta"}
    nested = {"a": {"b": {"max": 1}}, "c": {"min": 0}}
    assert flat_metric_tables(nested) == {"a.b": {"max": 1}, "c": {"min": 0}}


def test_threshold_names_are_checked_against_the_statistics_and_the_tasks_metrics():
    # The runner's check: a pattern of the task's metric_names must match, whatever the lm-eval task.
    build_tasks(["lmeval"], RunContext(), {"lmeval": {"arc_easy.acc": {"recovery": {"min": 0.9}}}})
    with pytest.raises(InputError, match="reports no such metric"):
        build_tasks(["lmeval"], RunContext(), {"lmeval": {"arc_easy.acc.recovry": {"min": 0.9}}})
    # The task's check, once the lm-eval tasks are loaded: their names and metrics.
    task = lmeval_task(thresholds={"toy.acc.flip_rate": {"max": 0.1}})
    task.check_threshold_names({"toy": ["acc", "acc_norm"]})
    with pytest.raises(InputError, match=r"`toy` reports acc; a threshold is `toy\.METRIC\.STAT`"):
        lmeval_task(thresholds={"toy.exact_match.delta": {"min": 0}}).check_threshold_names({"toy": ["acc"]})
    with pytest.raises(InputError, match="names no lm-eval task this spec runs"):
        lmeval_task(thresholds={"other.acc.delta": {"min": 0}}).check_threshold_names({"toy": ["acc"]})


def test_spec_refuses_an_empty_task_list_and_a_zero_limit():
    with pytest.raises(ValueError, match="at least one"):
        LmEvalSpec.model_validate({"tasks": []})
    with pytest.raises(ValueError, match="1 or more"):
        LmEvalSpec.model_validate({"tasks": ["toy"], "limit": 0})
    with pytest.raises(ValueError, match="named twice"):
        LmEvalSpec.model_validate({"tasks": ["toy", "toy"]})
    with pytest.raises(ValueError, match="0 or more"):
        LmEvalSpec.model_validate({"tasks": ["toy"], "num_fewshot": -1})


def test_a_backend_without_the_transformers_model_makes_the_task_skipped(tiny_pair, monkeypatch):
    import types

    from evalsuite import backends

    ckpt = Checkpoint.open(tiny_pair["tiny-minicpmv47-bf16"])
    ref = Side("ref", BackendOptions(), checkpoint=ckpt)
    other = Side("ckpt", BackendOptions(backend="exl3"), checkpoint=ckpt)
    # exl3's decoded path is a Transformers model; its exllamav3 path keeps exllamav3's model apart.
    assert exposes_model("hf") and exposes_model("intref") and exposes_model("exl3")
    assert not isinstance(types.SimpleNamespace(exl3_model=object(), tokenizer=object()), HFModelAccess)
    monkeypatch.setattr(backends, "MODEL_ACCESS_BACKENDS", frozenset({"hf", "intref"}))
    with pytest.raises(TaskSkipped, match="backend 'exl3'"):
        lmeval_task().prepare(ref, other)
    assert not isinstance(object(), HFModelAccess)


def test_evalsuite_mini_ships_beside_the_spec():
    folder = shipped_task_folder()
    assert folder == Path(__file__).resolve().parents[2] / "tasks" / "lmeval"
    names = {p.name for p in folder.iterdir()}
    assert {"evalsuite-mini.yaml", "evalsuite-mini-gen.yaml", "evalsuite_mini.py", "mc_test.jsonl"} <= names
    assert len((folder / "mc_test.jsonl").read_text(encoding="utf-8").splitlines()) == 100


# --------------------------------------------------------------------------------------------------------
# prepare: lm-eval's task loading, in process (the shipped folder's index is quick; no model loads)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def sides(tiny_pair) -> tuple[Side, Side]:
    ckpt = Checkpoint.open(tiny_pair["tiny-minicpmv47-bf16"])
    return Side("ref", BackendOptions(), checkpoint=ckpt), Side("ckpt", BackendOptions(), checkpoint=ckpt)


def my_tasks(tmp_path: Path, edit: dict[str, tuple[str, str]] | None = None) -> Path:
    """A copy of the shipped task folder, with `file: (old, new)` replacements."""
    folder = Path(shutil.copytree(shipped_task_folder(), tmp_path / f"tasks-{len(list(tmp_path.iterdir()))}"))
    for name, (old, new) in (edit or {}).items():
        text = (folder / name).read_text(encoding="utf-8")
        assert old in text
        (folder / name).write_text(text.replace(old, new), encoding="utf-8")
    return folder


def prepared(sides, **spec: Any) -> dict[str, Any]:
    task = LmEval(LmEvalSpec.model_validate({"tasks": ["evalsuite-mini"], **spec}), RunContext())
    return task.prepare(*sides)


def test_the_inputs_hash_what_is_asked_not_where_its_files_lie(sides, tmp_path):
    shipped = prepared(sides, limit=5)
    assert shipped["lmeval_versions"] == "evalsuite-mini=1.0"
    moved = prepared(sides, limit=5, include_path=str(my_tasks(tmp_path)))
    assert moved["lmeval_tasks_sha256"] == shipped["lmeval_tasks_sha256"]
    prompt = my_tasks(tmp_path, {"evalsuite-mini.yaml": ("Question: {{question}}", "Q: {{question}}")})
    document = my_tasks(tmp_path, {"mc_test.jsonl": ("What is 7 + 8?", "What is 8 + 7?")})
    late_document = my_tasks(tmp_path, {"mc_test.jsonl": ("What is 9 times 6?", "What is 6 times 9?")})
    digest = {
        "prompt": prepared(sides, limit=5, include_path=str(prompt)),
        "document": prepared(sides, limit=5, include_path=str(document)),
        "more documents": prepared(sides, limit=6),
    }
    for what, inputs in digest.items():
        assert inputs["lmeval_tasks_sha256"] != shipped["lmeval_tasks_sha256"], what
    # Only the documents scored count: the second one is outside `limit = 1`.
    assert (
        prepared(sides, limit=1, include_path=str(late_document))["lmeval_tasks_sha256"]
        == prepared(sides, limit=1)["lmeval_tasks_sha256"]
    )


def test_tasks_that_need_images_or_run_code_are_refused(sides, tmp_path):
    unsafe = my_tasks(tmp_path, {"evalsuite-mini.yaml": ("output_type:", "unsafe_code: true\noutput_type:")})
    with pytest.raises(InputError, match="executes model-written code"):
        prepared(sides, include_path=str(unsafe))
    images = my_tasks(
        tmp_path, {"evalsuite-mini.yaml": ("output_type:", "doc_to_image: [question]\noutput_type:")}
    )
    with pytest.raises(InputError, match="needs images or audio"):
        prepared(sides, include_path=str(images))


def test_an_include_path_that_is_not_a_folder_is_refused(sides, tmp_path):
    with pytest.raises(InputError, match="include_path is not a folder"):
        prepared(sides, include_path=str(tmp_path / "nowhere"))


def test_a_backend_object_without_the_model_is_refused_by_the_observer(tmp_path):
    observer = lmeval_task().needs()[0].observer

    class NoModel:
        tokenizer = None

        def describe(self) -> dict:
            return {}

    with pytest.raises(DependencyError, match="does not expose a Transformers model"):
        observer.observe(NoModel(), {}, tmp_path, lambda label, total: lambda: None)


# --------------------------------------------------------------------------------------------------------
# read_samples: lm-eval's results document as evalsuite keeps it
# --------------------------------------------------------------------------------------------------------


def lm_eval_results(filters: dict[str, list[int]]) -> dict[str, Any]:
    """A generate-until task's results as simple_evaluate(log_samples=True) returns them, one sample per
    document and filter."""
    samples = [
        {
            "doc_id": i,
            "target": "42",
            "arguments": [[f"Question: {i}?\nAnswer:", {"until": ["\n"]}]],
            "filtered_resps": [f" {40 + i}" if name == "none" else f"{40 + i}"],
            "filter": name,
            "metrics": ["exact_match"],
            "doc_hash": f"d{i}",
            "prompt_hash": f"p{i}",
            "target_hash": "t",
            "exact_match": float(40 + i == 42),
        }
        for name, ids in filters.items()
        for i in ids
    ]
    return {
        "samples": {"gen": samples},
        "configs": {"gen": {"output_type": "generate_until"}},
        "versions": {"gen": 2.0},
        "n-shot": {"gen": 0},
        "higher_is_better": {"gen": {"exact_match": True}},
        "results": {"gen": {"exact_match,none": 1 / 3, "exact_match_stderr,none": "N/A", "alias": "gen"}},
    }


def test_each_multiple_choice_metric_picks_its_answer_by_lm_evals_rule():
    # "ab" at −2.0 (−1.0 per character) against "abcd" at −3.0 (−0.75 per character, −0.5 per byte for
    # "日本" at −3.0: six bytes, two characters).
    assert chosen_answers([-2.0, -3.0], ["ab", "abcd"]) == {"acc": 0, "acc_norm": 1, "acc_bytes": 1}
    assert chosen_answers([-2.0, -3.0], ["ab", "日本"]) == {"acc": 0, "acc_norm": 0, "acc_bytes": 1}


def test_the_question_shown_is_the_prompt_after_its_few_shot_examples():
    results = lm_eval_results({"none": [0]})
    results["configs"]["gen"]["fewshot_delimiter"] = "\n\n"
    prompt = "Question: 1?\nAnswer: 1\n\nQuestion: 0?\nAnswer:"
    results["samples"]["gen"][0]["arguments"][0][0] = prompt
    assert read_samples(results)["gen"]["questions"] == [prompt]  # zero-shot: the prompt is the question
    results["n-shot"]["gen"] = 1
    assert read_samples(results)["gen"]["questions"] == ["Question: 0?\nAnswer:"]


def test_scores_under_a_named_filter_are_metric_comma_filter():
    entry = read_samples(lm_eval_results({"none": [2, 0, 1], "strict": [0, 1, 2]}))["gen"]
    assert entry["doc_ids"] == [0, 1, 2]
    assert entry["scores"] == {"exact_match": [0.0, 0.0, 1.0], "exact_match,strict": [0.0, 0.0, 1.0]}
    assert entry["answers"] == {"none": [" 40", " 41", " 42"], "strict": ["40", "41", "42"]}
    assert entry["gold"] == ["42"] * 3 and entry["version"] == 2.0
    assert entry["lm_eval_results"] == {"exact_match,none": 1 / 3}  # the "N/A" stderr is not a number


def test_filters_that_scored_other_documents_are_refused():
    with pytest.raises(InputError, match="other documents under filter 'strict'"):
        read_samples(lm_eval_results({"none": [0, 1, 2], "strict": [0, 1]}))


def test_sides_given_other_choices_or_other_tasks_are_refused(tmp_path):
    three = samples_observation({"toy": entry(REF, [[-1.0, -2.0, -3.0]] * len(REF))}, "0.4.13", {}, INPUTS)
    with pytest.raises(InputError, match="different choices"):
        lmeval_task().compare({"ref": observation(REF), "ckpt": three}, tmp_path)
    other = observation(CKPT)
    other.meta["lmeval_tasks_sha256"] = "f" * 64
    with pytest.raises(InputError, match="other configs or documents"):
        lmeval_task().compare({"ref": observation(REF), "ckpt": other}, tmp_path)


def test_lm_eval_s_environment_survey_is_off_inside_and_restored_after():
    import lm_eval.evaluator as evaluator

    from evalsuite.tasks.lmeval import without_environment_survey

    before = evaluator.add_env_info, evaluator.get_git_commit_hash
    with without_environment_survey():
        storage: dict = {}
        evaluator.add_env_info(storage)
        assert storage == {} and evaluator.get_git_commit_hash() is None
    assert (evaluator.add_env_info, evaluator.get_git_commit_hash) == before
