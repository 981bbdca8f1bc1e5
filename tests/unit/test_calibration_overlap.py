"""The calibration set against the evaluated text, without a model: 13-gram overlap worked by hand, a unit
shorter than 13 tokens found whole, the calibration file's shapes, and the data a pack's metadata names;
smoke's shipped prompts checked against a calibration file by SmolLM2's tokenizer (files only), and smoke's
figures and verdicts without its flagged prompts, on answers built by hand."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from evalsuite.backends.options import BackendOptions
from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.inputs.calibration_set import (
    CalibrationSet,
    calibration_set,
    calibration_texts,
    named_calibration_data,
    ngram_hashes,
    token_ids,
)
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import RunContext
from evalsuite.tasks.calibration_overlap import Overlap, overlap_metrics
from evalsuite.tasks.smoke import Smoke, SmokeSpec, prompt_ids
from tests.unit.test_vision_case_checks import answer_observation, flagging, forced_observation

SMOKE = load_spec(SmokeSpec, default_spec_path("smoke"))
# Under SmolLM2's tokenizer: a prompt of 7 tokens, and a chat of 30 whose every turn is shorter than 13.
SHORT, CHAT = "capital-france", "chat-favourite-colour"


def _set(*sequences: np.ndarray) -> CalibrationSet:
    return CalibrationSet.of_texts(sequences, "test", "0" * 64)


def test_a_shared_13_gram_covers_its_13_tokens_and_a_shared_12_gram_none():
    evaluated = np.arange(100, 140)  # 40 token ids
    thirteen = _set(np.concatenate([[7, 8], evaluated[10:23], [9]]))  # tokens 10..22 of it, 13 of them
    assert np.flatnonzero(thirteen.overlapping(evaluated)).tolist() == list(range(10, 23))
    twelve = _set(np.concatenate([[7, 8], evaluated[10:22], [9]]))
    assert not twelve.overlapping(evaluated).any()
    # Two overlapping 13-grams cover their union; the share is per sequence.
    both = _set(evaluated[0:14], evaluated[30:40])
    assert np.flatnonzero(both.overlapping(evaluated)).tolist() == list(range(0, 14))
    assert both.shares([evaluated, evaluated[:13], np.arange(5)]).tolist() == [14 / 40, 1.0, 0.0]


def test_a_unit_shorter_than_13_tokens_overlaps_where_it_lies_whole_inside_one_calibration_text():
    unit = np.arange(50, 56)  # 6 token ids
    inside = _set(np.arange(200, 240), np.concatenate([[1, 2], unit, [3]]))
    assert inside.overlapping(unit).tolist() == [True] * 6 and inside.shares([unit]).tolist() == [1.0]
    # The same six tokens split across two texts (end to end in the set's ids): in no one text whole.
    split = _set(np.concatenate([[1, 2], unit[:3]]), np.concatenate([unit[3:], [3]]))
    assert not split.overlapping(unit).any() and split.shares([unit]).tolist() == [0.0]
    # Five of the six, or the six in another order: no overlap either; a window-length unit is unchanged.
    assert not _set(np.concatenate([[1], unit[:5], [3]])).overlapping(unit).any()
    assert not _set(unit[::-1]).overlapping(unit).any()
    assert not inside.overlapping(np.concatenate([unit, np.arange(300, 310)])).any()


def test_ngram_hashes_tell_apart_what_differs_in_one_token_or_its_order():
    a = np.arange(13)
    b = a.copy()
    b[6] = 99
    swapped = a.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    hashes = {int(ngram_hashes(x)[0]) for x in (a, b, swapped, a + 1)}
    assert len(hashes) == 4
    assert ngram_hashes(np.arange(12)).size == 0


def test_calibration_files_of_chats_documents_or_text_give_their_texts(tmp_path):
    chats = tmp_path / "calib.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        + "\n",
        encoding="utf-8",
    )
    assert calibration_texts(chats) == ["q\na"]
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "one"}\n\n{"text": "two"}\n', encoding="utf-8")
    assert calibration_texts(docs) == ["one", "two"]
    plain = tmp_path / "calib.txt"
    plain.write_text("some text\n", encoding="utf-8")
    assert calibration_texts(plain) == ["some text\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"prompt": "two"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"bad.jsonl: line 2: neither"):
        calibration_texts(bad)
    with pytest.raises(InputError, match="calibration file does not exist"):
        calibration_texts(tmp_path / "missing.txt")


def test_the_data_a_packs_metadata_names_is_read_where_it_is_a_file_on_disk(tmp_path):
    pack = tmp_path / "pack"
    pack.mkdir()
    config = {"quantization_config": {"quant_method": "auto-round", "dataset": "calibration.jsonl"}}
    (pack / "config.json").write_text(json.dumps(config), encoding="utf-8")
    path, note = named_calibration_data(pack)
    assert (
        path is None
        and note == "calibration.jsonl (named by the pack's metadata; not a file on disk, so not checked)"
    )
    (pack / "calibration.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    assert named_calibration_data(pack) == (pack / "calibration.jsonl", None)
    # recipe.yaml, nested (llm-compressor's stages), when config.json names nothing.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"quantization_config": {"quant_method": "compressed-tensors"}}')
    (other / "recipe.yaml").write_text("stage:\n  calibration:\n    dataset: NeelNanda/pile-10k\n")
    path, note = named_calibration_data(other)
    assert path is None and note is not None and note.startswith("NeelNanda/pile-10k")
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    assert named_calibration_data(nothing) == (None, None)


@pytest.fixture
def smollm2_sides(smollm2_pair) -> tuple[Side, Side]:
    return (
        Side("ref", BackendOptions(), checkpoint=Checkpoint.open(smollm2_pair[SMOLLM2_BF16])),
        Side("ckpt", BackendOptions(), checkpoint=Checkpoint.open(smollm2_pair[SMOLLM2_W4A8])),
    )


def _chats(path, *chats: list[dict[str, str]]):
    lines = (json.dumps({"messages": [*chat, {"role": "assistant", "content": "Sure."}]}) for chat in chats)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _smoke_overlap(sides: tuple[Side, Side], calibration) -> Overlap:
    smoke = Smoke(SMOKE, RunContext(calibration_file=calibration))
    smoke.prepare(*sides)
    assert smoke.overlap is not None
    return smoke.overlap


def test_a_calibration_file_holding_two_shipped_smoke_prompts_flags_exactly_those_two(
    smollm2_sides, tmp_path
):
    """A short prompt that is a calibration chat's user turn, and a three-turn chat prompt a calibration chat
    holds (no turn of it 13 tokens long): both flagged, whole; a file of other chats flags nothing, though it
    holds the chat template's default system prompt and role markers, which every templated prompt has."""
    prompts = {p.id: p for p in SMOKE.prompts}
    tokenizer = smollm2_sides[0].tokenizer
    short, chat = (len(token_ids(tokenizer, prompts[name].text())) for name in (SHORT, CHAT))
    assert short < 13 <= chat
    assert all(len(token_ids(tokenizer, m.content)) < 13 for m in prompts[CHAT].messages or [])
    other = [{"role": "user", "content": "Tell me about rivers in Europe and where they flow."}]
    holding = _chats(tmp_path / "holding.jsonl", other, prompts[SHORT].chat(), prompts[CHAT].chat())
    overlap = _smoke_overlap(smollm2_sides, holding)
    flagged = {overlap.labels[i]: float(overlap.shares[i]) for i in np.flatnonzero(overlap.flagged)}
    assert flagged == {SHORT: 1.0, CHAT: 1.0}
    m = overlap_metrics(overlap)
    assert m["calibration_flagged_prompts"] == 2 and m["calibration_flagged_prompt_list"] == f"{SHORT},{CHAT}"
    assert m["calibration_source"] == str(holding) and m["calibration_tokens"] > 0
    rendered = tokenizer.apply_chat_template(other, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant" in rendered  # the boilerplate every templated prompt begins with
    disjoint = tmp_path / "disjoint.jsonl"
    disjoint.write_text(json.dumps({"text": rendered * 3}) + "\n", encoding="utf-8")
    # The prompts as the model reads them (through the template) would overlap it; their own words do not.
    templated = prompt_ids(smollm2_sides[0], prompts[SHORT])
    assert calibration_set(disjoint, tokenizer).shares([np.asarray(templated)])[0] > 0.5
    clear = _smoke_overlap(smollm2_sides, disjoint)
    assert not clear.flagged.any() and clear.shares.max() == 0.0
    assert overlap_metrics(clear)["calibration_flagged_prompt_list"] == ""


def _smoke_observed(ref_answers: list[str], ckpt_answers: list[str], far: int) -> dict:
    """Both sides forced along answers of 4 tokens per prompt that agree everywhere; the candidate's
    distribution moved (KLD > 0) on the answer of prompt `far` only."""
    n = len(ref_answers)
    forced = forced_observation(n, reference=False)
    rows = slice(4 * far, 4 * far + 4)
    forced.arrays["at_top"][rows] = np.roll(forced.arrays["at_top"][rows], 1, axis=1)
    return {
        "answers": answer_observation(ref_answers, {}),
        "forced-ref": forced_observation(n, reference=True),
        "forced": forced,
        "ckpt-answers": answer_observation(ckpt_answers, {}),
    }


def test_smoke_without_its_flagged_prompts_gives_the_clean_figures_and_both_verdicts(tmp_path):
    """Three prompts; the candidate answers the first wrongly (a check fails) and only there moves its
    distribution. Flagged, the first is left out of every clean_ figure and check: the verdict without it
    passes, the run's verdict still fails."""
    spec = SmokeSpec.model_validate(
        {
            "thresholds": {"ref_pass_ckpt_fail": {"max": 0}, "diverged_outside_top5": {"max": 0}},
            "prompts": [
                {"id": i, "category": "factual", "prompt": q, "max_new_tokens": 24, "expect": e}
                for i, q, e in (
                    ("france", "What is the capital of France?", "paris"),
                    ("japan", "What is the capital of Japan?", "tokyo"),
                    ("add", "What is 2 + 2?", "4"),
                )
            ],
        }
    )
    smoke = Smoke(spec, RunContext())
    smoke.overlap = flagging("prompt", ("france", "japan", "add"), "france")
    observed = _smoke_observed(["Paris.", "Tokyo.", "4"], ["London.", "Tokyo.", "4"], far=0)
    result = smoke.compare(observed, tmp_path)
    m = result.metrics
    assert (m["n_prompts"], m["ref_pass"], m["ckpt_pass"], m["ref_pass_ckpt_fail"]) == (3, 3, 2, 1)
    clean = ("clean_n_prompts", "clean_ref_pass", "clean_ckpt_pass", "clean_ref_pass_ckpt_fail")
    assert tuple(m[k] for k in clean) == (2, 2, 2, 0)
    assert m["clean_diverged_outside_top5"] == m["diverged_outside_top5"] == 0
    assert (m["survival_8_n"], m["clean_survival_8_n"]) == (3, 2) and m["clean_survival_8"] == 1.0
    assert m["clean_survival_8_lower95"] < m["survival_8_lower95"] < 1.0  # fewer prompts, a wider interval
    assert m["kld_mean"] > 0.0 and m["clean_kld_mean"] == 0.0 and m["clean_answer_tokens"] == 8
    passed = {c.name: c.passed for c in result.checks}
    assert passed == {
        "ref_pass_ckpt_fail": False,
        "diverged_outside_top5": True,
        "clean_ref_pass_ckpt_fail": True,
        "clean_diverged_outside_top5": True,
    }
    assert (m["verdict_with_flagged"], m["verdict_without_flagged"]) == ("fail", "pass")
    assert result.status == "fail"
    rows = [r for r in result.details if r.get("table")]
    assert rows == [
        {"table": "overlapping the calibration set (flagged)", "prompt": "france", "overlap share": 1.0}
    ]
    # Every prompt flagged: nothing is left to judge without them.
    smoke.overlap = flagging("prompt", ("france", "japan", "add"), "france", "japan", "add")
    m = smoke.compare(observed, tmp_path).metrics
    assert m["clean_note"] == "every prompt overlaps the calibration set" and "clean_n_prompts" not in m


def _table(tmp_path, name: str, rows: list[dict]) -> Path:
    """`rows` as a table file: parquet, or Arrow IPC as a stream (`datasets`' own files) or as a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, table = tmp_path / name, pa.Table.from_pylist(rows)
    if name.endswith(".parquet"):
        pq.write_table(table, path)
    else:
        new = pa.ipc.new_stream if "stream" in name else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
            writer.write_table(table)
    return path


ROWS = [
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": "only a prompt"}]},
]


@pytest.mark.parametrize("name", ["calib.parquet", "calib-stream.arrow", "calib-file.arrow"])
def test_calibration_tables_of_documents_or_chats_give_their_texts(tmp_path, name):
    assert calibration_texts(_table(tmp_path, name, [{"text": "one"}, {"text": "two"}])) == ["one", "two"]
    assert calibration_texts(_table(tmp_path, "chats-" + name, ROWS)) == ["q\na", "only a prompt"]
    broken = tmp_path / ("broken-" + name)
    broken.write_bytes(b"not a table")
    with pytest.raises(InputError, match=f"broken-{name}: not a"):
        calibration_texts(broken)


def test_a_json_array_calibration_file_gives_its_texts_and_names_an_item_that_is_neither(tmp_path):
    array = tmp_path / "calib.json"
    array.write_text(json.dumps([{"text": "one"}, *ROWS], indent=2), encoding="utf-8")
    assert calibration_texts(array) == ["one", "q\na", "only a prompt"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"text": "one"}, {"prompt": "two"}]), encoding="utf-8")
    with pytest.raises(InputError, match=r"bad.json: item 1: neither"):
        calibration_texts(bad)


def test_calibration_chats_of_a_prompt_alone_or_with_a_tool_turn_are_read(tmp_path):
    """What calibration sets hold and no chat file to score would: no answer, a tool's output, an assistant
    turn that only calls a tool (its content null)."""
    path = tmp_path / "calib.jsonl"
    tool = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "weather"}]},
        {"role": "tool", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    path.write_text(
        json.dumps({"messages": ROWS[1]["messages"]}) + "\n" + json.dumps({"messages": tool}) + "\n",
        encoding="utf-8",
    )
    assert calibration_texts(path) == ["only a prompt", "Weather in Paris?\n18 C, sunny\nIt is sunny."]


def test_short_units_are_looked_for_in_memory_bounded_by_the_units_not_the_set():
    """Twelve units of 1 to 12 tokens against a set of 2 million: found whole where they lie inside one text,
    not where they straddle two, without a table of the set's k-grams per length (16 MB each)."""
    rng = np.random.default_rng(0)
    texts = [rng.integers(0, 50_000, 100_000) for _ in range(20)]
    found = _set(*texts)
    units = [texts[k][1000 * k : 1000 * k + k] for k in range(1, 13)]
    straddling = np.concatenate([texts[0][-3:], texts[1][:3]])
    tracemalloc.start()
    try:
        shares = found.shares([*units, straddling])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert shares.tolist() == [1.0] * 12 + [0.0]
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_ppl_on_chats_is_checked_on_the_chats_own_words_not_their_template(smollm2_sides, tmp_path):
    """A calibration text that is another chat through SmolLM2's template (its default system prompt, role
    markers) flags none of the shipped chats; one holding two shipped chats' words flags exactly those."""
    from evalsuite.inputs.chat_files import read_chats
    from evalsuite.tasks.chats import shipped_chats
    from evalsuite.tasks.ppl import Perplexity, PplSpec

    tokenizer = smollm2_sides[0].tokenizer
    other = [
        {"role": "user", "content": "Tell me about rivers in Europe and where they flow."},
        {"role": "assistant", "content": "The Rhine flows north into the North Sea; the Danube flows east."},
    ]
    templated = tmp_path / "templated.jsonl"
    templated.write_text(json.dumps({"text": tokenizer.apply_chat_template(other, tokenize=False)}) + "\n")
    spec = load_spec(PplSpec, default_spec_path("ppl-chat"))

    def flagged(calibration: Path) -> list[int]:
        ppl = Perplexity(spec, RunContext(calibration_file=calibration))
        ppl.prepare(*smollm2_sides)
        assert ppl.overlap is not None and len(ppl.overlap.flagged) == 110
        return np.flatnonzero(ppl.overlap.flagged).tolist()

    assert flagged(templated) == []
    shipped = read_chats(shipped_chats())
    holding = _chats(tmp_path / "holding.jsonl", other[:1], *(shipped[i].as_messages() for i in (3, 70)))
    assert flagged(holding) == [3, 70]
