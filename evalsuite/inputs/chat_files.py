"""Chats scored as the model serves them: a JSONL file of chats read and checked, and each chat put through a
tokenizer's own chat template with its assistant tokens found.

A chat file holds one chat per line, in the shape calibration sets use: `{"messages": [{"role": …,
"content": …}, …], "tag": "…"}` (`tag` optional: a language or a domain, by which the scores are split).

The scored tokens are the assistant's, found as character spans of the template's rendering of the whole
chat, one per assistant message. Where the template marks them (`{% generation %}` … `{% endgeneration %}`,
Transformers' assistant-mask markers), each marked span is one assistant message's, in order. Where it does
not (ChatML templates such as SmolLM2's), each assistant turn's span is what the template's own rendering adds
for it: the chat up to that turn rendered with the generation prompt (`add_generation_prompt=True`) is a
prefix of the chat rendered up to and including the turn, and the rest, trailing whitespace left out (a
separator between turns, never generated), is the turn's span. A template that does not render its turns as
prefixes of one another has no such span and is refused, naming the chat's line.

Either way, text the template itself writes at the start of a span, before the message's content (the empty
thinking block, `<think>` and `</think>` on lines of their own, that a Qwen3-style template opens an answer
with), is not the chat's and is not scored: it is found by rendering the message with a placeholder for its
content. The tokens overlapping a span are scored, as Transformers marks them, each numbered by its assistant
message (1, 2, … as the chat counts them, an empty one included), so a template with markers and the same
template without score the same tokens.

The token ids are the tokenizer's on the template's whole rendering of the chat (special tokens parsed, none
added), so both sides of a comparison tokenise the same text. A chat the template refuses (its
`raise_exception`) is refused naming its line.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from evalsuite.errors import InputError

ROLES = ("system", "user", "assistant", "tool")
UNTAGGED = "untagged"
# Transformers' markers of the tokens a model generates, in a chat template.
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
# What stands for an assistant message's content while the template text around it is found.
_PLACEHOLDER = "evalsuite-assistant-content-placeholder"

SpanSource = Literal["generation markers", "template rendering"]


@dataclass(frozen=True)
class Chat:
    """One chat of a chat file: its messages (role, content), its tag and where it was read (`line 3`, for
    errors; not part of its identity)."""

    messages: tuple[tuple[str, str], ...]
    tag: str = UNTAGGED
    where: str = field(default="the chat", compare=False)

    def as_messages(self, turns: int | None = None) -> list[dict[str, str]]:
        """The first `turns` messages (all of them: None) as a chat template takes them."""
        return [{"role": r, "content": c} for r, c in self.messages[:turns]]

    @property
    def text(self) -> str:
        """The chat's own words, without a template: its messages' contents joined by newlines (an empty one
        left out)."""
        return "\n".join(content for _, content in self.messages if content)

    def with_content(self, index: int, content: str) -> Chat:
        """The chat with message `index`'s content replaced."""
        messages = list(self.messages)
        messages[index] = (messages[index][0], content)
        return replace(self, messages=tuple(messages))


def read_text(path: Path, what: str) -> str:
    """A UTF-8 file's text; a missing or undecodable one is refused, naming it as `what`."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} does not exist", path) from None
    except IsADirectoryError:
        raise InputError(f"{what} is a folder; give a file", path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})", path) from None


def json_lines(text: str, path: Path) -> list[tuple[str, Any]]:
    """Each non-blank line's JSON value with where it is (`line N`); a line that is not JSON is refused."""
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                docs.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise InputError(f"line {number}: not JSON ({exc.msg})", path) from None
    return docs


def read_chats(path: Path, what: str = "chat file") -> list[Chat]:
    """The chats of a JSONL file to score, in order; blank lines skipped. A line that is not such a chat
    (`parse_chat`) is refused, naming it."""
    chats = [parse_chat(doc, where, path) for where, doc in json_lines(read_text(path, what), Path(path))]
    if not chats:
        raise InputError(f"{what} holds no chat", path)
    return chats


def parse_chat(doc: Any, where: str, path: Path, scored: bool = True) -> Chat:
    """The chat a JSON value holds (`where` it is in `path`, for errors): `messages` with a known role and
    text each. A chat to score (`scored`) also needs an assistant turn, one that some turn before it
    prompts (a chat opening with the assistant's is refused) and a tag that is a name; a calibration chat
    is read as it is (a prompt alone, a tool call's null content as no text)."""
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(f'{where}: no "messages" list (each is {{"messages": [...], "tag": ...}})', path)
    turns = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise InputError(f"{where}: message {i} has role {role!r}, not one of {', '.join(ROLES)}", path)
        if content is None and not scored:
            content = ""
        if not isinstance(content, str):
            raise InputError(f"{where}: message {i}'s content is not text", path)
        turns.append((role, content))
    if not scored:
        return Chat(tuple(turns), where=where)
    if not any(role == "assistant" for role, _ in turns):
        raise InputError(f"{where}: the chat has no assistant turn to score", path)
    if turns[0][0] == "assistant":
        # Nothing prompts it, and the template would render the prompt before it from no message at all.
        raise InputError(f"{where}: the chat opens with an assistant turn; begin it with a user turn", path)
    tag = doc.get("tag", UNTAGGED)
    if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", tag):
        raise InputError(f"{where}: tag {tag!r} is not a name (letters, digits, _ and -)", path)
    return Chat(tuple(turns), tag, where)


def chats_sha256(chats: list[Chat]) -> str:
    """Identity of a list of chats (their messages and tags, in order)."""
    doc = [{"messages": [list(m) for m in c.messages], "tag": c.tag} for c in chats]
    return hashlib.sha256(json.dumps(doc, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class ChatTokens:
    """A chat as a model is fed it: `ids`, the template's rendering tokenised; `scored`, the positions whose
    logits predict an assistant token (position p predicts ids[p + 1]); `turn`, the assistant message (1, 2,
    …, counted in the chat) of each; `spans`, how the assistant tokens were found."""

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


def chat_tokens(tokenizer: Any, chat: Chat, path: Path | None = None) -> ChatTokens:
    """`chat` (of the chat file `path`, for errors) through the tokenizer's chat template, its assistant
    tokens found by the template's generation markers where it has them, else by its rendering, less the
    text the template writes before each message's content (module docstring)."""
    renderer = _Renderer(tokenizer, chat_template(tokenizer), path)
    text = renderer.render(chat, None, False)[0]
    assistant = [i for i, (role, _) in enumerate(chat.messages) if role == "assistant"]
    spans = []
    for rank, index in enumerate(assistant):
        found = renderer.span(chat, index, rank)
        if found is None or not text.startswith(found[0][: found[2]]):
            raise InputError(
                f"{chat.where}: the chat template does not render turn {index} as a prefix of the whole "
                "chat, so its assistant tokens cannot be told from it; give the template {% generation %} "
                "markers",
                path,
            )
        _, start, end = found
        before = renderer.text_before_content(chat, index, rank)
        spans.append((start + len(before) if text.startswith(before, start, end) else start, end))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], np.int64)
    turn = _turns(encoded["offset_mapping"], spans, chat, path)
    # Position p scores the token at p + 1.
    scored = np.flatnonzero(turn[1:])
    if not len(scored):
        raise InputError(f"{chat.where}: its template rendering leaves no assistant token to score", path)
    how: SpanSource = "generation markers" if renderer.marked else "template rendering"
    return ChatTokens(ids=ids, scored=scored.astype(np.int64), turn=turn[scored + 1], spans=how)


class _Renderer:
    """A tokenizer's chat template rendering a chat's first messages, with the character spans its
    generation markers enclose; a chat the template refuses is refused naming its line."""

    def __init__(self, tokenizer: Any, template: str, path: Path | None) -> None:
        self.tokenizer, self.template, self.path = tokenizer, template, path
        self.marked = has_generation_markers(template)

    def render(
        self, chat: Chat, turns: int | None, generation_prompt: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendering of `chat`'s first `turns` messages (all: None) and its marked spans."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            # As `apply_chat_template` renders (the special tokens as variables), with the marked spans.
            texts, spans = render_jinja_template(
                conversations=[chat.as_messages(turns)],
                chat_template=self.template,
                # Asked only of a marked template: Transformers warns of one without markers.
                return_assistant_tokens_mask=self.marked,
                add_generation_prompt=generation_prompt,
                **self.tokenizer.special_tokens_map,
            )
        except jinja2.TemplateError as exc:
            raise InputError(f"{chat.where}: the chat template refuses the chat ({exc})", self.path) from None
        return texts[0], [tuple(span) for span in spans[0]] if self.marked else []

    def span(self, chat: Chat, index: int, rank: int) -> tuple[str, int, int] | None:
        """A rendering of `chat` (whole where marked, else through message `index`) and the characters of it
        that assistant message `index`, the chat's `rank`th, takes; None where the template does not render
        the turn as an addition to the chat before it."""
        if self.marked:
            text, spans = self.render(chat, None, False)
            assistant = sum(role == "assistant" for role, _ in chat.messages)
            if len(spans) != assistant:
                raise InputError(
                    f"{chat.where}: the chat template's {{% generation %}} markers enclose {len(spans)} "
                    f"spans for its {assistant} assistant turns: which turn a token is cannot be told",
                    self.path,
                )
            return text, *spans[rank]
        prefix = self.render(chat, index, True)[0]
        through = self.render(chat, index + 1, False)[0].rstrip()
        return (through, len(prefix), len(through)) if through.startswith(prefix) else None

    def text_before_content(self, chat: Chat, index: int, rank: int) -> str:
        """What the template writes in assistant message `index`'s span before its content: found with a
        placeholder for the content ("" where the template does not show the placeholder)."""
        probe = chat.with_content(index, _PLACEHOLDER)
        found = self.span(probe, index, rank)
        if found is None:
            return ""
        text, start, end = found
        at = text.find(_PLACEHOLDER, start, end)
        return text[start:at] if at >= 0 else ""


def _turns(
    offsets: list[tuple[int, int]], spans: list[tuple[int, int]], chat: Chat, path: Path | None
) -> np.ndarray:
    """Each token's assistant message (1, 2, … by `spans`, one per message; 0 for none): the span it
    overlaps, as Transformers marks a token for its assistant mask."""
    if not offsets and spans:
        raise InputError(
            f"{chat.where}: the tokenizer gives no character offsets (a slow tokenizer): chats need a fast "
            "one",
            path,
        )
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    turn = np.zeros(len(bounds), dtype=np.int64)
    for number, (begin, stop) in enumerate(spans, start=1):
        turn[(turn == 0) & (bounds[:, 0] < stop) & (bounds[:, 1] > begin)] = number
    return turn
