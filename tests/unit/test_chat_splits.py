"""`ppl` on chats split by tag and turn, on figures built by hand: a split of fewer chats than the spec's
`[chats] min_split_chats` is reported and marked too small, its checks left out of the verdict."""

from __future__ import annotations

import numpy as np

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.tasks.chats import split_checks, split_metrics, split_rows
from evalsuite.tasks.ppl import PplSpec

SPEC = load_spec(PplSpec, default_spec_path("ppl-chat"))


def test_a_split_of_fewer_chats_than_the_minimum_is_reported_but_not_judged():
    """Five English chats of 10 tokens that the candidate keeps exactly, and one Chinese chat of 2 tokens
    that it loses (KLD 1 nat): the whole set and `en` pass; `zh`, one chat, would fail alone."""
    assert SPEC.chats is not None and SPEC.chats.min_split_chats == 5
    tags = ["en"] * 5 + ["zh"]
    chat = np.repeat(np.arange(6), [10] * 5 + [2])
    kld = np.where(chat == 5, 1.0, 0.0)
    turn, same, nll = np.ones(len(chat), np.int64), np.ones(len(chat), bool), np.full(len(chat), 2.0)
    splits = split_metrics(tags, chat, turn, kld, same, nll, nll, SPEC.chats.min_split_chats)
    assert set(splits) == {"tag_en", "tag_zh"}  # one turn each: no split by turn
    zh = splits["tag_zh"]
    assert zh["tag_zh_n_windows"] == 1 and zh["tag_zh_kld_mean"] == 1.0
    assert zh["tag_zh_note"] == "too small to judge: 1 chat < 5"
    assert "tag_en_note" not in splits["tag_en"]
    checks = split_checks(SPEC, splits)
    assert checks["tag_zh"] == []
    assert {c.name for c in checks["tag_en"]} == {"tag_en_kld_mean", "tag_en_same_top_p", "tag_en_ppl_ratio"}
    assert all(c.passed for c in checks["tag_en"])
    rows = {r["tag"]: r for r in split_rows(splits, checks)}
    assert (rows["en"]["verdict"], rows["zh"]["verdict"]) == ("pass", "too small to judge: 1 chat < 5")
    assert rows["zh"]["kld_mean"] == 1.0  # reported all the same
    # With a minimum of 1 the same chat is judged, and fails.
    judged = split_checks(SPEC, split_metrics(tags, chat, turn, kld, same, nll, nll, 1))
    assert not all(c.passed for c in judged["tag_zh"])
