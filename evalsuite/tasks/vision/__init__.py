"""Generated images and a short clip, described by both sides; vision-tower parity on every visual token.

The task runs cases, each an input the packs claim to handle: the single image (a red square and a blue
circle; its metrics keep their names without a prefix), and the spec's `[[cases]]`: a large image the
processor slices into a grid, that image under each `downsample_mode`, a clip of the square moving through
the video processor, a label to read (OCR: each side's character error rate against the text drawn), a
bar chart and shapes to count. Each case is its own observation on each side (observer
`vision-answer[-CASE]`): the vision tower and merger's output for every visual token, and the greedy answer
with the full next-token distributions of its first steps. A case that cannot run here (a video without
torchvision) is skipped with its reason; the others still run. Each question is checked against the
calibration set (`--calibration`); a flagged case's checks are left out of the verdict without them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from evalsuite.backends.multimodal import NoVisualPath, VisualProcessing
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import Check, TaskSpec, apply_threshold
from evalsuite.errors import InputError
from evalsuite.files.run_folder import write_atomic
from evalsuite.observers.forced_answers import FORCED_LABEL, FORCED_REFERENCE_LABEL
from evalsuite.observers.greedy_answers import ANSWERS_LABEL, ANSWERS_META, PROMPTS, GreedyAnswers
from evalsuite.observers.kld_detail import kld_at_reference
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import (
    Inputs,
    Need,
    Progress,
    RunContext,
    TaskResult,
    TaskSkipped,
    skip_if_cannot_generate,
    task,
)
from evalsuite.stats import metrics, tensor_errors
from evalsuite.tasks.answer_pairs import PairedAnswers, paired_answers
from evalsuite.tasks.calibration_overlap import (
    Overlap,
    flagged_verdicts,
    overlap_metrics,
    overlap_rows,
    text_overlap,
)
from evalsuite.tasks.smoke import CKPT_ANSWERS_LABEL, smoke_needs
from evalsuite.tasks.vision._pictures import contact_sheet, draw, draw_frames, png
from evalsuite.tasks.vision._reading import OCR_DESCRIPTIONS, OCR_METRICS, ocr_values
from evalsuite.tasks.vision._spec import ANSWER_METRICS, CASE_METRICS, SHIPPED_CASES, SINGLE, Case, VisionSpec

if TYPE_CHECKING:
    from evalsuite.backends import Backend


def tensors_sha256(inputs: dict[str, Any]) -> str:
    """Hash of the model inputs (names, dtypes, shapes and bytes; settings by value), so both sides provably
    got the same."""
    digest = hashlib.sha256()
    for name in sorted(inputs):
        value = inputs[name]
        if isinstance(value, torch.Tensor):
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            digest.update(value.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, str | int | float | bool):
            digest.update(f"{name}={value!r}".encode())
    return digest.hexdigest()


class VisionFeatures:
    """Observer of one side: the vision tower and merger's output for every visual token of every case run
    (`features-CASE`). A side's answers to the cases are observed as `smoke`'s are (`smoke_needs`): each
    side's decoded (a question about an image alone), both sides forced along the reference's for the KLD."""

    # Its recording is the observation itself: a replay plans it under the key it was made under.
    records_itself = True

    name = "vision-features"

    def __init__(self, cases: list[Case]) -> None:
        self.cases = cases

    def identity(self) -> dict[str, Any]:
        return {"cases": [c.identity() for c in self.cases]}

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        run = [c for c in self.cases if "skipped" not in inputs["cases"][c.name]]
        step = progress("vision features", len(run))
        arrays = {}
        for case in run:
            arrays[f"features-{case.name}"] = backend.image_features(
                inputs["cases"][case.name]["tensors"]
            ).numpy()
            step()
        return Observation(name=self.name, meta={"execution": backend.describe()}, arrays=arrays)

    def record(self, obs: Observation, folder: Path) -> Observation:
        """Features are what a replay needs: kept as they are."""
        return Observation(name=obs.name, key=obs.key, meta=obs.meta, arrays=obs.arrays)


def case_prompt(case: Case, prepared: dict[str, Any]) -> dict[str, Any]:
    """A case as a prompt of the answer observers: its question's token ids, its images (and settings) as
    the rest of the model's inputs, the digest of those inputs."""
    tensors = prepared["tensors"]
    extra = {k: v for k, v in tensors.items() if k not in ("input_ids", "attention_mask")}
    return {
        "ids": tensors["input_ids"].reshape(-1).tolist(),
        "extra": extra,
        "extra_sha256": prepared["inputs_sha256"],
        "max_new_tokens": case.generation.max_new_tokens,
    }


def case_inputs(case: Case, prepared: dict[str, Any]) -> dict[str, Any]:
    """What a case's metrics say of its inputs: the picture's digest, the inputs', how they were made, the
    processor's grid."""
    grid = prepared["grid"]
    values: dict[str, Any] = {
        case.media_metric: prepared["media_sha256"],
        "inputs_sha256": prepared["inputs_sha256"],
        "processing": prepared["processing"],
        "grid": f"{grid[0]}x{grid[1]}" if grid else "none",
        "n_slices": grid[0] * grid[1] if grid else 0,
    }
    if case.downsample_mode is not None:
        values["downsample_mode"] = case.downsample_mode
    if case.video is not None:
        values["frames"] = case.video.frames
    return values


def prepare_case(case: Case, processing: VisualProcessing) -> dict[str, Any]:
    """A case's inputs: the picture or clip drawn, processed with the question (NoVisualPath when it cannot
    be here), and their hashes."""
    prompt, mode = case.generation.prompt, case.downsample_mode
    if case.video is not None:
        frames = draw_frames(case.video)
        pixels = np.stack([np.asarray(f) for f in frames])
        made = processing.video(pixels, prompt, mode)
        media = hashlib.sha256(pixels.tobytes()).hexdigest()
    else:
        image = draw(case.image)
        made = processing.image(image, prompt, mode)
        media = hashlib.sha256(image.tobytes()).hexdigest()
    return {
        "tensors": made.tensors,
        "processing": made.path,
        "grid": list(made.grid) if made.grid else None,
        "media_sha256": media,
        "inputs_sha256": tensors_sha256(made.tensors),
    }


def compare_case(
    case: Case,
    index: int,
    observed: Mapping[str, Observation],
    pair: PairedAnswers,
) -> dict[str, Any]:
    """One case's metrics (unprefixed) from both sides' observations: `index` is its place among the cases
    run (the prompts of the answer observations); its answers are both sides' as decoded (`pair`)."""
    forced_ref, forced = observed[FORCED_REFERENCE_LABEL], observed[FORCED_LABEL]
    fa = observed["features:ref"].arrays[f"features-{case.name}"]
    fb = observed["features:ckpt"].arrays[f"features-{case.name}"]
    if fa.shape != fb.shape:
        raise InputError(f"vision case {case.name!r}: the features differ in shape: {fa.shape} vs {fb.shape}")
    # The first steps' full distributions, both sides forced along the reference's answer.
    full = forced_ref.arrays["full_offsets"]
    start = int(full[index])
    steps = min(case.generation.kld_steps, int(full[index + 1]) - start)
    kld = metrics.kl_divergence(
        forced_ref.arrays["full_logp"][start : start + steps],
        forced.arrays["full_logp"][start : start + steps],
    )
    rows = slice(int(forced_ref.arrays["offsets"][index]), int(forced_ref.arrays["offsets"][index + 1]))
    along = kld_at_reference(forced_ref, forced)[rows]
    ref_answer, ckpt_answer = pair.ref.texts[index], pair.ckpt.texts[index]
    values: dict[str, Any] = {
        "vision_tokens": int(fa.shape[0]),
    }
    if case.answer is not None:
        ref_pass = case.answer.matches(ref_answer)
        ckpt_pass = case.answer.matches(ckpt_answer)
        values.update(ref_pass=ref_pass, ckpt_pass=ckpt_pass, answer_lost=ref_pass and not ckpt_pass)
    values.update(
        vision_cosine=tensor_errors.cosine_similarity(fa, fb),
        vision_rel_err=tensor_errors.relative_frobenius_error(fa, fb),
        vision_max_abs=tensor_errors.max_abs_error(fa, fb),
        first_tokens_kld=float(kld.mean()) if steps else float("nan"),
        first_tokens_compared=steps,
        answer_kld_mean=float(along.mean()) if len(along) else float("nan"),
        answers_identical=pair.step(index) is None,
        first_diff_token=pair.step(index),
    )
    return values


@task("vision")
class Vision:
    """Both sides describe the same generated images and clip; their visual features and first tokens are
    compared per case."""

    spec_model: ClassVar[type[TaskSpec]] = VisionSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        *CASE_METRICS,
        "cases_run",
        *(f"{case}.{metric}" for case in SHIPPED_CASES for metric in CASE_METRICS),
        "calibration_*",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "ref_pass": "the reference's answer names the red square and the blue circle",
        "ckpt_pass": "the candidate's answer names them",
        "vision_cosine": "cosine of the two sides' vision tower + merger features over every visual token",
        "vision_rel_err": "relative Frobenius error of the candidate's vision features against the ref's",
        "vision_max_abs": "largest absolute difference of one vision feature",
        "first_tokens_kld": (
            "mean KL(ref ‖ ckpt) over the first tokens of the reference's answer, both sides forced along it"
        ),
        "answer_kld_mean": (
            "mean KL(ref ‖ ckpt) over every token of the reference's answer, both sides forced along it "
            "(top-k exact, sampled tail)"
        ),
        "first_diff_token": "the first token at which the two sides decoded different answers",
        "answers_compared": "how both sides' answers were decoded (a question about an image alone)",
        **{name: about.format(text="the text the image shows") for name, about in OCR_DESCRIPTIONS.items()},
        "calibration_overlap_share": "share of the questions' tokens (each tokenised alone, no chat "
        "template) in a 13-gram the calibration set holds, or in a shorter question found whole in it",
        "calibration_flagged_cases": "cases whose question overlaps the calibration set by more than the "
        "spec's share; verdict_without_flagged is the verdict of the other cases' checks",
    }

    def __init__(self, spec: VisionSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        self.cases = spec.resolved_cases()
        self.overlap: Overlap | None = None  # each run case's question against the calibration set

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Every case's picture or clip, drawn and processed once and fed to both sides; the candidate's
        processor must make the same inputs. The single image must be possible here; another case that is
        not (a video without torchvision) is skipped with the reason."""
        source = ckpt if ref.is_recorded else ref
        config = source.checkpoint.config
        if "vision_config" not in config:
            # The first reason a reader needs: no backend or case could change it.
            model = source.checkpoint.model_type or "this model"
            raise TaskSkipped(f"the vision cases need a vision model: {model} is text-only (no vision tower)")
        skip_if_cannot_generate(ref, ckpt, "vision")
        if not ckpt.is_recorded and ckpt.options.backend == "exl3":
            from evalsuite.backends.exl3 import exllamav3_path

            if exllamav3_path(ckpt.options):
                raise TaskSkipped("exllamav3 runs the EXL3 pack for text only here; --device cpu decodes it")
        options = source.options
        processing = VisualProcessing(source.checkpoint.path, trust_remote_code=options.trust_remote_code)
        other = None
        if not ref.is_recorded and ckpt.checkpoint is not ref.checkpoint:
            other = VisualProcessing(ckpt.checkpoint.path, trust_remote_code=ckpt.options.trust_remote_code)
        inputs: Inputs = {"cases": {}}
        for case in self.cases:
            try:
                prepared = prepare_case(case, processing)
            except NoVisualPath as exc:
                if case.name == SINGLE:
                    raise TaskSkipped(str(exc)) from None
                inputs["cases"][case.name] = {"skipped": str(exc)}
                inputs[f"{case.prefix}skipped"] = str(exc)
                continue
            if other is not None:
                try:
                    theirs = prepare_case(case, other)
                except NoVisualPath as exc:
                    raise InputError(f"vision case {case.name!r}: {exc}", ckpt.checkpoint.path) from None
                if theirs["inputs_sha256"] != prepared["inputs_sha256"]:
                    raise InputError(
                        f"its processor or tokenizer makes other inputs for vision case {case.name!r} than "
                        "the reference's; the sides cannot be compared",
                        ckpt.checkpoint.path,
                    )
            inputs["cases"][case.name] = prepared
            for key in ("media_sha256", "inputs_sha256", "processing"):
                name = case.media_metric if key == "media_sha256" else key
                inputs[f"{case.prefix}{name}"] = prepared[key]
        run = [c for c in self.cases if "skipped" not in inputs["cases"][c.name]]
        inputs[PROMPTS] = [case_prompt(c, inputs["cases"][c.name]) for c in run]
        questions = {c.name: c.generation.prompt for c in run}
        self.overlap = text_overlap(self.spec.calibration, self.context, ref, ckpt, questions, "case")
        # What compare says of each case's inputs, kept with the reference's answers (and its recording).
        inputs[ANSWERS_META] = {
            "cases": {c.name: case_inputs(c, inputs["cases"][c.name]) for c in run},
            "skipped": {n: p["skipped"] for n, p in inputs["cases"].items() if "skipped" in p},
        }
        return inputs

    def needs(self) -> list[Need]:
        identity = {"cases": [c.identity() for c in self.cases]}
        full_steps = max(c.generation.kld_steps for c in self.cases)
        answers = GreedyAnswers("vision-answers", "vision cases", identity, 5, full_steps, 1)
        features = VisionFeatures(self.cases)
        return [
            Need("features:ref", "ref", features),
            # A question about an image is decoded alone (`greedy_answers.batches`).
            *smoke_needs("vision", answers, self.spec.record, full_steps),
            Need("features:ckpt", "ckpt", features),
        ]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        values: dict[str, Any] = {}
        checks: list[Check] = []
        not_measured: list[str] = []
        skipped: dict[str, str] = {}
        details: list[dict[str, Any]] = []
        pictures: dict[str, str] = {}
        null_reasons: dict[str, str] = {}
        descriptions: dict[str, str] = {}
        about = observed[ANSWERS_LABEL].meta
        skipped_here: dict[str, str] = about.get("skipped", {})
        run = [c.name for c in self.cases if c.name in about.get("cases", {})]
        pair = paired_answers(observed[ANSWERS_LABEL], observed[CKPT_ANSWERS_LABEL])
        for case in self.cases:
            pictures[case.name] = self.picture(case, artifacts)
            reason = skipped_here.get(case.name) or (None if case.name in run else "not observed")
            if reason:
                skipped[case.name] = reason
                not_measured += [case.prefix + m for m in case.thresholds]
                row = {"case": case.name, "input": pictures[case.name], "note": f"skipped: {reason}"}
                details.append(row)
                continue
            index = run.index(case.name)
            found = {**about["cases"][case.name], **compare_case(case, index, observed, pair)}
            answers = (pair.ref.texts[index], pair.ckpt.texts[index])
            unjudged: set[str] = set()
            if case.ocr is not None:
                read, reason = ocr_values(case.ocr, case.reads or "", *answers)
                found.update(read)
                if reason is not None:
                    null_reasons[f"{case.prefix}cer_delta"] = reason
                    unjudged.add("cer_delta")
                for metric, about_it in OCR_DESCRIPTIONS.items():
                    descriptions[case.prefix + metric] = about_it.format(text=repr(case.reads))
                # The KLD along the reference's reading, shown beside the error rates.
                descriptions[f"{case.prefix}answer_kld_mean"] = self.metric_descriptions["answer_kld_mean"]
            else:
                unjudged |= OCR_METRICS
            if case.answer is None:
                unjudged |= ANSWER_METRICS
            values.update({case.prefix + k: v for k, v in found.items()})
            for metric, threshold in case.thresholds.items():
                if metric in unjudged:
                    not_measured.append(case.prefix + metric)
                    continue
                checks += apply_threshold(case.prefix + metric, found.get(metric), threshold)
            details.append(self.row(case, found, answers, pictures[case.name], null_reasons))
        values["cases_run"] = len(self.cases) - len(skipped)
        values["answers_compared"] = pair.describe()  # the configuration is part of an answer
        values["skipped_cases"] = ", ".join(skipped)
        # A threshold of [thresholds] on a skipped case's metric was not measured; any other missing metric
        # (a misspelled name) fails.
        unmeasurable = {n for n in self.spec.thresholds if n.partition(".")[0] in skipped and "." in n}
        top, unmeasured = self.spec.threshold_checks(
            values, measurable=frozenset(self.spec.thresholds) - unmeasurable
        )
        if self.overlap is not None:
            values.update(overlap_metrics(self.overlap))
            values.update(self.verdicts_without_flagged(top + checks))
            details += overlap_rows(self.overlap)
        return TaskResult.from_checks(
            values,
            top + checks,
            artifacts={case: path for case, path in pictures.items()},
            details=details,
            not_measured=unmeasured + not_measured,
            null_reasons=null_reasons,
            descriptions=descriptions,
        )

    def verdicts_without_flagged(self, checks: list[Check]) -> dict[str, str]:
        """Where the calibration set holds some case's question: the verdict with it, and that of the other
        cases' checks alone (a check is its case's, `CASE.metric`; an unprefixed one the single image's)."""
        assert self.overlap is not None
        flagged = {name for name, f in zip(self.overlap.labels, self.overlap.flagged, strict=True) if f}
        if not flagged:
            return {}
        if len(flagged) == len(self.overlap.labels):
            return {"clean_note": "every case overlaps the calibration set"}
        kept = [c for c in checks if (c.name.partition(".")[0] if "." in c.name else SINGLE) not in flagged]
        return flagged_verdicts(checks, kept)

    @staticmethod
    def row(
        case: Case, found: dict[str, Any], answers: tuple[str, str], picture: str, unjudged: dict[str, str]
    ) -> dict:
        """A case's line in report.md: what was shown, both answers and whether each matches (an OCR case:
        each answer's character error rate, and why cer_delta was not judged where it was not)."""
        note = f"grid {found['grid']}, {found['vision_tokens']} visual tokens"
        if case.downsample_mode is not None:
            note += f", downsample {case.downsample_mode}"
        if case.video is not None:
            note = f"{case.video.frames} frames, {found['vision_tokens']} visual tokens"
        if case.ocr is not None:
            note += f"; reads {case.reads!r}: CER ref {found['ref_cer']:.3g}, ckpt {found['ckpt_cer']:.3g}"
            reason = unjudged.get(f"{case.prefix}cer_delta")
            note += f"; cer_delta not judged: {reason}" if reason else f", cer_delta {found['cer_delta']:.3g}"
        return {
            "case": case.name,
            "input": picture,
            "ref_answer": answers[0],
            "ref_pass": found.get("ref_pass"),
            "ckpt_answer": answers[1],
            "ckpt_pass": found.get("ckpt_pass"),
            "note": note,
        }

    @staticmethod
    def picture(case: Case, artifacts: Path) -> str:
        """The case's image, or the contact sheet of its frames, drawn again from the spec (the observation
        keys guarantee the same spec) into the artifacts; its path relative to the run folder."""
        if case.video is not None:
            name, image = f"vision_{case.name}_frames.png", contact_sheet(draw_frames(case.video))
        else:
            name = "vision_image.png" if case.name == SINGLE else f"vision_{case.name}.png"
            image = draw(case.image)
        write_atomic(artifacts / name, png(image))
        return f"{artifacts.name}/{name}"
