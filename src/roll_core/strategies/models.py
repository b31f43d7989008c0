"""Loading Hugging Face models for the strategies built on transformers (``hf``, ``fsdp2``, and
plugins that start from the same weights): one place for dtype, device and the value head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from roll_core.data import Batch


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
    """``AutoModelForCausalLM`` in float32 on ``device`` (CPU when None)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to(device or torch.device("cpu"))


def load_value_model(model_path: str, device: torch.device, seed: int) -> Any:
    """A causal LM checkpoint as ``AutoModelForTokenClassification`` with one label: the backbone
    starts from the checkpoint and a fresh linear head gives ``V(s_t)`` per token.

    The new head is initialised from a forked global RNG seeded with ``seed``, so the driver's RNG
    (``local`` executor) is untouched and the head is the same for a seed in any executor. The
    head's dropout (transformers defaults it to 0.1) is off: the values the update regresses must
    be the ones computed at rollout time, and accumulating micro-batches must not change them."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "score head newly initialised" report is expected
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            config = AutoConfig.from_pretrained(model_path, num_labels=1)
            config.classifier_dropout = 0.0
            model: Any = AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device)


def full_sequence(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-then-response ids and attention mask ``[B, P + R]``."""
    ids = torch.cat([batch["prompt_ids"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    return ids, mask
