"""How an OCR case of the vision task is scored: each side's answer read against the text its image shows,
by character error rate, and the candidate judged against the reference only where the reference reads it."""

from __future__ import annotations

import unicodedata

from pydantic import Field

from evalsuite.contract.spec import StrictModel
from evalsuite.stats import metrics

OCR_METRICS = frozenset({"ref_cer", "ckpt_cer", "cer_delta"})
OCR_DESCRIPTIONS = {
    "ref_cer": "character error rate of the reference's answer against {text}",
    "ckpt_cer": "character error rate of the candidate's answer against {text}",
    "cer_delta": (
        "ckpt_cer − ref_cer: how much worse the candidate reads {text} (judged where the reference reads it)"
    ),
}


class OcrSpec(StrictModel):
    """A case that reads the text its image shows: each side's answer scored by its character error rate."""

    # The reference reads the text when its CER is at most this; only then is the candidate's CER judged
    # against it (cer_delta): a reference that reads nothing gives the candidate nothing to be compared with.
    ref_reads: float = Field(0.5, gt=0)


def as_reading(text: str) -> str:
    """An answer, or the text drawn, as a reading: Unicode NFC, surrounding whitespace dropped, each run of
    whitespace read as one space. Case and punctuation count: they are part of what the image shows."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def ocr_values(
    ocr: OcrSpec, text: str, ref_answer: str, ckpt_answer: str
) -> tuple[dict[str, float], str | None]:
    """An OCR case's character error rates against `text`, the text its image shows, and why `cer_delta`
    is not judged (None when it is): a reference that does not read the text leaves it undefined."""
    truth = as_reading(text)
    ref_cer = metrics.character_error_rate(as_reading(ref_answer), truth)
    ckpt_cer = metrics.character_error_rate(as_reading(ckpt_answer), truth)
    values = {"ref_cer": ref_cer, "ckpt_cer": ckpt_cer, "cer_delta": ckpt_cer - ref_cer}
    if ref_cer <= ocr.ref_reads:
        return values, None
    values["cer_delta"] = float("nan")
    reason = (
        f"the reference does not read {truth!r} (its CER {ref_cer:.3g} > ocr.ref_reads "
        f"{ocr.ref_reads:g}): the candidate's reading has nothing to be compared with"
    )
    return values, reason
