"""Session fixtures: the project's own offline test checkpoints (built once, cached by recipe hash) and the
expensive runs many tests assert on, each made once per session.

The suite's budget is 8 minutes on 2 cores, so a model run is never repeated to check one more thing:
`tiny_run` and `smollm2_run` put each pair through every task once; `rerun` repeats a run in a copy of its
folder, where every observation is reused under its key, so a test of thresholds, baselines or a recorded
reference costs a comparison, not a model. A run goes through the CLI's entry point in the test's own
process (`cli_run_in_process`: the code a user runs, without an interpreter's start-up and imports, most of a
tiny pair's run) unless a child process is what the test is about: `tiny_run` and `smollm2_run` (each pair
through every task as a user's shell runs it), signals, exit codes, the environment (thread counts, proxies,
descriptor limits), files changed from another process and runs side by side run `run_cli`."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from evalsuite.backends.hf import HFBackend
from evalsuite.fixtures import (
    SMOLLM2_BF16,
    SMOLLM2_EXL3,
    SMOLLM2_W4A8,
    TINY_BF16,
    TINY_EXL3,
    TINY_MTP_BF16,
    TINY_MTP_EXL3,
    TINY_W4A8,
    build_fixtures,
)
from evalsuite.fixtures.cache import build_lock, write_json
from tests.format_evidence import (  # noqa: F401 (hooks: the evidence behind docs/formats.md's table)
    pytest_addoption,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)
from tests.format_evidence import pytest_collection_modifyitems as mark_format_evidence

# The test files whose module fixtures take longest, handed to the xdist workers first (`--dist loadfile`
# hands out files in collection order): a worker's last file is then a short one and both finish together,
# where one used to run a long file alone at the end. Every other file keeps its order; the tests pass in any.
LONGEST_FIRST = (
    "tests/e2e/test_llamacpp.py",
    "tests/e2e/test_interrupt.py",
    "tests/e2e/test_lmeval.py",
    "tests/e2e/test_layer_pass.py",
    "tests/e2e/test_intref.py",
    "tests/e2e/test_exl3.py",
    "tests/e2e/test_decoded_answers.py",
    "tests/e2e/test_moe.py",
    "tests/e2e/test_smoke_vision.py",
    "tests/e2e/test_streamed.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_format_evidence(config, items)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


FIXTURES = Path(
    os.environ.get("EVALSUITE_TEST_FIXTURES", Path.home() / ".cache" / "evalsuite" / "test-fixtures")
)
TINY = (TINY_BF16, TINY_W4A8)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share two cores: a second torch thread only spins in OpenMP barriers while the other
    # worker's core is busy, which made a 1 s refusal take 24 s in a worker's own (in-process) runs, and
    # cost the CLI runs in child processes much of the tier's CPU time (see `run_cli`).
    import torch

    torch.set_num_threads(1)
SMOLLM2 = (SMOLLM2_BF16, SMOLLM2_W4A8)


@pytest.fixture(scope="session")
def tiny_pair() -> dict[str, Path]:
    """The tiny MiniCPM-V 4.7 BF16 source and its W4A8 copy (read-only: copy before changing)."""
    return build_fixtures(FIXTURES, list(TINY))


@pytest.fixture(scope="session")
def smollm2_pair() -> dict[str, Path]:
    """SmolLM2-135M-Instruct in BF16 and its W4A8 copy (read-only: copy before changing)."""
    return build_fixtures(FIXTURES, list(SMOLLM2))


@pytest.fixture(scope="session")
def tiny_exl3_pair() -> dict[str, Path]:
    """The tiny MiniCPM-V 4.7 BF16 source and its EXL3 copy (mixed K 2..6; read-only)."""
    return build_fixtures(FIXTURES, [TINY_BF16, TINY_EXL3])


@pytest.fixture(scope="session")
def smollm2_exl3_pair() -> dict[str, Path]:
    """SmolLM2-135M-Instruct in BF16 and its EXL3 copy (4 bpw, head 6 bpw; read-only)."""
    return build_fixtures(FIXTURES, [SMOLLM2_BF16, SMOLLM2_EXL3])


@pytest.fixture(scope="session")
def tiny_mtp_exl3_pair() -> dict[str, Path]:
    """The tiny Qwen3.5 MoE causal LM with an MTP layer and its EXL3 copy (FP16 routers, MTP at 4 bpw)."""
    return build_fixtures(FIXTURES, [TINY_MTP_BF16, TINY_MTP_EXL3])


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("evalsuite: error:")]


def import_or_skip(module: str, reason: str) -> ModuleType:
    """`module`, imported; else the test, or the module of tests calling it at its top, skipped with `reason`
    and what the import raised. Whatever it raised, not only ImportError as `pytest.importorskip` catches:
    mlx-lm sets its own limit of open files at import, a ValueError under a lower hard limit (`ulimit -Hn
    1024`), and a package that cannot be imported here is as missing as one not installed."""
    try:
        return importlib.import_module(module)
    except Exception as exc:
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        pytest.skip(f"{reason} ({module}: {type(exc).__name__}: {said})", allow_module_level=True)


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an evalsuite child process of this session, with `env` added. Under pytest-xdist
    each child gets one OpenMP thread unless the caller's environment sets a count: its second thread would
    spin in barriers against the other worker (README: the default tier's time with and without it). Every
    child of a test takes it from here: the thread count is part of a CPU observation's key, so a child run
    under another count would not resume or reuse its siblings' observations."""
    threads = {"OMP_NUM_THREADS": "1"} if os.environ.get("PYTEST_XDIST_WORKER") else {}
    return {**threads, **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def run_cli(
    *args: str | Path, cwd: Path | None = None, timeout: float = 1200, env: dict[str, str] | None = None
) -> CliResult:
    """Run `evalsuite ARGS` as a subprocess, the way users and CI run it (`env` adds variables, `cli_env`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "evalsuite.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=cli_env(env),
        timeout=timeout,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def assert_ppl_refused_before_any_load(ckpt: Path, ref: Path, out: Path, fragment: str) -> None:
    """`evalsuite run --tasks ppl` of `ckpt` against `ref` into `out`: exit 2, its last stderr line holding
    `fragment`, and no observation begun (refused before any model loads)."""
    res = cli_run_in_process(
        "run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--corpus", "python-docs", "--out", out,
        "--quiet",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert fragment in last, last
    assert not (out / "observations").exists()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A writable copy of a fixture checkpoint, for building a broken variant of it."""
    shutil.copytree(src, dst)
    return dst


def config_edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """A copy of a fixture checkpoint whose config.json's quantization_config went through `edit`."""
    import json

    copy = copy_checkpoint(src, dst)
    config = json.loads((copy / "config.json").read_text())
    edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def weights_only(quantization_config: dict[str, Any]) -> None:
    """The `config_edited_copy` edit that makes a W4A8 copy W4A16: the same integer weights, no input
    activations quantized (Transformers then runs the layers on BF16 inputs)."""
    for group in quantization_config["config_groups"].values():
        group["input_activations"] = None


def edit_tensors(folder: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite a checkpoint's one shard with `edit(tensors)` applied to the name → tensor dict (in place); a
    shard index beside it (mlx-lm writes one for a single shard) is rewritten to name what the shard holds."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shard = folder / "model.safetensors"
    with safe_open(str(shard), "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        content = json.loads(index.read_text())
        content["weight_map"] = dict.fromkeys(sorted(tensors), shard.name)
        index.write_text(json.dumps(content, indent=2))


def tensor_edited_copy(src: Path, dst: Path, tensor: str, change: Callable[[Any], Any]) -> Path:
    """A copy of a checkpoint with `change` applied in place to one stored tensor (a corrupted byte, a
    scale off by a factor)."""
    edit_tensors(copy_checkpoint(src, dst), lambda tensors: change(tensors[tensor]))
    return dst


def run_tasks(ref: Path, ckpt: Path, tasks: str, out: Path, *extra: str | Path) -> tuple[int, dict[str, Any]]:
    """`evalsuite run` of `tasks` on the offline corpus (`cli_run_in_process`): the exit code (a run may fail
    a threshold; it must not fail otherwise) and results.json's tasks."""
    import json

    args = ["--tasks", tasks, "--corpus", "python-docs", *extra, "--out", out, "--quiet"]
    res = cli_run_in_process("run", "--ref", ref, "--ckpt", ckpt, *args)
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads((out / "results.json").read_text())["tasks"]


def ppl_metrics(ckpt: Path, ref: Path, out: Path) -> dict[str, Any]:
    """`ppl` of a candidate against its reference (`run_tasks`): results.json's ppl metrics."""
    return run_tasks(ref, ckpt, "ppl", out)[1]["ppl"]["metrics"]


def wrong_scale_copy(src: Path, dst: Path, factor: float = 4.0) -> Path:
    """A copy of a compressed-tensors checkpoint with every `weight_scale` multiplied by `factor`."""
    copy_checkpoint(src, dst)
    edit_tensors(dst, lambda t: t.update({k: v * factor for k, v in t.items() if k.endswith("weight_scale")}))
    return dst


class Models:
    """What the models were asked: loads and forwarded windows per (checkpoint folder, backend)."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []
        self.windows: Counter[tuple[str, str]] = Counter()

    def watch(self, mp: pytest.MonkeyPatch) -> Models:
        """Wrap HFBackend (and so IntrefBackend) to count loads and windows."""
        init, window_logits = HFBackend.__init__, HFBackend.window_logits

        def counting_init(backend, checkpoint, options):
            self.loads.append((checkpoint.path.name, options.backend))
            init(backend, checkpoint, options)

        def counting_window_logits(backend, windows, positions):
            for logits in window_logits(backend, windows, positions):
                self.windows[backend.checkpoint.path.name, backend.options.backend] += 1
                yield logits

        mp.setattr(HFBackend, "__init__", counting_init)
        mp.setattr(HFBackend, "window_logits", counting_window_logits)
        return self


@dataclass
class Run:
    """A CLI run and its folder."""

    cli: CliResult
    out: Path

    @property
    def results(self) -> dict[str, Any]:
        import json

        return json.loads((self.out / "results.json").read_text(encoding="utf-8"))

    def task(self, name: str) -> dict[str, Any]:
        return self.results["tasks"][name]

    def metrics(self, name: str) -> dict[str, Any]:
        return self.task(name)["metrics"]

    @property
    def loads(self) -> list[str]:
        """The `loading …` lines the run printed: which models it loaded."""
        return [line for line in self.cli.stderr.splitlines() if line.startswith("loading")]


def run_pair(
    ckpt: Path | str, ref: Path | str, out: Path, tasks: str, *extra: str | Path, child: bool = False
) -> Run:
    """`evalsuite run` of a candidate against a reference on the offline corpus, quietly: through the CLI's
    entry point in this process (`cli_run_in_process`), or in a `child` process of its own (`run_cli`)."""
    args = ("run", "--ckpt", ckpt, "--ref", ref, "--tasks", tasks, "--corpus", "python-docs", "--out", out)
    return Run((run_cli if child else cli_run_in_process)(*args, "--quiet", *extra), out)


def rerun(run: Run, out: Path, *args: str | Path) -> Run:
    """`evalsuite ARGS` in a copy of `run`'s folder: observations whose keys still match are reused. It runs
    through the CLI's entry point in this process (`cli_run_in_process`): most reruns only compare what is
    on disk, where an interpreter's start-up and imports would be most of their time; one that names another
    candidate (an EXL3 pack, a perturbed copy) observes it here, with the same code a child would run."""
    shutil.copytree(run.out, out)
    return Run(cli_run_in_process(*args, "--out", out, "--quiet"), out)


TINY_TASKS = "ppl,smoke,vision,tensors,intref"
# The smoke prompts the tiny pair's shared runs answer: the random model's answers mean nothing, so the
# mechanism is checked on a subset (each side decodes every prompt alone and in batches); the whole shipped
# set is answered by SmolLM2 in the slow tier.
TINY_SMOKE_PROMPTS = 12


def smoke_subset_spec(folder: Path, count: int = 12) -> Path:
    """The shipped smoke spec with `count` of its prompts (the first of each category, then in order): the
    same tables, fewer prompts, for runs that check a mechanism rather than the prompt set."""
    import tomllib

    from evalsuite.contract.spec import default_spec_path

    text = default_spec_path("smoke").read_text(encoding="utf-8")
    head, *blocks = text.split("\n[[prompts]]")
    chosen, seen = [], set()
    parsed = [tomllib.loads("[[prompts]]" + b)["prompts"][0] for b in blocks]
    for i, p in enumerate(parsed):
        if p["category"] not in seen:
            seen.add(p["category"])
            chosen.append(i)
    chosen += [i for i in range(len(blocks)) if i not in chosen][: max(0, count - len(chosen))]
    path = folder / f"smoke-first-{count}.toml"
    path.write_text(head + "".join("\n[[prompts]]" + blocks[i] for i in sorted(chosen)), encoding="utf-8")
    return path


def tiny_spec_args() -> tuple[str, str]:
    """`--spec smoke=…` of the tiny pair's shared runs (`TINY_SMOKE_PROMPTS`): a rerun of one that asks
    `smoke` passes it too, so that the shared run's observations are its own."""
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"evalsuite-tests-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    return ("--spec", f"smoke={smoke_subset_spec(folder, TINY_SMOKE_PROMPTS)}")


SMOLLM2_TASKS = "ppl,smoke,tensors,intref"


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], CliResult]) -> Run:
    """`make(out)` once for the whole test session, whichever pytest-xdist worker asks first: the others wait
    for it and read its folder, as pytest-xdist's documentation shows for session fixtures. A session
    fixture alone runs once per worker, and the runs shared here are used by files on both workers."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the one folder every worker of this session has in common
    shared = root / "shared-runs"
    shared.mkdir(exist_ok=True)
    folder, saved = shared / name, shared / f"{name}.cli.json"
    with build_lock(shared, name):
        if not saved.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a run of this session that died half-way
            folder.mkdir()
            cli = make(folder / "run")
            write_json(saved, dataclasses.asdict(cli))
    return Run(CliResult(**json.loads(saved.read_text(encoding="utf-8"))), folder / "run")


@pytest.fixture(scope="session")
def tiny_run(tiny_pair, tmp_path_factory) -> Run:
    """The tiny MiniCPM-V 4.7 W4A8 copy against its source through every built-in task, once."""
    return shared_run(
        tmp_path_factory,
        "tiny-run",
        lambda out: (
            run_pair(
                tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], out, TINY_TASKS, *tiny_spec_args(), child=True
            ).cli
        ),
    )


@pytest.fixture(scope="session")
def tiny_recording(tiny_pair, tmp_path_factory) -> Path:
    """A recording of the tiny source for every recordable built-in task."""

    def record(out: Path) -> CliResult:
        args = ("record", "--ckpt", tiny_pair[TINY_BF16], "--tasks", "ppl,smoke,vision,intref")
        return cli_run_in_process(
            *args, *tiny_spec_args(), "--corpus", "python-docs", "--out", out, "--quiet"
        )

    recorded = shared_run(tmp_path_factory, "tiny-recording", record)
    assert recorded.cli.returncode == 0, recorded.cli.stderr
    return recorded.out


@pytest.fixture(scope="session")
def tiny_replay(tiny_pair, tiny_run, tiny_recording, tmp_path_factory) -> Run:
    """`tiny_run` again with the recording as reference: the candidate's observations are reused, so no
    model is loaded at all."""
    args = (
        "run",
        "--ckpt",
        tiny_pair[TINY_W4A8],
        "--ref",
        tiny_recording,
        "--tasks",
        "ppl,smoke,vision,intref",
    )
    replay = (*args, *tiny_spec_args(), "--corpus", "python-docs")
    return shared_run(tmp_path_factory, "tiny-replay", lambda out: rerun(tiny_run, out, *replay).cli)


@pytest.fixture(scope="session")
def smollm2_run(smollm2_pair, tmp_path_factory) -> Run:
    """SmolLM2-135M W4A8 against its BF16 source through every text task, once."""
    return shared_run(
        tmp_path_factory,
        "smollm2-run",
        lambda out: (
            run_pair(
                smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16], out, SMOLLM2_TASKS, child=True
            ).cli
        ),
    )


def cli_run_in_process(*args: str | Path) -> CliResult:
    """`evalsuite ARGS` run through the CLI's entry point in this process, as `run_cli` reports a child's:
    the same code a user runs, without an interpreter's start-up and imports (seconds each), for the many
    tests of refusals, reruns and file-only checks. Under pytest-xdist this process runs torch on one
    thread, as `cli_env` gives a child, so an observation's key is the one a child's run would give."""
    import contextlib
    import io

    from evalsuite.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main([str(a) for a in args])
    return CliResult(stop.value.code, out.getvalue(), err.getvalue())


def cli_in_process(*args: str | Path) -> tuple[int, list[str], str]:
    """Exit code, non-blank stderr lines and stdout of `evalsuite ARGS` run in this process
    (`cli_run_in_process`)."""
    res = cli_run_in_process(*args)
    return res.returncode, [line for line in res.stderr.splitlines() if line.strip()], res.stdout


def assert_refused(code: int, lines: list[str], *fragments: str) -> None:
    """Exit code 2 and exactly one line on stderr, `evalsuite: error: …`, holding every fragment."""
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("evalsuite: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def demo_thresholds(tasks: str, folder: Path) -> Path:
    """The bounds `evalsuite demo` judges the SmolLM2 pair by (tasks/demo-thresholds.toml), cut to the tables
    of `tasks` as the demo cuts them (a run refuses thresholds for a task it does not run)."""
    import tomllib

    from evalsuite.cli.app import DEMO_THRESHOLDS
    from evalsuite.contract.spec import default_spec_path

    tables = tomllib.loads(default_spec_path(DEMO_THRESHOLDS).read_text(encoding="utf-8"))
    lines = []
    for task in tasks.split(","):
        if task in tables:
            lines.append(f"[{task}]")
            for metric, bound in tables[task].items():
                lines.append(f'"{metric}" = {{ ' + ", ".join(f"{k} = {v!r}" for k, v in bound.items()) + " }")
    path = folder / "demo-thresholds.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def smollm2_demo_rerun(smollm2_pair, smollm2_run, tmp_path_factory) -> Run:
    """`smollm2_run` (judged by the shipped defaults, which it fails) compared again under the demo's
    thresholds: every observation is reused, nothing loads."""
    root = tmp_path_factory.mktemp("smollm2-demo")
    args = ("run", "--ckpt", smollm2_pair[SMOLLM2_W4A8], "--ref", smollm2_pair[SMOLLM2_BF16])
    args += ("--tasks", SMOLLM2_TASKS, "--corpus", "python-docs")
    return rerun(smollm2_run, root / "run", *args, "--thresholds", demo_thresholds(SMOLLM2_TASKS, root))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster of 2 CPUs for the whole session (its start-up takes seconds on 2 cores); the
    tests that use it skip where Ray is not installed (`pip install 'evalsuite[ray]'`)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'evalsuite[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _llmc_fixtures(names: list[str]) -> dict[str, Path]:
    """llm-compressor's packs (its virtual environment built on first use), or a skip saying why not."""
    from evalsuite.errors import DependencyError

    try:
        return build_fixtures(FIXTURES, names)
    except DependencyError as exc:
        pytest.skip(f"packs of a writer in its own environment cannot be built here: {exc}")


@pytest.fixture(scope="session")
def llmc_tiny() -> dict[str, Path]:
    """A tiny random Llama (BF16) and llm-compressor's packs of it, one folder per scheme (read-only)."""
    return _llmc_fixtures(["tiny-llama-bf16", "tiny-llama-llmc"])


@pytest.fixture(scope="session")
def llmc_smollm2() -> dict[str, Path]:
    """SmolLM2-135M-Instruct (BF16) and llm-compressor's packs of it, one folder per scheme (read-only)."""
    return _llmc_fixtures([SMOLLM2_BF16, "smollm2-135m-llmc"])


@pytest.fixture(scope="session")
def llmc_actorder() -> dict[str, Path]:
    """The tiny Llama (BF16) and GPTQ W4A8 packs of it solved in activation order by llm-compressor 0.14
    (`actorder: "static"`) and 0.13 (`"group"`, with g_idx and the writer's dequantization), read-only."""
    return _llmc_fixtures(["tiny-llama-bf16", "tiny-llama-llmc-actorder"])


@pytest.fixture(scope="session")
def autoround_tiny() -> dict[str, Path]:
    """The tiny Llama (BF16) and auto-round's GPTQ and AWQ packs of it, each with the writer's own
    dequantization beside it (read-only)."""
    return _llmc_fixtures(["tiny-llama-bf16", "tiny-llama-autoround"])


@pytest.fixture(scope="session")
def modelopt_tiny() -> dict[str, Path]:
    """The tiny Llama (BF16) and ModelOpt's FP8 and NVFP4 packs of it, each with the writer's own
    dequantization beside it (read-only)."""
    return _llmc_fixtures(["tiny-llama-bf16", "tiny-llama-modelopt"])


@pytest.fixture(scope="session")
def fp8_block_tiny() -> dict[str, Path]:
    """The tiny Llama (BF16) and its block-wise FP8 pack, written by Transformers' FP8 quantizer."""
    return build_fixtures(FIXTURES, ["tiny-llama-bf16", "tiny-llama-fp8-block"])


LLMC_FIXTURES = {
    "tiny": ("llmc_tiny", "tiny-llama-bf16", "tiny-llama-llmc"),
    "smollm2": ("llmc_smollm2", SMOLLM2_BF16, "smollm2-135m-llmc"),
}


def llmc_fixture(request: pytest.FixtureRequest, which: str) -> tuple[Path, Path]:
    """(BF16 source, folder of its packs) of an llm-compressor fixture: `tiny` or `smollm2`."""
    session_fixture, source, packs = LLMC_FIXTURES[which]
    built = request.getfixturevalue(session_fixture)
    return built[source], built[packs]


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def llmc_pair(request) -> tuple[Path, Path]:
    """Each llm-compressor fixture in turn, as `llmc_fixture` gives it: the tiny Llama's in the default tier,
    SmolLM2's in the slow one."""
    return llmc_fixture(request, request.param)


def bench_module(name: str) -> Any:
    """A module of bench/ (not a package), loaded from its file with bench/ on the path while it imports, as
    running it from there would have it (`from figures import ...`)."""
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "bench"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module
