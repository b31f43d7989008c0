"""Pipeline interface. A pipeline is the single controller: it owns the loop and drives the roles."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Pipeline(ABC):
    """Constructed as ``cls(config, executor)``; ``run()`` returns a summary dict. ``phase`` says
    what it is doing now (``roll run`` names it when interrupted)."""

    #: Whether the pipeline scores held-out generations with ``roles.eval_reward`` (rlvr does); a
    #: config that sets the role for a pipeline that does not is refused.
    reads_eval_reward = False
    #: The pipeline-specific config sections (:data:`~roll_core.config.schema.PIPELINE_SECTIONS`)
    #: the pipeline reads; None (a pipeline that does not say): all of them. A resume compares the
    #: saved config with the new one only where the pipeline reads it (:meth:`resume_view`).
    config_sections: frozenset[str] | None = None

    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        """What this pipeline cannot run in ``cfg``, one ``key '...': why (and the fix)`` line each.

        The config schema checks what holds for every pipeline; a pipeline checks here what is its
        own (rollout sizes it needs, sections it does not read), so a third-party pipeline's checks
        run where the built-in ones do: ``roll validate`` and ``roll run`` report them with the rest
        before any worker starts. ``plugins`` gives the registries (a registered loss's flags).
        Keep it cheap and side-effect free: no files, models or workers. A subclass extends its
        parent's list (``super().config_problems(cfg, plugins) + [...]``)."""
        if cfg.roles.eval_reward is not None and not cls.reads_eval_reward:
            return [f"key 'roles.eval_reward': pipeline {cfg.pipeline} evaluates without a reward, so the role "
                    f"would never be read (set roles.eval_reward=null)"]
        return []

    def __init__(self, config, executor):
        self.config, self.executor = config, executor
        self.phase = "start-up"

    @classmethod
    def starts_reference(cls, cfg, plugins) -> bool:
        """Whether a run starts ``roles.reference`` (where configured). A pipeline that reads it
        only under some settings says so, so that an unread reference costs no workers, and the
        placement (whether the controller can run inside the one worker) agrees with the run."""
        return cfg.roles.reference is not None

    @classmethod
    def resume_view(cls, flat: dict[str, Any], plugins) -> dict[str, Any]:
        """A config flattened to ``{"dpo.beta": 0.1, ...}`` (a checkpoint's, or the new run's), as far
        as it decides what this pipeline's run is: the resume guard compares the two through it, so
        a section the pipeline does not read (``dpo.*`` in an rlvr run) never refuses a resume. A
        pipeline whose keys have a null meaning "as something else says" resolves them here (a run
        saved with the resolved value then resumes under the null). ``plugins``: the registries."""
        from roll_core.config.schema import PIPELINE_SECTIONS

        unread = PIPELINE_SECTIONS - (PIPELINE_SECTIONS if cls.config_sections is None else cls.config_sections)
        return {key: value for key, value in flat.items() if key.split(".", 1)[0] not in unread}

    def resume_hint(self) -> str:
        """Where a run stopped now would resume from (pipelines with checkpoints say more)."""
        return "the start"

    @abstractmethod
    def run(self) -> dict[str, Any]: ...
