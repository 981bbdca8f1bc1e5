"""Backend `llamacpp`: a GGUF file's decoder run by llama.cpp (xllamacpp's prebuilt CPU wheel), the head by
evalsuite. On SmolLM2-135M-Instruct's own Q4_1 file (written by llama.cpp's converter), over two windows:
`ppl` of the file through llama.cpp against the same file through Transformers' dequantization gives the KLD
between the two executions; against the BF16 source both executions give nearly the same perplexity; what
the backend cannot do is refused or skipped with its reason."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from evalsuite.fixtures.smollm2 import smollm2_gguf_path
from tests.conftest import FIXTURES, assert_refused, cli_in_process, run_cli
from tests.e2e.test_gguf import alias_second_tensor
from tests.e2e.test_streamed import TWO_WINDOWS

PPL_SPEC = TWO_WINDOWS + "[thresholds]\nppl_ratio = { max = 1.05 }\n"
# The variables urllib (and most HTTP clients) take a proxy from.
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


@pytest.fixture(scope="module")
def q4_1(smollm2_pair, tmp_path_factory) -> Path:
    """A folder holding SmolLM2's Q4_1 GGUF file alone (the BF16 fixture is its dequantized copy)."""
    folder = tmp_path_factory.mktemp("smollm2-q4_1")
    shutil.copy(smollm2_gguf_path(FIXTURES), folder)
    return folder


def ppl_run(
    ckpt: Path,
    ref: Path,
    backend: str,
    out: Path,
    tasks: str = "ppl",
    env: dict[str, str] | None = None,
    codes: tuple[int, ...] = (0, 1),
) -> dict:
    spec = out.parent / f"{out.name}-ppl.toml"
    spec.write_text(PPL_SPEC)
    args = ["run", "--ckpt", ckpt, "--ref", ref, "--tasks", tasks, "--backend", backend]
    res = run_cli(
        *args,
        "--spec",
        f"ppl={spec}",
        "--corpus",
        "python-docs",
        "--out",
        out,
        "--quiet",
        "--no-plots",
        env=env,
    )
    assert res.returncode in codes, res.stderr
    return json.loads((out / "results.json").read_text())


@contextlib.contextmanager
def dead_proxy() -> Iterator[dict[str, str]]:
    """Every proxy variable set to a loopback port held but not listening (a connection to it is refused,
    and nothing else can take the port meanwhile), and no host exempted from the proxy."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        yield {**dict.fromkeys(PROXY_VARIABLES, url), "no_proxy": "", "NO_PROXY": ""}


@contextlib.contextmanager
def service_on_port_8080() -> Iterator[None]:
    """Something listening on llama-server's default port (or, where a service holds it already, that)."""
    with socket.socket() as service:
        try:
            service.bind(("127.0.0.1", 8080))
            service.listen()
        except OSError:
            pass  # a service holds it already: the case itself
        yield


# The two whole SmolLM2 runs below are the slow tier's (a model through llama.cpp and through Transformers'
# GGUF dequantization, twice, is most of a minute and a half on two cores); what this backend refuses before
# loading stays in the default tier.
ON_SMOLLM2_RUNS = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(q4_1, smollm2_pair, tmp_path_factory) -> dict[str, dict]:
    """Two runs at once, behind a dead proxy and beside a service on port 8080: the Q4_1 file through
    llama.cpp against itself through Transformers (with `smoke`, which this backend skips), and through
    llama.cpp against the BF16 source (each run is a whole SmolLM2 load: one pair shows all three)."""
    pytest.importorskip("xllamacpp", reason="backend llamacpp needs xllamacpp: pip install -e '.[llamacpp]'")
    root = tmp_path_factory.mktemp("llamacpp")
    bf16 = smollm2_pair["smollm2-135m-bf16"]
    with dead_proxy() as env, service_on_port_8080(), ThreadPoolExecutor(2) as pool:
        executions = pool.submit(ppl_run, q4_1, q4_1, "llamacpp", root / "executions", "ppl,smoke", env, (0,))
        against_bf16 = pool.submit(ppl_run, q4_1, bf16, "llamacpp", root / "llamacpp", env=env, codes=(0,))
        return {"executions": executions.result(), "llamacpp": against_bf16.result()}


@pytest.mark.format_evidence(format="gguf", claim="ppl", writer="llama.cpp (SmolLM2's published GGUF)")
@ON_SMOLLM2_RUNS
def test_one_gguf_through_llamacpp_and_transformers_reports_the_kld_between_the_executions(runs):
    ppl = runs["executions"]["tasks"]["ppl"]
    m = ppl["metrics"]
    assert "llama.cpp" in m["ckpt_execution"] and "Transformers" in m["ref_execution"], m
    # llama.cpp's converter kept SmolLM2's tied embedding in Q8_0: the head evalsuite applies.
    assert "head (token_embd.weight, Q8_0) applied by evalsuite" in m["ckpt_execution"]
    assert m["n_scored_tokens"] == 2 * 255
    # The same weights, two arithmetics: llama.cpp's quantized-activation dot products and f16 KV cache
    # part from Transformers' dequantized bf16 by a small, non-zero divergence.
    assert 0 < m["kld_mean"] < 0.02, m["kld_mean"]
    assert m["same_top_p"] > 0.95


@ON_SMOLLM2_RUNS
def test_both_executions_of_the_gguf_score_the_text_alike(runs):
    both = runs["executions"]["tasks"]["ppl"]["metrics"]  # ref: Transformers, ckpt: llama.cpp
    against_bf16 = runs["llamacpp"]["tasks"]["ppl"]["metrics"]
    # Transformers runs the Q4_1 weights dequantized, as the BF16 copy holds them: the same perplexity.
    assert abs(both["ppl_ref"] / against_bf16["ppl_ref"] - 1) < 0.005
    assert both["ppl_ckpt"] == against_bf16["ppl_ckpt"]  # llama.cpp's side, observed twice, is deterministic
    assert abs(both["ppl_ckpt"] / both["ppl_ref"] - 1) < 0.02, (both["ppl_ref"], both["ppl_ckpt"])
    assert against_bf16["kld_mean"] > 0


@ON_SMOLLM2_RUNS
def test_the_tasks_that_generate_are_skipped_on_llamacpp_with_the_reason(runs):
    smoke = runs["executions"]["tasks"]["smoke"]
    assert smoke["status"] == "skipped"
    assert "UTF-8 character" in json.dumps(smoke)


@pytest.mark.parametrize("case", ["safetensors", "stream"])
def test_what_llamacpp_cannot_run_is_refused_in_one_line_before_loading(case, q4_1, smollm2_pair, tmp_path):
    bf16 = smollm2_pair["smollm2-135m-bf16"]
    ckpt, extra = (bf16, ()) if case == "safetensors" else (q4_1, ("--stream",))
    code, lines, _ = cli_in_process(
        "run", "--ckpt", ckpt, "--ref", bf16, "--tasks", "ppl", "--backend", "llamacpp", *extra,
        "--out", tmp_path / "out", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, "runs GGUF files" if case == "safetensors" else "not streamed")


@ON_SMOLLM2_RUNS
def test_two_runs_at_once_behind_a_dead_proxy_and_beside_a_service_on_port_8080_each_score_on_their_own(runs):
    """The llama.cpp side's token ids go to its own server, not to a proxy nor to whatever listens on
    llama-server's default port, and two runs at once each have their own: both pass, and the llama.cpp side
    of each scores the same windows alike, where a run that reached a proxy or another's server would have
    failed or scored another model's logits (the KLD to Transformers' execution of the same file is small)."""
    executions, against_bf16 = (runs[name]["tasks"]["ppl"]["metrics"] for name in ("executions", "llamacpp"))
    assert runs["executions"]["verdict"] == runs["llamacpp"]["verdict"] == "pass"
    assert executions["ppl_ckpt"] == against_bf16["ppl_ckpt"]
    assert executions["n_scored_tokens"] == against_bf16["n_scored_tokens"] == 2 * 255


@pytest.mark.parametrize("backend", ["hf", "llamacpp"])
def test_a_gguf_whose_tensors_share_bytes_is_refused_before_any_model_loads(
    backend, q4_1, smollm2_pair, tmp_path
):
    """Transformers reads a GGUF file with its own reader, which would score the aliased tensors: the file is
    refused from its tensor table, as llama.cpp refuses it, before the reference loads."""
    folder = tmp_path / "pack"
    shutil.copytree(q4_1, folder)
    path = next(folder.glob("*.gguf"))
    names = alias_second_tensor(path)
    code, lines, _ = cli_in_process(
        "run", "--ckpt", folder, "--ref", smollm2_pair["smollm2-135m-bf16"], "--tasks", "ppl",
        "--backend", backend, "--corpus", "python-docs", "--out", tmp_path / "out", "--quiet",
    )  # fmt: skip
    # One line, `evalsuite: error: …`, and nothing else: no model was loaded first.
    assert_refused(code, lines, str(path), f"{names} share bytes")
