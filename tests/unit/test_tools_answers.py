"""The `tools` task's reading of an answer, on hand-written answers: the call markup of each template format,
else the first JSON object; schema validity with `jsonschema`; the comparison with the expected call; how a
template is found to take tools and write a call; and a user's malformed case or schema refused at start-up,
exit 2, naming the file and the line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.tasks.tools import TEMPLATE, Tools, filled, template_tools
from evalsuite.tasks.tools._answers import (
    FIRST_OBJECT,
    HERMES,
    LLAMA3,
    MISTRAL,
    PLAIN,
    as_call,
    call_error,
    call_format,
    first_json_object,
    parse_answer,
    same_json,
    schema_error,
)
from evalsuite.tasks.tools._spec import ToolsSpec
from tests.conftest import assert_refused, cli_in_process, copy_checkpoint

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('Sure! Here it is: {"a": 1} and {"b": 2}', {"a": 1}),
        ('```json\n{\n  "a": [1, {"b": null}]\n}\n```', {"a": [1, {"b": None}]}),
        # A truncated outer object: the first complete object inside it.
        ('{"a": {"b": 2}, "c": ', {"b": 2}),
        # Braces in text before the object, and a brace inside a string of it.
        ('use {braces} like {"k": "}{"}', {"k": "}{"}),
        ("{'a': 1}", None),  # Python's repr is not JSON
        ('{"a": NaN}', None),  # nor is NaN
        ('{"a": 1', None),
        ("[1, 2]", None),  # an array is no object
        ("no JSON here", None),
        ("", None),
    ],
)
def test_first_json_object_of_hand_written_answers(text, expected):
    assert first_json_object(text) == expected


def test_each_call_format_is_read_by_its_markup_and_else_as_the_first_object():
    hermes = (
        'I will call it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    # A decoy object before the block: the block wins in Hermes format, the decoy in plain JSON.
    decoy = '{"note": 1} ' + hermes
    assert parse_answer(decoy, HERMES).value == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert parse_answer(decoy, HERMES).found_by == "<tool_call> block"
    assert parse_answer(decoy, PLAIN).value == {"note": 1}
    assert parse_answer(decoy, PLAIN).found_by == FIRST_OBJECT
    # A block left open by the token budget still holds its object.
    assert parse_answer('<tool_call>{"name": "f", "arguments": {}}', HERMES).value == {
        "name": "f",
        "arguments": {},
    }
    mistral = '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    assert parse_answer(mistral, MISTRAL).value == {"name": "f", "arguments": {"x": 1}}
    assert parse_answer(mistral, MISTRAL).found_by == "[TOOL_CALLS] list"
    # Without its special token (decoded without special tokens), the list's first object is still found.
    assert parse_answer(mistral.replace("[TOOL_CALLS] ", ""), MISTRAL).value == {
        "name": "f",
        "arguments": {"x": 1},
    }
    assert parse_answer("<tool_call>not json</tool_call>", HERMES) == parse_answer("nothing", PLAIN)
    assert parse_answer("nothing", PLAIN).value is None and parse_answer("nothing", PLAIN).found_by is None


def test_calls_are_read_in_each_convention():
    assert as_call({"name": "f", "parameters": {"x": 1}}) == {"name": "f", "arguments": {"x": 1}}  # Llama 3
    assert as_call({"function": {"name": "f", "arguments": '{"x": 1}'}}) == {
        "name": "f",
        "arguments": {"x": 1},
    }
    assert as_call({"name": "f"}) == {"name": "f", "arguments": {}}
    assert as_call({"name": 3}) is None and as_call({"city": "Paris"}) is None
    assert as_call({"name": "f", "arguments": "{not json"}) == {"name": "f", "arguments": "{not json"}


def test_schema_and_call_errors_say_why():
    assert schema_error(WEATHER, {"city": "Paris", "unit": "celsius"}) is None
    assert "'unit' is a required property" in schema_error(WEATHER, {"city": "Paris"})
    assert schema_error(WEATHER, {"city": "Paris", "unit": "kelvin"}).startswith("['unit']: 'kelvin'")
    tools = {"get_weather": WEATHER}
    assert (
        call_error(tools, {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}) is None
    )
    assert "does not offer" in call_error(tools, {"name": "get_time", "arguments": {}})
    assert "names no function" in call_error(tools, {"city": "Oslo"})
    assert call_error(tools, {"name": "get_weather", "arguments": {"city": 1, "unit": "celsius"}}).startswith(
        "arguments['city']"
    )
    assert call_error(tools, {"name": "get_weather", "arguments": "{oops"}).startswith("arguments: ")


def test_same_json_compares_values_not_spellings():
    assert same_json({"a": 1, "b": [1.0, "Paris "]}, {"b": [1, "paris"], "a": 1.0})
    assert not same_json({"a": "Paris"}, {"a": "paris"}, case_sensitive=True)
    assert not same_json({"a": True}, {"a": 1}) and not same_json({"a": 1}, {"a": 1, "b": None})
    assert not same_json([1, 2], [2, 1]) and same_json(None, None) and not same_json(None, "")


def test_call_format_is_found_from_rendered_markup():
    assert call_format('<|im_start|>assistant\n<tool_call>\n{"name": "probe"}</tool_call>') == HERMES
    assert call_format('[TOOL_CALLS] [{"name": "probe"}]') == MISTRAL
    assert call_format('{"name": "probe", "parameters": {"word": "x"}}') == LLAMA3
    assert call_format("<|assistant|>") == PLAIN


def test_placeholders_are_filled_once_and_never_read_again():
    text = filled("{prompt} / {schema}", {"prompt": "say {schema}", "schema": '{"type": "object"}'})
    assert text == 'say {schema} / {"type": "object"}'


# A Hermes-style template (as Qwen's): the functions in the system turn, a call as a <tool_call> block.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}
{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_takes_tools_is_asked_through_them_and_one_that_does_not_in_json_mode(
    tiny_pair, tmp_path
):
    """The tiny fixture's template takes no tools: every case goes through JSON mode. The same checkpoint
    with a Hermes-style template takes them: tool cases go through the template, whose call format is
    found by rendering a call."""
    from transformers import AutoTokenizer

    spec = load_spec(ToolsSpec, default_spec_path("tools"))
    plain = AutoTokenizer.from_pretrained(tiny_pair[TINY_BF16])
    assert template_tools(plain) == (False, PLAIN)
    hermes = copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "hermes")
    (hermes / "chat_template.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(hermes)
    assert template_tools(tokenizer) == (True, HERMES)
    task = Tools.__new__(Tools)
    task.spec = spec
    tool_case = next(c for c in spec.cases if c.kind == "tool")
    json_case = next(c for c in spec.cases if c.kind == "json")
    chat, tools, path = task.asked(tool_case, True)
    assert path == TEMPLATE and tools and tools[0]["function"]["name"] == tool_case.expect["name"]
    assert chat == [{"role": "user", "content": tool_case.prompt}]
    _, tools, path = task.asked(tool_case, False)
    assert tools is None and path.startswith("JSON mode")
    chat, tools, _ = task.asked(json_case, True)
    assert tools is None and '"type": "object"' in chat[0]["content"]


def test_the_shipped_set_has_at_least_40_cases_of_both_kinds():
    spec = load_spec(ToolsSpec, default_spec_path("tools"))
    kinds = [c.kind for c in spec.cases]
    assert len(kinds) >= 40 and kinds.count("tool") >= 10 and kinds.count("json") >= 10


GOOD_CASE = """
[[cases]]
id = "a"
kind = "json"
prompt = "p"
max_new_tokens = 8
schema = '''{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}'''
expect = '''{"x": 1}'''
"""
FUNCTION = """
[functions.f]
description = "d"
parameters = '''{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}'''
"""


@pytest.mark.parametrize(
    ("body", "line", "fragment"),
    [
        # A schema that is no JSON Schema: checked against its metaschema.
        (GOOD_CASE.replace('"integer"', '"integr"'), 7, "not a valid JSON Schema"),
        # A schema that is not JSON text.
        (GOOD_CASE.replace('"required": ["x"]}', '"required": ["x"]'), 7, "not valid JSON"),
        # An expected answer its own schema refuses.
        (GOOD_CASE.replace('{"x": 1}', '{"x": "one"}'), 2, "`expect` is not valid"),
        # A tool case offering a function [functions] does not define.
        (
            FUNCTION + GOOD_CASE.replace('kind = "json"', 'kind = "tool"\ntools = ["g"]'),
            9,
            "names no function",
        ),
        # A function's parameters that are not a schema of an object.
        (FUNCTION.replace('"type": "object"', '"type": "array"') + GOOD_CASE, 4, "type"),
    ],
    ids=["not-a-schema", "not-json", "expect-invalid", "unknown-function", "parameters-not-object"],
)
def test_a_malformed_case_or_schema_is_exit_2_naming_the_file_and_line(
    tiny_pair, tmp_path, body, line, fragment
):
    path = tmp_path / "tools.toml"
    path.write_text('description = "x"\n' + body.lstrip("\n"), encoding="utf-8")
    code, lines, _ = cli_in_process(
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "tools",
        "--spec", f"tools={path}", "--corpus", "python-docs", "--out", tmp_path / "out", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, str(path), f"(line {line})", fragment)
    assert not (tmp_path / "out" / "results.json").exists()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def test_the_good_case_alone_loads(tmp_path: Path):
    path = tmp_path / "tools.toml"
    path.write_text('description = "x"\n' + GOOD_CASE, encoding="utf-8")
    assert load_spec(ToolsSpec, path).cases[0].expect == {"x": 1}
