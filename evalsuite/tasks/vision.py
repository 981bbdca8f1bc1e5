"""A generated image of a red square and a blue circle, described by both sides; vision-tower parity."""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from pydantic import field_validator

from evalsuite import metrics
from evalsuite.errors import InputError
from evalsuite.multimodal import NoImagePath, image_question_inputs
from evalsuite.observation import Observation
from evalsuite.run_folder import write_atomic
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec
from evalsuite.task import Inputs, Need, Progress, RunContext, TaskResult, TaskSkipped, task

if TYPE_CHECKING:
    from evalsuite.backends import Backend

RGB = tuple[int, int, int]


class Square(StrictModel):
    left: int
    top: int
    size: int
    color: RGB


class Circle(StrictModel):
    center_x: int
    center_y: int
    radius: int
    color: RGB


class ImageSpec(StrictModel):
    width: int = 448
    height: int = 448
    background: RGB = (255, 255, 255)
    square: Square
    circle: Circle


class GenerationSpec(StrictModel):
    prompt: str
    max_new_tokens: int = 40
    kld_steps: int = 4


class AnswerSpec(StrictModel):
    patterns: list[str]

    @field_validator("patterns")
    @classmethod
    def _compile(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a valid regular expression: {exc}") from None
        return value

    def matches(self, answer: str) -> bool:
        return all(re.search(p, answer, flags=re.IGNORECASE) for p in self.patterns)


class VisionSpec(TaskSpec):
    image: ImageSpec
    generation: GenerationSpec
    answer: AnswerSpec


def draw(spec: ImageSpec) -> Any:
    """The test image, drawn with Pillow from the spec (deterministic: no anti-aliasing)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (spec.width, spec.height), spec.background)
    pen = ImageDraw.Draw(image)
    s, c = spec.square, spec.circle
    pen.rectangle((s.left, s.top, s.left + s.size - 1, s.top + s.size - 1), fill=s.color)
    pen.ellipse(
        (c.center_x - c.radius, c.center_y - c.radius, c.center_x + c.radius, c.center_y + c.radius),
        fill=c.color,
    )
    return image


def tensors_sha256(inputs: dict[str, Any]) -> str:
    """Hash of the model inputs (names, dtypes, shapes and bytes), so both sides provably got the same."""
    digest = hashlib.sha256()
    for name in sorted(inputs):
        value = inputs[name]
        if isinstance(value, torch.Tensor):
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            digest.update(value.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class VisionAnswer:
    """Observer: the vision tower + merger features of the image, and the greedy answer with the full
    next-token distributions of its first steps."""

    name = "vision-answer"

    def __init__(self, spec: VisionSpec) -> None:
        self.spec = spec

    def identity(self) -> dict[str, Any]:
        return {
            "image": self.spec.image.model_dump(mode="json"),
            "generation": self.spec.generation.model_dump(mode="json"),
        }

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        gen_spec = self.spec.generation
        step = progress("vision answer", 1)
        features = backend.image_features(inputs["tensors"])
        gen = backend.generate_greedy(
            inputs["tensors"], gen_spec.max_new_tokens, top_k=5, full_steps=gen_spec.kld_steps
        )
        step()
        return Observation(
            name=self.name,
            meta={
                "answer": backend.tokenizer.decode(gen.tokens, skip_special_tokens=True),
                "image_sha256": inputs["image_sha256"],
                "inputs_sha256": inputs["inputs_sha256"],
                "processing": inputs["processing"],
                "execution": backend.describe(),
            },
            arrays={
                "features": features.numpy(),
                "tokens": np.asarray(gen.tokens, dtype=np.int64),
                "first_logp": gen.full_logp,
            },
        )

    def record(self, obs: Observation, folder: Path) -> Observation:
        """Features, tokens and the first steps' distributions are what a replay needs: kept as they are."""
        return Observation(name=obs.name, key=obs.key, meta=obs.meta, arrays=obs.arrays)


@task("vision")
class Vision:
    """Both sides describe the same generated image; their vision features and first tokens are compared."""

    spec_model: ClassVar[type[TaskSpec]] = VisionSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "ref_pass",
        "ckpt_pass",
        "vision_cosine",
        "vision_rel_err",
        "vision_max_abs",
        "vision_tokens",
        "first_tokens_kld",
        "first_tokens_compared",
        "answers_identical",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "ref_pass": "the reference's answer names the red square and the blue circle",
        "ckpt_pass": "the candidate's answer names them",
        "vision_cosine": "cosine of the two sides' vision tower + merger features over every visual token",
        "vision_rel_err": "relative Frobenius error of the candidate's vision features against the ref's",
        "vision_max_abs": "largest absolute difference of one vision feature",
        "first_tokens_kld": "mean KL(ref ‖ ckpt) over the first generated tokens, while both share a prefix",
    }

    def __init__(self, spec: VisionSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The image, drawn once, and the processed inputs fed to both sides."""
        source = ckpt if ref.is_recorded else ref
        config = source.checkpoint.config
        if "vision_config" not in config:
            raise TaskSkipped(f"{source.checkpoint.model_type or 'this model'} is text-only: no vision tower")
        if not ckpt.is_recorded and ckpt.options.backend == "exl3":
            from evalsuite.backends.exl3 import exllamav3_path

            if exllamav3_path(ckpt.options):
                raise TaskSkipped("exllamav3 runs the EXL3 pack for text only here; --device cpu decodes it")
        image = draw(self.spec.image)
        try:
            inputs, path = image_question_inputs(
                source.checkpoint.path,
                image,
                self.spec.generation.prompt,
                trust_remote_code=source.options.trust_remote_code,
            )
        except NoImagePath as exc:
            raise TaskSkipped(str(exc)) from None
        if not ref.is_recorded and ckpt.checkpoint is not ref.checkpoint:
            other, _ = image_question_inputs(
                ckpt.checkpoint.path,
                image,
                self.spec.generation.prompt,
                trust_remote_code=ckpt.options.trust_remote_code,
            )
            if tensors_sha256(other) != tensors_sha256(inputs):
                raise InputError(
                    "its processor or tokenizer makes other inputs for the image prompt than the "
                    "reference's; the sides cannot be compared",
                    ckpt.checkpoint.path,
                )
        return {
            "tensors": inputs,
            "image_sha256": hashlib.sha256(image.tobytes()).hexdigest(),
            "inputs_sha256": tensors_sha256(inputs),
            "processing": path,
        }

    def needs(self) -> list[Need]:
        observer = VisionAnswer(self.spec)
        return [Need("ref", "ref", observer), Need("ckpt", "ckpt", observer)]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ckpt = observed["ref"], observed["ckpt"]
        if ref.meta["inputs_sha256"] != ckpt.meta["inputs_sha256"]:
            raise InputError("the sides were given different image inputs")
        fa, fb = ref.arrays["features"], ckpt.arrays["features"]
        if fa.shape != fb.shape:
            raise InputError(f"the vision features differ in shape: {fa.shape} vs {fb.shape}")
        # Steps are comparable while both sides share their prefix: up to and including the first divergence.
        d = metrics.first_divergence(ref.arrays["tokens"], ckpt.arrays["tokens"])
        limit = min(len(ref.arrays["first_logp"]), len(ckpt.arrays["first_logp"]))
        steps = limit if d is None else min(limit, d + 1)
        kld = metrics.kl_divergence(ref.arrays["first_logp"][:steps], ckpt.arrays["first_logp"][:steps])
        values: dict[str, Any] = {
            "image_sha256": ref.meta["image_sha256"],
            "processing": ref.meta["processing"],
            "ref_pass": self.spec.answer.matches(ref.meta["answer"]),
            "ckpt_pass": self.spec.answer.matches(ckpt.meta["answer"]),
            "vision_cosine": metrics.cosine_similarity(fa, fb),
            "vision_rel_err": metrics.relative_frobenius_error(fa, fb),
            "vision_max_abs": metrics.max_abs_error(fa, fb),
            "vision_tokens": int(fa.shape[0]),
            "first_tokens_kld": float(kld.mean()) if steps else float("nan"),
            "first_tokens_compared": steps,
            "answers_identical": d is None,
        }
        checks, _ = self.spec.threshold_checks(values)
        # Drawn again from the spec for the report (the observation keys guarantee the same spec).
        png = io.BytesIO()
        draw(self.spec.image).save(png, format="PNG")
        write_atomic(artifacts / "vision_image.png", png.getvalue())
        return TaskResult.from_checks(
            values,
            checks,
            artifacts={"image": f"{artifacts.name}/vision_image.png"},
            details=[
                {"side": "ref", "answer": ref.meta["answer"], "pass": values["ref_pass"]},
                {"side": "ckpt", "answer": ckpt.meta["answer"], "pass": values["ckpt_pass"]},
            ],
        )
