"""Image prompts: rows that carry ``images``, the model's processor that turns them into inputs, and
the one batch tensor that takes them from the driver to every pass over a prompt.

Why one tensor: a batch moves between roles as tensors that share their first dimension (samples),
and every step of the pipeline (grouping, chunking to workers, micro-batches, dynamic sampling)
selects rows. Sample ``b``'s images as ``pixel_values[b]`` (``[B, K, C, H, W]``, ``K`` images per
prompt) go wherever its prompt goes with no bookkeeping of their own. A model pass that reads
prompts (generation's prefill, the log-prob, reference and training passes, padded or packed) hands
the images of the prompts it computes to the model, in the order their image tokens come.

A row with images::

    {"prompt": "<image>What color is the shape?", "images": ["shapes/0001.png"], "ground_truth": "red"}

``<image>`` marks where each image goes, one per image, in order; roll puts the model's own image
token there and its processor repeats it as many times as the image has features. ``images`` are
file paths (relative to the JSONL file), PIL images or ``[H, W, 3]`` uint8 arrays. Every row of a
data set has the same number of images.

Agentic episodes (an environment's :class:`~roll_core.envs.Observation` carries images) gather
images turn by turn, so their samples hold different numbers: ``pixel_values`` is then padded to the
most any sample has, and ``image_counts`` ``[B]`` says how many of each sample's are real. Their
later images stand in the response (the environment's replies, context the loss never trains).

The models: LLaVA-style image-text models, whose processor gives ``pixel_values`` per image and
whose forward takes them beside ``input_ids`` (transformers' ``...ForConditionalGeneration`` under
``AutoModelForImageTextToText``). The embedded tiny model has such a variant (``model.tiny.vision``).
Models whose processor returns more image inputs (Qwen2-VL's ``image_grid_thw``) are refused by name.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from roll_core.errors import ConfigError, RollError

IMAGE_PLACEHOLDER = "<image>"  # where an image goes in a row's prompt
IMAGES = "pixel_values"  # the batch key: [B, K, C, H, W]
IMAGE_COUNTS = "image_counts"  # [B]: how many of IMAGES[b] are real (rows of other counts; agentic episodes)
_TEXT_KEYS = ("input_ids", "attention_mask")


def has_images(rows: Sequence[dict]) -> bool:
    return any(row.get("images") for row in rows)


def resolve_paths(row: dict, base: Path) -> dict:
    """``row`` with its relative image paths made relative to ``base`` (the JSONL file's directory)."""
    if not row.get("images"):
        return row
    # base / an absolute path is that path
    images = [str(base / image) if isinstance(image, str) else image for image in row["images"]]
    return {**row, "images": images}


def load_image(image: Any):
    """One image as a PIL RGB image: from a file path, a PIL image or an ``[H, W, 3]`` uint8 array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, Path)):
        try:
            with Image.open(image) as opened:
                return opened.convert("RGB")
        except OSError as exc:
            raise ConfigError(f"image '{image}' cannot be read: {exc}") from None
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise ConfigError(f"an image given as an array must be [H, W, 3] uint8; got {array.shape} {array.dtype}")
    return Image.fromarray(array)


@functools.lru_cache(maxsize=4)
def processor_for(model_path: str):
    """The processor of the model at ``model_path`` (``AutoProcessor``), which must read images."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the inputs have images, but the model at {model_path} has no processor that reads them "
                          f"({exc})") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"the inputs have images, but the model at {model_path} has no image processor "
                          f"(processor {type(processor).__name__}); use an image-text model")
    return processor


def save_processor(model_path: str, directory) -> None:
    """The image processor of the model at ``model_path`` into ``directory`` (an exported or
    warmed-up model's), so the directory reads images as the original did; nothing for a model
    without one. Call it before saving the run's tokenizer there, which it rewrites."""
    if any((Path(model_path) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        processor_for(model_path).save_pretrained(directory)


def check_rows(rows: Sequence[dict], where: str) -> None:
    """Every row has as many images as placeholders in its prompt (rows may differ: text rows and
    rows of one or more images mix)."""
    for i, row in enumerate(rows):
        n, marked = len(row.get("images") or []), row["prompt"].count(IMAGE_PLACEHOLDER)
        if n != marked:
            raise ConfigError(f"{where} row {i} has {n} image(s) and {marked} '{IMAGE_PLACEHOLDER}' placeholder(s) "
                              f"in its prompt; put one where each image goes")


def tokenize_prompts(tokenizer, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, P]`` ids and mask of text prompts, without BOS/EOS (used verbatim); rows
    with images go through :func:`encode_prompts`."""
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def encode_prompts(tokenizer, rows: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Rows' prompts as left-padded ``prompt_ids``, ``prompt_mask`` ``[B, P]``, without BOS/EOS, and,
    where the rows have images, their ``pixel_values`` ``[B, K, C, H, W]`` from the model's processor
    (which also repeats each image token once per image feature) with ``image_counts`` ``[B]``: rows
    may hold different numbers of images, text rows none, zeros past each row's own
    (:func:`stack_images`)."""
    prompts = [row["prompt"] for row in rows]
    if not has_images(rows):
        ids, mask = tokenize_prompts(tokenizer, prompts)
        return {"prompt_ids": ids, "prompt_mask": mask}
    check_rows(rows, "the batch's")
    counts = [len(row.get("images") or []) for row in rows]
    images = [image for row in rows for image in row.get("images") or []]
    enc = _processed(tokenizer, prompts, images, padding=True, padding_side="left")
    per_row = enc[IMAGES].split(counts)
    return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], **stack_images(per_row)}


def encode_text(tokenizer, text: str, images: Sequence[Any] = ()) -> tuple[list[int], torch.Tensor | None]:
    """One text's ids, without BOS/EOS, and its images' pixels ``[k, C, H, W]`` (None without images):
    an agentic turn's observation (:class:`roll_core.envs.Observation`), through the model's
    processor where it has images, so each ``<image>`` becomes the image tokens of its features."""
    if not images:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None
    marked = text.count(IMAGE_PLACEHOLDER)
    if marked != len(images):
        raise ValueError(f"an observation has {len(images)} image(s) and {marked} '{IMAGE_PLACEHOLDER}' "
                         f"placeholder(s) in its text; put one where each image goes")
    enc = _processed(tokenizer, [text], list(images))
    return enc["input_ids"][0].tolist(), enc[IMAGES]


def _processed(tokenizer, texts: list[str], images: list, **padding) -> dict[str, torch.Tensor]:
    """The model's processor on ``texts`` (``<image>`` in place of its image token) and ``images``."""
    processor = processor_for(tokenizer.name_or_path)
    token = getattr(processor, "image_token", None) or IMAGE_PLACEHOLDER
    if token != IMAGE_PLACEHOLDER:
        texts = [t.replace(IMAGE_PLACEHOLDER, token) for t in texts]
    enc = processor(text=texts, images=[load_image(image) for image in images], return_tensors="pt",
                    add_special_tokens=False, **padding)
    extra = sorted(set(enc) - {*_TEXT_KEYS, IMAGES})
    if extra:
        raise ConfigError(f"the model's processor ({type(processor).__name__}) gives image inputs roll does not pass "
                          f"on yet ({', '.join(extra)}); roll takes models whose images are pixel_values alone "
                          f"(LLaVA-style)")
    return enc


def stack_images(per_sample: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Samples' images (``[k_b, C, H, W]`` each, None for none) as the batch's ``pixel_values``
    ``[B, K, C, H, W]``, zero past each sample's own, and ``image_counts`` ``[B]``; nothing when no
    sample has any."""
    present = [p for p in per_sample if p is not None and len(p)]
    if not present:
        return {}
    counts = torch.tensor([0 if p is None else len(p) for p in per_sample], dtype=torch.long)
    pixels = present[0].new_zeros(len(per_sample), int(counts.max()), *present[0].shape[1:])
    for b, p in enumerate(per_sample):
        if p is not None and len(p):
            pixels[b, :len(p)] = p
    return {IMAGES: pixels, IMAGE_COUNTS: counts}


def with_image_fields(parts: list[dict[str, torch.Tensor]], rows: list[int]) -> list[dict[str, torch.Tensor]]:
    """The tensors of a batch's ``parts`` (of ``rows`` samples each), each given the image fields
    another part has: ``pixel_values`` with no image (``[n, 0, C, H, W]``) for a part of text
    prompts, ``image_counts`` for a part without them (all of its images real, or none). Where no
    part has images, the parts as they are."""
    pixels = next((part[IMAGES] for part in parts if IMAGES in part), None)
    if pixels is None:
        return parts
    out = []
    for part, n in zip(parts, rows):
        part = dict(part)
        if IMAGES not in part:
            part[IMAGES] = pixels.new_zeros(n, 0, *pixels.shape[2:])
        if IMAGE_COUNTS not in part:
            part[IMAGE_COUNTS] = torch.full((n,), part[IMAGES].shape[1], dtype=torch.long)
        out.append(part)
    return out


def model_images(images: torch.Tensor | None, device: torch.device | None = None,
                 counts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The keyword a model pass takes ``[B, K, C, H, W]`` images by (``pixel_values``, ``[B * K, C, H, W]``
    in the order their image tokens come), or nothing for a text-only batch; with ``counts`` ``[B]``
    (``image_counts``) only each sample's first ``counts[b]``."""
    if images is None:
        return {}
    if counts is None:
        flat = images.flatten(0, 1)
    else:
        flat = images[torch.arange(images.shape[1], device=images.device)[None, :] < counts.to(images.device)[:, None]]
        if not len(flat):  # text samples only (a micro-batch of a mixed batch): no image pass at all
            return {}
    return {IMAGES: flat if device is None else flat.to(device)}


def batch_images(batch, config=None) -> torch.Tensor | None:
    """``batch``'s images ``[B, K, C, H, W]``, or None for a text-only batch. With the model's
    ``config``, a batch whose prompts hold its image token but carry no images is an error: the
    model would read the image tokens as plain tokens and compute without a word of complaint."""
    if IMAGES in batch:
        return batch[IMAGES]
    image_id = getattr(config, "image_token_id", None)
    if image_id is not None and bool((batch["prompt_ids"] == image_id).any()):
        raise RollError(f"the batch's prompts hold the model's image token ({image_id}) but the batch carries no "
                        f"'{IMAGES}'; build prompt batches with roll_core.multimodal.encode_prompts")
    return None


def image_token_id(tokenizer) -> int | None:
    """The id of the tokenizer's ``<image>`` token (None for a text model's tokenizer)."""
    special = tokenizer.all_special_tokens
    return tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER) if IMAGE_PLACEHOLDER in special else None


def readable(tokenizer, ids: Sequence[int], per_image: int | None = None, **decode) -> str:
    """``tokenizer.decode(ids, **decode)`` with each image's tokens shown as one ``<image>``:
    transcripts and rollout dumps. Adjacent images (no text between) make one run of image tokens,
    shown as ``len(run) // per_image`` placeholders, ``per_image`` being each image's token count
    (:func:`tokens_per_image`); as one where it is not given."""
    image_id = image_token_id(tokenizer)
    if image_id is None or image_id not in ids:
        return tokenizer.decode(ids, **decode)
    runs = [(is_image, list(run)) for is_image, run in itertools.groupby(ids, key=lambda i: i == image_id)]
    return "".join(IMAGE_PLACEHOLDER * max(1, len(run) // (per_image or len(run))) if is_image
                   else tokenizer.decode(run, **decode) for is_image, run in runs)


def tokens_per_image(tokenizer, ids: Sequence[int], images: int) -> int | None:
    """How many image tokens each of the ``images`` images in ``ids`` has (the model's processor
    gives every image as many: LLaVA-style models); None without images."""
    image_id = image_token_id(tokenizer)
    if not images or image_id is None:
        return None
    return sum(1 for i in ids if i == image_id) // images or None


def image_counts(batch) -> torch.Tensor | None:
    """``batch``'s ``image_counts`` ``[B]``, or None where every sample has all of its ``pixel_values``."""
    return batch[IMAGE_COUNTS] if IMAGE_COUNTS in batch else None


def sample_image_counts(batch) -> list[int] | None:
    """How many images each sample of ``batch`` holds (None for a batch without images)."""
    if IMAGES not in batch:
        return None
    counts = image_counts(batch)
    return counts.tolist() if counts is not None else [batch[IMAGES].shape[1]] * len(batch)


def image_keys(images: torch.Tensor) -> torch.Tensor:
    """``[B]``: one integer per sample, equal exactly where two samples have the same images. With the
    prompt's tokens it tells which samples share a prompt (one prefill, one packed prompt)."""
    return torch.unique(images.flatten(1), dim=0, return_inverse=True)[1]
