"""The shipped `specdec` prompt set: the eight workloads of exllamav3's eval/spec_decode.py, at least five
prompts each, the prompt tables last; and a spec that names an unknown workload is refused before any model
loads, naming the file and the line."""

from __future__ import annotations

import tomllib
from collections import Counter

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.tasks.specdec import CATEGORIES, SpecdecSpec
from tests.conftest import TINY_BF16, TINY_W4A8, assert_refused, cli_in_process


def test_the_shipped_set_covers_every_workload_with_five_prompts_or_more():
    path = default_spec_path("specdec")
    spec = load_spec(SpecdecSpec, path)
    counts = Counter(p.category for p in spec.prompts)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 5, counts
    # The reasoning workloads switch the template's thinking on, the others leave it off.
    assert all(p.thinking == p.category.endswith("_reasoning") for p in spec.prompts)
    # The prompt tables come last: nothing but prompts and their messages follows the first of them.
    text = path.read_text(encoding="utf-8")
    tail = text[text.index("[[prompts]]") :]
    headers = {line.strip() for line in tail.splitlines() if line.startswith("[")}
    assert headers == {"[[prompts]]", "[[prompts.messages]]"}, headers
    assert len(tomllib.loads(text)["prompts"]) == len(spec.prompts)


def test_a_prompt_of_an_unknown_workload_is_refused_with_the_file_and_line(tiny_pair, tmp_path):
    text = default_spec_path("specdec").read_text(encoding="utf-8")
    bad = tmp_path / "specdec.toml"
    bad.write_text(text.replace('category = "coding"', 'category = "poetry"', 1), encoding="utf-8")
    line = bad.read_text(encoding="utf-8").splitlines().index('category = "poetry"')
    code, lines, _ = cli_in_process(
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "specdec",
        "--spec", f"specdec={bad}", "--out", tmp_path / "run", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, str(bad), "prompts.", "category")
    # The line of the prompt's table (its `[[prompts]]` header) or of the field itself.
    assert any(f"line {n}" in lines[0] for n in range(line - 6, line + 2)), lines[0]
