"""Pipeline interface. A pipeline is the single controller: it owns the loop and drives the roles."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable


class Pipeline(ABC):
    """Constructed as ``cls(config, executor)``; ``run()`` returns a summary dict. ``phase`` says
    what it is doing now (``roll run`` names it when interrupted).

    The class attributes and classmethods answer, before any instance or worker exists, what the
    config checks, the placement, the resume guard and the run line need to know of the pipeline;
    the defaults are rlvr-like, and a pipeline overrides where it differs."""

    #: Whether the pipeline scores held-out generations with ``roles.eval_reward`` (rlvr does); a
    #: config that sets the role for a pipeline that does not is refused.
    reads_eval_reward = False
    #: The pipeline-specific config sections (:data:`~roll_core.config.schema.PIPELINE_SECTIONS`)
    #: the pipeline reads; None (a pipeline that does not say): all of them. A resume compares the
    #: saved config with the new one only where the pipeline reads it (:meth:`resume_view`).
    config_sections: frozenset[str] | None = None
    #: The setting that makes the pipeline's rollout generate while the policy trains, as
    #: :meth:`generates_while_training` reads it (named where ``rollout.async_generation_ratio`` needs it).
    overlap_setting = "rollout.scheduler: async"
    #: ``(cfg, plugins) -> (loss_fn, UpdateSpec)``: actor_train's update on a step's training batch,
    #: the batch ``trainer.dump_rollouts_every`` dumps, so ``roll replay`` can train a dumped batch
    #: again as the run did. None: the pipeline's dumps are not one such update's batch (online_dpo
    #: dumps its preference pairs).
    policy_update: Callable[[Any, Any], tuple[Any, Any]] | None = None

    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        """What this pipeline cannot run in ``cfg``, one ``key '...': why (and the fix)`` line each.

        The config schema checks what holds for every pipeline; a pipeline checks here what is its
        own (rollout sizes it needs, sections it does not read), so a third-party pipeline's checks
        run where the built-in ones do: ``roll validate`` and ``roll run`` report them with the rest
        before any worker starts. ``plugins`` gives the registries (a registered loss's flags).
        Keep it cheap and side-effect free: no files, models or workers. A subclass extends its
        parent's list (``super().config_problems(cfg, plugins) + [...]``)."""
        problems = []
        if cfg.roles.eval_reward is not None and not cls.reads_eval_reward:
            problems.append(f"key 'roles.eval_reward': pipeline {cfg.pipeline} evaluates without a reward, so the "
                            f"role would never be read (set roles.eval_reward=null)")
        if cfg.rollout.async_generation_ratio > 0 and cls.generates_while_training(cfg, plugins) is None:
            problems.append(f"key 'rollout.async_generation_ratio': > 0 bounds how far generation runs ahead of "
                            f"training, which needs {cls.overlap_setting} (or set it to 0)")
        return problems

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
    def generates_while_training(cls, cfg, plugins) -> str | None:
        """Why actor_infer may generate while actor_train updates the policy (None: every rollout
        waits for the update): by default the rollout scheduler's registration (``async``). The
        placement reads it (no shared devices, no in-process weights, no hybrid engine), as does
        the check that ``rollout.async_generation_ratio`` has something to bound."""
        from roll_core.errors import RegistryError
        from roll_core.rollout import overlaps_training

        try:
            overlaps = overlaps_training(cfg.rollout.scheduler, plugins)
        except RegistryError:  # an unknown name is reported by the registry-name check
            return None
        return f"the '{cfg.rollout.scheduler}' scheduler generates while the policy trains" if overlaps else None

    @classmethod
    def environments(cls, cfg) -> list:
        """The environments a run plays (``EnvSettings``; ``agentic``: ``agentic.envs``), whose
        names and options the config checks cover and whose workers run in processes of their own."""
        return []

    @classmethod
    def generating_roles(cls, cfg) -> list[str]:
        """The roles that generate with the rollout's sampling settings (``distill`` adds its
        teacher when the teacher writes the responses)."""
        return ["actor_infer"]

    @classmethod
    def planned_steps(cls, cfg) -> int:
        """The steps a run makes (``trainer.max_steps``; ``sft`` makes ``warmup.steps``): what the
        ``roll run`` line, the progress display and the loop count to."""
        return cfg.trainer.max_steps

    @classmethod
    def describe_task(cls, cfg) -> str:
        """What the run trains on, for the line ``roll run`` starts with."""
        return f"data {cfg.data.train_file or ', '.join(cfg.data.domains) or cfg.data.dataset}"

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


def pipeline_class(cfg, plugins=None) -> type[Pipeline]:
    """The class-level answers of the run's pipeline (``config_problems``, ``starts_reference``,
    ``environments``, ...): its registered class, or :class:`Pipeline`'s defaults for a name that
    is not registered (reported by the registry-name check) and for a registered class that only
    has the ``cls(config, executor).run()`` shape of one."""
    from roll_core.plugins import get_plugins

    return pipeline_named(cfg.pipeline, plugins or get_plugins())


def pipeline_named(name: str, plugins) -> type[Pipeline]:
    """:func:`pipeline_class` by registered name (a name whose plugin fails to import gets the
    defaults too; ``roll list-plugins`` reports the plugin)."""
    from roll_core.errors import RegistryError

    try:
        cls = plugins.pipelines.get(name)
    except RegistryError:
        return Pipeline
    return cls if isinstance(cls, type) and issubclass(cls, Pipeline) else Pipeline
