"""File manifests: both forms read, every malformed line or escaping path refused with the file and the
line, verification through the run's digest cache, `SHA256SUMS` written the way `sha256sum` writes it."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.files.manifest import read_manifest, verify_manifest, write_sha256sums

FILES = {
    "config.json": b'{"a": 1}\n',
    "model.safetensors": b"not really weights",
    "sub/tokenizer.json": b"{}",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def sums_text(files: dict[str, bytes]) -> str:
    return "".join(f"{sha(data)}  {name}\n" for name, data in files.items())


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------


def test_sha256sum_lines_are_read_in_both_modes_and_the_bsd_form(folder):
    text = (
        "# written by hand\n\n"
        f"{sha(FILES['config.json'])}  config.json\n"
        f"{sha(FILES['model.safetensors']).upper()} *model.safetensors\n"
        f"SHA256 (sub/tokenizer.json) = {sha(FILES['sub/tokenizer.json'])}\n"
    )
    (folder / "SHA256SUMS").write_text(text)
    manifest = read_manifest(folder / "SHA256SUMS")
    assert [(e.path, e.sha256, e.where) for e in manifest.entries] == [
        ("config.json", sha(FILES["config.json"]), "line 3"),
        ("model.safetensors", sha(FILES["model.safetensors"]), "line 4"),
        ("sub/tokenizer.json", sha(FILES["sub/tokenizer.json"]), "line 5"),
    ]


@pytest.mark.parametrize(
    "doc",
    [
        {name: sha(data) for name, data in FILES.items()},
        [{"path": name, "sha256": sha(data), "size": len(data)} for name, data in FILES.items()],
        {"created": "today", "files": {n: {"sha256": sha(d), "size": len(d)} for n, d in FILES.items()}},
    ],
    ids=["mapping", "list", "files-key"],
)
def test_upload_manifest_json_is_read_in_each_documented_shape(folder, doc):
    (folder / "UPLOAD_MANIFEST.json").write_text(json.dumps(doc))
    manifest = read_manifest(folder / "UPLOAD_MANIFEST.json")
    assert {e.path: e.sha256 for e in manifest.entries} == {n: sha(d) for n, d in FILES.items()}
    check = verify_manifest(manifest, DigestCache())
    assert check.ok and check.verified == len(FILES)


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("SHA256SUMS", sums_text(FILES) + "deadbeef  config.json\n", "line 4: not `<sha256>  <path>`"),
        ("SHA256SUMS", f"{sha(b'')}  ../outside.json\n", "line 1: '../outside.json' lies outside"),
        ("SHA256SUMS", f"{sha(b'')}  /etc/passwd\n", "line 1: '/etc/passwd' lies outside"),
        (
            "SHA256SUMS",
            sums_text(FILES) + sums_text({"config.json": b""}),
            "line 4: config.json is listed again",
        ),
        ("UPLOAD_MANIFEST.json", '{"config.json": "xyz"}', "entry 'config.json': `sha256` of config.json"),
        (
            "UPLOAD_MANIFEST.json",
            json.dumps([{"path": "a", "sha256": sha(b"")}, {"sha": 1}]),
            "entry 2: `path`",
        ),
        ("UPLOAD_MANIFEST.json", json.dumps({"../x": sha(b"")}), "entry '../x': '../x' lies outside"),
        ("UPLOAD_MANIFEST.json", '{"a": ', "line 1: invalid JSON"),
    ],
    ids=[
        "short-digest",
        "dotdot",
        "absolute",
        "repeated",
        "json-digest",
        "json-no-path",
        "json-dotdot",
        "json",
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_file_and_line(folder, name, text, fragment):
    (folder / name).write_text(text)
    with pytest.raises(InputError) as caught:
        read_manifest(folder / name)
    message = str(caught.value)
    assert message.startswith(f"{folder / name}: ") and fragment in message, message
    assert "\n" not in message


def test_a_path_that_escapes_through_a_symlink_is_refused(folder, tmp_path):
    (tmp_path / "secret.json").write_text("{}")
    (folder / "link.json").symlink_to(tmp_path / "secret.json")
    (folder / "SHA256SUMS").write_text(f"{sha(b'{}')}  link.json\n")
    with pytest.raises(InputError, match=r"line 1: 'link\.json' lies outside"):
        read_manifest(folder / "SHA256SUMS")


# ----------------------------------------------------------------------------------------------------------
# Verifying
# ----------------------------------------------------------------------------------------------------------


def test_one_wrong_digest_fails_naming_the_file(folder):
    files = {**FILES, "config.json": b"something else"}
    (folder / "SHA256SUMS").write_text(sums_text(files))
    check = verify_manifest(read_manifest(folder / "SHA256SUMS"), DigestCache())
    assert not check.ok and check.verified == len(FILES) - 1 and not check.missing
    [row] = check.problems()
    assert row["check"] == "manifest_mismatched" and row["file"] == "config.json"
    assert row["key"] == "SHA256SUMS line 1" and sha(FILES["config.json"]) in row["detail"]


def test_missing_files_wrong_sizes_and_unlisted_weights_are_each_reported(folder):
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.pt").write_bytes(b"weights")
    doc = [
        {"path": "config.json", "sha256": sha(FILES["config.json"]), "size": 3},
        {"path": "gone.json", "sha256": sha(b"")},
        {"path": "model.safetensors", "sha256": sha(FILES["model.safetensors"])},
    ]
    (folder / "UPLOAD_MANIFEST.json").write_text(json.dumps(doc))
    check = verify_manifest(read_manifest(folder / "UPLOAD_MANIFEST.json"), DigestCache())
    found = {(r["check"], r["file"]) for r in check.problems()}
    assert found == {
        ("manifest_mismatched", "config.json"),
        ("manifest_missing", "gone.json"),
        ("manifest_unlisted_weights", "original/consolidated.pt"),
    }
    assert check.verified == 1


def test_verification_hashes_through_the_cache_that_keys_observations(folder, tmp_path):
    """Digests verified once are not read again: not by a second verification, not for the content digest."""
    (folder / "SHA256SUMS").write_text(sums_text(FILES))
    manifest = read_manifest(folder / "SHA256SUMS")
    first = DigestCache(tmp_path / "digests")
    assert verify_manifest(manifest, first).ok and first.hashed_bytes == sum(map(len, FILES.values()))
    again = DigestCache(tmp_path / "digests")
    assert verify_manifest(manifest, again).ok and again.hashed_bytes == 0
    (folder / "config.json").write_bytes(
        b"changed"
    )  # a changed file is hashed again, never taken from the cache
    assert not verify_manifest(manifest, again).ok and again.hashed_bytes == len(b"changed")


def test_a_real_checkpoint_content_digest_reuses_what_verification_hashed(tiny_pair, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_pair["tiny-minicpmv47-w4a8"], ckpt)
    cache = DigestCache(tmp_path / "digests")
    write_sha256sums(ckpt, DigestCache())
    assert verify_manifest(read_manifest(ckpt / "SHA256SUMS"), cache).ok
    read = cache.hashed_bytes
    assert read > 0
    Checkpoint.open(ckpt).content_sha256(cache)
    assert cache.hashed_bytes == read  # every content file was listed, so nothing was read twice


# ----------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------


def test_written_sha256sums_is_what_sha256sum_writes_and_checks(folder):
    odd = folder / "odd\\name.txt"
    odd.write_bytes(b"backslash")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("")
    path, count = write_sha256sums(folder, DigestCache())
    assert path == folder / "SHA256SUMS" and count == len(FILES) + 1
    names = sorted([*FILES, "odd\\name.txt"])
    expected = subprocess.run(
        ["sha256sum", "--", *names], cwd=folder, capture_output=True, text=True, check=True
    ).stdout
    assert path.read_text() == expected
    checked = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=folder, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    manifest = read_manifest(path)
    assert sorted(e.path for e in manifest.entries) == names
    assert verify_manifest(manifest, DigestCache()).ok


def test_the_run_hands_its_digest_cache_to_the_file_tasks(tiny_pair, tmp_path):
    from evalsuite.pipeline.runner import RunRequest, plan_run

    cache = DigestCache(tmp_path / "digests")
    request = RunRequest(
        ckpt=str(tiny_pair["tiny-minicpmv47-w4a8"]),
        ref=str(tiny_pair["tiny-minicpmv47-bf16"]),
        tasks=["tensors"],
        out=tmp_path / "out",
    )
    plan = plan_run(request, cache)
    assert plan.tasks[0].context.digests is cache
    assert request.context.digests is None  # the request itself is left as it was given
