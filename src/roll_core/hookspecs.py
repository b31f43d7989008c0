"""Every hook roll calls, in one place. Plugins implement them with ``@roll_core.hookimpl``.

Conventions (enforced by ``tests/test_hookspecs.py``):
  * every hook is prefixed ``roll_`` and has a docstring saying when it is called, its arguments and
    what it returns;
  * registration hooks receive a ``register`` callback instead of returning lists (as simonw/llm and
    tox do), so a plugin can register any number of things, lazily, with metadata;
  * hooks only ever *gain* arguments; an implementation may accept any subset of a hook's arguments
    (pluggy's opt-in arguments), so old plugins keep working when a hook grows.

``register(name, target, *, description="", **metadata)``: ``target`` is the object itself or a lazy
``"package.module:attribute"`` string, imported the first time a run asks for ``name``. Prefer the
string: ``roll list-plugins`` then never imports your heavy dependencies.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "roll"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


@hookspec
def roll_register_strategies(register):
    """Register training and inference strategies (backends such as ``hf``, ``vllm``, ``megatron``).

    Called once per process when the plugin registries are built (driver and every worker).

    Args:
        register: ``register(name, target, *, kind, description="")`` where ``kind`` is ``"train"``
            (a :class:`roll_core.strategy.TrainStrategy`: forward/backward/optimizer, log-probs),
            ``"infer"`` (a :class:`roll_core.strategy.InferStrategy`: generation and log-probs) or
            ``"critic"`` (a :class:`roll_core.strategy.CriticStrategy`: PPO's value model).
            The same name may be registered once per kind. ``options=Model`` (a pydantic model or
            its import path) validates ``roles.<role>.strategy_options``, the engine's arguments
            (a method ``check_role(role_config) -> list[str]`` on it reports what needs the rest of
            the role, such as a parallel layout that does not divide ``num_workers``);
            ``requires={"module": "how to install it"}`` names the engine packages the strategy
            imports when it starts: a config naming the strategy where one is missing is rejected
            by ``roll validate`` with that hint, and ``roll check-plugin`` skips its checks with it
            (registration itself imports nothing);
            ``generates=False`` marks an inference strategy that computes log-probs only (a
            reference or teacher role), which ``roll validate`` refuses for ``roles.actor_infer``.

    Returns: nothing.
    """


# ---------------------------------------------------------------------------------------------
# Algorithms
# ---------------------------------------------------------------------------------------------


@hookspec
def roll_register_advantage_estimators(register):
    """Register advantage estimators (``grpo``, ``reinforce_plus_plus``, ...).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="", needs=())``; ``target`` is a callable
            ``fn(batch: AdvantageInput, config: AlgorithmConfig) -> (advantages [B, R], returns [B, R])``
            (see :mod:`roll_core.algorithms.advantages`). ``needs`` names the roles it reads
            (``"critic"`` for values, ``"reference"`` for teacher log-probs); a config that uses
            the estimator without them is rejected before any worker starts. An estimator that
            reads ``old_log_probs`` registers with ``reads_old_log_probs=True``, so the pipeline
            always computes them before the update (see ``algorithm.old_log_probs``). One that
            compares the samples of a prompt's group (a group baseline) registers with
            ``group_baseline=True``, and a config with groups of one sample (or, in ``rlvr``, greedy
            sampling, which makes them all the same) is rejected. Settings of
            its own: ``options=Model`` as for policy losses, set under
            ``algorithm.advantage_estimator_options``.

    Returns: nothing.
    """


@hookspec
def roll_register_policy_losses(register):
    """Register policy losses (``ppo_clip``, ``gspo``, ...).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a callable
            ``fn(inputs: PolicyLossInput, config: AlgorithmConfig) -> (loss_matrix [B, R], metrics)``
            returning the per-token loss, aggregated later by ``config.loss_agg_mode``
            (see :mod:`roll_core.algorithms.losses`). Pass ``options=Model`` (a pydantic model,
            or its ``"pkg.mod:Model"`` target) for a loss with settings of its own: users set them
            under ``algorithm.policy_loss_options``, ``roll validate`` checks them against the model
            (a misspelled name gets a did-you-mean), and the loss is called with ``options=`` the
            validated instance.

    Returns: nothing.
    """


@hookspec
def roll_register_preference_losses(register):
    """Register preference losses for pairs of responses (``dpo_sigmoid``, ``ipo``, ...).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="", reads_reference=True,
            average_log_probs=False)``;
            ``target`` is a callable ``fn(inputs: PreferenceInput, *, beta, label_smoothing,
            **options) -> (loss [B], metrics)`` taking the sequence log-probs of the chosen and
            rejected responses under the policy and the reference, one loss per pair (see
            :mod:`roll_core.algorithms.preference`); ``options`` are its own keyword parameters,
            set with ``dpo.loss_options``. A loss that ignores the reference registers with
            ``reads_reference=False``, and no reference role is started for it. A loss defined on
            per-token mean log-probs (SimPO) registers ``average_log_probs=True``: the default of
            ``dpo.average_log_probs`` (null) then takes means for it, sums for the others.

    Returns: nothing.
    """


@hookspec
def roll_register_distill_losses(register):
    """Register knowledge-distillation objectives (``forward_kl``, ``reverse_kl``, ``jsd``, ...).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a callable
            ``fn(student_logp [B, R, K], teacher_logp [B, R, K], **options) -> loss [B, R]``: a
            per-token divergence between two log-distributions over the same support (the
            vocabulary or the teacher's top-k; see :mod:`roll_core.algorithms.distill`). Keyword
            options (such as ``alpha``) come from the pipeline's configuration.

    Returns: nothing.
    """


@hookspec
def roll_register_kl_estimators(register):
    """Register KL estimators (``k1``, ``k2``, ``k3``, ...).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a callable
            ``fn(log_prob [B, R], ref_log_prob [B, R]) -> kl [B, R]`` (see :mod:`roll_core.algorithms.kl`).
            Pass ``distribution=True`` for an estimator that takes full log-distributions
            ``[B, R, V]`` instead of the sampled tokens' log-probs.

    Returns: nothing.
    """


# ---------------------------------------------------------------------------------------------
# Tasks: data, rewards, environments
# ---------------------------------------------------------------------------------------------


@hookspec
def roll_register_datasets(register):
    """Register built-in data sources (tasks whose rows roll generates, such as ``carry_addition``).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a factory called with
            the config's ``data.options`` dict, returning an object with ``train_rows()`` and ``eval_rows()``, each a list of dicts
            with at least ``prompt`` and ``ground_truth`` (see :mod:`roll_core.data`).

    Returns: nothing.
    """


@hookspec
def roll_register_rewards(register):
    """Register reward functions (``exact_match``, math or code verifiers, judges).

    Called once per process when the plugin registries are built, including inside reward workers.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a
            :class:`roll_core.rewards.Reward` subclass (or a factory returning one) constructed with the
            options from the config.

    Returns: nothing.
    """


@hookspec
def roll_register_envs(register):
    """Register environments for agentic, multi-turn RL (GEM-style ``reset``/``step``).

    Called once per process when the plugin registries are built, including inside env workers.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a
            :class:`roll_core.envs.Env` subclass (or factory) constructed with the config's options.

    Returns: nothing.
    """


# ---------------------------------------------------------------------------------------------
# Orchestration and observability
# ---------------------------------------------------------------------------------------------


@hookspec
def roll_register_schedulers(register):
    """Register rollout schedulers (how prompts become scored groups of samples).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="", overlaps_training=False)``; ``target``
            is a :class:`roll_core.rollout.RolloutScheduler` subclass. ``overlaps_training=True``
            says that it generates while the policy trains (disjoint devices, queued weight updates).

    Returns: nothing.
    """


@hookspec
def roll_register_weight_syncs(register):
    """Register weight-sync backends (how trained weights reach the inference engines).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a
            :class:`roll_core.runtime.weight_sync.WeightSync` subclass, chosen with ``runtime.weight_sync``.

    Returns: nothing.
    """


@hookspec
def roll_register_trackers(register):
    """Register metric trackers (``stdout``, ``jsonl``, ``tensorboard``, ...).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="", requires={})``; ``target`` is a
            :class:`roll_core.trackers.Tracker` subclass constructed as ``cls(run_dir, options)``.
            ``requires={"module": "how to install it"}`` names the service's client package, as
            for strategies: ``roll validate`` rejects a config listing the tracker where it is
            missing, and ``roll check-plugin`` skips it.

    Returns: nothing.
    """


@hookspec
def roll_register_pipelines(register):
    """Register pipelines (``rlvr``; later SFT, DPO, agentic, distillation).

    Called once per process when the plugin registries are built.

    Args:
        register: ``register(name, target, *, description="")``; ``target`` is a
            :class:`roll_core.pipelines.Pipeline` subclass constructed as ``cls(config, executor)``.
            Its classmethod ``config_problems(cfg, plugins)`` lists what it cannot run in a config
            (``roll validate`` and ``roll run`` report it with the rest, before any worker starts);
            ``reads_eval_reward`` and ``starts_reference`` say which optional roles it reads,
            ``config_sections`` which pipeline-only sections (a resume compares only those);
            ``generates_while_training``, ``environments``, ``generating_roles`` and
            ``describe_task`` answer the placement, the config checks and the run line.

    Returns: nothing.
    """
