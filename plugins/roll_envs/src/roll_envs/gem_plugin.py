"""The ``gem`` plugin of roll-envs: every GEM environment as ``gem:<id>`` (see ``gem_adapter``),
registered only when ``gem-llm`` is installed (``pip install "roll-envs[gem]"``)."""

import importlib.util

from roll_core import hookimpl


@hookimpl
def roll_register_envs(register):
    if importlib.util.find_spec("gem") is None:
        return
    from roll_envs.gem_adapter import gem_env_class, gem_ids

    for gem_id in gem_ids():
        register(f"gem:{gem_id}", gem_env_class(gem_id), description=f"GEM's {gem_id} (gem-llm)")
