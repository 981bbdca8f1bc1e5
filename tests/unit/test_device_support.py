"""Every device path decided once, from the plan: docs/devices.md is what the run's own planning decides for
every task, backend, device and `--stream` choice on a machine made to look like one with two GPUs; on this
CPU every CUDA and auto combination is refused in one line before any model loads; accelerate's own planning
of `device_map="auto"` over fake GPU budgets spreads, offloads and counts the model as the memory plan
does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.pipeline.device_support import BACKENDS, DEVICES, plan_cells
from tests.conftest import TINY_BF16, TINY_W4A8, run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_devices_page_is_what_the_planning_decides(tiny_pair, tiny_exl3_pair):
    spec = importlib.util.spec_from_file_location("render_devices", ROOT / "scripts" / "render_devices.py")
    assert spec is not None and spec.loader is not None
    render_devices = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_devices)
    fixtures = next(iter(tiny_pair.values())).parent
    assert render_devices.render(fixtures) == render_devices.PAGE.read_text(encoding="utf-8"), (
        "docs/devices.md is not what the planning decides: run python scripts/render_devices.py"
    )
    page = (ROOT / "docs" / "devices.md").read_text(encoding="utf-8")
    # The cells a user looks for: generation streamed like the rest (no skipped smoke or vision), the
    # inside-looking tasks streamed on cuda:0 under auto, the integer task skipped for an EXL3 pack.
    assert "streaming does not apply to generation" not in page
    assert "| hf | yes | **streams**: ckpt streamed on cpu; ref streamed on cpu |" in page
    assert "**streams**: ckpt streamed on cuda:0; ref streamed on cuda:0" in page
    assert "**skipped**: intref executes compressed-tensors integer checkpoints; this one is exl3" in page


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_on_this_cpu_every_cuda_and_auto_combination_is_refused_before_any_load(tiny_pair, tiny_exl3_pair):
    fixtures = next(iter(tiny_pair.values())).parent
    for backend in BACKENDS:
        for device in DEVICES[1:]:
            for stream in (False, True):
                cell = plan_cells(fixtures, ["ppl"], backend, device, stream)["ppl"]
                assert cell.verdict == "refused", (backend, device, stream, cell)
                assert cell.detail == f"--device {device} needs CUDA, and this machine has none"
    res = run_cli(
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--device", "auto",
        "--tasks", "ppl,moe", "--stream", "--out", fixtures.parent / "refused-auto", "--quiet",
    )  # fmt: skip
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "needs CUDA" in res.stderr and "loading" not in res.stderr


def test_accelerate_plans_auto_over_fake_gpus_and_counts_what_the_memory_plan_counts(tiny_pair):
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes, infer_auto_device_map
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = tiny_pair[TINY_BF16]
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.tie_weights()
    sizes = compute_module_sizes(model, dtype=torch.bfloat16)
    planned = loaded_bytes(Checkpoint.open(folder), BackendOptions())
    assert abs(planned - sizes[""]) <= 0.01 * sizes[""], (planned, sizes[""])
    no_split = model._no_split_modules
    whole = sizes[""]

    def plan(*budgets: int, cpu: int) -> set:
        max_memory = {i: b for i, b in enumerate(budgets)} | {"cpu": cpu}
        return set(
            infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split).values()
        )

    assert plan(2 * whole, 2 * whole, cpu=2 * whole) == {0}  # fits the first GPU
    assert plan(whole * 6 // 10, 2 * whole, cpu=2 * whole) == {0, 1}  # spread over two
    short = plan(whole // 4, whole // 4, cpu=2 * whole)
    assert "cpu" in short and "disk" not in short  # what the GPUs cannot hold offloaded to the CPU
    assert "disk" in plan(whole // 4, whole // 4, cpu=whole // 4)  # and then to disk
