"""`ppl` on chats: the `[chats]` spec section, the chats tokenised once through the chat template (and refused
where the sides' templates or tokens differ), and the figures split by tag and by assistant turn.

How a chat is rendered and its assistant tokens found is `evalsuite.chats`; how each side is observed on
them, `evalsuite.observers.chat_logits`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evalsuite import claims
from evalsuite.chats import UNTAGGED, chat_template, chat_tokens, chats_sha256, read_chats
from evalsuite.errors import InputError
from evalsuite.observers.chat_logits import CHATS, ChatLogits, ChatLogitsAtReference, chat_inputs
from evalsuite.observers.compact_window_logits import REFERENCE_LABEL
from evalsuite.observers.window_logits import RecordOptions
from evalsuite.spec import Check, StrictModel, TaskSpec, default_spec_path
from evalsuite.task import Inputs, Need, RunContext
from evalsuite.tasks.long_context import context_length
from evalsuite.tasks.ppl_subsets import subset_checks, subset_metrics, with_claims

if TYPE_CHECKING:
    from evalsuite.side import Side

# `[chats] file`'s name for the chat set shipped beside tasks/ppl-chat.toml.
SHIPPED = "shipped"
SHIPPED_SPEC = "ppl-chat"
# Assistant turns from this rank on are reported together.
LAST_TURN_SPLIT = 3


class ChatOptions(StrictModel):
    """The `[chats]` section of a `ppl` spec: score chats through the chat template instead of windows of a
    text. `--chats FILE` scores that file's chats with these options (or their defaults)."""

    # The chat file: `shipped` (tasks/ppl-chat.jsonl) or a JSONL file's path (relative to the working folder).
    file: str = SHIPPED
    # Scored positions per application of the head: never a chat's positions × vocabulary at once.
    head_chunk_rows: int = 256

    def model_post_init(self, _: Any) -> None:
        if self.head_chunk_rows < 1:
            raise ValueError("head_chunk_rows must be a number of positions, at least 1")


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
    different text), a candidate whose tokenizer gives other ids, a chat longer than a side's context."""
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
    tokens = [chat_tokens(source.tokenizer, chat, i + 1) for i, chat in enumerate(chats)]
    if not ref.is_recorded and ref.checkpoint.tokenizer_sha256 != ckpt.checkpoint.tokenizer_sha256:
        for i, chat in enumerate(chats):
            theirs = chat_tokens(ckpt.tokenizer, chat, i + 1)
            if not np.array_equal(theirs.ids, tokens[i].ids):
                raise InputError(
                    f"its tokenizer disagrees with the reference's on chat {i + 1} of {path.name}; the sides "
                    "cannot be compared",
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
    """Each chat's token ids, as the model is fed them."""
    return [chat.ids for chat in inputs[CHATS]]


def split_metrics(
    tags: list[str],
    chat: np.ndarray,
    turn: np.ndarray,
    kld: np.ndarray,
    same_top: np.ndarray,
    nll_ref: np.ndarray,
    nll_ckpt: np.ndarray,
) -> dict[str, dict[str, Any]]:
    """The figures of each tag's chats (`tag_TAG_…`) and of each assistant turn's rank (`turn_1_…`,
    `turn_2_…`, turns from `LAST_TURN_SPLIT` on together as `turn_3plus_…`), every error clustered by chat;
    by split name. A chat set with one tag, or of one-turn chats, is not split that way."""
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
        out[name] = with_claims(name, values, len(np.unique(chat[mask])))
    return out


def split_rows(splits: dict[str, dict[str, Any]], checks: dict[str, list[Check]]) -> list[dict[str, Any]]:
    """report.md's rows of the splits: one per tag and per turn, with the verdict of its own checks."""
    rows = []
    for name, values in splits.items():
        kind, _, label = name.partition("_")
        own = checks.get(name, [])
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
                "verdict": ("pass" if all(c.passed for c in own) else "FAIL") if own else "",
            }
        )
    return rows


def _interval(values: dict[str, Any], name: str) -> str:
    lo, hi = values[f"{name}_lower95"], values[f"{name}_upper95"]
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f"— (fewer than {claims.MIN_CLUSTERS} chats)"
    return f"{lo:.4g} … {hi:.4g}"


def split_checks(spec: TaskSpec, splits: dict[str, dict[str, Any]]) -> dict[str, list[Check]]:
    """The spec's thresholds on each split's own figures (`subset_checks`), by split name."""
    return {name: subset_checks(spec, name, values) for name, values in splits.items()}
