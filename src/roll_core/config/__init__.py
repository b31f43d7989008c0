"""Run configuration: schema (:mod:`.schema`) and loading/validation (:mod:`.loader`)."""

from roll_core.config.loader import check_registry_names, load_and_check, load_config
from roll_core.config.schema import RollConfig

__all__ = ["RollConfig", "load_config", "load_and_check", "check_registry_names"]
