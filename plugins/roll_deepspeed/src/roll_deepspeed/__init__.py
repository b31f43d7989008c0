"""roll-deepspeed: DeepSpeed ZeRO as roll's training backend (``roles.actor_train.strategy: deepspeed``).

Installed, it registers the ``deepspeed`` training and critic strategies through the ``roll`` entry
point without importing DeepSpeed (``roll list-plugins`` stays fast). DeepSpeed is imported when a
worker builds the strategy, and by ``roll validate`` when it checks ``strategy_options.zero_config``.
"""

__version__ = "0.1.0"

#: DeepSpeed releases this plugin is tested against; others get a warning when a strategy starts.
SUPPORTED_DEEPSPEED = (">=0.19.8", "<0.20")
