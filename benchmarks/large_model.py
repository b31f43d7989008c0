"""The benchmarks' "large" model: the embedded architecture at about 95M parameters (hidden 768,
10 layers, 12 heads, random weights), where model compute rather than framework overhead dominates a
step. Built locally, like the tiny one; ``vs_trl.py``, ``step_profile.py`` and ``bench_sampling.py``
share it so their numbers describe the same model."""

from pathlib import Path

from roll_core.config.schema import TinyModelConfig
from roll_core.embedded.model import build_tiny_model

SHAPE = TinyModelConfig(hidden_size=768, num_layers=10, num_heads=12, intermediate_size=3072,
                        max_position_embeddings=256)


def build_large_model(directory: str | Path) -> Path:
    return build_tiny_model(Path(directory) / "large", SHAPE)
