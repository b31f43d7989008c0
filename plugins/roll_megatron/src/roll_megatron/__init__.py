"""roll-megatron: Megatron-Core as roll's training backend."""

__version__ = "0.1.0"

#: megatron-core releases this plugin is tested against; others get a warning when a strategy starts.
SUPPORTED_MEGATRON = (">=0.16.1", "<0.17")
