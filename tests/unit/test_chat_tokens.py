"""Chats through a tokenizer's chat template, without a model: exactly the assistant tokens scored (counted by
hand), found by the template's generation markers or by its rendering, the same either way, without the text
the template writes into a turn (a thinking block), numbered by the chat's own assistant messages; chat files
read and refused line by line, a chat the template refuses naming its line; the shipped chat set is what
tasks/ppl-chat.toml says it is."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from evalsuite.errors import InputError
from evalsuite.inputs.chat_files import Chat, chat_tokens, read_chats
from evalsuite.tasks.chats import shipped_chats
from tests.conftest import TINY_BF16

# The tiny fixture's ChatML template with Transformers' generation markers around each assistant turn's
# content and end token (the newline after it is the template's separator, outside the markers).
MARKED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TWO_TURNS = Chat(
    (("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "It is 6.")), "math"
)
# Counted by hand from the tiny fixture's byte-level BPE: "4" and "<|im_end|>" for the first turn; "I", "t",
# " is", " ", "6", "." and "<|im_end|>" for the second. Nothing of the system, user or generation prompts.
ASSISTANT_TOKENS = ["4", "<|im_end|>", "I", "t", "Ġis", "Ġ", "6", ".", "<|im_end|>"]
ASSISTANT_TURNS = [1, 1, 2, 2, 2, 2, 2, 2, 2]


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair[TINY_BF16])


def test_generation_markers_score_exactly_the_assistant_tokens(tokenizer):
    tokenizer.chat_template = MARKED_TEMPLATE
    chat = chat_tokens(tokenizer, TWO_TURNS)
    assert chat.spans == "generation markers"
    assert tokenizer.convert_ids_to_tokens(chat.targets.tolist()) == ASSISTANT_TOKENS
    assert chat.turn.tolist() == ASSISTANT_TURNS
    # Each scored position is the one before its token: its logits predict that token.
    text = tokenizer.decode(chat.ids)
    assert text.count("<|im_start|>assistant\n4<|im_end|>") == 1
    assert all(chat.ids[p + 1] == t for p, t in zip(chat.scored, chat.targets, strict=True))


def test_a_template_without_markers_scores_the_same_tokens_from_its_rendering(tiny_pair):
    # The fixture's own template has no markers: each turn's span is what its rendering adds.
    plain = AutoTokenizer.from_pretrained(tiny_pair[TINY_BF16])
    chat = chat_tokens(plain, TWO_TURNS)
    assert chat.spans == "template rendering"
    assert plain.convert_ids_to_tokens(chat.targets.tolist()) == ASSISTANT_TOKENS
    assert chat.turn.tolist() == ASSISTANT_TURNS


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_chat(tokenizer):
    # A template that renders the last assistant turn differently from the earlier ones (as reasoning
    # templates drop earlier thoughts): the chat up to a turn is no prefix of the whole chat.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if loop.last %}{{ m['content'] }}{% else %}{{ m['content'][:1] }}{% endif %}{{ '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = Chat(TWO_TURNS.messages, TWO_TURNS.tag, where="line 7")
    with pytest.raises(InputError, match=r"line 7: the chat template does not render turn 1 as a prefix"):
        chat_tokens(tokenizer, chat)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "line 2: not JSON"),
        ('{"text": "no chat"}', 'line 2: no "messages" list'),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: message 0 has role 'robot'"),
        (
            '{"messages": [{"role": "user", "content": "only a question"}]}',
            "line 2: the chat has no assistant",
        ),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}], '
            '"tag": "a b"}',
            "line 2: tag 'a b' is not",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"}, '
            '{"role": "assistant", "content": "x"}]}',
            "line 2: the chat opens with an assistant turn",
        ),
    ],
)
def test_a_chat_file_line_that_is_no_chat_is_refused_naming_its_line(tmp_path, line, fragment):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=fragment) as refused:
        read_chats(path)
    assert str(path) in str(refused.value)


def test_the_shipped_chat_set_is_what_its_spec_says(tiny_pair):
    chats = read_chats(shipped_chats())
    tags = Counter(c.tag for c in chats)
    assert tags["zh"] >= 30 and tags["en"] >= 30 and tags["math"] >= 30 and tags["code"] >= 10
    assert set(tags) == {"zh", "en", "math", "code"}
    turns = [sum(role == "assistant" for role, _ in c.messages) for c in chats]
    assert sum(t >= 2 for t in turns) >= 10 and sum(t >= 3 for t in turns) >= 3
    assert any("的" in content for c in chats if c.tag == "zh" for _, content in c.messages)
    # Every chat renders under a ChatML template with its assistant tokens found.
    plain = AutoTokenizer.from_pretrained(tiny_pair[TINY_BF16])
    scored = [len(chat_tokens(plain, c).scored) for c in chats]
    assert min(scored) > 0
    text = Path(shipped_chats().with_name("ppl-chat.toml")).read_text(encoding="utf-8")
    assert "written for evalsuite" in text and "Apache-2.0" in text
    assert np.sum(scored) > 5000


# A Qwen3-style template: every assistant turn opens with an empty thinking block the template writes, not
# the chat's message; with and without Transformers' generation markers around the whole turn.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MARKED_THINKING_TEMPLATE = THINKING_TEMPLATE.replace("{{ '<think>", "{% generation %}{{ '<think>").replace(
    "'<|im_end|>' }}{% else %}", "'<|im_end|>' }}{% endgeneration %}{% else %}"
)


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, MARKED_THINKING_TEMPLATE])
def test_template_text_inside_an_assistant_turn_is_not_scored_as_the_assistants(tokenizer, template):
    """The thinking block the template writes into each assistant turn is no token of the chat's: rendered
    with or without generation markers, exactly the tokens of the plain ChatML template are scored."""
    tokenizer.chat_template = template
    chat = chat_tokens(tokenizer, TWO_TURNS)
    assert chat.spans == (
        "generation markers" if template is MARKED_THINKING_TEMPLATE else "template rendering"
    )
    assert "<think>\n\n</think>\n\n4<|im_end|>" in tokenizer.decode(chat.ids)
    assert tokenizer.convert_ids_to_tokens(chat.targets.tolist()) == ASSISTANT_TOKENS
    assert chat.turn.tolist() == ASSISTANT_TURNS


# Generation markers around the assistant's content alone: an empty turn encloses no token.
CONTENT_MARKED_TEMPLATE = MARKED_TEMPLATE.replace(
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
    "{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
)


@pytest.mark.parametrize("template", [None, MARKED_TEMPLATE, CONTENT_MARKED_TEMPLATE])
def test_turns_are_numbered_by_the_chats_own_messages_an_empty_assistant_turn_included(tiny_pair, template):
    """The third assistant message is turn 3 whether the empty second one scores its end token or nothing."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[TINY_BF16])
    if template is not None:
        tokenizer.chat_template = template
    chat = Chat(
        (
            ("user", "What is 2+2?"),
            ("assistant", "4"),
            ("user", "Say nothing."),
            ("assistant", ""),
            ("user", "And 3+3?"),
            ("assistant", "It is 6."),
        )
    )
    scored = chat_tokens(tokenizer, chat)
    first, third = ["4", "<|im_end|>"], ["I", "t", "Ġis", "Ġ", "6", ".", "<|im_end|>"]
    second = ["<|im_end|>"]
    if template == CONTENT_MARKED_TEMPLATE:  # the end tokens lie outside the markers
        first, second, third = first[:-1], [], third[:-1]
    assert tokenizer.convert_ids_to_tokens(scored.targets.tolist()) == first + second + third
    assert scored.turn.tolist() == [1] * len(first) + [2] * len(second) + [3] * len(third)


RAISING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    + MARKED_TEMPLATE
)


def test_a_template_that_raises_on_a_chat_is_refused_naming_the_chats_line(tokenizer, tmp_path):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    system = {"messages": [{"role": "system", "content": "Be brief."}, *good["messages"]]}
    path.write_text(f"{json.dumps(good)}\n\n{json.dumps(system)}\n", encoding="utf-8")
    tokenizer.chat_template = RAISING_TEMPLATE
    first, third = read_chats(path)
    chat_tokens(tokenizer, first, path)
    with pytest.raises(
        InputError, match=r"chats.jsonl: line 3: the chat template refuses the chat"
    ) as refused:
        chat_tokens(tokenizer, third, path)
    assert "System role not supported" in str(refused.value)
