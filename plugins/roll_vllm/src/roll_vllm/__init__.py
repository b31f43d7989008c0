"""roll-vllm: vLLM as roll's inference engine (``roles.actor_infer.strategy: vllm``).

Installed, it registers the ``vllm`` inference strategy through the ``roll`` entry point, without
importing vLLM (``roll list-plugins`` stays fast and works where the engine is missing). The engine
is imported when a worker builds the strategy, and by ``roll validate``, which imports every target
a config names.
"""

__version__ = "0.1.0"

#: vLLM releases this plugin is tested against; others get a warning when the engine starts.
SUPPORTED_VLLM = (">=0.32", "<0.33")
