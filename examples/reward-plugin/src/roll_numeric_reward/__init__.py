"""roll-numeric-reward: an example third-party reward plugin for roll (see docs/tutorial-reward-plugin.md)."""
