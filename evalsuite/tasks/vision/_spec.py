"""The vision task's spec, validated when it is read: the single image, the pictures the cases show by name,
the cases with their bounds, and each case with its defaults resolved (`Case`): what is shown, asked and
expected, and its checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from evalsuite.contract.spec import StrictModel, TaskSpec, Threshold
from evalsuite.observers.window_logits import RecordOptions
from evalsuite.tasks.calibration_overlap import CalibrationOptions
from evalsuite.tasks.vision._pictures import ImageSpec, VideoSpec
from evalsuite.tasks.vision._reading import OcrSpec

# The single image's case: its metrics have no prefix (the names `vision` reported before it had cases).
SINGLE = "image"
# Metrics every case reports that a threshold may bound (prefixed `CASE.` except for the single image).
CASE_METRICS = (
    "vision_cosine",
    "vision_rel_err",
    "vision_max_abs",
    "vision_tokens",
    "first_tokens_kld",
    "first_tokens_compared",
    "answer_kld_mean",
    "answers_identical",
    "first_diff_token",
    "ref_pass",
    "ckpt_pass",
    "answer_lost",
    "n_slices",
    "ref_cer",
    "ckpt_cer",
    "cer_delta",
)
ANSWER_METRICS = frozenset({"ref_pass", "ckpt_pass", "answer_lost"})
# The cases of the shipped spec, so that `--thresholds` may name their metrics.
SHIPPED_CASES = ("slices", "downsample_4x", "downsample_16x", "video", "ocr", "chart", "count")


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


def _known_metrics(table: dict[str, Threshold]) -> dict[str, Threshold]:
    unknown = sorted(set(table) - set(CASE_METRICS))
    if unknown:
        raise ValueError(f"no case reports {', '.join(unknown)} (a case reports {', '.join(CASE_METRICS)})")
    return table


class CaseSpec(StrictModel):
    """One more input both sides describe. Without `image` or `video` it shows the single image; without
    `prompt` it asks `[generation].prompt` and, unless it sets `answer`, is judged by `[answer]`."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    image: str | None = None  # a name in [images]
    video: VideoSpec | None = None
    downsample_mode: Literal["4x", "16x"] | None = None  # None: the checkpoint's own setting
    prompt: str | None = None
    max_new_tokens: int | None = None
    kld_steps: int | None = None
    answer: AnswerSpec | None = None
    ocr: OcrSpec | None = None  # the answer is a reading of the image's text, scored by its CER
    thresholds: dict[str, Threshold] = Field(default_factory=dict)  # on top of [case_thresholds]

    @field_validator("thresholds")
    @classmethod
    def _known(cls, value: dict[str, Threshold]) -> dict[str, Threshold]:
        return _known_metrics(value)

    @model_validator(mode="after")
    def _one_medium(self) -> CaseSpec:
        if self.name == SINGLE:
            raise ValueError(f"case name {SINGLE!r} is the single image's ([image])")
        if self.image is not None and self.video is not None:
            raise ValueError("a case shows an image or a video, not both")
        if self.ocr is not None and self.video is not None:
            raise ValueError(f"case {self.name!r} reads text (`ocr`) from a video: OCR cases show an image")
        return self


class VisionSpec(TaskSpec):
    image: ImageSpec
    generation: GenerationSpec
    answer: AnswerSpec
    images: dict[str, ImageSpec] = Field(default_factory=dict)
    cases: list[CaseSpec] = Field(default_factory=list)
    # Bounds on every [[cases]] entry's metrics (not the single image's: [thresholds] has those).
    case_thresholds: dict[str, Threshold] = Field(default_factory=dict)
    # What the reference's forced rows keep for the KLD along the answers (top-k exact, sampled beyond).
    record: RecordOptions = RecordOptions()
    calibration: CalibrationOptions = CalibrationOptions()  # each question against the calibration set

    COMPARE_ONLY: ClassVar[frozenset[str]] = TaskSpec.COMPARE_ONLY | {"case_thresholds", "calibration"}

    @field_validator("case_thresholds")
    @classmethod
    def _known(cls, value: dict[str, Threshold]) -> dict[str, Threshold]:
        return _known_metrics(value)

    @model_validator(mode="after")
    def _cases_resolve(self) -> VisionSpec:
        names = [c.name for c in self.cases]
        if len(set(names)) != len(names):
            repeated = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"case names repeat: {', '.join(repeated)}")
        for case in self.cases:
            if case.image is not None and case.image not in self.images:
                raise ValueError(f"case {case.name!r} shows image {case.image!r}, not defined in [images]")
            shown = self.images[case.image] if case.image else self.image
            if case.ocr is not None and not shown.written():
                raise ValueError(f"case {case.name!r} reads text (`ocr`) but its image draws none (`text`)")
        return self

    def resolved_cases(self) -> list[Case]:
        """The single image, then every `[[cases]]` entry with its defaults filled in."""
        cases = [
            Case(SINGLE, self.image, None, None, self.generation, self.answer, {}),
        ]
        for c in self.cases:
            generation = GenerationSpec(
                prompt=c.prompt or self.generation.prompt,
                max_new_tokens=c.max_new_tokens or self.generation.max_new_tokens,
                kld_steps=self.generation.kld_steps if c.kld_steps is None else c.kld_steps,
            )
            answer = c.answer if c.answer is not None or c.prompt else self.answer
            image = None if c.video is not None else self.images[c.image] if c.image else self.image
            thresholds = {**self.case_thresholds, **c.thresholds}
            shown = (c.name, image, c.video, c.downsample_mode)
            cases.append(Case(*shown, generation, answer, thresholds, c.ocr))
        return cases


@dataclass(frozen=True)
class Case:
    """A case with its defaults resolved: what is shown, asked and expected, and its checks."""

    name: str
    image: ImageSpec | None
    video: VideoSpec | None
    downsample_mode: str | None
    generation: GenerationSpec
    answer: AnswerSpec | None
    thresholds: dict[str, Threshold] = field(default_factory=dict)
    ocr: OcrSpec | None = None

    @property
    def prefix(self) -> str:
        """Its metrics' prefix: none for the single image."""
        return "" if self.name == SINGLE else f"{self.name}."

    @property
    def reads(self) -> str | None:
        """The text an OCR case's answers are scored against: the one its image shows; None elsewhere."""
        return self.image.written() if self.ocr is not None and self.image is not None else None

    @property
    def media_metric(self) -> str:
        return "frames_sha256" if self.video is not None else "image_sha256"

    def identity(self) -> dict[str, Any]:
        """What shapes its observation: the picture or clip, the question and the settings."""
        if self.name == SINGLE:
            return {
                "image": self.image.model_dump(mode="json"),
                "generation": self.generation.model_dump(mode="json"),
            }
        return {
            "case": self.name,
            "image": None if self.image is None else self.image.model_dump(mode="json"),
            "video": None if self.video is None else self.video.model_dump(mode="json"),
            "downsample_mode": self.downsample_mode,
            "generation": self.generation.model_dump(mode="json"),
        }
