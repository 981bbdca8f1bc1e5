"""The machine a run computed on (results.json's environment.machine) and what differs between two."""

from __future__ import annotations

import torch

from evalsuite.machine import describe_machine, execution_differences, largest_cache_bytes, replay_caveat


def _environment(**machine):
    base = {"cpu_model": "AMD EPYC", "torch_cpu_capability": "AVX2", "onednn_isa": "Intel AVX2", "gpu": None}
    return {"device": "cpu", "dtype": "bfloat16", "packages": {"torch": "2.13.0"}, "machine": base | machine}


def test_the_machine_names_the_kernels_torch_and_onednn_use_and_the_overrides(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    machine = describe_machine("cpu")
    assert machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["kernel_overrides"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    # oneDNN is built into the CPU torch the project pins; its verbose header names the ISA.
    assert machine["onednn_isa"] and "Intel" in machine["onednn_isa"]
    assert machine["gpu"] is None


def test_the_same_environment_has_no_execution_difference():
    assert execution_differences(_environment(), _environment()) == {}


def test_another_isa_or_gpu_is_an_execution_difference_and_a_thread_count_or_path_is_not():
    here = _environment()
    then = _environment(torch_cpu_capability="AVX512", gpu=None)
    then["torch_threads"], then["platform"] = 16, "elsewhere"
    assert execution_differences(then, here) == {"machine.torch_cpu_capability": ["AVX512", "AVX2"]}
    gpu = _environment(gpu={"name": "H200", "cuda": "13.0", "cublas": "13.1"})
    assert set(execution_differences(gpu, here)) == {"machine.gpu"}


def test_a_recording_that_does_not_say_its_machine_counts_as_another_one():
    then = _environment()
    del then["machine"]
    differences = execution_differences(then, _environment())
    assert list(differences) == ["machine"]
    assert "its machine was not recorded" in replay_caveat(differences, None)


def test_the_caveat_quotes_the_measured_drift_or_says_it_was_not_measured():
    differences = {"machine.torch_cpu_capability": ["AVX512", "AVX2"]}
    unmeasured = replay_caveat(differences, None)
    assert "recorded AVX512, here AVX2" in unmeasured and "not measured" in unmeasured
    drift = {
        "measured_on": {"cpu_model": "AMD EPYC"},
        "variants": {"ONEDNN_MAX_CPU_ISA=AVX2": {"kld_mean": 1.24e-05, "ppl_ref": 11.6, "ppl_ckpt": 11.61}},
    }
    measured = replay_caveat(differences, drift)
    assert "ONEDNN_MAX_CPU_ISA=AVX2: kld_mean 1.2e-05, ppl 11.6000 recorded, 11.6100 run" in measured
    assert "not measured" not in measured


def test_the_largest_cache_is_the_largest_data_or_unified_one_sysfs_lists(tmp_path):
    for name, kind, size in (
        ("index0", "Data", "48K"),
        ("index1", "Instruction", "64M"),  # instructions: not where rows of logits go
        ("index2", "Unified", "2048K"),
        ("index3", "Unified", "32M"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "type").write_text(kind + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert largest_cache_bytes(str(tmp_path)) == 32 << 20
    (tmp_path / "index3" / "size").write_text("unknown\n")  # unreadable: the next largest
    assert largest_cache_bytes.__wrapped__(str(tmp_path)) == 2 << 20
    assert largest_cache_bytes(str(tmp_path / "absent")) is None
