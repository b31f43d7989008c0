"""Loading Hugging Face models for the strategies built on transformers (``hf``, ``fsdp2``, and
plugins that start from the same weights): one place for dtype, device and the value head."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from roll_core.data import Batch
from roll_core.files import replace_dir


def default_device() -> torch.device:
    """The first visible GPU when there is one (a worker sees only its mapped devices), else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def safetensors_files(model_path: str) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint: its one file, or those its index names."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        return [root / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [root / "model.safetensors"]


def load_causal_lm(model_path: str, device: torch.device | None = None) -> Any:
    """``AutoModelForCausalLM`` in float32 on ``device`` (CPU when None); an image-text model
    (a config with a ``vision_config``) as ``AutoModelForImageTextToText``, which generates text too."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model: Any = auto.from_pretrained(model_path, config=config, dtype=torch.float32)
    return model.to(device or torch.device("cpu"))


VALUE_HEAD = "score"  # the value model's head module, as transformers' ...ForTokenClassification names it


def load_value_model(model_path: str, device: torch.device, seed: int) -> Any:
    """A causal LM checkpoint as ``AutoModelForTokenClassification`` with one label: the backbone
    starts from the checkpoint and a fresh linear head (:func:`fresh_value_head`) gives ``V(s_t)``
    per token. A value model's own checkpoint keeps its trained head. An image-text checkpoint
    loads as roll's own such model for it (:mod:`roll_core.strategies.image_value_model`).

    The load runs in a forked global RNG, so the driver's RNG (``local`` executor) is untouched. The
    head's dropout (transformers defaults it to 0.1) is off: the values the update regresses must
    be the ones computed at rollout time, and accumulating micro-batches must not change them."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    with _expected_reports(), torch.random.fork_rng(devices=[]):  # "score head newly initialised"
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0
        auto: Any = AutoModelForTokenClassification
        if getattr(config, "vision_config", None) is not None:
            from roll_core.strategies import image_value_model

            auto = image_value_model.LlavaForTokenClassification
        model, loading = auto.from_pretrained(model_path, config=config, dtype=torch.float32,
                                              output_loading_info=True)
    text = config.get_text_config()
    head = fresh_value_head(text.hidden_size, text.initializer_range, seed)
    parameters = dict(model.named_parameters())
    drawn = {name: head.get(name.rsplit(".", 1)[1]) for name in loading["missing_keys"]}  # a causal LM has no head
    absent = sorted(name for name, value in drawn.items() if value is None or value.shape != parameters[name].shape)
    if absent:
        raise ValueError(f"{model_path} lacks weights a value model needs beyond its new head: {absent[:5]}")
    with torch.no_grad():
        for name, value in drawn.items():
            parameters[name].copy_(value)
    return model.to(device)


def fresh_value_head(hidden_size: int, std: float, seed: int) -> dict[str, torch.Tensor]:
    """A value model's new one-label head: ``weight`` ``[1, H]`` drawn from N(0, std^2) by a
    generator of its own seeded with ``seed``, ``bias`` ``[1]`` zero (transformers' draw for a new
    linear layer, ``std`` being the checkpoint's ``initializer_range``). One definition for every
    strategy that hosts a critic, so a seed gives the same head on ``hf`` and on roll-megatron. With
    transformers 5.24 it is bitwise the head that transformers drew from the global RNG seeded with
    ``seed``, which ``load_value_model`` relied on before; now no transformers release can change it."""
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(1, hidden_size, generator=generator) * std, "bias": torch.zeros(1)}


def export_sequence_classifier(value_model: Path, out: Path, tokenizer) -> None:
    """A value model's checkpoint (:func:`load_value_model`'s ``...ForTokenClassification``, one
    label) as ``...ForSequenceClassification`` at ``out``, with ``tokenizer``: the same backbone and
    head weights, the head's bias left out, and the padding id set so that batched scoring finds each
    row's last token. Written whole or not at all (a directory beside ``out``, renamed over it)."""
    from transformers import AutoModelForSequenceClassification

    with _expected_reports():  # "score.bias was not used": it is left out on purpose
        model = AutoModelForSequenceClassification.from_pretrained(value_model, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    replace_dir(partial, out)


@contextlib.contextmanager
def _expected_reports() -> Iterator[None]:
    """transformers' warnings off within the block, for the reports a head swap makes (a head newly
    initialised, a head's weight unused); its verbosity as it was after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def full_sequence(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-then-response ids and attention mask ``[B, P + R]``."""
    ids = torch.cat([batch["prompt_ids"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    return ids, mask
