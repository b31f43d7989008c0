"""roll's built-in plugins. They register exactly as a third-party plugin would (hooks + lazy
targets), and are listed by ``roll list-plugins`` with the distribution ``roll-core``.
Importing these modules must stay cheap: no torch, no transformers at import time."""
