"""Task `tensors` on the files that are not tensors, and `evalsuite manifest`, through the CLI.

Two candidates built from the tiny W4A8 copy: a faithful one with the manifest `evalsuite manifest` writes,
and a broken one (a slice setting changed, the chat template deleted, a manifest with one wrong digest, a
file it lists deleted and a weight file it does not list); then the manifests that are bad input.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import cli_run_in_process, copy_checkpoint

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"


def tensors_entry(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["tasks"]["tensors"]


def failed(entry: dict) -> set[str]:
    return {c["name"] for c in entry["checks"] if not c["passed"]}


def problems(entry: dict, check: str) -> set[tuple[str, str]]:
    return {(d["file"], d["key"]) for d in entry.get("details", []) if d.get("check") == check}


@pytest.fixture(scope="module")
def faithful(tiny_pair, tmp_path_factory):
    """The W4A8 copy with the SHA256SUMS `evalsuite manifest` writes, compared with its source."""
    root = tmp_path_factory.mktemp("faithful")
    ckpt = copy_checkpoint(tiny_pair[TINY_W4A8], root / "ckpt")
    written = cli_run_in_process("manifest", ckpt)
    res = cli_run_in_process(
        "run", "--ckpt", ckpt, "--ref", tiny_pair[TINY_BF16], "--tasks", "tensors", "--out", root / "out"
    )
    return written, res, ckpt, root / "out"


@pytest.fixture(scope="module")
def broken(tiny_pair, tmp_path_factory):
    """A copy whose slice setting changed and whose chat template is gone, with a manifest that lies."""
    root = tmp_path_factory.mktemp("broken")
    ckpt = copy_checkpoint(tiny_pair[TINY_W4A8], root / "ckpt")
    preprocessor = json.loads((ckpt / "preprocessor_config.json").read_text())
    preprocessor["slice_mode"] = False
    (ckpt / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (ckpt / "chat_template.jinja").unlink()
    assert cli_run_in_process("manifest", ckpt).returncode == 0
    sums = (ckpt / "SHA256SUMS").read_text().splitlines()
    # One wrong digest (the first character of tokenizer.json's flipped), then a listed file deleted and a
    # weight file the manifest does not list.
    sums = [
        ("0" if line[0] != "0" else "1") + line[1:] if line.endswith("  tokenizer.json") else line
        for line in sums
    ]
    (ckpt / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    (ckpt / "generation_config.json").unlink()
    (ckpt / "original").mkdir()
    (ckpt / "original" / "consolidated.pt").write_bytes(b"weights the manifest forgot")
    res = cli_run_in_process(
        "run", "--ckpt", ckpt, "--ref", tiny_pair[TINY_BF16], "--tasks", "tensors", "--out", root / "out"
    )
    return res, root / "out"


def test_manifest_command_writes_what_sha256sum_checks(faithful):
    written, _, ckpt, _ = faithful
    assert written.returncode == 0, written.stderr
    assert written.stdout.strip() == f"{ckpt / 'SHA256SUMS'}\t9 files"
    checked = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=ckpt, capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.count(": OK") == 9, checked.stdout


def test_a_faithful_copy_passes_with_every_asset_equal_and_its_manifest_verified(faithful):
    _, res, _, out = faithful
    assert res.returncode == 0, res.stderr
    entry = tensors_entry(out)
    m = entry["metrics"]
    # config.json differs by quantization_config alone, which the spec allows.
    assert (m["assets_compared"], m["assets_missing"], m["assets_changed"]) == (7, 0, 0)
    assert m["manifests"] == "SHA256SUMS" and m["manifest_entries"] == m["manifest_verified"] == 9
    assert (m["manifest_missing"], m["manifest_mismatched"], m["manifest_unlisted_weights"]) == (0, 0, 0)
    checked = {c["name"] for c in entry["checks"]}
    assert {"assets_missing", "assets_changed", "manifest_mismatched", "manifest_unlisted_weights"} <= checked
    table = json.loads((out / entry["artifacts"]["tensors"]).read_text())
    assert "preprocessor_config.json" in table["assets"]["compared"]


def test_without_a_manifest_its_checks_are_not_measured_rather_than_passed(tiny_pair, tmp_path):
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_pair[TINY_W4A8],
        "--ref",
        tiny_pair[TINY_BF16],
        "--tasks",
        "tensors",
        "--out",
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    entry = tensors_entry(tmp_path)
    assert {"manifest_missing", "manifest_mismatched", "manifest_unlisted_weights"} <= set(
        entry["not_measured"]
    )
    assert not any(name.startswith("manifest") for name in entry["metrics"])


def test_a_changed_slice_setting_and_a_deleted_chat_template_fail_naming_file_and_key(broken):
    res, out = broken
    assert res.returncode == 1, res.stderr
    entry = tensors_entry(out)
    assert {"assets_changed", "assets_missing"} <= failed(entry)
    assert problems(entry, "asset_changed") == {("preprocessor_config.json", "slice_mode")}
    assert problems(entry, "asset_missing") == {("chat_template.jinja", ""), ("generation_config.json", "")}
    report = (out / "report.md").read_text()
    assert "| asset_changed |" in report and "preprocessor_config.json | slice_mode |" in report


def test_a_manifest_with_one_wrong_digest_fails_naming_the_file(broken):
    _, out = broken
    entry = tensors_entry(out)
    assert {"manifest_mismatched", "manifest_missing", "manifest_unlisted_weights"} <= failed(entry)
    [(file, where)] = problems(entry, "manifest_mismatched")
    assert file == "tokenizer.json" and where.startswith("SHA256SUMS line ")
    assert problems(entry, "manifest_missing") == {("generation_config.json", "SHA256SUMS line 3")}
    assert problems(entry, "manifest_unlisted_weights") == {("original/consolidated.pt", "SHA256SUMS")}
    m = entry["metrics"]
    assert (m["manifest_entries"], m["manifest_verified"], m["manifest_mismatched"]) == (8, 6, 1)


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        (
            "SHA256SUMS",
            "{sha}  config.json\nnot a checksum line\n",
            "SHA256SUMS: line 2: not `<sha256>  <path>`",
        ),
        ("SHA256SUMS", "{sha}  ../tiny-minicpmv47-bf16/config.json\n", "SHA256SUMS: line 1: '../tiny"),
        (
            "UPLOAD_MANIFEST.json",
            '[{{"path": "/etc/passwd", "sha256": "{sha}"}}]',
            "UPLOAD_MANIFEST.json: entry 1:",
        ),
    ],
    ids=["malformed-line", "outside", "json-absolute"],
)
def test_a_bad_manifest_is_refused_with_exit_2_and_one_line(tiny_pair, tmp_path, name, content, fragment):
    ckpt = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "ckpt")
    (ckpt / name).write_text(content.format(sha="0" * 64))
    res = cli_run_in_process(
        "run", "--ckpt", ckpt, "--ref", tiny_pair[TINY_BF16], "--tasks", "tensors", "--out", tmp_path / "out"
    )
    assert res.returncode == 2 and len(res.error_lines) == 1, res.stderr
    assert fragment in res.error_lines[0] and str(ckpt) in res.error_lines[0]
    assert not (tmp_path / "out" / "results.json").exists()
    shutil.rmtree(ckpt)
