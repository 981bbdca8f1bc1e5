"""The vision task's cases without a model: spec validation, and `compare` on observations built by hand, so
that each per-case check is shown to fail on an input made to fail it; report.md shows each case's picture
in its row beside both answers."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.errors import InputError
from evalsuite.protocol.task import RunContext, TaskResult
from evalsuite.reporting.diff_report import render_markdown
from evalsuite.reporting.model_card import render_model_card
from evalsuite.tasks.calibration_overlap import CalibrationOptions, Overlap
from evalsuite.tasks.vision import Vision, VisionSpec

SPEC_TEXT = default_spec_path("vision").read_text()
VOCAB = 8


CASES = ("image", "slices", "downsample_4x", "downsample_16x", "video", "ocr", "chart", "count")
GRIDS = {
    **{"image": None, "slices": (2, 3), "downsample_4x": (2, 3), "downsample_16x": (2, 3), "video": None},
    **{"ocr": (1, 2), "chart": None, "count": None},
}
SAME = "a red square and a blue circle; it moves from left to right"
LABEL = "KAFKA 7351"  # the text the shipped `ocr` case's image shows


def _logp(rows: int, seed: int = 0) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(rows, VOCAB))
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def answer_observation(texts: list[str], about: dict) -> Observation:
    """One side's decoded answers, one of 4 tokens per case."""
    n = len(texts)
    return Observation(
        name="answers",
        meta={"texts": texts, "char_ends": [[1, 2, 3, len(t)] for t in texts], "top_text": [], **about},
        arrays={
            "tokens": np.tile(np.arange(4), n),
            "offsets": np.arange(0, 4 * n + 1, 4),
            "top_ids": np.zeros((4 * n, 5), np.int64),
            "top_logp": np.tile(_logp(4)[:, :5].max(-1, keepdims=True), (n, 5)).astype(np.float32),
        },
    )


def forced_observation(n: int, reference: bool) -> Observation:
    """Forced rows of `n` cases that agree with the answers everywhere (each answer token the top)."""
    lp = np.tile(_logp(4), (n, 1))
    tokens = np.tile(np.arange(4), n)
    # Make each answer token its row's most probable one.
    lp[np.arange(len(lp)), tokens] = lp.max(-1) + 1.0
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    order = np.argsort(-lp, axis=1, kind="stable")
    offsets, full = np.arange(0, 4 * n + 1, 4), np.arange(0, 4 * n + 1, 4)
    common = {
        "offsets": offsets,
        "full_offsets": full,
        "full_logp": lp.astype(np.float32),
        "ranked": order[:, :5].astype(np.int32),
        "target_logp": lp[np.arange(len(lp)), tokens],
        "top_logit": np.ones(len(lp)),
    }
    if reference:
        arrays = {
            **common,
            "top_ids": order.astype(np.int32),
            "top_logp": np.take_along_axis(lp, order, 1).astype(np.float32),
            "tail_mass": np.zeros(len(lp), np.float32),
            "tail_ids": np.zeros((len(lp), 0), np.int32),
            "tail_logp": np.zeros((len(lp), 0), np.float32),
        }
        return Observation(name="forced-ref", meta={"top_k": VOCAB, "tail_samples": 0}, arrays=arrays)
    arrays = {
        **common,
        "at_top": np.take_along_axis(lp, order, 1).astype(np.float32),
        "at_tail": np.zeros((len(lp), 0), np.float32),
        "ranked_logp": np.take_along_axis(lp, order[:, :5], 1),
        "same_top": np.ones(len(lp), bool),
    }
    return Observation(name="forced", meta={"logits_dtype": "float32"}, arrays=arrays)


def observed(
    vision: Vision,
    answers: dict[str, tuple[str, str]] | None = None,
    features: dict[str, np.ndarray] | None = None,
    grids: dict[str, tuple[int, int] | None] | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, Observation]:
    """Every case run by both sides with the same answer (the label's text for `ocr`) and features, but where
    the arguments say otherwise: `answers` (reference's, candidate's) and the candidate's `features` by case,
    the processor's `grids`, the cases `skipped` here with their reason."""
    answers = {"ocr": (LABEL, LABEL), **(answers or {})}
    features, skipped = features or {}, skipped or {}
    grids = {**GRIDS, **(grids or {})}
    run = [c for c in CASES if c not in skipped]
    about = {
        "cases": {
            c: {
                "image_sha256" if c != "video" else "frames_sha256": "m",
                "inputs_sha256": "i",
                "processing": "processor",
                "grid": f"{grids[c][0]}x{grids[c][1]}" if grids[c] else "none",
                "n_slices": grids[c][0] * grids[c][1] if grids[c] else 0,
                **({"downsample_mode": "4x"} if c == "downsample_4x" else {}),
                **({"downsample_mode": "16x"} if c == "downsample_16x" else {}),
                **({"frames": 6} if c == "video" else {}),
            }
            for c in run
        },
        "skipped": skipped,
    }
    ones = np.ones((6, 4), np.float32)
    return {
        "answers": answer_observation([answers.get(c, (SAME, SAME))[0] for c in run], about),
        "ckpt-answers": answer_observation([answers.get(c, (SAME, SAME))[1] for c in run], {}),
        "forced-ref": forced_observation(len(run), reference=True),
        "forced": forced_observation(len(run), reference=False),
        "features:ref": Observation(name="f", arrays={f"features-{c}": ones for c in run}),
        "features:ckpt": Observation(name="f", arrays={f"features-{c}": features.get(c, ones) for c in run}),
    }


def results_document(result: TaskResult) -> dict:
    return {
        "verdict": result.status,
        "ckpt": {"path": "c", "format": "bf16"},
        "ref": {"path": "r", "format": "bf16"},
        "environment": {"device": "cpu", "device_name": "cpu", "dtype": "bfloat16", "packages": {}},
        "tasks": {"vision": result.to_json()},
    }


@pytest.fixture
def vision() -> Vision:
    return Vision(load_spec(VisionSpec, default_spec_path("vision")), RunContext())


def test_the_shipped_spec_has_the_single_image_then_each_case(vision):
    names = [(c.name, c.downsample_mode, c.video is not None) for c in vision.cases]
    assert names == [
        ("image", None, False),
        ("slices", None, False),
        ("downsample_4x", "4x", False),
        ("downsample_16x", "16x", False),
        ("video", None, True),
        ("ocr", None, False),
        ("chart", None, False),
        ("count", None, False),
    ]
    labels = [(n.label, n.role) for n in vision.needs()]
    # The cases are the prompts of the answer observations (smoke's, one per side), the features one per side.
    assert labels == [
        ("features:ref", "ref"),
        ("answers", "ref"),
        ("forced-ref", "ref"),
        ("ckpt-answers", "ckpt"),
        ("forced", "ckpt"),
        ("features:ckpt", "ckpt"),
    ]


def test_identical_sides_pass_every_case_with_unprefixed_names_for_the_single_image(vision, tmp_path):
    result = vision.compare(observed(vision), tmp_path / "artifacts")
    assert result.status == "pass", [c for c in result.checks if not c.passed]
    m = result.metrics
    assert m["vision_cosine"] == 1.0 and m["slices.vision_cosine"] == 1.0 and m["video.vision_rel_err"] == 0.0
    assert m["slices.grid"] == "2x3" and m["slices.n_slices"] == 6 and m["cases_run"] == len(CASES)
    assert m["skipped_cases"] == "" and m["downsample_4x.downsample_mode"] == "4x" and m["video.frames"] == 6
    assert (m["ocr.ref_cer"], m["ocr.ckpt_cer"], m["ocr.cer_delta"]) == (0.0, 0.0, 0.0)
    assert {c.name for c in result.checks} >= {
        "slices.n_slices",
        "video.answer_lost",
        "downsample_4x.vision_cosine",
        "ocr.cer_delta",
    }


def test_a_perturbed_tower_fails_the_parity_checks_of_the_case(vision, tmp_path):
    noisy = np.ones((6, 4), np.float32) + np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
    result = vision.compare(observed(vision, features={"downsample_4x": noisy}), tmp_path / "a")
    failed = {c.name for c in result.checks if not c.passed}
    assert failed == {"downsample_4x.vision_cosine", "downsample_4x.vision_rel_err"}


def test_an_unsliced_large_image_fails_the_slices_case(vision, tmp_path):
    result = vision.compare(observed(vision, grids={"slices": None}), tmp_path / "a")
    assert result.metrics["slices.grid"] == "none" and result.metrics["slices.n_slices"] == 0
    assert {c.name for c in result.checks if not c.passed} == {"slices.n_slices"}


def test_an_answer_the_reference_gets_and_the_candidate_loses_fails(vision, tmp_path):
    lost = {"video": ("It moves from left to right.", "It moves left.")}
    result = vision.compare(observed(vision, answers=lost), tmp_path / "a")
    m = result.metrics
    assert (m["video.ref_pass"], m["video.ckpt_pass"], m["video.answer_lost"]) == (True, False, True)
    assert {c.name for c in result.checks if not c.passed} == {"video.answer_lost"}
    # A reference that fails too is no regression: the case reports it, and answer_lost holds.
    both = vision.compare(
        observed(vision, answers={"video": ("It moves up.", "It moves left.")}), tmp_path / "b"
    )
    assert both.status == "pass" and both.metrics["video.ref_pass"] is False


def test_a_candidate_that_reads_the_label_worse_than_the_reference_fails_cer_delta(vision, tmp_path):
    # Two digits misread of ten characters: CER 0.2 against the reference's 0.
    misread = vision.compare(observed(vision, answers={"ocr": (LABEL, "KAFKA 7857")}), tmp_path / "a")
    m = misread.metrics
    assert (m["ocr.ref_cer"], m["ocr.ckpt_cer"], m["ocr.cer_delta"]) == (0.0, 0.2, 0.2)
    assert {c.name for c in misread.checks if not c.passed} == {"ocr.cer_delta", "ocr.answer_lost"}
    row = next(r for r in misread.details if r["case"] == "ocr")
    assert row["note"].endswith("reads 'KAFKA 7351': CER ref 0, ckpt 0.2, cer_delta 0.2")
    # Spaces around and between the words do not count; a full stop does: one character in ten, within
    # the shipped tolerance.
    stop = vision.compare(observed(vision, answers={"ocr": (LABEL, "  KAFKA \n 7351. ")}), tmp_path / "b")
    assert stop.metrics["ocr.cer_delta"] == 0.1 and stop.status == "pass"


def test_a_reference_that_cannot_read_the_label_leaves_cer_delta_unjudged_and_says_why(vision, tmp_path):
    garbage = "z\ufffd--ss\ufffd'stance"  # what the tiny random model answers: 14 characters, none right
    result = vision.compare(observed(vision, answers={"ocr": (garbage, LABEL)}), tmp_path / "a")
    m = result.metrics
    assert m["ocr.ref_cer"] == 1.4 and m["ocr.ckpt_cer"] == 0.0 and np.isnan(m["ocr.cer_delta"])
    assert result.status == "pass" and "ocr.cer_delta" in result.not_measured
    assert "ocr.cer_delta" not in {c.name for c in result.checks}
    reason = result.null_reasons["ocr.cer_delta"]
    assert reason.startswith("the reference does not read 'KAFKA 7351' (its CER 1.4 > ocr.ref_reads 0.5)")
    entry = result.to_json()
    assert entry["metrics"]["ocr.cer_delta"] is None and entry["null_reasons"]["ocr.cer_delta"] == reason
    row = next(r for r in result.details if r["case"] == "ocr")
    assert row["note"].endswith(f"CER ref 1.4, ckpt 0; cer_delta not judged: {reason}")
    document = results_document(result)
    caveat = f"- Vision case `ocr`: cer_delta not judged: {reason}."
    assert caveat in render_model_card(document).splitlines()
    assert f"| ocr.cer_delta | — ({reason}) |" in render_markdown(document)


def test_a_skipped_case_is_reported_with_its_reason_and_its_checks_not_measured(vision, tmp_path):
    reason = "the video processor cannot be built here (ImportError: needs torchvision)"
    result = vision.compare(observed(vision, skipped={"video": reason}), tmp_path / "artifacts")
    assert result.status == "pass" and result.metrics["skipped_cases"] == "video"
    assert result.metrics["cases_run"] == len(CASES) - 1 and not any(
        k.startswith("video.") for k in result.metrics
    )
    assert set(result.not_measured) == {"video.vision_cosine", "video.vision_rel_err", "video.answer_lost"}
    row = next(r for r in result.details if r["case"] == "video")
    assert row["note"] == f"skipped: {reason}" and row["input"] == "artifacts/vision_video_frames.png"
    card = render_model_card(results_document(result))
    assert f"- Vision case `video` skipped: {reason}." in card.splitlines()


def test_report_shows_each_picture_in_its_row_beside_both_answers(vision, tmp_path):
    artifacts = tmp_path / "artifacts"
    result = vision.compare(observed(vision), artifacts)
    sheet = Image.open(artifacts / "vision_video_frames.png")
    assert sheet.width > 6 * 448 // 2 and sheet.height < 448  # six half-size frames in a row
    assert Image.open(artifacts / "vision_slices.png").size == (1344, 896)
    report = render_markdown(results_document(result))
    row = next(line for line in report.splitlines() if line.startswith("| video |"))
    assert '<img src="artifacts/vision_video_frames.png" alt="vision_video_frames" width="240">' in row
    assert row.count("left to right") == 2  # both answers beside the picture
    assert report.count("artifacts/vision_slices.png") == 1  # in its row, not listed again below


def flagging(unit: str, labels: tuple[str, ...], *names: str) -> Overlap:
    """An overlap with the calibration set of the units `labels` (prompt ids, case names) that flags those
    named, each held whole."""
    flagged = np.array([label in names for label in labels])
    return Overlap(
        unit,
        flagged.astype(np.float64),
        flagged,
        np.full(len(labels), 14),
        CalibrationOptions(),
        source="calibration.jsonl",
        sha256="0" * 64,
        n_tokens=100,
        labels=labels,
        named=True,
    )


def test_the_verdict_without_a_flagged_case_is_that_of_the_other_cases_checks(vision, tmp_path):
    """The candidate loses the video's answer: flagging the video's question leaves a passing verdict without
    it; flagging another case does not; the single image owns the unprefixed checks."""
    lost = {"video": ("It moves from left to right.", "It moves left.")}
    vision.overlap = flagging("case", CASES, "video")
    result = vision.compare(observed(vision, answers=lost), tmp_path / "a")
    m = result.metrics
    assert result.status == "fail"  # the run's own verdict still counts every case
    assert m["calibration_flagged_cases"] == 1 and m["calibration_flagged_case_list"] == "video"
    assert (m["verdict_with_flagged"], m["verdict_without_flagged"]) == ("fail", "pass")
    rows = [r for r in result.details if r.get("table", "").startswith("overlapping the calibration set")]
    assert rows == [
        {"table": "overlapping the calibration set (flagged)", "case": "video", "overlap share": 1.0}
    ]
    vision.overlap = flagging("case", CASES, "chart")
    m = vision.compare(observed(vision, answers=lost), tmp_path / "b").metrics
    assert (m["verdict_with_flagged"], m["verdict_without_flagged"]) == ("fail", "fail")
    # The single image's answer lost: its unprefixed checks (ckpt_pass) are left out with it.
    unseen = {"image": ("A red square and a blue circle.", "Nothing.")}
    vision.overlap = flagging("case", CASES, "image")
    m = vision.compare(observed(vision, answers=unseen), tmp_path / "c").metrics
    assert (m["verdict_with_flagged"], m["verdict_without_flagged"]) == ("fail", "pass")
    vision.overlap = flagging("case", CASES, "slices")
    m = vision.compare(observed(vision, answers=unseen), tmp_path / "d").metrics
    assert (m["verdict_with_flagged"], m["verdict_without_flagged"]) == ("fail", "fail")
    vision.overlap = flagging("case", CASES, *CASES)
    m = vision.compare(observed(vision, answers=lost), tmp_path / "e").metrics
    assert m["clean_note"] == "every case overlaps the calibration set" and "verdict_without_flagged" not in m
    vision.overlap = flagging("case", CASES)
    m = vision.compare(observed(vision, answers=lost), tmp_path / "f").metrics
    assert m["calibration_flagged_cases"] == 0 and "verdict_without_flagged" not in m


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (
            lambda t: t.replace(
                'image = "large"\nprompt = "What colour', 'image = "huge"\nprompt = "What colour', 1
            ),
            "shows image 'huge'",
        ),
        (lambda t: t.replace('name = "downsample_16x"', 'name = "slices"'), "case names repeat: slices"),
        (lambda t: t.replace("answer_lost = { max = 0 }", "answer_lots = { max = 0 }"), "answer_lots"),
        (
            lambda t: t.replace('downsample_mode = "4x"', 'downsample_mode = "8x"'),
            "`cases.1.downsample_mode` (line {line})",
        ),
        (lambda t: t.replace('name = "video"', 'name = "video"\nimage = "large"'), "an image or a video"),
        (
            lambda t: t.replace('image = "label"', 'image = "chart"'),
            "case 'ocr' reads text (`ocr`) but its image draws none (`text`)",
        ),
        (lambda t: t.replace('name = "video"', 'name = "video"\nocr = {}'), "OCR cases show an image"),
        (lambda t: t.replace("ocr = { ref_reads = 0.5 }", "ocr = { ref_reads = -1 }"), "ref_reads"),
    ],
    ids=[
        "unknown-image",
        "repeated-name",
        "unknown-metric",
        "unknown-mode",
        "two-media",
        "ocr-without-text",
        "ocr-of-a-video",
        "ocr-bad-bound",
    ],
)
def test_a_bad_case_spec_is_refused_at_start_up(tmp_path, edit, fragment):
    path = tmp_path / "vision.toml"
    text = edit(SPEC_TEXT)
    assert text != SPEC_TEXT
    path.write_text(text)
    # The line the error must point at: where the bad mode was written.
    fragment = fragment.format(line=next((n for n, s in enumerate(text.splitlines(), 1) if '"8x"' in s), 0))
    with pytest.raises(InputError) as caught:
        load_spec(VisionSpec, path)
    assert str(path) in str(caught.value) and fragment in str(caught.value), str(caught.value)


def test_metric_names_let_thresholds_name_every_shipped_case():
    shipped = ("vision_cosine", "slices.n_slices", "downsample_4x.vision_rel_err", "video.answer_lost")
    for name in (*shipped, "ocr.cer_delta", "ocr.ref_cer", "chart.answer_lost", "count.answer_lost"):
        assert name in Vision.metric_names
