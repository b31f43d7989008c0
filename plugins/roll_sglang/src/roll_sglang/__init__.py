"""roll-sglang: SGLang as roll's inference engine (``roles.actor_infer.strategy: sglang``).

Installed, it registers the ``sglang`` inference strategy through the ``roll`` entry point without
importing SGLang, so ``roll list-plugins`` works where the engine is missing (any machine without
CUDA). The engine is imported when a worker builds the strategy.
"""

__version__ = "0.1.0"

#: SGLang releases this plugin is written against; others get a warning when the engine starts.
SUPPORTED_SGLANG = (">=0.5.23", "<0.6")
