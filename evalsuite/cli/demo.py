"""`evalsuite demo`: the SmolLM2-135M BF16 / W4A8 pair built and run the way the README shows (or, with
`--vision`, the tiny MiniCPM-V 4.7 pair through `vision`), as run requests the CLI executes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from evalsuite.api import read_thresholds
from evalsuite.cli.output import console

if TYPE_CHECKING:
    from evalsuite.pipeline.runner import RunRequest

DEMO_CKPT, DEMO_REF = "smollm2-135m-w4a8", "smollm2-135m-bf16"
# `smoke` is left out: the round-to-nearest W4A8 copy of a 135 M model loses an answer, which `smoke` rightly
# fails; `evalsuite run --tasks smoke` shows it. `vision` does not apply to a text-only model. `lmeval` runs
# the shipped evalsuite-mini, offline, and puts the paired accuracy on the model card beside the PPL.
# lmeval is left out of the default: on 2 cores it doubles the demo's time (evalsuite-mini on both sides).
DEMO_TASKS = "ppl,tensors,intref"
# The demo writes under an ignored folder of the working directory, so that running it in a clone leaves
# `git status` clean; the committed example under reports/ is regenerated only on purpose (`--out`, README).
DEMO_OUT = Path("demo-reports")
# The demo pair is judged by this committed file, which says why it is looser than the shipped defaults.
DEMO_THRESHOLDS = "demo-thresholds"
VISION_DEMO_OUT = DEMO_OUT / "tiny-minicpmv47-vision"


def demo_request(fixtures: Path, out: Path, corpus: str, tasks: list[str], record: Path | None) -> RunRequest:
    """Build the SmolLM2 pair if needed, (re)record its reference into `record` when given, and return the
    demo's run, judged by tasks/demo-thresholds.toml.

    Args:
        fixtures: where the pair is built.
        out: the run folder.
        corpus: the corpus to score.
        tasks: the tasks to run.
        record: a recording folder to (re)write first, or None.
    """
    from evalsuite.contract.spec import default_spec_path
    from evalsuite.fixtures import build_fixtures
    from evalsuite.pipeline.runner import RecordRequest, RunRequest
    from evalsuite.pipeline.runner import record as record_reference
    from evalsuite.protocol.task import RunContext

    built = build_fixtures(fixtures, [DEMO_REF, DEMO_CKPT], progress=lambda msg: console.print(msg))
    if record is not None:
        # The recording holds every task a nightly run of a text model can replay, not only the demo's.
        recording = RecordRequest(
            ckpt=str(built[DEMO_REF]),
            tasks=["ppl", "smoke", "lmeval"],
            out=record,
            context=RunContext(corpus_name=corpus),
        )
        console.print(f"recording: {record_reference(recording)}")
    thresholds_file = default_spec_path(DEMO_THRESHOLDS)
    thresholds = {t: v for t, v in read_thresholds(thresholds_file).items() if t in tasks}
    return RunRequest(
        ckpt=str(built[DEMO_CKPT]),
        ref=str(built[DEMO_REF]),
        tasks=tasks,
        out=out,
        context=RunContext(corpus_name=corpus),
        thresholds=thresholds,
        thresholds_file=thresholds_file,
        # The demo's reports are what it is for; its observations (about 0.6 GB of logits) are not kept.
        keep_observations=False,
    )


def vision_demo_request(fixtures: Path) -> RunRequest:
    """Build the tiny MiniCPM-V 4.7 pair if needed and return its `vision` run into `VISION_DEMO_OUT`, with
    `ppl` on the shipped chats through the pair's chat template (tasks/ppl-chat.toml): the distribution a
    vision-language model serves, beside its images.

    Args:
        fixtures: where the pair is built.
    """
    from evalsuite.contract.spec import default_spec_path
    from evalsuite.fixtures import TINY_BF16, TINY_W4A8, build_fixtures
    from evalsuite.pipeline.runner import RunRequest
    from evalsuite.tasks.chats import SHIPPED_SPEC

    built = build_fixtures(fixtures, [TINY_BF16, TINY_W4A8], progress=lambda msg: console.print(msg))
    console.print(
        "note: no vision-language model can be had offline, so this is the tiny random-weight MiniCPM-V 4.7: "
        "vision-tower parity passes, the answer checks fail (a random model names no shapes)",
        highlight=False,
    )
    return RunRequest(
        ckpt=str(built[TINY_W4A8]),
        ref=str(built[TINY_BF16]),
        tasks=["vision", "ppl"],
        out=VISION_DEMO_OUT,
        specs={"ppl": default_spec_path(SHIPPED_SPEC)},
        keep_observations=False,
    )
