"""Tool calls and JSON: does the candidate still call the right function with the right arguments, and still
answer in valid JSON, where the reference does?

Each case is a request: a `tool` case offers functions (a JSON Schema of each one's parameters) and expects a
call; a `json` case states a JSON Schema in its prompt and expects an object. A tool case goes through the
chat template's `tools` (`apply_chat_template(tools=…)`) where the template takes them; else, as a `json`
case always does, it is asked in JSON mode, the schema or the functions written into the prompt's text, which
any instruct model can be asked. Both sides decode every case greedily as `smoke`'s prompts are
(`evalsuite.observers.greedy_answers`, paired by `evalsuite.tasks.answer_pairs`: alone where loaded, in the
spec's batches where streamed, the configuration stated), and every outcome is read off those answers
(`evalsuite.tasks.tools._answers`): the object each answer holds (the template's call markup, else the first
JSON object), whether it is valid under the case's schema (`jsonschema`), and whether it is the expected call.

Per side, the share of cases parsed, schema-valid and right, each with its Wilson interval over cases; paired,
the flips of each outcome between the sides, McNemar's exact test of them, and the drop of each share with
Newcombe's paired interval. Each case is one independent outcome: the intervals are over cases.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import jinja2

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import TaskSpec
from evalsuite.errors import InputError
from evalsuite.observers.greedy_answers import ANSWERS_LABEL, PROMPTS, GreedyAnswers
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import (
    Difference,
    Inputs,
    Need,
    RunContext,
    TaskResult,
    skip_if_cannot_generate,
    task,
)
from evalsuite.tasks.answer_pairs import PairedAnswers, batch_cells, divergence_row, marked, paired_answers
from evalsuite.tasks.smoke import CKPT_ANSWERS_LABEL, agreed_ids, batch_figures, chat_ids, ids_sha256
from evalsuite.tasks.tools._answers import (
    CALL_FORMATS,
    PLAIN,
    Parsed,
    as_call,
    call_error,
    call_format,
    parse_answer,
    same_json,
    schema_error,
)
from evalsuite.tasks.tools._figures import (
    OUTCOMES,
    outcome_descriptions,
    outcome_differences,
    outcome_figures,
    outcomes,
)
from evalsuite.tasks.tools._spec import Case, ToolsSpec

# How a case was asked (each row's `path`).
TEMPLATE = "template tools"
JSON_SCHEMA = "JSON mode: schema in the text"
JSON_TOOLS = "JSON mode: functions in the text"
# What the template is shown to see how it offers functions and writes a call (`template_tools`).
_PROBE = {
    "name": "probe",
    "description": "Looks up a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}
_PROBE_CALL = {
    "id": "probe0001",
    "type": "function",
    "function": {"name": "probe", "arguments": {"word": "x"}},
}


def template_tools(tokenizer: Any) -> tuple[bool, str]:
    """Whether a side's chat template takes tools (offering a function changes what it renders) and how it
    writes a call (`_answers.call_format`, read off an assistant turn that calls one, the part after the
    chat before it; where the template cannot render that turn, off its own source)."""
    if not getattr(tokenizer, "chat_template", None):
        return False, PLAIN
    chat = [{"role": "user", "content": "Look up the word x."}]

    def render(messages: list[dict[str, Any]], **kw: Any) -> str | None:
        try:
            return str(tokenizer.apply_chat_template(messages, tokenize=False, **kw))
        except (jinja2.TemplateError, ValueError, TypeError, KeyError):
            return None

    plain = render(chat, add_generation_prompt=True)
    offered = render(chat, add_generation_prompt=True, tools=[{"type": "function", "function": _PROBE}])
    if offered is None or offered == plain:
        return False, PLAIN
    before = render(chat, tools=[{"type": "function", "function": _PROBE}]) or ""
    called = render([*chat, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}])
    if called is None:
        return True, call_format(str(tokenizer.get_chat_template(tools=[_PROBE])))
    shared = next((i for i, (a, b) in enumerate(zip(before, called, strict=False)) if a != b), len(before))
    return True, call_format(called[shared:])


def filled(text: str, values: dict[str, str]) -> str:
    """A `[prompting]` text with its `{prompt}`, `{schema}` and `{tools}` replaced in one pass (what they are
    replaced with is never read again, braces and all)."""
    return re.sub(r"\{(prompt|schema|tools)\}", lambda m: values.get(m.group(1), m.group(0)), text)


@task("tools")
class Tools:
    """Tool calls and JSON answers of both sides to the spec's cases: parsed, schema-valid and right, per side
    and in pairs (module docstring)."""

    spec_model: ClassVar[type[TaskSpec]] = ToolsSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_*",
        "parse_*",
        "schema_valid_*",
        "right_call_*",
        "ref_*",
        "ckpt_*",
        "identical",
        "batch_sensitivity_p",
    )
    # What the figures that every run has mean; each outcome's, with this run's intervals, are the run's
    # own (`_figures.outcome_descriptions`).
    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_cases": "cases both sides answered (each one independent outcome: the intervals are over cases)",
        "n_through_template": "tool cases asked through the chat template's `tools`",
        "n_json_mode": "cases asked in JSON mode, the schema or the functions in the prompt's text",
        "tool_call_format": "how the chat template writes a call (tried first when reading an answer)",
        "identical": "cases the two sides answered token for token the same",
    }

    def __init__(self, spec: ToolsSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        # How each case was asked and how the template writes a call, found by `prepare`.
        self.paths: list[str] = []
        self.form = PLAIN

    def asked(
        self, case: Case, takes_tools: bool
    ) -> tuple[list[dict[str, str]], list[dict[str, Any]] | None, str]:
        """A case as one user turn: its chat, the functions handed to the template (None: none), its path."""
        p = self.spec.prompting
        if case.kind == "tool" and takes_tools and p.tools_through_template:
            return (
                [{"role": "user", "content": case.prompt}],
                [t.definition() for t in case.offered()],
                TEMPLATE,
            )
        if case.kind == "tool":
            tools = json.dumps([t.described() for t in case.offered()], ensure_ascii=False)
            text = filled(p.tools_as_json, {"prompt": case.prompt, "tools": tools})
            return [{"role": "user", "content": text}], None, JSON_TOOLS
        schema = json.dumps(case.answer_schema, ensure_ascii=False)
        text = filled(p.json_mode, {"prompt": case.prompt, "schema": schema})
        return [{"role": "user", "content": text}], None, JSON_SCHEMA

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Each case's ids made once (with the reference tokenizer, or the candidate's for a recorded
        reference), hashed; where the tokenizers differ, the candidate's must agree. How each case is asked
        follows the template: through its `tools` where it takes them, else in JSON mode."""
        skip_if_cannot_generate(ref, ckpt, "tools")
        found: dict[str, tuple[list[str], str]] = {}

        def ids_of(side: Side) -> list[list[int]]:
            takes_tools, form = template_tools(side.tokenizer)
            asked = [self.asked(case, takes_tools) for case in self.spec.cases]
            found[side.role] = [path for _, _, path in asked], form
            return [chat_ids(side, chat, tools) for chat, tools, _ in asked]

        ids = agreed_ids(ref, ckpt, [c.id for c in self.spec.cases], ids_of)
        self.paths, self.form = found["ckpt" if ref.is_recorded else "ref"]
        prompts = [
            {"ids": i, "max_new_tokens": c.max_new_tokens} for i, c in zip(ids, self.spec.cases, strict=True)
        ]
        return {PROMPTS: prompts, "prompts_sha256": ids_sha256(ids), "n_cases": len(ids)}

    def needs(self) -> list[Need]:
        g = self.spec.generation
        # The expected answers are compare-only: changing one never re-runs a model.
        identity = {
            "cases": [c.model_dump(mode="json", by_alias=True, exclude={"expect"}) for c in self.spec.cases],
            "prompting": self.spec.prompting.model_dump(mode="json"),
        }
        answers = GreedyAnswers("tools-answers", "tools cases", identity, g.top_k, 0, g.batch)
        return [Need(ANSWERS_LABEL, "ref", answers), Need(CKPT_ANSWERS_LABEL, "ckpt", answers)]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        pair = paired_answers(observed[ANSWERS_LABEL], observed[CKPT_ANSWERS_LABEL])
        if len(pair) != len(self.spec.cases):
            raise InputError(f"the sides answered {len(pair)} cases, not {len(self.spec.cases)}")
        rows = [self.compare_case(i, case, pair) for i, case in enumerate(self.spec.cases)]
        values: dict[str, Any] = {
            "n_cases": len(rows),
            "n_through_template": sum(path == TEMPLATE for path in self.paths),
            "n_json_mode": sum(path != TEMPLATE for path in self.paths),
            "tool_call_format": CALL_FORMATS[self.form],
            "identical": sum(row["identical"] for row in rows),
        }
        for outcome in OUTCOMES:
            ref, ckpt = (outcomes(rows, side, outcome) for side in ("ref", "ckpt"))
            values.update(outcome_figures(outcome, ref, ckpt))
        batch_values, null_reasons = batch_figures(pair)
        values.update(batch_values)
        checks, _ = self.spec.threshold_checks(values)
        descriptions = outcome_descriptions(values)
        return TaskResult.from_checks(
            values, checks, details=rows, null_reasons=null_reasons, descriptions=descriptions
        )

    def read(self, case: Case, text: str) -> dict[str, Any]:
        """What one answer says (`_answers`): the object it holds and where it was found, whether it is valid
        under the case's schema (why not), whether it is the expected call or object."""
        parsed: Parsed = parse_answer(text, self.form if case.kind == "tool" else PLAIN)
        value, sensitive = parsed.value, self.spec.compare.case_sensitive
        if value is None:
            return {"parsed": None, "parsed_from": None, "schema_valid": False, "right_call": False,
                    "error": "no JSON object"}  # fmt: skip
        if case.kind == "tool":
            error = call_error(case.parameters(), value)
            call = as_call(value)
            right = call is not None and call["name"] == case.expect["name"]
            right = right and same_json(call["arguments"], case.expect["arguments"], sensitive)
        else:
            assert case.answer_schema is not None
            error = schema_error(case.answer_schema, value)
            right = same_json(value, case.expect, sensitive)
        return {
            "parsed": json.dumps(value, ensure_ascii=False),
            "parsed_from": parsed.found_by,
            "schema_valid": error is None,
            "right_call": bool(right),
            "error": error,
        }

    def compare_case(self, i: int, case: Case, pair: PairedAnswers) -> dict[str, Any]:
        """One case: how it was asked, both answers as decoded (where they part marked), what each holds."""
        d = pair.step(i)
        read = {"ref": self.read(case, pair.ref.texts[i]), "ckpt": self.read(case, pair.ckpt.texts[i])}
        row: dict[str, Any] = {"id": case.id, "kind": case.kind, "path": self.paths[i] if self.paths else ""}
        for side, answers in (("ref", pair.ref), ("ckpt", pair.ckpt)):
            row[f"{side}_answer"] = marked(answers.texts[i], answers.char_ends[i], d)
        for key in read["ref"]:
            row.update({f"{side}_{key}": read[side][key] for side in ("ref", "ckpt")})
        divergence = divergence_row(pair, i, self.spec.generation.top_k, self.spec.generation.near_tie)
        row.update(identical=d is None, first_diff_token=d, divergence=divergence.get("divergence", ""))
        row.update(batch_cells(pair, i, {"parsed": lambda text: self.read(case, text)["parsed"] is not None}))
        return row

    def paired_differences(self, values: dict[str, Any]) -> list[Difference]:
        """McNemar's exact test of each outcome's flips, the candidate against the reference on the same
        cases (`_figures.outcome_differences`)."""
        return outcome_differences(values)
