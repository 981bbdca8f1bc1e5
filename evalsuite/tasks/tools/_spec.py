"""The `tools` task's spec, validated when it is read: the functions the cases may offer, how a case is asked
in JSON mode, and the cases, each with its expected call or object checked against its own schema.

JSON Schemas, function parameters and expected answers are written as JSON text in the TOML file (a `'''…'''`
string) or as TOML tables; either way each schema is checked as a JSON Schema at load
(`jsonschema.validators.validator_for(schema).check_schema`) and each expected answer against its schema, so
that a malformed case is refused at start-up, naming the file and the line, never found half-way through a
run.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import Field, field_validator, model_validator

from evalsuite.contract.spec import StrictModel, TaskSpec
from evalsuite.tasks.smoke import GenerationOptions
from evalsuite.tasks.tools._answers import call_error, schema_error

PROMPT, SCHEMA, TOOLS = "{prompt}", "{schema}", "{tools}"


def json_document(value: Any) -> Any:
    """A JSON document written as JSON text (a TOML string) or as TOML tables."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None


def checked_schema(value: Any) -> dict[str, Any]:
    """A JSON Schema of an object, checked against its own metaschema (its `$schema`, else draft 2020-12)."""
    schema = json_document(value)
    if not isinstance(schema, dict):
        raise ValueError("a JSON Schema here is a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON Schema{' at ' + where if where else ''}: {exc.message}") from None
    return schema


class Function(StrictModel):
    """A function a case may offer: what it does and its parameters, a JSON Schema of an object."""

    description: str
    parameters: dict[str, Any]

    @field_validator("parameters", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> dict[str, Any]:
        schema = checked_schema(value)
        if schema.get("type") != "object":
            raise ValueError('a function\'s parameters are a JSON Schema with "type": "object"')
        return schema


class Tool(Function):
    """A function as a case offers it: with its name (its key in `[functions]`)."""

    name: str

    def definition(self) -> dict[str, Any]:
        """The function as chat templates take it (`apply_chat_template(tools=…)`, OpenAI's form)."""
        return {"type": "function", "function": self.described()}

    def described(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


class Case(StrictModel):
    """One request. A `tool` case offers `tools` (names in `[functions]`) and expects the call
    `{"name", "arguments"}`; a `json` case states `schema` in its prompt and expects the object."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    kind: Literal["tool", "json"]
    prompt: str
    max_new_tokens: int = Field(ge=1, le=4096)
    tools: list[Tool | str] | None = None
    answer_schema: dict[str, Any] | None = Field(None, alias="schema")
    expect: dict[str, Any]

    @field_validator("tools")
    @classmethod
    def _offered(cls, value: list[Tool | str] | None) -> list[Tool | str] | None:
        unknown = [t for t in value or [] if isinstance(t, str)]
        if unknown:
            raise ValueError(f"names no function of [functions]: {', '.join(map(repr, unknown))}")
        names = [t.name for t in value or [] if isinstance(t, Tool)]
        if len(set(names)) != len(names):
            raise ValueError("offers a function twice")
        return value

    @field_validator("answer_schema", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        return None if value is None else checked_schema(value)

    @field_validator("expect", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        return json_document(value)

    @model_validator(mode="after")
    def _expected_is_valid(self) -> Case:
        if self.kind == "tool":
            if not self.tools or self.answer_schema is not None:
                raise ValueError(
                    "a tool case offers `tools` and has no `schema` (its tools' parameters are it)"
                )
            if set(self.expect) != {"name", "arguments"}:
                raise ValueError('a tool case expects {"name": …, "arguments": {…}}')
            error = call_error(self.parameters(), self.expect)
        else:
            if self.answer_schema is None or self.tools:
                raise ValueError("a json case states a `schema` and offers no `tools`")
            error = schema_error(self.answer_schema, self.expect)
        if error is not None:
            raise ValueError(f"`expect` is not valid under the case's own schema: {error}")
        return self

    def offered(self) -> list[Tool]:
        return [t for t in self.tools or [] if isinstance(t, Tool)]

    def parameters(self) -> dict[str, dict[str, Any]]:
        """Each offered function's parameters' schema, by name."""
        return {t.name: t.parameters for t in self.offered()}


class Prompting(StrictModel):
    """How a case is asked in JSON mode: its prompt, with the schema (a `json` case) or the functions it
    offers (a `tool` case whose template takes no tools) written into the text."""

    # Tool cases go through the chat template's `tools` where it takes them; false asks them in JSON mode.
    tools_through_template: bool = True
    json_mode: str = (
        "{prompt}\n\nAnswer with only a JSON object that is valid under this JSON Schema:\n{schema}"
    )
    tools_as_json: str = (
        "You can call these functions:\n{tools}\n\n{prompt}\n\nCall one of them: answer with only a JSON "
        'object {"name": <the function\'s name>, "arguments": <an object of its arguments>}.'
    )

    @model_validator(mode="after")
    def _placeholders(self) -> Prompting:
        for field, needed in (("json_mode", (PROMPT, SCHEMA)), ("tools_as_json", (PROMPT, TOOLS))):
            missing = [p for p in needed if p not in getattr(self, field)]
            if missing:
                raise ValueError(f"`{field}` must hold {' and '.join(missing)}")
        return self


class CompareOptions(StrictModel):
    # Strings in an expected answer compared exactly, or after trimming white space and folding case.
    case_sensitive: bool = False


class ToolsSpec(TaskSpec):
    generation: GenerationOptions = GenerationOptions()
    prompting: Prompting = Prompting()
    compare: CompareOptions = CompareOptions()
    functions: dict[str, Function] = Field(default_factory=dict)
    cases: list[Case]

    @model_validator(mode="before")
    @classmethod
    def _functions_of_cases(cls, data: Any) -> Any:
        """Each case's `tools` (names) resolved to the functions `[functions]` defines, so that a case
        offering a function it does not define is refused at its own line."""
        if not isinstance(data, dict) or not isinstance(data.get("functions"), dict):
            return data
        functions = data["functions"]
        cases = []
        for case in data.get("cases") or []:
            if isinstance(case, dict) and isinstance(case.get("tools"), list):
                tools = [
                    {**functions[t], "name": t}
                    if isinstance(t, str) and isinstance(functions.get(t), dict)
                    else t
                    for t in case["tools"]
                ]
                case = {**case, "tools": tools}
            cases.append(case)
        return {**data, "cases": cases}

    @field_validator("cases")
    @classmethod
    def _unique(cls, value: list[Case]) -> list[Case]:
        ids = [c.id for c in value]
        if not ids:
            raise ValueError("the spec needs at least one case")
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"case ids must be unique: {', '.join(twice)}")
        return value
