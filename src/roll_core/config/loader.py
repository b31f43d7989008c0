"""Load a run config from YAML plus dotted ``key=value`` overrides, and check it before anything starts.

Every problem a user can make ends in one :class:`~roll_core.errors.ConfigError` whose message names
the key (and the file), says what is wrong and, for misspellings, suggests the right key or name:

    config error in exp.yaml: unknown key 'rollout.temprature'. Did you mean 'temperature'?
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from roll_core.config.schema import EnvSettings, InferRoleConfig, RollConfig
from roll_core.errors import ConfigError, RegistryError, did_you_mean


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model found at ``loc`` (``()`` = the top level)."""
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        nested = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


# Keys that moved: a config that still uses one is told where it went.
MOVED_KEYS = {"agentic.env_workers": "roles.env.num_workers", "agentic.env_worker_cpus": "roles.env.cpus",
              "agentic.envs_per_worker": "roles.env.envs_per_worker"}


def _own_role(loc: tuple) -> tuple[tuple, type[BaseModel] | None]:
    """``loc`` without the kind pydantic puts after a role of one's own (``roles.teacher.infer.lr``),
    and that role's model; other locations unchanged, with None."""
    from roll_core.config.schema import OWN_ROLE_MODELS, RolesConfig

    if len(loc) >= 3 and loc[0] == "roles" and loc[1] not in RolesConfig.model_fields and loc[2] in OWN_ROLE_MODELS:
        return loc[:2] + loc[3:], OWN_ROLE_MODELS[loc[2]]
    return loc, None


def _format_validation_error(exc: ValidationError, source: str) -> str:
    from roll_core.config.schema import OWN_ROLE_KINDS, RolesConfig

    own_kinds = ", ".join(OWN_ROLE_KINDS)
    lines = []
    for err in exc.errors():
        loc, own = _own_role(tuple(p for p in err["loc"]))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            fields = _fields_at(own, loc[2:-1]) if own is not None else _fields_at(RollConfig, loc[:-1])
            hint = f" It moved to '{MOVED_KEYS[key]}'." if key in MOVED_KEYS else did_you_mean(str(loc[-1]), fields)
            if not hint and fields:  # nothing close (data.path for data.train_file): name what is there
                where = f"'{'.'.join(str(p) for p in loc[:-1])}'" if loc[:-1] else "the config's top level"
                hint = f" The keys of {where}: {', '.join(fields)}."
            lines.append(f"unknown key '{key}'.{hint}")
        elif err["type"] == "union_tag_not_found" and loc[:1] == ("roles",) and len(loc) == 2:
            hint = did_you_mean(str(loc[1]), list(RolesConfig.model_fields))
            lines.append(f"unknown key '{key}'.{hint} A role of your own needs a kind: one of {own_kinds}")
        elif err["type"] == "union_tag_invalid" and loc[:1] == ("roles",) and len(loc) == 2:
            lines.append(f"key '{key}.kind': {err['input'].get('kind')!r} is not a kind of role of your own; use one "
                         f"of {own_kinds} (rewards are roles.reward and roles.domain_rewards)")
        elif err["type"] == "value_error" and not loc:  # a cross-check of the whole config: its message names the keys
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"key '{key}': {err['msg']} (got {err.get('input')!r})")
    return f"config error in {source}: " + "; ".join(lines)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping: PyYAML would keep the last
    one silently (``rollout:`` twice in a file drops the first section's settings)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': keys written after a merge may override it
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice in one mapping (lines {seen[key]} and {line}); "
                    "YAML would keep only the second", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"rollout.temperature=0.7"`` -> ``(["rollout", "temperature"], 0.7)`` (value parsed as YAML)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{item}' is not of the form key.sub=value")
    try:
        value = _yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': value is not valid YAML ({exc})") from None
    return key.strip().split("."), value


def mapping_value(where: str, text: str) -> dict:
    """``text`` read as a YAML mapping, as an override's value is (``'{size: 6}'``; JSON is YAML
    too); anything else is a one-line error naming ``where``."""
    try:
        value = _yaml(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML: {problem}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping such as '{{size: 6}}', got {text!r}")
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RollConfig:
    """Read ``path`` (None = defaults, the quickstart), apply overrides and validate the schema."""
    source = str(path) if path else "the default config"
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error in {p}: the file does not exist")
        try:
            data = _yaml(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config error in {p}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config error in {p}: the file must contain a mapping at the top level")
    if overrides:
        source += " (with command-line overrides)"
        data = apply_overrides(data, overrides)
    try:
        return RollConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def registry_references(cfg: RollConfig) -> list[tuple[str, str, str]]:
    """Every ``(config key, registry, name)`` the config refers to."""
    refs = [
        ("pipeline", "pipelines", cfg.pipeline),
        ("rollout.scheduler", "schedulers", cfg.rollout.scheduler),
        ("algorithm.advantage_estimator", "advantage_estimators", cfg.algorithm.advantage_estimator),
        ("algorithm.policy_loss", "policy_losses", cfg.algorithm.policy_loss),
        ("algorithm.kl_estimator", "kl_estimators", cfg.algorithm.kl_estimator),
        ("algorithm.kl_penalty.estimator", "kl_estimators", cfg.algorithm.kl_penalty.estimator),
        ("dpo.loss", "preference_losses", cfg.dpo.loss),
        ("distill.loss", "distill_losses", cfg.distill.loss),
        *[(f"roles.{name}.strategy", f"{role.kind}_strategies", role.strategy)
          for name, role in cfg.model_roles().items()],
    ]
    refs += [(f"{r.key}.name", "rewards", r.name) for _, entries in cfg.roles.reward_roles().values() for r in entries]
    if cfg.data.domains:
        refs += [(f"data.domains.{d}.dataset", "datasets", src.dataset)
                 for d, src in cfg.data.domains.items() if src.dataset is not None]
    elif cfg.data.train_file is None:
        refs.append(("data.dataset", "datasets", cfg.data.dataset))
    if cfg.runtime.weight_sync != "auto":
        refs.append(("runtime.weight_sync", "weight_syncs", cfg.runtime.weight_sync))
    refs += [(f"trackers[{i}]", "trackers", name) for i, name in enumerate(cfg.trackers)]
    refs += [(f"{e.key}.env", "envs", e.env) for e in _environments(cfg)]
    return refs


def _environments(cfg: RollConfig) -> list[EnvSettings]:
    """Every environment the run plays (its pipeline's ``environments``: the agentic pipeline's)."""
    from roll_core.pipelines import pipeline_class

    return pipeline_class(cfg).environments(cfg)


def _role_requirements(cfg: RollConfig, plugins) -> list[str]:
    """Estimators and losses declare the roles they need (``needs=("critic",)`` at registration);
    ``actor_infer`` needs a strategy that generates."""
    problems = []
    for key, registry, name in (
        ("algorithm.advantage_estimator", "advantage_estimators", cfg.algorithm.advantage_estimator),
        ("algorithm.policy_loss", "policy_losses", cfg.algorithm.policy_loss),
    ):
        try:
            needs = plugins.registry(registry).entry(name).metadata.get("needs", ())
        except RegistryError:
            continue  # already reported as an unknown name
        for role in needs:
            if getattr(cfg.roles, role) is None:
                problems.append(f"key '{key}': '{name}' needs roles.{role}, which is not configured")
    # an inference strategy registered with generates=False serves log-probs only (a reference)
    name = cfg.roles.actor_infer.strategy
    able = _registered_with(plugins, "infer_strategies", "generates", default=True)
    if name in plugins.registry("infer_strategies") and name not in able:
        problems.append(f"key 'roles.actor_infer.strategy': '{name}' computes log-probs only (for roles.reference) "
                        f"and cannot generate; strategies that generate: {', '.join(able)}")
    return problems


def group_baseline_problems(cfg: RollConfig, plugins, key: str, size: int, greedy: bool) -> list[str]:
    """An estimator registered with ``group_baseline=True`` compares the samples of one prompt's
    group: with one sample a group (``size`` at ``key``), or ``greedy`` sampling that makes every
    sample the same, every advantage is 0 and nothing is learned. For the pipelines that train
    with an estimator (rlvr, agentic), from their ``config_problems``."""
    name = cfg.algorithm.advantage_estimator
    try:
        grouped = plugins.advantage_estimators.entry(name).metadata.get("group_baseline", False)
    except RegistryError:
        return []  # already reported as an unknown name
    if grouped and size < 2:
        return [f"key '{key}': '{name}' compares the samples of each prompt's group against each other, and a group "
                f"of {size} makes every advantage 0; use 2 or more, or an estimator without a group baseline "
                f"(reinforce_plus_plus)"]
    if grouped and greedy:
        return [f"key 'rollout.temperature': 0 samples greedily, so every response of a prompt's group is the same "
                f"and '{name}' gives each an advantage of 0; sample with a temperature above 0"]
    return []


def _top_k_requirements(cfg: RollConfig, plugins) -> list[str]:
    """``rollout.top_k`` reaches ``generate`` only when it is set (:meth:`RolloutConfig.sampling`), so
    an inference strategy written before it existed runs the default settings; with it set, every
    role that generates from the rollout settings needs a ``generate`` that takes it."""
    if not cfg.rollout.top_k:
        return []
    from roll_core.pipelines import pipeline_class

    problems, roles = [], cfg.model_roles()
    for name in pipeline_class(cfg, plugins).generating_roles(cfg):
        role = roles.get(name)
        if not isinstance(role, InferRoleConfig):
            continue  # a missing or misplaced role is reported by its own check
        try:
            cls = plugins.infer_strategies.get(role.strategy)
        except RegistryError:
            continue  # already reported as an unknown name
        params = inspect.signature(cls.generate).parameters.values()
        if not any(p.name == "top_k" or p.kind is p.VAR_KEYWORD for p in params):
            problems.append(f"key 'rollout.top_k': roles.{name}'s infer strategy '{role.strategy}' cannot sample with "
                            f"top-k (its generate() takes no top_k); set rollout.top_k=0, or use a strategy whose "
                            f"generate() takes it (roll's hf, vllm and sglang do)")
    return problems


def _registered_with(plugins, registry: str, flag: str, default: bool = False) -> list[str]:
    """Names in ``registry`` whose registration metadata sets ``flag`` (``default`` when it says nothing)."""
    entries = plugins.registry(registry)
    return [n for n in entries.names() if entries.entry(n).metadata.get(flag, default)]


def _packing_requirements(cfg: RollConfig, plugins) -> list[str]:
    """Packed sequences need a strategy of the role's kind registered with ``packed_sequences=True``.
    They are asked for by ``warmup.packing`` (actor_train's supervised steps), a role's
    ``pack_sequences: true`` or its ``max_tokens_per_micro_batch``; left unset, packing is simply off
    where the strategy cannot do it."""
    roles = cfg.model_roles()
    asks = [("warmup.packing", "actor_train", cfg.warmup.packing)]
    for name, role in roles.items():
        asks += [(f"roles.{name}.pack_sequences", name, role.pack_sequences is True),
                 (f"roles.{name}.max_tokens_per_micro_batch", name,
                  getattr(role, "max_tokens_per_micro_batch", None) is not None)]
    return [problem for key, name, asked in asks if asked
            for problem in _strategy_lacks(plugins, key, roles[name], "packed_sequences", "take packed sequences")]


def image_sources(cfg: RollConfig, plugins) -> list[str]:
    """The data sources whose rows have images: a dataset registered with ``images=True``, a JSONL
    file with a row that has ``images`` (``data``, or each of ``data.domains``)."""
    found = []
    for key, source in (cfg.data.domains.items() if cfg.data.domains else [("data", cfg.data)]):
        where = key if key == "data" else f"data.domains.{key}"
        if source.train_file:
            found += [f"{where}.{name} {path}" for name, path in (("train_file", source.train_file),
                                                                 ("eval_file", source.eval_file))
                      if path and _has_image_rows(path)]
        elif source.dataset in _registered_with(plugins, "datasets", "images"):
            found.append(f"{where}.dataset '{source.dataset}'")
    return found


def _has_image_rows(path: str) -> bool:
    """Whether a row of a JSONL file has ``images`` (text and image rows may mix): only the lines
    that name the key are parsed, so a file of text rows costs one read. False where the file cannot
    be read: the data loader reports that."""
    try:
        with open(path) as f:
            for line in f:
                if '"images"' in line:
                    row = json.loads(line)
                    if isinstance(row, dict) and row.get("images"):
                        return True
    except (OSError, ValueError):
        return False
    return False


def _image_requirements(cfg: RollConfig, plugins) -> list[str]:
    """Data with images (:mod:`roll_core.multimodal`) needs every role that runs the model on its
    prompts on a strategy registered with ``images=True``."""
    sources = image_sources(cfg, plugins)
    return image_role_problems(cfg, plugins, f"the data has them: {sources[0]}") if sources else []


def image_role_problems(cfg: RollConfig, plugins, why: str) -> list[str]:
    """Every model role on a strategy registered with ``images=True``, as inputs with images need
    (``why`` says where they come from)."""
    return [problem for name, role in cfg.model_roles().items()
            for problem in _strategy_lacks(plugins, f"roles.{name}.strategy", role, "images", f"read images ({why})")]


def _strategy_lacks(plugins, key: str, role, flag: str, ability: str) -> list[str]:
    """The problem (none or one) with config ``key``, which needs ``role``'s strategy registered with
    ``flag`` (``ability`` says what that flag stands for)."""
    registry = f"{role.kind}_strategies"
    if role.strategy not in plugins.registry(registry):
        return []  # an unknown strategy is reported as such
    able = _registered_with(plugins, registry, flag)
    if role.strategy in able:
        return []
    return [f"key '{key}': {role.kind} strategy '{role.strategy}' does not {ability}; "
            f"{role.kind} strategies that do: {', '.join(able) or '(none)'}"]


def _compile_requirements(cfg: RollConfig, plugins) -> list[str]:
    """A role's ``compile: true`` needs a strategy of its kind registered with ``compiles=True``, and
    a C++ compiler, with which TorchInductor builds its kernels (on GPUs too, for its launchers)."""
    from roll_core.strategies.compiled import MISSING_COMPILER, cxx_compiler

    problems = []
    asked = cfg.compiled_roles()
    for name, role in asked.items():
        problems += _strategy_lacks(plugins, f"roles.{name}.compile", role, "compiles", "compile its model")
    if asked and cxx_compiler() is None:  # the workers look again on their own machines (compile_layers)
        problems.append(f"key 'roles.{next(iter(asked))}.compile': {MISSING_COMPILER}")
    return problems


def _lora_requirements(cfg: RollConfig, plugins) -> list[str]:
    """LoRA (on the policy, on the critic) needs a strategy of the role's kind registered with
    ``lora=True``, peft, and target modules the model has; the policy's reference (no
    ``model_path``) runs on actor_train's workers, so a placement of its own would go unused."""
    adapted = {name: (role, role.lora) for name, role in (("actor_train", cfg.roles.actor_train),
                                                          ("critic", cfg.roles.critic))
               if role is not None and role.lora is not None}
    problems = []
    for name, (role, settings) in adapted.items():
        key, registry = f"roles.{name}.lora", f"{role.kind}_strategies"
        able = _registered_with(plugins, registry, "lora")
        if role.strategy in plugins.registry(registry) and role.strategy not in able:
            problems.append(f"key '{key}': {role.kind} strategy '{role.strategy}' does not train LoRA adapters; "
                            f"strategies that do: {', '.join(able) or 'none installed'}")
        targets, path = settings.target_modules, cfg.model.path
        if targets != "all-linear" and (path == "tiny" or (Path(path) / "config.json").is_file()):
            from roll_core.strategies import lora  # a named layer the model lacks: now, not in a worker

            if problem := lora.unknown_targets(targets, lora.architecture_linear_names(path, cfg.model.tiny), path):
                problems.append(f"key '{key}.target_modules': {problem}")
    ref = cfg.roles.reference
    if "actor_train" in adapted and ref is not None and cfg.reference_on_actor() and ref.device_mapping is not None:
        problems.append("key 'roles.reference.device_mapping': under roles.actor_train.lora the reference is the "
                        "base model on actor_train's workers (adapters disabled); drop its device_mapping")
    if adapted and importlib.util.find_spec("peft") is None:
        problems.append(f"key 'roles.{next(iter(adapted))}.lora': needs peft, which is not installed: "
                        "pip install 'roll-core[lora]'")
    return problems


def _reward_options(cfg: RollConfig, plugins) -> list[str]:
    """Every reward's options must fit its constructor: checked here, before the reward workers
    start, instead of failing inside one with a traceback."""
    return [problem for _, entries in cfg.roles.reward_roles().values() for r in entries
            for problem in _options_fit(f"key '{r.key}.options'", r.name, r.options, plugins.rewards, "reward")]


def _env_options(cfg: RollConfig, plugins) -> list[str]:
    """An agentic run's environment options against each environment's constructor, as rewards'
    (the pipeline also builds one of each before its workers start; ``roll validate`` does not)."""
    return [problem for e in _environments(cfg)
            for problem in env_options_problems(f"key '{e.key}.env_options'", e.env, e.env_options, plugins)]


def env_options_problems(where: str, name: str, options: dict, plugins) -> list[str]:
    """What is wrong with ``options`` for the environment registered as ``name`` (``where`` names
    them in each message: a config key, or ``roll play``'s ``--options``); coerces their values."""
    return _options_fit(where, name, options, plugins.envs, "environment")


def _component_options(cfg: RollConfig, plugins) -> list[str]:
    """``algorithm.<kind>_options`` against the options model the named policy loss or advantage
    estimator was registered with (``register(..., options=Model)``): names with a did-you-mean,
    then types and values. The validated values replace the raw ones, so a command-line ``x=9``
    reaches a ``str`` option as "9"."""
    algo = cfg.algorithm
    problems = []
    for kind, registry in (("policy_loss", plugins.policy_losses), ("advantage_estimator", plugins.advantage_estimators)):
        name, key = getattr(algo, kind), f"algorithm.{kind}_options"
        validated, found = _validated_options(key, kind.replace("_", " "), registry, name, getattr(algo, f"{kind}_options"))
        problems += found
        if validated is not None:
            setattr(algo, f"{kind}_options", validated.model_dump())
    return problems


# Strategies of the project's own plugin packages: a config that names one which is not installed is
# told which package to install.
PLUGIN_PACKAGES = {"vllm": "roll-vllm", "sglang": "roll-sglang", "deepspeed": "roll-deepspeed",
                   "megatron": "roll-megatron"}


def _strategy_options(cfg: RollConfig, plugins) -> list[str]:
    """``roles.<role>.strategy_options`` against the options model of the role's strategy (an
    engine's arguments), like :func:`_component_options`; the validated values replace the raw ones."""
    problems = []
    for role, role_cfg in cfg.model_roles().items():
        kind = role_cfg.kind
        registry = plugins.registry(f"{kind}_strategies")
        validated, found = _validated_options(f"roles.{role}.strategy_options", f"{kind} strategy", registry,
                                              role_cfg.strategy, role_cfg.strategy_options)
        problems += found
        if validated is not None:
            role_cfg.strategy_options = validated.model_dump()
            # checks that need the role's other settings (a parallel layout against its workers); a
            # problem with another key of the role names it ("key '...': ...")
            check_role = getattr(validated, "check_role", None)
            problems += [p if p.startswith("key '") else f"key 'roles.{role}.strategy_options': {p}"
                         for p in (check_role(role_cfg) if check_role else [])]
    return problems


def _missing_packages(key: str, registry, name: str) -> list[str]:
    """The packages ``name`` registered as ``requires`` that are not installed here."""
    if name not in registry:
        return []
    return [f"key '{key}': {registry.kind} '{name}' needs the '{module}' package, which is not installed: {hint}"
            for module, hint in registry.entry(name).missing_packages().items()]


def _validated_options(key: str, kind: str, registry, name: str, options: dict) -> tuple[Any, list[str]]:
    from roll_core.algorithms.objective import component_options, options_model

    if name not in registry:
        return None, []  # already reported as an unknown name
    plugin = registry.entry(name).plugin
    try:
        validated = component_options(registry, name, options)
    except ValidationError as exc:
        fields = list(options_model(registry, name).model_fields)
        problems = []
        for err in exc.errors():
            option = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"key '{key}' for {kind} '{name}': unknown option '{option}'."
                                f"{did_you_mean(option, fields)} Valid options: {', '.join(fields)}")
            else:
                problems.append(f"key '{key}.{option}' for {kind} '{name}': {err['msg']} (got {err.get('input')!r})")
        return None, problems
    except Exception as exc:  # an options target that does not import
        return None, [f"key '{key}': {kind} '{name}' (plugin '{plugin}') registered options that failed to load: "
                      f"{type(exc).__name__}: {exc}"]
    if validated is None and options:
        return None, [f"key '{key}': {kind} '{name}' takes no options, got {sorted(options)}"]
    return validated, []


def _loss_options(cfg: RollConfig, plugins) -> list[str]:
    """``distill.loss_options`` and ``dpo.loss_options`` against the keyword parameters of the named
    loss, beyond those its pipeline passes itself."""
    problems = []
    for key, section, registry, what, passed in (
            ("distill.loss_options", cfg.distill, plugins.distill_losses, "distillation loss", 2),  # (student, teacher)
            ("dpo.loss_options", cfg.dpo, plugins.preference_losses, "preference loss", 1)):  # (inputs, *, beta, ...)
        try:
            fn = registry.get(section.loss)
        except RegistryError:
            continue  # already reported as an unknown name
        params = [p for p in list(inspect.signature(fn).parameters)[passed:] if p not in ("beta", "label_smoothing")]
        problems += [f"key '{key}' for {what} '{section.loss}': unknown option '{k}'."
                     f"{did_you_mean(k, params)} Valid options: {', '.join(params) or '(none)'}"
                     for k in section.loss_options if k not in params]
    return problems


def _pipeline_problems(cfg: RollConfig, plugins) -> list[str]:
    """The pipeline's own checks (:meth:`roll_core.pipelines.Pipeline.config_problems`; a name that
    is not registered, already reported, and a registered class that only has the
    ``cls(config, executor).run()`` shape of one get :class:`Pipeline`'s)."""
    from roll_core.pipelines import pipeline_class

    return pipeline_class(cfg, plugins).config_problems(cfg, plugins)


def _options_fit(where: str, name: str, options: dict, registry, what: str) -> list[str]:
    """``options`` against the constructor of the ``what`` (a reward, an environment) that ``name``
    is in ``registry``: unknown names with a did-you-mean, missing required ones, scalar types.
    ``where`` starts each message (``key 'roles.reward.options'``)."""
    from roll_core.envs import Env
    from roll_core.rewards import Reward

    base = {"reward": Reward, "environment": Env}[what]
    try:
        cls = registry.get(name)
    except RegistryError:
        return []  # already reported as an unknown name
    if not isinstance(cls, type) or not issubclass(cls, base):
        return []
    key = f"{where} for {what} '{name}'"
    if cls.__init__ is base.__init__:
        return [f"{key}: it takes no options, got {sorted(options)}"] if options else []
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    problems = [f"{key}: unknown option '{k}'.{did_you_mean(k, params)} Valid options: {', '.join(params)}"
                for k in options if k not in params]
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in options]
    if missing:
        problems.append(f"{key}: missing required option(s) {', '.join(missing)}")
    return problems + _coerce_option_values(key, cls, options)


_SCALARS = (str, int, float, bool)


def _coerce_option_values(key: str, cls: type, options: dict) -> list[str]:
    """Values checked against the constructor's annotations where those are scalars (``str``,
    ``int``, ``float``, ``bool``, optionally ``None``) or a ``Literal`` of values, and coerced in place: a command-line
    ``explode_on=9`` is YAML's int 9, and a ``str`` option gets ``"9"``, not a failure minutes into
    the run. Other annotations are left to the reward."""
    import typing

    from pydantic import ConfigDict, TypeAdapter

    try:
        hints = typing.get_type_hints(getattr(cls, "__init__"))
    except Exception:  # annotations that do not resolve: nothing to check against
        return []
    problems = []
    for name, value in list(options.items()):
        annotation = hints.get(name)
        if typing.get_origin(annotation) is typing.Literal:  # one of the values it names
            allowed = typing.get_args(annotation)
            if value not in allowed:
                hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
                problems.append(f"{key}: option '{name}' must be one of {', '.join(map(repr, allowed))}, got "
                                f"{value!r}" + (f".{hint}" if hint else ""))
            continue
        union = typing.get_args(annotation)  # (int, NoneType) for `int | None`; () for a plain type
        members = [m for m in union if m is not type(None)] if union else [annotation]
        if annotation is None or not members or not all(m in _SCALARS for m in members):
            continue
        try:
            options[name] = TypeAdapter(annotation, config=ConfigDict(coerce_numbers_to_str=True)).validate_python(value)
        except ValidationError as exc:
            expected = " or ".join(getattr(m, "__name__", str(m)) for m in members)
            problems.append(f"{key}: option '{name}' must be {expected}, got {value!r} "
                            f"({exc.errors()[0]['msg'].lower()})")
    return problems


def _missing_plugin_hint(name: str, registry, message: str) -> str:
    """What to try when ``name`` is not registered: the roll plugin known to provide it, or (no
    near miss either) a reminder that a third-party plugin may be missing or disabled."""
    if name in registry:
        return ""  # registered, but its target failed to import: the message says why
    package = PLUGIN_PACKAGES.get(name)
    if package:
        return f". '{name}' comes with the {package} plugin: install it (plugins/{package.replace('-', '_')})"
    if "Did you mean" in message:
        return ""
    return (". If a plugin provides it: is it installed in this Python environment (roll list-plugins), and not "
            "disabled by ROLL_DISABLE_PLUGINS?")


def check_registry_names(cfg: RollConfig, plugins=None, where: str = "the config") -> None:
    """Raise one ConfigError listing every name that no installed plugin registered, and every
    registered target that cannot be imported (a plugin that registered a wrong path)."""
    from roll_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    problems = []
    for key, registry, name in registry_references(cfg):
        try:
            plugins.registry(registry).get(name)  # imports the target, so a broken path shows now
        except RegistryError as exc:
            problems.append(f"key '{key}': {exc}{_missing_plugin_hint(name, plugins.registry(registry), str(exc))}")
            continue
        problems += _missing_packages(key, plugins.registry(registry), name)
    problems += _role_requirements(cfg, plugins)
    problems += _top_k_requirements(cfg, plugins)
    problems += _lora_requirements(cfg, plugins)
    problems += _packing_requirements(cfg, plugins)
    problems += _image_requirements(cfg, plugins)
    problems += _compile_requirements(cfg, plugins)
    problems += _reward_options(cfg, plugins)
    problems += _env_options(cfg, plugins)
    problems += _component_options(cfg, plugins)
    problems += _strategy_options(cfg, plugins)
    problems += _loss_options(cfg, plugins)
    problems += _pipeline_problems(cfg, plugins)
    sources = [("data", cfg.data)] + [(f"data.domains.{d}", src) for d, src in cfg.data.domains.items()]
    for prefix, source in sources:
        for key in ("train_file", "eval_file"):
            value = getattr(source, key)
            if value is not None and not Path(value).is_file():
                problems.append(f"key '{prefix}.{key}': file '{value}' does not exist")
    model_paths = [("model.path", cfg.model.path)] + [
        (f"roles.{name}.model_path", role.model_path) for name, role in cfg.model_roles().items()
        if isinstance(role, InferRoleConfig) and role.model_path is not None]
    for key, path in model_paths:
        if path != "tiny" and not (Path(path) / "config.json").is_file():
            problems.append(
                f"key '{key}': '{path}' is not a Hugging Face model directory (no config.json); "
                "roll never downloads from a hub at run time, point it at a local checkpoint"
            )
    if problems:
        raise ConfigError(f"config error in {where}: " + "; ".join(problems))


def load_and_check(path=None, overrides=None, plugins=None) -> RollConfig:
    """:func:`load_config`, then :func:`check_registry_names`; both name the file (or "the default
    config") in the same form: ``config error in SOURCE: key '...': ...``."""
    cfg = load_config(path, overrides)
    check_registry_names(cfg, plugins, where=str(path) if path else "the default config")
    return cfg
