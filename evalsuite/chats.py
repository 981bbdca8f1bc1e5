"""Chats scored as the model serves them: a JSONL file of chats read and checked, and each chat put through a
tokenizer's own chat template with its assistant tokens found.

A chat file holds one chat per line, in the shape calibration sets use: `{"messages": [{"role": …,
"content": …}, …], "tag": "…"}` (`tag` optional: a language or a domain, by which the scores are split).

The scored tokens are the assistant's. Where the template marks them (`{% generation %}` … `{% endgeneration
%}`, Transformers' assistant-mask markers), Transformers' own mask decides (`apply_chat_template(...,
return_assistant_tokens_mask=True)`: every token overlapping a marked span). Where it does not (ChatML
templates such as SmolLM2's), each assistant turn's span is what the template's own rendering adds for it:
the chat up to that turn rendered with the generation prompt (`add_generation_prompt=True`) is a prefix of
the chat rendered up to and including the turn, and the rest, trailing whitespace left out (a separator
between turns, never generated), is the turn's span; the tokens overlapping it are scored, as Transformers
marks them. A template that does not render its turns as prefixes of one another has no such span and is
refused, naming the chat.

Either way the token ids are the tokenizer's on the template's whole rendering of the chat (special tokens
parsed, none added), so both sides of a comparison tokenise the same text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from evalsuite.errors import InputError

ROLES = ("system", "user", "assistant")
UNTAGGED = "untagged"
# Transformers' markers of the tokens a model generates, in a chat template.
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")

SpanSource = Literal["generation markers", "template rendering"]


@dataclass(frozen=True)
class Chat:
    """One chat of a chat file: its messages (role, content) and its tag."""

    messages: tuple[tuple[str, str], ...]
    tag: str = UNTAGGED

    def as_messages(self, turns: int | None = None) -> list[dict[str, str]]:
        """The first `turns` messages (all of them: None) as a chat template takes them."""
        return [{"role": r, "content": c} for r, c in self.messages[:turns]]


def read_chats(path: Path, what: str = "chat file") -> list[Chat]:
    """The chats of a JSONL file, in order; blank lines skipped. A line that is not a chat (not JSON, no
    `messages`, an unknown role, a content that is not text, no assistant turn) is refused, naming it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} does not exist", path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})", path) from None
    chats = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            chats.append(_chat(line, number, path))
    if not chats:
        raise InputError(f"{what} holds no chat", path)
    return chats


def _chat(line: str, number: int, path: Path) -> Chat:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"line {number}: not JSON ({exc.msg})", path) from None
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(
            f'line {number}: no "messages" list (each line is {{"messages": [...], "tag": ...}})', path
        )
    turns = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise InputError(
                f"line {number}: message {i} has role {role!r}, not one of {', '.join(ROLES)}", path
            )
        if not isinstance(content, str):
            raise InputError(f"line {number}: message {i}'s content is not text", path)
        turns.append((role, content))
    if not any(role == "assistant" for role, _ in turns):
        raise InputError(f"line {number}: the chat has no assistant turn to score", path)
    tag = doc.get("tag", UNTAGGED)
    if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", tag):
        raise InputError(f"line {number}: tag {tag!r} is not a name (letters, digits, _ and -)", path)
    return Chat(tuple(turns), tag)


def chats_sha256(chats: list[Chat]) -> str:
    """Identity of a list of chats (their messages and tags, in order)."""
    doc = [{"messages": [list(m) for m in c.messages], "tag": c.tag} for c in chats]
    return hashlib.sha256(json.dumps(doc, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class ChatTokens:
    """A chat as a model is fed it: `ids`, the template's rendering tokenised; `scored`, the positions whose
    logits predict an assistant token (position p predicts ids[p + 1]); `turn`, the assistant turn (1, 2, …)
    of each; `spans`, how the assistant tokens were found."""

    ids: np.ndarray
    scored: np.ndarray
    turn: np.ndarray
    spans: SpanSource

    @property
    def targets(self) -> np.ndarray:
        """The assistant tokens scored, in order."""
        return self.ids[self.scored + 1]


def has_generation_markers(template: str | None) -> bool:
    """Whether a chat template marks the tokens a model generates (`{% generation %}`)."""
    return bool(template) and _GENERATION.search(template) is not None


def chat_template(tokenizer: Any) -> str:
    """The tokenizer's chat template; one without is refused (there is no rendering to score)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is the model's
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise InputError(
            "the tokenizer has no chat template: chats cannot be scored as the model serves them"
        )
    return template


def chat_tokens(tokenizer: Any, chat: Chat, number: int) -> ChatTokens:
    """`chat` (the `number`th of its file, for errors) through the tokenizer's chat template, its assistant
    tokens found by the template's generation markers where it has them, else by its rendering (module
    docstring)."""
    if has_generation_markers(chat_template(tokenizer)):
        out = tokenizer.apply_chat_template(
            chat.as_messages(), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = np.asarray(out["input_ids"], np.int64), np.asarray(out["assistant_masks"], bool)
        how: SpanSource = "generation markers"
    else:
        text = _render(tokenizer, chat.as_messages(), False)
        spans = [
            _turn_span(tokenizer, chat, i, text, number)
            for i, (r, _) in enumerate(chat.messages)
            if r == "assistant"
        ]
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], np.int64)
        mask = _overlapping(encoded["offset_mapping"], spans)
        how = "template rendering"
    # A turn is a run of assistant tokens; position p scores the token at p + 1.
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    turn = np.cumsum(starts)
    scored = np.flatnonzero(mask[1:])
    if not len(scored):
        raise InputError(f"chat {number}: its template rendering leaves no assistant token to score")
    return ChatTokens(
        ids=ids, scored=scored.astype(np.int64), turn=turn[scored + 1].astype(np.int64), spans=how
    )


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _turn_span(tokenizer: Any, chat: Chat, index: int, text: str, number: int) -> tuple[int, int]:
    """The characters of the whole chat's rendering `text` that assistant message `index` adds."""
    prefix = _render(tokenizer, chat.as_messages(index), True)
    through = _render(tokenizer, chat.as_messages(index + 1), False).rstrip()
    if not (through.startswith(prefix) and text.startswith(through)):
        raise InputError(
            f"chat {number}: the chat template does not render turn {index} as a prefix of the whole chat, "
            "so its assistant tokens cannot be told from it; give the template {% generation %} markers"
        )
    return len(prefix), len(through)


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens (character `offsets`) overlap one of `spans`: Transformers' rule for its assistant
    mask."""
    if not offsets and spans:
        raise InputError("the tokenizer gives no character offsets (a slow tokenizer): chats need a fast one")
    mask = np.zeros(len(offsets), dtype=bool)
    for i, (start, end) in enumerate(offsets):
        mask[i] = any(start < stop and end > begin for begin, stop in spans)
    return mask
