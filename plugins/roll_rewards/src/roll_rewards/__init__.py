"""roll-rewards: verifiable rewards for roll (math answers with math-verify, code in a sandbox).

Installed, it registers its rewards through the ``roll`` entry point; ``roll list-plugins`` shows
them and a config selects one with ``roles.reward.name``.
"""

__version__ = "0.1.0"
