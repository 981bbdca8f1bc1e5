"""Task `vision`'s cases through the CLI on the tiny MiniCPM-V 4.7 pair: one run on the W4A8 copy (its vision
tower and merger are stored byte-identical, so every case must show exact parity), one on a copy whose vision
tower was perturbed (every case that runs must fail its parity checks). The video case runs where the video
processor can be built (torchvision) and is skipped with its reason elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import copy_checkpoint, edit_tensors, rerun

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"
IMAGE_CASES = ("", "slices.", "downsample_4x.", "downsample_16x.", "ocr.", "chart.", "count.")
HAS_VIDEO = importlib.util.find_spec("torchvision") is not None
RUN_CASES = (*IMAGE_CASES, "video.") if HAS_VIDEO else IMAGE_CASES


@pytest.fixture(scope="module")
def exact(tiny_run):
    """The W4A8 copy's vision cases: those of the shared run of every task on the tiny pair."""
    return tiny_run.cli, tiny_run.task("vision"), tiny_run.out


@pytest.fixture(scope="module")
def perturbed(tiny_pair, tiny_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-perturbed")
    ckpt = copy_checkpoint(tiny_pair[TINY_W4A8], root / "ckpt")
    generator = torch.Generator().manual_seed(0)

    def add_noise(tensors):
        for name, value in tensors.items():
            if "vision_tower" in name and name.endswith(".weight") and value.ndim == 2:
                # Three standard deviations: the random tower's features are dominated by its layer norms, and
                # one moves the 4x case's cosine to 0.995 only (it skips the perturbed window merger).
                noise = 3 * torch.randn(value.shape, generator=generator) * value.float().std()
                tensors[name] = (value.float() + noise).to(value.dtype)

    edit_tensors(ckpt, add_noise)
    # In a copy of the shared run's folder: the reference's observations are reused.
    args = ("run", "--ckpt", ckpt, "--ref", tiny_pair[TINY_BF16], "--tasks", "vision")
    run = rerun(tiny_run, root / "out", *args)
    return run.cli, run.task("vision")


def test_every_case_of_an_identical_tower_is_exactly_equal(exact):
    res, entry, _ = exact
    assert res.returncode == 1, res.stderr  # the random model names no shapes: ref_pass / ckpt_pass fail
    assert {c["name"] for c in entry["checks"] if not c["passed"]} == {"ref_pass", "ckpt_pass"}
    m = entry["metrics"]
    for prefix in RUN_CASES:
        assert m[f"{prefix}vision_cosine"] == 1.0, prefix
        assert m[f"{prefix}vision_rel_err"] == 0.0 and m[f"{prefix}vision_max_abs"] == 0.0, prefix
        assert m[f"{prefix}vision_tokens"] > 0 and len(m[f"{prefix}inputs_sha256"]) == 64, prefix
    assert m["cases_run"] == len(RUN_CASES)


def test_the_large_image_is_sliced_and_4x_keeps_four_times_the_tokens(exact):
    _, entry, _ = exact
    m = entry["metrics"]
    # The tiny processor (112-pixel slices, at most 4) cuts the 1344×896 image into a 2×2 grid.
    assert (m["slices.grid"], m["slices.n_slices"]) == ("2x2", 4)
    assert m["downsample_16x.vision_tokens"] == m["slices.vision_tokens"] == 5 * 4  # 5 crops of 8×8 patches
    # 4x skips the window merger: each crop is resized to multiples of 28 pixels instead of 56 (6×10 patches
    # here) and merged 2×2 once, 15 tokens a crop.
    assert m["downsample_4x.vision_tokens"] == 5 * 15
    assert m["downsample_4x.downsample_mode"] == "4x" and m["downsample_16x.downsample_mode"] == "16x"
    assert m["downsample_4x.inputs_sha256"] != m["downsample_16x.inputs_sha256"]


def test_the_video_case_runs_or_is_skipped_with_its_reason(exact):
    _, entry, _ = exact
    m = entry["metrics"]
    row = next(r for r in entry["details"] if r["case"] == "video")
    if HAS_VIDEO:
        assert m["skipped_cases"] == "" and m["video.frames"] == 6 and m["video.vision_cosine"] == 1.0
        assert row["note"].startswith("6 frames")
    else:
        assert m["skipped_cases"] == "video" and not any(k.startswith("video.") for k in m)
        assert row["note"].startswith("skipped: the video processor cannot be built here")
        assert "Torchvision" in row["note"]
        assert {"video.vision_cosine", "video.vision_rel_err", "video.answer_lost"} <= set(
            entry["not_measured"]
        )


def test_report_shows_every_picture_beside_both_answers(exact):
    _, entry, out = exact
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| case |"))
    assert header == "| case | input | ref_answer | ref_pass | ckpt_answer | ckpt_pass | note |"
    pictures = {
        "image": "vision_image",
        "slices": "vision_slices",
        "downsample_4x": "vision_downsample_4x",
        "downsample_16x": "vision_downsample_16x",
        "video": "vision_video_frames",
        "ocr": "vision_ocr",
        "chart": "vision_chart",
        "count": "vision_count",
    }
    for case, stem in pictures.items():
        row = next(line for line in report.splitlines() if line.startswith(f"| {case} |"))
        assert f'<img src="artifacts/{stem}.png" alt="{stem}" width="240">' in row, row
        assert (out / "artifacts" / f"{stem}.png").stat().st_size > 0
    for row in entry["details"]:
        if "ref_answer" in row:  # a case that ran shows both sides' answers, each judged by its regex
            assert isinstance(row["ref_answer"], str) and isinstance(row["ckpt_answer"], str)
            assert row["ref_pass"] is False and row["ckpt_pass"] is False


def test_a_perturbed_vision_tower_fails_every_case_that_uses_it(perturbed):
    res, entry = perturbed
    assert res.returncode == 1, res.stderr
    failed = {c["name"] for c in entry["checks"] if not c["passed"]}
    for prefix in RUN_CASES:
        assert {f"{prefix}vision_cosine", f"{prefix}vision_rel_err"} <= failed, prefix
        assert entry["metrics"][f"{prefix}vision_cosine"] < 0.99, prefix
    assert not any(name.startswith("video.") for name in failed) or HAS_VIDEO
