"""What a side's answer to a `tools` case says, read from its text alone: the call or object it holds, parsed
as the chat template writes a call where it has a format of its own, else as the first JSON object in it;
whether that is valid under the case's schema (`jsonschema`); whether it is the expected call or object.
Pure functions on text and JSON: no model.

How templates write a call (found by rendering an assistant turn that calls a function, `call_format`):

- **Hermes** (Qwen, Hermes, many others): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
- **Mistral**: `[TOOL_CALLS] [{"name": …, "arguments": {…}}]` (a special token, which decoding without special
  tokens drops: the list's first object is then the first JSON object of the answer);
- **Llama 3** (JSON calls): `{"name": …, "parameters": {…}}`, a bare object.

An answer in none of these, or a template with no format of its own (JSON mode), is read as the first JSON
object in the answer: `json.JSONDecoder().raw_decode` tried from each `{` in turn, the first that decodes to a
whole object wins (so an object inside a code fence or after a sentence is found, and a truncated outer object
yields the first complete object inside it). Only strict JSON counts: `NaN` and `Infinity` are not JSON.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

HERMES, MISTRAL, LLAMA3, PLAIN = "hermes", "mistral", "llama3-json", "json"
# Each call format in words, as the report names the one a template uses.
CALL_FORMATS = {
    HERMES: "Hermes/Qwen `<tool_call>{…}</tool_call>`",
    MISTRAL: "Mistral `[TOOL_CALLS] [{…}]`",
    LLAMA3: 'Llama 3 JSON `{"name": …, "parameters": {…}}`',
    PLAIN: "no tool-call markup of its own (the first JSON object)",
}
FIRST_OBJECT = "first JSON object"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_MISTRAL_MARK = "[TOOL_CALLS]"


def call_format(rendered: str) -> str:
    """How a chat template writes a tool call, from a text it rendered with one (or, where it cannot render
    one, its own source): the first of the known formats whose markup the text holds."""
    if "<tool_call>" in rendered:
        return HERMES
    if _MISTRAL_MARK in rendered:
        return MISTRAL
    if '"parameters"' in rendered or "<|python_tag|>" in rendered:
        return LLAMA3
    return PLAIN


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_not_json)


def first_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text`: decoding tried from each `{` in turn (module docstring); None."""
    at = text.find("{")
    while at != -1:
        try:
            value, _ = _DECODER.raw_decode(text, at)
        except ValueError:  # json.JSONDecodeError is one, and so is a NaN refused
            pass
        else:
            if isinstance(value, dict):
                return value
        at = text.find("{", at + 1)
    return None


@dataclass(frozen=True)
class Parsed:
    """The JSON object an answer holds (None: none), and where it was found: the template's call markup
    (`<tool_call> block`, `[TOOL_CALLS] list`) or the first JSON object of the answer."""

    value: dict[str, Any] | None
    found_by: str | None


def parse_answer(text: str, form: str) -> Parsed:
    """The object an answer holds, read in the template's call format `form` (`call_format`) first, else as
    the first JSON object in the whole answer."""
    if form == HERMES:
        for block in _HERMES_BLOCK.finditer(text):
            value = first_json_object(block.group(1))
            if value is not None:
                return Parsed(value, "<tool_call> block")
    if form == MISTRAL and _MISTRAL_MARK in text:
        rest = text[text.index(_MISTRAL_MARK) + len(_MISTRAL_MARK) :].lstrip()
        try:
            value, _ = _DECODER.raw_decode(rest)
        except ValueError:
            value = None
        if isinstance(value, list) and value and isinstance(value[0], dict):
            value = value[0]
        if isinstance(value, dict):
            return Parsed(value, "[TOOL_CALLS] list")
    value = first_json_object(text)
    return Parsed(value, FIRST_OBJECT if value is not None else None)


def as_call(value: dict[str, Any]) -> dict[str, Any] | None:
    """A parsed object read as a function call `{"name", "arguments"}`: Llama 3's `parameters` taken for
    `arguments`, OpenAI's `{"function": {…}}` unwrapped, arguments given as JSON text decoded, absent ones
    taken as none (`{}`). None where it names no function (no string `name`)."""
    if "name" not in value and isinstance(value.get("function"), dict):
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # arguments that are not JSON text stay as they are: invalid
            arguments = _DECODER.decode(arguments)
    return {"name": name, "arguments": arguments}


def schema_error(schema: dict[str, Any], value: Any) -> str | None:
    """Why `value` is not valid under the JSON Schema `schema` (the most relevant error, as `jsonschema`'s
    `best_match` picks it, with where in the value it is); None where it is valid."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def call_error(tools: dict[str, dict[str, Any]], value: dict[str, Any]) -> str | None:
    """Why a parsed object is not a valid call of one of `tools` (name → its parameters' JSON Schema): it
    names no function, names one not offered, or its arguments are not valid under that function's
    parameters; None where it is valid."""
    call = as_call(value)
    if call is None:
        return "names no function (no string `name`)"
    if call["name"] not in tools:
        return f"calls {call['name']!r}, which the case does not offer"
    error = schema_error(tools[call["name"]], call["arguments"])
    return None if error is None else f"arguments{error if error.startswith('[') else ': ' + error}"


def same_json(a: Any, b: Any, case_sensitive: bool = False) -> bool:
    """Two JSON values equal: objects with the same keys and equal values, arrays element by element,
    numbers by value (1 equals 1.0; a boolean is no number), strings exactly where `case_sensitive`, else
    after trimming white space and folding case."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a == b if case_sensitive else a.strip().casefold() == b.strip().casefold()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k], case_sensitive) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y, case_sensitive) for x, y in zip(a, b, strict=True))
    return a is None and b is None
