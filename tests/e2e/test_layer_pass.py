"""One streamed pass per side: `ppl`, `moe`, `layers` and the noise floor, together on streamed sides, read
each decoder layer of each side from the files once (results.json's `model_loads`), measure exactly what each
measures alone, and an interrupted pass resumes at the layer it stopped at.

The tiny pair on a 2-window protocol (the same windows for every task, so that they share the pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_interrupt import interrupt_after
from tests.e2e.test_streamed import TWO_WINDOWS

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"
SPECS = {
    "ppl": TWO_WINDOWS + "[noise_floor]\nenabled = true\n[thresholds]\nppl_ratio = { max = 1.70 }\n",
    "moe": TWO_WINDOWS + "[thresholds]\nmean_topk_overlap = { min = 0.5 }\n",
    "layers": TWO_WINDOWS + "[thresholds]\nfinal_hidden_cosine = { min = 0.5 }\n",
}
# Strings that say how a side ran ("streamed"), not what it measured.
EXECUTION = {"ref_execution", "ckpt_execution"}


def pair_args(pair: dict[str, Path], root: Path, tasks: str, out: Path, *extra: str) -> list:
    args: list = ["run", "--ckpt", pair[TINY_W4A8], "--ref", pair[TINY_BF16], "--tasks", tasks]
    for task in tasks.split(","):
        spec = root / f"{task}.toml"
        spec.write_text(SPECS[task])
        args += ["--spec", f"{task}={spec}"]
    return [*args, "--corpus", "python-docs", *extra, "--out", out, "--quiet"]


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def measured(doc: dict, task: str) -> dict:
    return {k: v for k, v in doc["tasks"][task]["metrics"].items() if k not in EXECUTION}


@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory) -> dict[str, dict]:
    """The three tasks streamed together; each alone (`ppl` loaded, with its floor); and the together run
    interrupted after the reference's first layer, then resumed."""
    root = tmp_path_factory.mktemp("layer-pass")
    docs = {}
    for name, tasks, extra in (
        ("together", "ppl,moe,layers", ("--stream",)),
        ("ppl", "ppl", ()),
        ("moe", "moe", ()),
        ("layers", "layers", ()),
    ):
        res = run_cli(*pair_args(tiny_pair, root, tasks, root / name, *extra))
        assert res.returncode == 0, res.stderr
        docs[name] = results(root / name)
    args = pair_args(tiny_pair, root, "ppl,moe,layers", root / "resumed", "--stream")
    stopped = interrupt_after("ref (hf): layers", 1, args)
    assert stopped.returncode == 130, stopped.stderr
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    docs["resumed"] = results(root / "resumed")
    return docs


def test_ppl_moe_layers_and_the_floor_streamed_read_each_decoder_layer_of_each_side_once(runs):
    loads = {entry["side"]: entry for entry in runs["together"]["model_loads"]}
    assert set(loads) == {"ref", "ckpt"}
    for side, observers in (
        ("ref", {"window-logits", "window-logits-noise", "moe-reference", "boundary-states"}),
        ("ckpt", {"window-logits", "moe-errors", "layer-errors"}),
    ):
        assert loads[side]["streamed"] is True
        assert set(loads[side]["observations"]) == observers
        assert loads[side]["n_layers"] == 2
        assert loads[side]["decoder_layer_loads"] == 2, loads[side]


def test_each_task_in_the_shared_pass_measures_what_it_measures_alone(runs):
    # `ppl` alone ran loaded: the shared streamed pass gives its metrics, the floor's included, bit for bit.
    assert "kld_floor" in runs["together"]["tasks"]["ppl"]["metrics"]
    for task in ("ppl", "moe", "layers"):
        assert measured(runs["together"], task) == measured(runs[task], task), task
        assert runs["together"]["tasks"][task].get("details") == runs[task]["tasks"][task].get("details")


def test_an_interrupted_pass_resumes_at_the_layer_it_stopped_at(runs):
    loads = {entry["side"]: entry for entry in runs["resumed"]["model_loads"]}
    # Stopped after the reference's first layer: the resumed run reads only the second one of that side.
    assert loads["ref"]["decoder_layer_loads"] == 1
    assert loads["ckpt"]["decoder_layer_loads"] == 2
    for task in ("ppl", "moe", "layers"):
        assert measured(runs["resumed"], task) == measured(runs["together"], task), task
