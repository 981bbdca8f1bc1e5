"""A verdict never rests on a stale or misapplied observation, and refusals come before any model runs.

In-process runs count what the models were asked to do: `HFBackend` (and `IntrefBackend`, which inherits
it) is wrapped to count loads and forwarded windows. The models and files are real.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from evalsuite.errors import InputError
from evalsuite.observers.noise_floor import NoiseFloorOptions
from evalsuite.pipeline.runner import RunRequest, run
from evalsuite.protocol.task import RunContext
from evalsuite.reporting.diff_report import write_reports
from tests.conftest import Models, cli_run_in_process, copy_checkpoint, edit_tensors, rerun, run_cli

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"
# Bounds the good tiny copy meets (it measures ppl_ratio 1.0008, same_top_p 0.91).
TIGHT = "[ppl]\nppl_ratio = { max = 1.01 }\nsame_top_p = { min = 0.85 }\n"


@pytest.fixture
def models(monkeypatch) -> Models:
    return Models().watch(monkeypatch)


def request(ckpt: Path, ref: Path, out: Path, tasks: str, **kw) -> RunRequest:
    return RunRequest(
        ckpt=str(ckpt),
        ref=str(ref),
        tasks=tasks.split(","),
        out=out,
        context=RunContext(corpus_name="python-docs"),
        **kw,
    )


@pytest.fixture(scope="module")
def ppl_intref_out(tiny_pair, tmp_path_factory):
    """One in-process run of `--tasks ppl,intref` on the tiny pair, with what it asked of the models."""
    mp = pytest.MonkeyPatch()
    seen = Models().watch(mp)
    out = tmp_path_factory.mktemp("ppl-intref")
    try:
        result = run(request(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], out, "ppl,intref"))
    finally:
        mp.undo()
    write_reports(result.results, result.folder)
    return result, seen, out


def test_ppl_and_intref_forward_each_side_once_under_hf(ppl_intref_out):
    result, seen, out = ppl_intref_out
    assert result.results["verdict"] == "pass"
    # 8 windows: the reference once, the candidate under hf once for both tasks and once more per draw of
    # intref's rounding floor (in the same load), once under intref.
    draws = NoiseFloorOptions().draws
    hf = 8 * (1 + draws)
    assert seen.windows == {(TINY_BF16, "hf"): 8, (TINY_W4A8, "hf"): hf, (TINY_W4A8, "intref"): 8}
    assert sorted(seen.loads) == [(TINY_BF16, "hf"), (TINY_W4A8, "hf"), (TINY_W4A8, "intref")]
    # ref, ckpt (hf), ckpt (intref) and one per draw of the floor
    assert len(list((out / "observations").iterdir())) == 3 + draws
    ppl, intref = result.results["tasks"]["ppl"]["metrics"], result.results["tasks"]["intref"]["metrics"]
    assert ppl["ppl_ckpt"] == intref["ppl_hf"] and ppl["ppl_ref"] == intref["ppl_ref"]


def test_the_intref_spec_s_divisor_is_the_one_applied(tiny_pair, ppl_intref_out, tmp_path):
    """--spec intref=FILE with divisor 127 runs the integer path with 127, not the shipped 127.5; the
    reference's and the hf candidate's observations are reused (their keys do not hold the divisor)."""
    _, _, first = ppl_intref_out
    out = shutil.copytree(first, tmp_path / "run")
    from evalsuite.pipeline.registry import get_task, spec_source

    spec = tmp_path / "intref-127.toml"
    spec.write_text(spec_source(get_task("intref")).read_text().replace("divisor = 127.5", "divisor = 127.0"))
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_pair[TINY_W4A8],
        "--ref",
        tiny_pair[TINY_BF16],
        "--tasks",
        "intref",
        "--spec",
        f"intref={spec}",
        "--corpus",
        "python-docs",
        "--out",
        out,
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    loads = [line for line in res.stderr.splitlines() if line.startswith("loading")]
    assert len(loads) == 1 and "backend intref" in loads[0], res.stderr
    before = json.loads((first / "results.json").read_text())["tasks"]["intref"]["metrics"]
    after = json.loads((out / "results.json").read_text())["tasks"]["intref"]["metrics"]
    assert before["activation_divisor"] == 127.5 and after["activation_divisor"] == 127.0
    assert after["ppl_int"] != before["ppl_int"] and after["kld_int_vs_hf"] != before["kld_int_vs_hf"]
    assert after["ppl_hf"] == before["ppl_hf"] and after["ppl_ref"] == before["ppl_ref"]


def test_an_in_place_weight_change_is_observed_again(tiny_pair, tiny_run, tmp_path):
    """The same --out, a candidate whose scales were multiplied by 4 in place: its observation is made again
    (the reference's is reused), and the run fails. The first run, in a copy of `tiny_run`'s folder, finds
    every observation of the unchanged copy there."""
    ckpt = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "ckpt")
    thresholds = tmp_path / "tight.toml"
    thresholds.write_text(TIGHT)
    args = ("run", "--ckpt", ckpt, "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl", "--corpus", "python-docs")
    args += ("--thresholds", thresholds)
    good = rerun(tiny_run, tmp_path / "run", *args).cli
    assert good.returncode == 0, good.stderr
    assert not [line for line in good.stderr.splitlines() if line.startswith("loading")], good.stderr
    edit_tensors(ckpt, lambda t: t.update({k: v * 4 for k, v in t.items() if k.endswith("weight_scale")}))
    bad = cli_run_in_process(*args, "--out", tmp_path / "run", "--quiet")
    assert bad.returncode == 1, bad.stderr
    loads = [line for line in bad.stderr.splitlines() if line.startswith("loading")]
    assert len(loads) == 1 and loads[0].startswith("loading ckpt"), bad.stderr
    metrics = json.loads((tmp_path / "run" / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert metrics["same_top_p"] < 0.5


def test_a_baseline_on_other_tokens_is_refused_before_any_model(tiny_pair, ppl_intref_out, models, tmp_path):
    _, _, first = ppl_intref_out
    accepted = json.loads((first / "results.json").read_text())
    accepted["tasks"]["ppl"]["metrics"]["tokens_sha256"] = "f" * 64
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(accepted))
    with pytest.raises(InputError, match=r"other inputs \(ppl.tokens_sha256 differs\)"):
        run(request(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "r", "ppl", baseline=baseline))
    assert models.loads == [] and not models.windows


def test_a_baseline_without_a_task_of_the_run_is_refused_before_any_model(
    tiny_pair, ppl_intref_out, models, tmp_path
):
    _, _, first = ppl_intref_out
    accepted = json.loads((first / "results.json").read_text())
    del accepted["tasks"]["intref"]
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(accepted))
    with pytest.raises(InputError, match="no `intref` metrics"):
        sides = (tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16])
        run(request(*sides, tmp_path / "r", "ppl,intref", baseline=baseline))
    assert models.loads == []


@pytest.mark.format_evidence(
    format="compressed-tensors",
    claim="refused",
    writer="evalsuite's W4A8 writer (compressed-tensors' compressors)",
)
def test_a_candidate_loaded_with_random_weights_is_refused_before_the_reference(tiny_pair, models, tmp_path):
    """The vision tower's q_proj targeted by a config group but stored in BF16: Transformers would fill it at
    random. Refused from the meta-device load plan, before the reference is observed."""
    ckpt = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "trap")
    config = json.loads((ckpt / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    first = next(iter(groups.values()))
    first["targets"] = [*first["targets"], r"re:.*vision_tower.*self_attn\.q_proj$"]
    config["quantization_config"]["ignore"] = []
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(InputError, match="randomly initialised"):
        run(request(ckpt, tiny_pair[TINY_BF16], tmp_path / "r", "ppl"))
    assert models.loads == [] and not models.windows


PLUGIN = '''
"""A third-party task shipped with its own spec."""
from evalsuite.contract.spec import TaskSpec
from evalsuite.protocol.task import TaskResult, task


class CountSpec(TaskSpec):
    pass


@task("tensor-count")
class TensorCount:
    """Both checkpoints store tensors (a third-party example)."""

    spec_model = CountSpec
    spec_file = "tensor_count.toml"
    metric_names = ("ckpt_tensors",)

    def __init__(self, spec, context):
        self.spec = spec

    def prepare(self, ref, ckpt):
        return {}

    def compare_files(self, ref, ckpt, inputs, artifacts):
        values = {"ckpt_tensors": len(ckpt.checkpoint.tensors)}
        checks, _ = self.spec.threshold_checks(values)
        return TaskResult.from_checks(values, checks)
'''


@pytest.fixture
def plugin(tmp_path) -> Path:
    """An installed-looking distribution on a path entry: a package with its task and spec, and its
    `evalsuite.tasks` entry point."""
    root = tmp_path / "site"
    package = root / "evalsuite_count"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    spec = 'description = "x"\n[thresholds]\nckpt_tensors = { min = 1 }\n'
    (package / "tensor_count.toml").write_text(spec)
    info = root / "evalsuite_count-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: evalsuite-count\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[evalsuite.tasks]\ntensor-count = evalsuite_count:TensorCount\n")
    return root


def test_an_entry_point_task_runs_with_the_spec_it_ships(tiny_pair, plugin, tmp_path):
    env_path = {"PYTHONPATH": f"{plugin}:{Path(__file__).resolve().parents[2]}"}
    listed = run_cli("tasks", env=env_path)
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith("tensor-count"))
    assert str(plugin / "evalsuite_count" / "tensor_count.toml") in line
    res = run_cli(
        "run",
        "--ckpt",
        tiny_pair[TINY_W4A8],
        "--ref",
        tiny_pair[TINY_BF16],
        "--tasks",
        "tensor-count",
        "--out",
        tmp_path / "run",
        "--quiet",
        env=env_path,
    )
    assert res.returncode == 0, res.stderr
    entry = json.loads((tmp_path / "run" / "results.json").read_text())["tasks"]["tensor-count"]
    assert entry["checks"][0]["name"] == "ckpt_tensors" and entry["checks"][0]["threshold"] == 1
