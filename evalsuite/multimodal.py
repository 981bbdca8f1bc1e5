"""Model inputs for an image and a question, made once and fed to both sides.

The real processor is used where it can be built. The MiniCPM-V 4.7 processor needs torchvision for its video
half, which some platforms lack; for that family the same expansion is done with the image processor and the
tokenizer alone (the image id, a thumbnail `<image>…</image>`, then one `<slice>…</slice>` per crop, rows
separated by a newline, each crop worth (h·w)/16 tokens), and the report says which path was taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROCESSOR = "processor"
IMAGE_PROCESSOR = "image processor + tokenizer (the processor needs torchvision)"


class NoImagePath(Exception):
    """Neither the processor nor an image-only path can make inputs for this model here."""


def image_question_inputs(
    model_dir: Path, image: Any, question: str, *, trust_remote_code: bool = False
) -> tuple[dict[str, Any], str]:
    """`(inputs, path)`: tensors for `model.generate(**inputs)` and which processing path made them."""
    from transformers import AutoConfig

    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(images=[image], text=prompt, return_tensors="pt")
        return dict(inputs), PROCESSOR
    except Exception as exc:  # any failure to build or run the processor falls back below
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    model_type = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code).model_type
    if not model_type.startswith("minicpmv"):
        raise NoImagePath(
            f"the processor cannot be built here ({reason}) and model type {model_type!r} has no "
            "image-only path"
        )
    return minicpmv_inputs(model_dir, image, question), IMAGE_PROCESSOR


def minicpmv_inputs(model_dir: Path, image: Any, question: str) -> dict[str, Any]:
    """The MiniCPM-V processor's expansion of one image and a question, by image processor and tokenizer."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
    pixels = image_processor(image, return_tensors="pt")
    tokens_per_crop = (pixels["target_sizes"].prod(-1) // 16).tolist()
    rows, cols = pixels["grids"][0]
    thumbnail = tokenizer.image_token * tokens_per_crop[0]
    placeholder = tokenizer.image_start_token + thumbnail + tokenizer.image_end_token
    if image_processor.use_image_id:  # the processor numbers the images of a prompt from 0
        placeholder = f"{tokenizer.image_id_start_token}0{tokenizer.image_id_end_token}{placeholder}"
    crops = iter(tokens_per_crop[1:])
    placeholder += "\n".join(
        "".join(
            tokenizer.slice_start_token + tokenizer.image_token * next(crops) + tokenizer.slice_end_token
            for _ in range(cols)
        )
        for _ in range(rows)
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = prompt.replace(tokenizer.image_token, placeholder, 1)
    encoded = tokenizer(prompt, return_tensors="pt")
    return {
        "input_ids": encoded["input_ids"],
        "attention_mask": encoded["attention_mask"],
        "mm_token_type_ids": (encoded["input_ids"] == tokenizer.image_token_id).int(),
        "pixel_values": pixels["pixel_values"],
        "target_sizes": pixels["target_sizes"],
    }
