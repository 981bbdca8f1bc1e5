"""`ppl` on chats: the `[chats]` spec section, the chats tokenised once through the chat template (and refused
where the sides' templates or tokens differ), and the figures split by tag and by assistant turn, each split
judged where it holds enough chats (`[chats] min_split_chats`) and otherwise reported as too small to judge.

How a chat is rendered and its assistant tokens found is `evalsuite.inputs.chat_files`; how each side is
observed on them, `evalsuite.observers.chat_logits`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evalsuite.contract.spec import Check, StrictModel, TaskSpec, default_spec_path
from evalsuite.errors import InputError
from evalsuite.inputs.calibration_set import token_ids
from evalsuite.inputs.chat_files import UNTAGGED, chat_template, chat_tokens, chats_sha256, read_chats
from evalsuite.observers.chat_logits import ChatLogits, ChatLogitsAtReference, chat_inputs
from evalsuite.observers.compact_window_logits import REFERENCE_LABEL
from evalsuite.observers.window_logits import RecordOptions
from evalsuite.protocol.task import Inputs, Need, RunContext
from evalsuite.stats import claims
from evalsuite.tasks.long_context import context_length
from evalsuite.tasks.ppl_subsets import subset_checks, subset_metrics, with_claims

if TYPE_CHECKING:
    from evalsuite.protocol.side import Side

# `[chats] file`'s name for the chat set shipped beside tasks/ppl-chat.toml.
SHIPPED = "shipped"
SHIPPED_SPEC = "ppl-chat"
# Assistant turns from this rank on are reported together.
LAST_TURN_SPLIT = 3
# The inputs' key of each chat's own words, tokenised (`chat_sequences`).
OWN_WORDS = "chat_own_words"


class ChatOptions(StrictModel):
    """The `[chats]` section of a `ppl` spec: score chats through the chat template instead of windows of a
    text. `--chats FILE` scores that file's chats with these options (or their defaults)."""

    # The chat file: `shipped` (tasks/ppl-chat.jsonl) or a JSONL file's path (relative to the working folder).
    file: str = SHIPPED
    # Scored positions per application of the head: never a chat's positions × vocabulary at once.
    head_chunk_rows: int = 256
    # The fewest chats a tag's or a turn's split is judged on: one chat's spread would decide a smaller
    # split's estimate (and below `claims.MIN_CLUSTERS` it has no interval). A smaller split is reported,
    # marked too small to judge, and its checks are left out of the verdict.
    min_split_chats: int = 5

    def model_post_init(self, _: Any) -> None:
        if self.head_chunk_rows < 1:
            raise ValueError("head_chunk_rows must be a number of positions, at least 1")
        if self.min_split_chats < 1:
            raise ValueError("min_split_chats must be a number of chats, at least 1")


def shipped_chats() -> Path:
    """The chat set shipped with evalsuite (written for it; Apache-2.0), beside tasks/ppl-chat.toml."""
    return default_spec_path(SHIPPED_SPEC).with_suffix(".jsonl")


def chat_file(options: ChatOptions | None, context: RunContext) -> Path | None:
    """The chats to score: `--chats FILE`, else the spec's `[chats] file`; None for the windows of a text."""
    if context.chats_file is not None:
        return Path(context.chats_file)
    if options is None:
        return None
    return shipped_chats() if options.file == SHIPPED else Path(options.file)


def prepare_chats(path: Path, ref: Side, ckpt: Side) -> Inputs:
    """The chats of `path` through the chat template, tokenised once with the reference's tokenizer (the
    candidate's when the reference is a recording, whose tokens' hash is then checked before anything runs).
    Refused before any model loads, in one line: sides whose chat templates differ (they would score
    different text), a candidate whose tokenizer gives other ids, a chat longer than a side's context. Each
    chat's own words are tokenised too (`chat_sequences`)."""
    chats = read_chats(path)
    source = ckpt if ref.is_recorded else ref
    template = _template(source)
    if not ref.is_recorded:
        other = _template(ckpt)
        if other != template:
            pairs = enumerate(zip(template, other, strict=False))
            where = next((i for i, (a, b) in pairs if a != b), min(len(template), len(other)))
            raise InputError(
                f"its chat template differs from the reference's (first at character {where}): the sides "
                "would score different text; give both the same template",
                ckpt.checkpoint.path,
            )
    tokens = [chat_tokens(source.tokenizer, chat, path) for chat in chats]
    if not ref.is_recorded and ref.checkpoint.tokenizer_sha256 != ckpt.checkpoint.tokenizer_sha256:
        for i, chat in enumerate(chats):
            theirs = chat_tokens(ckpt.tokenizer, chat, path)
            if not np.array_equal(theirs.ids, tokens[i].ids):
                raise InputError(
                    f"its tokenizer disagrees with the reference's on {path.name}'s chat at {chat.where}; "
                    "the sides cannot be compared",
                    ckpt.checkpoint.path,
                )
    longest = max(len(t.ids) for t in tokens)
    for side in (ref, ckpt):
        context = context_length(side.checkpoint.config) if side.checkpoint is not None else None
        if context is not None and longest > context:
            raise InputError(
                f"the longest chat of {path.name} has {longest} tokens, more than the model's context "
                f"({context} tokens, max_position_embeddings in config.json)",
                side.checkpoint.path,
            )
    spans = sorted({t.spans for t in tokens})
    name = SHIPPED if path == shipped_chats() else path.name
    inputs = chat_inputs(tokens, [c.tag for c in chats], f"chats:{name}", ", ".join(spans))
    inputs["chats_sha256"] = chats_sha256(chats)
    # The template's text (a default system prompt, role markers) is in every chat and in every templated
    # calibration text: the overlap with a calibration set is of the chats' own words.
    inputs[OWN_WORDS] = [token_ids(source.tokenizer, chat.text) for chat in chats]
    return inputs


def _template(side: Side) -> str:
    try:
        return chat_template(side.tokenizer)
    except InputError as exc:
        raise InputError(str(exc), side.checkpoint.path) from None


def chat_needs(record: RecordOptions, chunk_rows: int, options: ChatOptions) -> list[Need]:
    """`ppl`'s needs on chats: the reference's compact form, then the candidate at its ids."""
    head = options.head_chunk_rows
    return [
        Need(REFERENCE_LABEL, "ref", ChatLogits(record, chunk_rows, head)),
        Need("ckpt", "ckpt", ChatLogitsAtReference(chunk_rows, head), consumes=(REFERENCE_LABEL,)),
    ]


def chat_sequences(inputs: Inputs) -> list[np.ndarray]:
    """Each chat's own words (its contents joined by newlines, as a calibration chat's), tokenised alone
    without its template: what its overlap with a calibration set is measured on."""
    return inputs[OWN_WORDS]


def split_metrics(
    tags: list[str],
    chat: np.ndarray,
    turn: np.ndarray,
    kld: np.ndarray,
    same_top: np.ndarray,
    nll_ref: np.ndarray,
    nll_ckpt: np.ndarray,
    min_chats: int,
) -> dict[str, dict[str, Any]]:
    """The figures of each tag's chats (`tag_TAG_…`) and of each assistant turn's rank (`turn_1_…`,
    `turn_2_…`, turns from `LAST_TURN_SPLIT` on together as `turn_3plus_…`), every error clustered by chat;
    by split name. A chat set with one tag, or of one-turn chats, is not split that way. A split of fewer
    than `min_chats` chats says so (`NAME_note`: too small to judge), and `split_checks` leaves it out."""
    token_tags = np.asarray(tags)[chat]
    splits: dict[str, np.ndarray] = {}
    if len(set(tags)) > 1 or tags[0] != UNTAGGED:
        for tag in dict.fromkeys(tags):
            splits[f"tag_{tag}"] = token_tags == tag
    if turn.max() > 1:
        for rank in range(1, min(int(turn.max()), LAST_TURN_SPLIT) + 1):
            last = rank == LAST_TURN_SPLIT
            splits[f"turn_{rank}plus" if last else f"turn_{rank}"] = turn >= rank if last else turn == rank
    out = {}
    for name, mask in splits.items():
        values = subset_metrics(name, mask, kld, same_top, nll_ref, nll_ckpt, chat)
        chats = len(np.unique(chat[mask]))
        out[name] = with_claims(name, values, chats)
        if chats < min_chats:
            out[name][f"{name}_note"] = f"too small to judge: {chats} chat{'s' * (chats != 1)} < {min_chats}"
    return out


def split_rows(splits: dict[str, dict[str, Any]], checks: dict[str, list[Check]]) -> list[dict[str, Any]]:
    """report.md's rows of the splits: one per tag and per turn, with the verdict of its own checks (or why
    it has none: too small to judge)."""
    rows = []
    for name, values in splits.items():
        kind, _, label = name.partition("_")
        own = checks.get(name, [])
        verdict = ("pass" if all(c.passed for c in own) else "FAIL") if own else ""
        rows.append(
            {
                "table": f"by {'tag' if kind == 'tag' else 'assistant turn'} (errors clustered by chat)",
                kind: label,
                "chats": values[f"{name}_n_windows"],
                "tokens": values[f"{name}_n_tokens"],
                "kld_mean": values[f"{name}_kld_mean"],
                "kld_mean lower95 … upper95": _interval(values, f"{name}_kld_mean"),
                "same_top_p": values[f"{name}_same_top_p"],
                "same_top_p lower95 … upper95": _interval(values, f"{name}_same_top_p"),
                "delta_p_mean": values[f"{name}_delta_p_mean"],
                "ppl_ratio": values[f"{name}_ppl_ratio"],
                "verdict": values.get(f"{name}_note", verdict),
            }
        )
    return rows


def _interval(values: dict[str, Any], name: str) -> str:
    lo, hi = values[f"{name}_lower95"], values[f"{name}_upper95"]
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"— (fewer than {claims.MIN_CLUSTERS} chats)"
    return f"{lo:.4g} … {hi:.4g}"


def split_checks(spec: TaskSpec, splits: dict[str, dict[str, Any]]) -> dict[str, list[Check]]:
    """The spec's thresholds on each split's own figures (`subset_checks`), by split name; none on a split
    too small to judge."""
    return {
        name: [] if f"{name}_note" in values else subset_checks(spec, name, values)
        for name, values in splits.items()
    }
