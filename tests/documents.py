"""results.json documents for the tests of what is rendered from one (report, model card, JUnit): shaped
like a real run's, a MiniCPM-V 4.7 W4A8 pack against a recorded reference."""

from __future__ import annotations

from typing import Any

PPL_METRICS: dict[str, Any] = {
    "corpus": "wikitext-2-raw-v1",
    "n_windows": 8,
    "window_tokens": 512,
    "window_starts": "0,4096,8192,12288,16384,20480,24576,28672",
    "scored_first": 256,
    "scored_last": 510,
    "n_scored_tokens": 2040,
    "tokens_sha256": "9348bc74c48a0b7817df301070a3388cc6800771974d301d6e23ffa101e2d1d7",
    "ppl_ref": 11.612510554149898,
    "ppl_ref_stderr": 0.6668534770323001,
    "ppl_ckpt": 21.07813441,
    "ppl_ckpt_stderr": 1.2240223059029199,
    "ppl_ratio": 1.8151403081254549,
    "ln_ppl_ratio": 0.5961070472971108,
    "ln_ppl_ratio_stderr": 0.022191914374849835,
    "kld_mean": 0.4528281086487701,
    "kld_mean_stderr": 0.007909890606253283,
    "kld_median": 0.3827962006529403,
    "kld_p90": 0.87483615683635,
    "kld_p99": 1.6396362751568097,
    "kld_p999": 3.0854681870998637,
    "kld_max": 3.4972578820854303,
    "kld_estimator": "top-k + sampled tail",
    "same_top_p": 0.6642156862745098,
    "same_top_p_stderr": 0.010458662607227814,
    "delta_p_mean": -0.07973569610434673,
    "delta_p_mean_stderr": 0.0038762957783808473,
    "rms_delta_p": 0.19234115588123443,
    "rms_delta_p_stderr": 0.004975907434740949,
}


def results_document(**tasks: dict[str, Any]) -> dict[str, Any]:
    """A results.json document shaped like `evalsuite demo`'s, with a recorded reference and these tasks.

    With no tasks given: a ppl task whose `ppl_ratio` check failed, a skipped `vision` task and a `tensors`
    task that could not run.
    """
    if not tasks:
        tasks = {
            "ppl": ppl_task(),
            "vision": {"status": "skipped", "reason": "exllamav3 needs CUDA 12: no GPU on this machine"},
            "tensors": {"status": "error", "reason": "shard model-00003-of-00007.safetensors is truncated"},
        }
    return {
        "schema": "evalsuite.results/1",
        "ckpt": {
            "path": "/packs/MiniCPM-V-4.7-W4A8/",
            "format": "compressed-tensors",
            "fingerprint": "21c6e5",
        },
        "ref": {
            "path": "reference_outputs/minicpm-v-4.7-bf16",
            "format": "recording",
            "fingerprint": "4981b3",
        },
        "environment": {
            "python": "3.11.7",
            "platform": "Linux-6.18.44-x86_64-with-glibc2.36",
            "packages": {
                "evalsuite": "0.1.0",
                "torch": "2.13.0+cu128",
                "transformers": "5.24.0",
                "gguf": None,
            },
            "device": "cuda:0",
            "device_name": "NVIDIA H200",
            "dtype": "bfloat16",
            "torch_threads": 16,
        },
        "verdict": "fail",
        "tasks": tasks,
    }


def ppl_task(**metrics: Any) -> dict[str, Any]:
    """A ppl task entry: PPL_METRICS updated by `metrics` (a value of None removes the metric)."""
    merged = {**PPL_METRICS, **metrics}
    merged = {k: v for k, v in merged.items() if v is not None}
    return {
        "status": "fail",
        "metrics": merged,
        "checks": [
            {
                "name": "ppl_ratio",
                "value": merged["ppl_ratio"],
                "op": "<=",
                "threshold": 1.7,
                "passed": False,
            },
            {
                "name": "same_top_p",
                "value": merged["same_top_p"],
                "op": ">=",
                "threshold": 0.6,
                "passed": True,
            },
        ],
        "artifacts": {},
    }
