"""The embedded tiny model: a small transformers causal LM with a character-level tokenizer.

Why: no machine roll is tested on can download weights from a hub, yet every pipeline must run
end to end on real transformers code. ``build_tiny_model`` writes an ordinary Hugging Face model
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``) that ``AutoModelForCausalLM``
and ``AutoTokenizer`` load like any checkpoint, so the strategies never special-case it. A user with
GPUs points ``model.path`` at a real checkpoint and nothing else changes.

The tokenizer is a ``tokenizers`` WordLevel model over printable ASCII with a pre-tokenizer that
splits every character, so it needs no custom Python code to load.

With ``model.tiny.vision`` the model reads images too: a LLaVA model (``AutoModelForImageTextToText``)
whose SigLIP encoder turns each image into one feature per patch, projected into the decoder's
width, standing where the prompt's image tokens are. The directory then holds its processor
(``processor_config.json``: the tokenizer with an ``<image>`` token and a PIL-based SigLIP image
processor, so no torchvision is needed), as real LLaVA checkpoints do.

Run by hand::

    python -m roll_core.embedded.model /tmp/tiny   # then AutoModelForCausalLM.from_pretrained("/tmp/tiny")
"""

from __future__ import annotations

import os
import shutil
import string
import sys
from pathlib import Path

from roll_core.config.schema import TinyModelConfig  # its shape is config (model.tiny); re-exported here

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
IMAGE = "<image>"  # the image-reading variant's image token (roll_core.multimodal.IMAGE_PLACEHOLDER)
# Printable ASCII without the whitespace controls, plus a plain space: enough for arithmetic,
# code-like tasks and short natural-language prompts.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


def build_char_tokenizer():
    """A ``PreTrainedTokenizerFast`` that maps every printable ASCII character to one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=PAD,
        padding_side="left",
        model_max_length=4096,
    )


def tiny_architecture(config: TinyModelConfig | None = None, tokenizer=None):
    """The tiny model's ``LlamaConfig`` (its shape, no weights) for ``model.tiny``'s settings."""
    from transformers import LlamaConfig

    config = config or TinyModelConfig()
    tokenizer = tokenizer or build_char_tokenizer()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )


def tiny_vision_architecture(config: TinyModelConfig, tokenizer):
    """The image-reading variant's ``LlavaConfig`` (``config.vision`` set; ``tokenizer`` has ``<image>``)."""
    from transformers import LlavaConfig, SiglipVisionConfig

    vision = config.vision
    assert vision is not None
    tower = SiglipVisionConfig(hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                               num_hidden_layers=vision.num_layers, num_attention_heads=vision.num_heads,
                               image_size=vision.image_size, patch_size=vision.patch_size, num_channels=3)
    text = tiny_architecture(config, tokenizer)
    return LlavaConfig(vision_config=tower, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
                       image_seq_length=(vision.image_size // vision.patch_size) ** 2, projector_hidden_act="gelu",
                       vision_feature_select_strategy="full", vision_feature_layer=-1, tie_word_embeddings=True)


def _tiny_processor(config: TinyModelConfig, tokenizer):
    """The image-reading variant's processor: ``<image>`` repeated once per patch, images resized to
    ``image_size`` and scaled to [-1, 1]."""
    from transformers import LlavaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    vision = config.vision
    assert vision is not None
    images = SiglipImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size},
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=vision.patch_size,
                          vision_feature_select_strategy="full", image_token=IMAGE, num_additional_image_tokens=0)


def build_tiny_model(path: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Create (or reuse) the tiny model at ``path`` and return the directory.

    The directory is written atomically: a crash half-way never leaves a directory that looks
    complete. An existing complete directory is reused, so every role and every resume loads
    the very same initial weights.
    """
    import torch
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    config = config or TinyModelConfig()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    tokenizer = build_char_tokenizer()
    if config.vision is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    # A private generator keeps model init independent of whatever else used the global RNG.
    fork_devices: list = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(config.init_seed)
        model: LlamaForCausalLM | LlavaForConditionalGeneration
        if config.vision is None:
            model = LlamaForCausalLM(tiny_architecture(config, tokenizer))
        else:
            model = LlavaForConditionalGeneration(tiny_vision_architecture(config, tokenizer))
    # Per-process temporary name: concurrent builders (tests, workers) never clobber each other,
    # and whichever finishes first wins the rename.
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if config.vision is not None:
        _tiny_processor(config, tokenizer).save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":  # pragma: no cover - manual entry point
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
