"""Model inputs for an image or a short video and a question, made once and fed to both sides.

The real processor is used where it can be built. The MiniCPM-V 4.7 processor needs torchvision for its video
half, which some platforms lack; for that family an image's inputs are then made with the image processor and
the tokenizer alone (the image id, a thumbnail `<image>…</image>`, then one `<slice>…</slice>` per crop, rows
separated by a newline, each crop worth (h·w)/16 tokens, or (h·w)/4 under `downsample_mode = "4x"`), and the
report says which path was taken. A video has no such path: without the video processor it cannot be made.

`downsample_mode` ("4x" or "16x", MiniCPM-V's names) is both a processor setting (how many visual tokens a
crop is worth) and a model argument (whether the vision tower's window merger runs): when a caller sets it, it
is handed to the processor and kept in the inputs, so that the model merges tokens the way they were counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROCESSOR = "processor"
IMAGE_PROCESSOR = "image processor + tokenizer (the processor needs torchvision)"


class NoVisualPath(Exception):
    """Neither the processor nor an image-only path can make inputs for this model and medium here."""


@dataclass(frozen=True)
class VisualInputs:
    """What one image or video and a question become: the model's inputs, which path made them, and for an
    image the grid (rows, columns) of slices its processor cut it into (None: not sliced)."""

    tensors: dict[str, Any]
    path: str
    grid: tuple[int, int] | None = None


def _first_sentence(exc: BaseException) -> str:
    # Transformers' import errors run to a paragraph of installation advice; the reason is its first sentence.
    text = str(exc).strip()
    first = text.splitlines()[0].split(". ")[0].rstrip(".") if text else ""
    return f"{type(exc).__name__}: {first}"


def _chat_prompt(template_owner: Any, medium: str, question: str) -> str:
    messages = [{"role": "user", "content": [{"type": medium}, {"type": "text", "text": question}]}]
    return template_owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class VisualProcessing:
    """The processing of one checkpoint folder, loaded once: its processor, or the reason it cannot be built
    here (then MiniCPM-V images go through its image processor and tokenizer)."""

    def __init__(self, model_dir: Path, *, trust_remote_code: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.trust_remote_code = trust_remote_code
        self._processor: Any = None
        self._failure: str | None = None
        self._loaded = False
        self._image_path: tuple[Any, Any] | None = None  # (tokenizer, image processor), read once

    @property
    def processor(self) -> Any:
        """The checkpoint's processor, or None when it cannot be built here (`failure` says why)."""
        if not self._loaded:
            self._loaded = True
            try:
                from transformers import AutoProcessor

                self._processor = AutoProcessor.from_pretrained(
                    str(self.model_dir), trust_remote_code=self.trust_remote_code
                )
            except Exception as exc:  # any failure to build the processor is a reason, reported as such
                self._failure = _first_sentence(exc)
        return self._processor

    @property
    def failure(self) -> str | None:
        """Why the processor cannot be built here, or None."""
        _ = self.processor
        return self._failure

    def image(self, image: Any, question: str, downsample_mode: str | None = None) -> VisualInputs:
        """Inputs for one image and a question (`NoVisualPath` when no path can make them here)."""
        settings = {} if downsample_mode is None else {"downsample_mode": downsample_mode}
        processor = self.processor
        if processor is not None:
            owner = getattr(processor, "image_processor", None)
            if settings and not hasattr(owner, "downsample_mode"):
                # The setting would be dropped by the processor and refused by the model's forward.
                raise NoVisualPath(f"{type(owner).__name__} has no downsample_mode setting")
            prompt = _chat_prompt(processor, "image", question)
            tensors = dict(processor(images=[image], text=prompt, return_tensors="pt", **settings))
            image_processor, path = getattr(processor, "image_processor", None), PROCESSOR
        else:
            tokenizer, image_processor = self._image_only_path()
            tensors, grid = _minicpmv_expansion(image, question, downsample_mode, tokenizer, image_processor)
            tensors.update(settings)
            return VisualInputs(tensors, IMAGE_PROCESSOR, grid)
        tensors.update(settings)
        return VisualInputs(tensors, path, slice_grid(image_processor, image, settings))

    def _image_only_path(self) -> tuple[Any, Any]:
        # Read once per folder: a vision task asks for a dozen images, and `device_support` plans it often.
        if self._image_path is None:
            from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

            config = AutoConfig.from_pretrained(str(self.model_dir), trust_remote_code=self.trust_remote_code)
            if not config.model_type.startswith("minicpmv"):
                raise NoVisualPath(
                    f"the processor cannot be built here ({self._failure}) and model type "
                    f"{config.model_type!r} has no image-only path"
                )
            folder = str(self.model_dir)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            self._image_path = (tokenizer, AutoImageProcessor.from_pretrained(folder))
        return self._image_path

    def video(self, frames: Any, question: str, downsample_mode: str | None = None) -> VisualInputs:
        """Inputs for a clip (frames as a (T, H, W, 3) uint8 array, every one used: no frame sampling) and a
        question, through the processor's video half (`NoVisualPath` when it cannot be built or run here)."""
        processor = self.processor
        if processor is None:
            raise NoVisualPath(f"the video processor cannot be built here ({self._failure})")
        if getattr(processor, "video_processor", None) is None:
            raise NoVisualPath(f"{type(processor).__name__} has no video processor")
        settings = {} if downsample_mode is None else {"downsample_mode": downsample_mode}
        prompt = _chat_prompt(processor, "video", question)
        try:
            made = processor(
                videos=[frames], text=prompt, return_tensors="pt", do_sample_frames=False, **settings
            )
        except Exception as exc:  # a processor that cannot take given frames: the case cannot run here
            raise NoVisualPath(f"the video processor fails on the frames ({_first_sentence(exc)})") from None
        tensors = dict(made)
        tensors.update(settings)
        return VisualInputs(tensors, PROCESSOR)


def slice_grid(image_processor: Any, image: Any, settings: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of slices the image processor cuts `image` into, or None when it does not slice it
    (or does not say: only processors that report `grids`, as MiniCPM-V's do, are asked)."""
    if image_processor is None:
        return None
    try:
        grids = image_processor(image, **settings).get("grids")
    except Exception:  # a processor that cannot be asked this way has no grid to report
        return None
    if not grids:
        return None
    rows, cols = (int(n) for n in grids[0])
    return (rows, cols) if rows > 0 and cols > 0 else None


def minicpmv_inputs(
    model_dir: Path,
    image: Any,
    question: str,
    downsample_mode: str | None = None,
    parts: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """The MiniCPM-V processor's expansion of one image and a question, by image processor and tokenizer
    (`parts`: the folder's (tokenizer, image processor), where the caller has read them already)."""
    if parts is None:
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = str(model_dir)
        parts = (AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder))
    return _minicpmv_expansion(image, question, downsample_mode, *parts)[0]


def _minicpmv_expansion(
    image: Any, question: str, downsample_mode: str | None, tokenizer: Any, image_processor: Any
) -> tuple[dict[str, Any], tuple[int, int] | None]:
    # The inputs and the slice grid `slice_grid` would report, from one pass of the image processor.
    settings = {} if downsample_mode is None else {"downsample_mode": downsample_mode}
    pixels = image_processor(image, return_tensors="pt", **settings)
    mode = downsample_mode or image_processor.downsample_mode
    tokens_per_crop = (pixels["target_sizes"].prod(-1) // (4 if mode == "4x" else 16)).tolist()
    rows, cols = pixels["grids"][0]
    thumbnail = tokenizer.image_token * tokens_per_crop[0]
    placeholder = tokenizer.image_start_token + thumbnail + tokenizer.image_end_token
    if image_processor.use_image_id:  # the processor numbers the images of a prompt from 0
        placeholder = f"{tokenizer.image_id_start_token}0{tokenizer.image_id_end_token}{placeholder}"
    if image_processor.slice_mode:
        crops = iter(tokens_per_crop[1:])
        placeholder += "\n".join(
            "".join(
                tokenizer.slice_start_token + tokenizer.image_token * next(crops) + tokenizer.slice_end_token
                for _ in range(cols)
            )
            for _ in range(rows)
        )
    prompt = _chat_prompt(tokenizer, "image", question)
    prompt = prompt.replace(tokenizer.image_token, placeholder, 1)
    encoded = tokenizer(prompt, return_tensors="pt")
    tensors = {
        "input_ids": encoded["input_ids"],
        "attention_mask": encoded["attention_mask"],
        # int64, as the processor makes it: both paths give the same inputs, byte for byte.
        "mm_token_type_ids": (encoded["input_ids"] == tokenizer.image_token_id).long(),
        "pixel_values": pixels["pixel_values"],
        "target_sizes": pixels["target_sizes"],
    }
    return tensors, ((int(rows), int(cols)) if rows > 0 and cols > 0 else None)
