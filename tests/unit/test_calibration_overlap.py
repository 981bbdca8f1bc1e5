"""The calibration set against the evaluated text, without a model: 13-gram overlap worked by hand, the
calibration file's shapes, and the data a pack's metadata names."""

from __future__ import annotations

import json

import numpy as np
import pytest

from evalsuite.calibration import CalibrationSet, calibration_texts, named_calibration_data, ngram_hashes
from evalsuite.errors import InputError


def _set(*sequences: np.ndarray) -> CalibrationSet:
    hashes = np.unique(np.concatenate([ngram_hashes(s) for s in sequences]))
    return CalibrationSet("test", "0" * 64, len(sequences), sum(len(s) for s in sequences), hashes)


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
    assert calibration_texts(chats) == ["q", "a"]
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
