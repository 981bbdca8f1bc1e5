"""One streamed pass per side: `ppl`, `moe`, `layers` and the noise floor, together on streamed sides, read
each decoder layer of each side from the files once (results.json's `model_loads`), measure exactly what each
measures alone, and an interrupted pass resumes at the layer it stopped at.

The tiny pair on a 2-window protocol (the same windows for every task, so that they share the pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli_run_in_process
from tests.e2e.test_interrupt import interrupt_after
from tests.e2e.test_streamed import TWO_WINDOWS

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"
BEYOND_PROTOCOL = {
    "ppl": "[noise_floor]\nenabled = true\n[thresholds]\nppl_ratio = { max = 1.70 }\n",
    "moe": "[thresholds]\nmean_topk_overlap = { min = 0.5 }\n",
    "layers": "[thresholds]\nfinal_hidden_cosine = { min = 0.5 }\n",
}
SPECS = {task: TWO_WINDOWS + rest for task, rest in BEYOND_PROTOCOL.items()}
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
        res = cli_run_in_process(*pair_args(tiny_pair, root, tasks, root / name, *extra))
        assert res.returncode == 0, res.stderr
        docs[name] = results(root / name)
    args = pair_args(tiny_pair, root, "ppl,moe,layers", root / "resumed", "--stream")
    stopped = interrupt_after("ref (hf): layers", 1, args)
    assert stopped.returncode == 130, stopped.stderr
    resumed = cli_run_in_process(*args)
    assert resumed.returncode == 0, resumed.stderr
    docs["resumed"] = results(root / "resumed")
    return docs


def test_ppl_moe_layers_and_the_floor_streamed_read_each_decoder_layer_of_each_side_once(runs):
    loads = {entry["side"]: entry for entry in runs["together"]["model_loads"]}
    assert set(loads) == {"ref", "ckpt"}
    for side, observers in (
        ("ref", {"window-logits", "window-logits-noise", "moe-reference", "boundary-states"}),
        # the candidate's windows compared with the reference's as the head makes them (no logits kept)
        ("ckpt", {"window-logits-paired", "moe-errors", "layer-errors"}),
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


THREE_WINDOWS = TWO_WINDOWS.replace("count = 2", "count = 3")


@pytest.fixture(scope="module")
def fed_runs(tiny_pair, tmp_path_factory) -> dict[int, dict]:
    """`moe` and `layers` together, streamed, on a 3-window protocol: the second forward (the candidate's
    layers fed the reference's input) on 2 windows (the spec's default) and on all 3."""
    root = tmp_path_factory.mktemp("fed-windows")
    docs = {}
    for windows in (2, 3):
        args: list = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16]]
        args += ["--tasks", "moe,layers", "--stream", "--corpus", "python-docs", "--quiet"]
        for task in ("moe", "layers"):
            spec = root / f"{task}-{windows}.toml"
            spec.write_text(THREE_WINDOWS + f"[fed]\nwindows = {windows}\n" + BEYOND_PROTOCOL[task])
            args += ["--spec", f"{task}={spec}"]
        res = cli_run_in_process(*args, "--out", root / str(windows))
        assert res.returncode == 0, res.stderr
        docs[windows] = results(root / str(windows))
    return docs


def test_the_second_forward_runs_on_the_fed_windows_and_the_rest_on_every_window(fed_runs):
    some, every = fed_runs[2], fed_runs[3]
    moe, layers = some["tasks"]["moe"]["metrics"], some["tasks"]["layers"]["metrics"]
    window = 512
    assert moe["fed_windows"] == layers["own_windows"] == "0, 2"
    assert every["tasks"]["moe"]["metrics"]["fed_windows"] == "0, 1, 2"
    assert moe["n_tokens"] == 3 * window and moe["n_fed_tokens"] == 2 * window
    assert every["tasks"]["moe"]["metrics"]["n_fed_tokens"] == 3 * window
    # What rides the candidate's own pass is measured on every window whatever [fed] says.
    for name in ("final_hidden_rel_err", "final_hidden_cosine", "embeddings_rel_err"):
        assert layers[name] == every["tasks"]["layers"]["metrics"][name], name
    for name in ("own_mean_topk_overlap", "router_mean_topk_overlap", "experts_unused"):
        assert moe[name] == every["tasks"]["moe"]["metrics"][name], name
    # ... and what the second forward measures differs with its windows (the W4A8 copy's layers all err).
    assert layers["worst_layer_rel_err"] != every["tasks"]["layers"]["metrics"]["worst_layer_rel_err"]
    assert moe["mean_topk_overlap"] != every["tasks"]["moe"]["metrics"]["mean_topk_overlap"]
