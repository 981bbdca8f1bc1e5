"""The documentation: the site builds strictly, its generated pages equal what generates them, and the
README is a front page.

`mkdocs build --strict` fails on any warning: a link to a page or anchor that does not exist, a page left out
of the navigation. The CLI reference and the benchmarks page are generated (scripts/cli_reference.py,
scripts/render_benchmarks.py) and must equal what generates them, byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def script(name: str) -> ModuleType:
    """A module of scripts/ (not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location(f"docs_script_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        cwd=config.parent,
        check=False,
    )


def site_copy(tmp_path: Path) -> Path:
    """The site's sources (config, pages, hooks, the example report they publish) in a folder of their own."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy)
    for folder in ("docs", "scripts", "reports"):
        shutil.copytree(ROOT / folder, copy / folder)
    return copy


def test_the_site_builds_strictly_with_the_example_report(tmp_path: Path) -> None:
    built = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "example" / "report" / "index.html").is_file()
    assert (tmp_path / "site" / "example" / "artifacts" / "ppl_kld_histogram.png").is_file()
    assert (tmp_path / "site" / "cli" / "index.html").is_file()


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path: Path) -> None:
    copy = site_copy(tmp_path)
    page = copy / "docs" / "statistics.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    built = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-page.md" in built.stderr

    page.write_text(page.read_text().replace("no-such-page.md", "ci.md#no-such-anchor"))
    built = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-anchor" in built.stderr


def test_the_cli_reference_is_what_the_typer_app_generates() -> None:
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert page == script("cli_reference").render(), "docs/cli.md is stale: run scripts/cli_reference.py"


def test_the_cli_reference_names_every_command_and_no_home_folder() -> None:
    from evalsuite.cli.app import app

    page = script("cli_reference").render()
    for command in app.registered_commands:
        assert f"## `evalsuite {command.name}`" in page
    assert str(Path.home()) not in page


def test_the_committed_benchmarks_page_regenerates_byte_identical_from_the_committed_json() -> None:
    render = script("render_benchmarks")
    page = (ROOT / "docs" / "benchmarks.md").read_bytes()
    assert render.render(ROOT / "bench" / "results").encode("utf-8") == page, (
        "docs/benchmarks.md is stale: run scripts/render_benchmarks.py"
    )


def test_the_scale_pages_serving_block_regenerates_from_the_committed_json() -> None:
    render = script("render_benchmarks")
    page = render.SCALE_PAGE.read_text(encoding="utf-8")
    assert render.render_scale(page, ROOT / "bench" / "results") == page, (
        "docs/scale.md is stale: run scripts/render_benchmarks.py"
    )
    # The block is there and says each serving task's forwards, or that none were measured.
    block = page.partition(render.SERVING_START)[2].partition(render.SERVING_END)[0]
    assert all(f"| `{task}` |" in block for task in ("longform", "tools", "specdec")), block


def test_the_benchmarks_page_takes_each_benchs_latest_full_run(tmp_path: Path) -> None:
    render = script("render_benchmarks")
    machine = {"cpu_model": "Test CPU", "torch_cpu_capability": "AVX2", "cores": 2, "memory_bytes": 16e9}

    def run(date: str, mode: str, commit: str, value: float) -> dict:
        return {
            "schema": render.SCHEMA, "bench": "digest", "script": "bench/digest.py", "title": "Digests.",
            "mode": mode, "date": date, "commit": commit, "dirty": False, "machine": machine, "argv": [],
            "figures": [{"name": "cold / sha256sum", "value": value, "unit": "",
                         "goal": {"op": "<=", "value": 1.1}, "met": value <= 1.1}],
            "printed": [f"cold / sha256sum {value}"],
        }  # fmt: skip

    import json

    for i, doc in enumerate(
        [
            run("2026-01-01T00:00:00Z", "full", "a" * 40, 0.9),
            {**run("2026-02-01T00:00:00Z", "full", "b" * 40, 1.3), "note": "converted from an older file"},
            run("2026-03-01T00:00:00Z", "quick", "c" * 40, 0.1),
        ]
    ):
        (tmp_path / f"digest-{i}.json").write_text(json.dumps(doc))
    page = render.render(tmp_path)
    assert "`bbbbbbbbbb`" in page and "cccccccccc" not in page  # the latest full run, not the later quick one
    assert "| cold / sha256sum | 1.3 | ≤ 1.1 | **missed** |" in page
    assert "- machine: Test CPU; torch kernels AVX2; 2 cores; 16.0 GB of memory\n" in page
    assert "- note: converted from an older file\n" in page
    assert render.render(tmp_path) == page  # deterministic


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    first_screen = "\n".join(lines[:60])
    # .ci/run runs the README's test command, quietly.
    ci_line = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    ci_command = ci_line.replace("pip install -q ", "pip install ")
    assert ci_command == "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"
    assert f"{ci_command}      # install and run the tests" in first_screen
    assert "pip install torch==2.13.0 && pip install -e '.[demo]' && evalsuite demo " in first_screen
    assert "does it still behave like its" in first_screen
    start, end = first_screen.find("<!-- tour:start -->"), first_screen.find("<!-- tour:end -->")
    assert 0 <= start < end, "the tour block ends within the first 60 lines"
    assert "$ evalsuite demo" in first_screen[start:end]
    assert not re.search(r"Timed|\d+ min \d+ s|\bpassed in\b|load average", first_screen)


def test_the_readme_links_only_to_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target


def test_the_tour_block_keeps_the_output_and_drops_progress_and_timings() -> None:
    tour = script("readme_tour")
    output = (
        "smollm2-135m-bf16: building\nsmollm2-135m-bf16: built in 43.0 s\n"
        "Loading: 100%|██████████| 3/3 [00:01<00:00,  2.1it/s]\n"
        "task  metric  ref  ckpt\nppl   ppl     11.6 17.7\n\nreport: demo-reports/x/report.md\n"
    )
    block = tour.tour_block(output)
    assert block.splitlines() == [
        tour.START, "```console", "$ evalsuite demo", "task  metric  ref  ckpt", "ppl   ppl     11.6 17.7",
        "report: demo-reports/x/report.md", "```", tour.END,
    ]  # fmt: skip
    readme = f"# t\n\nbefore\n{tour.START}\nold\n{tour.END}\nafter\n"
    assert tour.with_tour(readme, block) == f"# t\n\nbefore\n{block}\nafter\n"


def test_the_formats_table_regenerates_from_the_committed_evidence() -> None:
    render = script("render_formats")
    evidence = json.loads(render.EVIDENCE.read_text(encoding="utf-8"))
    page = render.PAGE.read_text(encoding="utf-8")
    assert render.render(page, evidence) == page, "docs/formats.md is stale: run scripts/render_formats.py"
    assert render.stale_tests(evidence) == [], "docs/format-evidence.json is stale: run it with --run"


def test_every_quantized_format_evalsuite_detects_has_passing_evidence_for_tensors_corruption_and_ppl() -> (
    None
):
    from typing import get_args

    from evalsuite.files.checkpoint import SOURCE_FORMATS, CheckpointFormat

    render = script("render_formats")
    tests = json.loads(render.EVIDENCE.read_text(encoding="utf-8"))["tests"]
    for fmt in sorted(set(get_args(CheckpointFormat)) - set(SOURCE_FORMATS)):
        for claim in ("tensors", "code", "ppl"):
            shown = [t["outcome"] for t in tests if t["format"] == fmt and claim in t["claim"]]
            assert shown and set(shown) == {"passed"}, (fmt, claim, shown)


def test_a_failed_test_makes_its_cell_fail_and_an_unshown_claim_a_dash() -> None:
    render = script("render_formats")
    evidence = json.loads(render.EVIDENCE.read_text(encoding="utf-8"))
    mlx = [t for t in evidence["tests"] if t["format"] == "mlx"]
    ppl = next(t for t in mlx if "ppl" in t["claim"])
    ppl["outcome"] = "failed"
    evidence["tests"] = mlx
    table = render.render_table(evidence)
    row = next(line for line in table.splitlines() if line.startswith("| MLX |"))
    cells = [c.strip() for c in row.strip("|").split("|")][2:]
    by_claim = dict(zip(render.CLAIMS, cells, strict=True))
    assert by_claim["ppl"].startswith("FAIL") and by_claim["tensors"] == "pass"
    evidence["tests"] = [t for t in mlx if "refused" not in t["claim"]]
    row = next(line for line in render.render_table(evidence).splitlines() if line.startswith("| MLX |"))
    assert [c.strip() for c in row.strip("|").split("|")][-1] == "—"


def test_the_evidence_plugin_records_what_each_claimed_test_did_and_runs_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "test_claims.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.format_evidence(format='mlx', writer='w')\n"
        "@pytest.mark.format_evidence(claim='tensors')\n"
        "def test_passes(): pass\n"
        "@pytest.mark.format_evidence(claim=['code', 'scale'])\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.format_evidence(claim='ppl')\n"
        "def test_skips(): pytest.skip('no writer here')\n"
        "def test_unclaimed(): assert False\n"
    )
    out = tmp_path / "evidence.json"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.format_evidence", "-o", "addopts=", "-p",
         "no:cacheprovider", "--format-evidence", str(out), str(tmp_path / "test_claims.py")],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr  # the failing claim, not the unclaimed test
    records = {r["test"].rpartition("::")[2]: r for r in json.loads(out.read_text())["tests"]}
    assert {k: (r["outcome"], r["claim"]) for k, r in records.items()} == {
        "test_passes": ("passed", ["tensors"]),
        "test_fails": ("failed", ["code", "scale"]),
        "test_skips": ("skipped", ["ppl"]),
    }
    assert records["test_passes"]["format"] == "mlx" and records["test_passes"]["writer"] == "w"
