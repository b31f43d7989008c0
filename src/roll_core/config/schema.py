"""The run configuration: pydantic v2 models, every one ``extra="forbid"``.

The defaults *are* the quickstart (the embedded tiny model on ``carry_addition``), so ``roll run``
with no file runs it; ``examples/quickstart.yaml`` spells the same values out. Names that refer to
registries (strategies, estimators, losses, rewards, ...) are plain strings here and are checked
against the installed plugins by :func:`roll_core.config.loader.check_registry_names` before any
worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator



class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyVisionConfig(Strict):
    """Shape of the embedded model's vision tower (``model.tiny.vision``), a SigLIP encoder."""

    image_size: int = Field(16, ge=2, description="images are resized to image_size x image_size pixels")
    patch_size: int = Field(4, ge=1, description="pixels per patch side; each patch is one image token")
    hidden_size: int = Field(64, description="width of the encoder")
    num_layers: int = Field(2, description="encoder layers")
    num_heads: int = Field(4, description="encoder attention heads")
    intermediate_size: int = Field(128, description="width of each encoder layer's MLP")

    @model_validator(mode="after")
    def _whole_patches(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        return self


class TinyModelConfig(Strict):
    """Shape of the embedded model (a Llama-architecture decoder). Defaults fit a 2-core CPU."""

    hidden_size: int = Field(128, description="width of the residual stream")
    num_layers: int = Field(2, description="decoder layers")
    num_heads: int = Field(4, description="attention heads (hidden_size must divide by it)")
    intermediate_size: int = Field(512, description="width of each layer's MLP")
    max_position_embeddings: int = Field(64, description="longest sequence, prompt and response, in tokens")
    init_seed: int = Field(0, description="seed of the random initial weights")
    vision: TinyVisionConfig | None = Field(None, description="a vision tower: the model reads images (LLaVA-style: "
                                            "a SigLIP encoder whose patches, projected, stand in the prompt)")


class ModelConfig(Strict):
    """The policy model every role starts from."""

    path: str = Field("tiny", description="a Hugging Face model directory, or 'tiny' for the embedded model")
    tiny: TinyModelConfig = TinyModelConfig()


class DomainDataConfig(Strict):
    """The data of one domain of a multi-domain run; every row gets the domain's name as ``domain``."""

    dataset: str | None = Field(None, description="registered dataset name (or train_file)")
    options: dict[str, Any] = Field(default_factory=dict, description="options of the registered dataset")
    train_file: str | None = Field(
        None, description="JSONL rows of this domain (prompt, ground_truth[, demonstration]); or dataset")
    eval_file: str | None = Field(None, description="its held-out JSONL rows; None: the dataset's own held-out split")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.dataset is None) == (self.train_file is None):
            raise ValueError("give exactly one of dataset and train_file")
        return self


class DataConfig(Strict):
    """Training and held-out prompts: a registered dataset, JSONL files, or several domains."""

    dataset: str = Field("carry_addition", description="registered dataset name (ignored when train_file is set)")
    options: dict[str, Any] = Field(default_factory=dict, description="options of the registered dataset")
    train_file: str | None = Field(None, description="JSONL rows with prompt, ground_truth[, demonstration, domain]")
    eval_file: str | None = Field(
        None, description="held-out JSONL rows (the fields of train_file); None: the dataset's own held-out split")
    eval_size: int | None = Field(None, ge=1, description="evaluate on the first N held-out rows (per domain)")
    chat_template: str | None = Field(
        None, description="a Jinja chat template for rows with 'messages' (replaces the tokenizer's own; needed "
        "when it has none)")
    apply_chat_template: bool = Field(
        False, description="render plain 'prompt' strings as one user turn through the chat template (instruct models)")
    domains: dict[str, DomainDataConfig] = Field(
        default_factory=dict, description="multi-domain data, one source per domain (replaces dataset/train_file)"
    )
    domain_interleave_probs: dict[str, float] | None = Field(
        None, description="share of each domain in every step's prompts (sums to 1); None = as the data comes"
    )

    @model_validator(mode="after")
    def _probabilities(self):
        probs = self.domain_interleave_probs
        if probs is None:
            return self
        if not probs or any(p < 0 for p in probs.values()) or abs(sum(probs.values()) - 1) > 1e-6:
            raise ValueError(f"domain_interleave_probs must be non-negative and sum to 1, got {probs}")
        if self.domains:
            unknown = sorted(set(probs) - set(self.domains))
            missing = sorted(set(self.domains) - set(probs))
            if unknown or missing:
                raise ValueError(f"domain_interleave_probs must name the domains of data.domains "
                                 f"({', '.join(self.domains)}); unknown {unknown}, missing {missing}")
        return self


class WarmupConfig(Strict):
    """Supervised warm-up on the data's demonstrations before RL (0 steps disables it)."""

    steps: int = Field(500, ge=0, description="supervised steps on the demonstrations before RL (0: none)")
    lr: float = Field(1e-3, gt=0, description="learning rate of the warm-up's own optimizer")
    batch_size: int = Field(64, ge=1, description="demonstrations per warm-up step")
    packing: bool = Field(False, description="pack each batch's examples into rows of max_length tokens, each "
                          "attending to itself only (position ids restart per example): no padding computed")
    max_length: int = Field(512, ge=2, description="tokens per packed row (packing: true); an example longer "
                            "than this is an error")


class DPOConfig(Strict):
    """The ``dpo`` and ``online_dpo`` pipelines: pairs of a ``prompt``, a ``chosen`` and a
    ``rejected`` response (online_dpo: the best and worst of each prompt's samples)."""

    loss: str = Field("dpo_sigmoid", description="a registered preference loss (dpo_sigmoid, ipo, simpo, ...)")
    loss_options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the loss beyond "
                                         "beta and label_smoothing (simpo's gamma)")
    beta: float = Field(0.1, gt=0, description="strength of the pull toward the reference (IPO: its tau)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="probability that a pair's label is wrong (cDPO)")
    average_log_probs: bool | None = Field(
        None, description="per-token mean log-probs of each response instead of sums (as IPO's paper does); "
        "null: the loss's own choice (means for simpo, which is defined on them; sums for dpo_sigmoid and ipo)")
    reference: Literal["role", "precomputed"] = Field(
        "role", description="role: log-probs from roles.reference; precomputed: each pair's "
        "reference_chosen_logp and reference_rejected_logp, computed once with the data")
    batch_size: int = Field(32, ge=1, description="pairs per optimizer step (online_dpo: at most one per prompt "
                            "of rollout.prompts_per_step)")


class RewardModelConfig(Strict):
    """The ``reward_model`` pipeline: ``roles.critic`` (the checkpoint with a one-label score head)
    learns to score the ``chosen`` response of each pair above the ``rejected`` one (Bradley-Terry)."""

    batch_size: int = Field(32, ge=1, description="pairs per optimizer step")


class AgenticEnvConfig(Strict):
    """One environment of a run that trains on several at once (``agentic.envs``). A key left out
    (None) takes the ``agentic`` section's value."""

    env: str = Field(description="a registered environment (roll list-plugins)")
    name: str | None = Field(None, description="its label in metrics (episode/NAME/..., eval/NAME/...); "
                             "default: env")
    env_options: dict[str, Any] = Field(default_factory=dict, description="the environment's constructor options")
    role: str | None = Field(None, description="the env role (a key of roles with kind env) whose workers run it")
    groups_per_step: int | None = Field(None, ge=1, description="seeds of this environment played per step")
    validation_episodes: int | None = Field(None, ge=0, description="its held-out seeds played at each evaluation")
    max_turns: int | None = Field(None, ge=1, description="turns before its episodes are cut")
    instruction: str | None = Field(None, description="text before its first observation")

    @property
    def label(self) -> str:
        return self.name or self.env


class AgenticConfig(Strict):
    """The ``agentic`` pipeline: episodes of registered environments, played turn by turn by the
    policy (actor_infer) and trained with a multi-turn estimator (``agentic_reinforce``: trajectory-
    wise, StarPO; ``gigpo``: step-wise). Each step plays ``groups_per_step`` seeds, ``group_size``
    episodes each (a group: the same start, for the group baselines); validation plays the held-out
    seeds ``0 .. validation_episodes - 1`` greedily (training seeds start at 1,000,000). With
    ``warmup.steps``, actor_train first imitates a careless teacher (the environment's
    ``expert_action``, ``teacher_noise`` of the time a random action) on ``warmup.batch_size``
    episodes per step (seeds from 2,000,000). One environment is ``env`` with ``env_options``;
    several are ``envs``, a list whose entries may override the per-environment keys, trained on
    together with metrics per environment (:meth:`environments` resolves either form)."""

    env: str = Field("frozen_lake", description="a registered environment (roll list-plugins)")
    env_options: dict[str, Any] = Field(default_factory=dict, description="the environment's constructor options")
    envs: list[AgenticEnvConfig] = Field(
        default_factory=list, description="several environments in one run (replaces env and env_options); "
        "each entry: env, name, env_options and overrides of role, groups_per_step, validation_episodes, "
        "max_turns, instruction")
    groups_per_step: int = Field(8, ge=1, description="seeds played per step, of each environment")
    group_size: int = Field(8, ge=1, description="episodes per seed (GRPO-style groups)")
    max_turns: int = Field(
        10, ge=1, description="turns before an episode is cut (an agentic.envs entry may set its own)")
    max_length: int = Field(512, ge=8, description="tokens of a whole conversation; longer ones are cut at a turn")
    validation_episodes: int = Field(64, ge=0, description="held-out seeds played greedily at each evaluation")
    instruction: str = Field("", description="text before the first observation")
    observation_prefix: str = Field("", description="text before each observation")
    observation_suffix: str = Field(">", description="text after each observation, before the action")
    rollout: Literal["sync", "async"] = Field(
        "sync", description="sync: each turn waits for every environment of the step; async: each environment "
        "plays its own loop, generation batches whatever is waiting, and a step takes the first complete groups, "
        "up to rollout.async_generation_ratio steps ahead of training")
    role: str = Field("env", description="the env role (a key of roles with kind env: its num_workers, cpus "
                      "and envs_per_worker) whose workers run each environment")
    step_timeout_s: float = Field(60.0, gt=0, description="a reset or step that takes longer is abandoned, its "
                                  "episode fails (episode/hung) and the environment is replaced")
    teacher_noise: float = Field(0.25, ge=0, le=1, description="the warm-up teacher's chance per turn of a random "
                                 "action instead of the expert's (its mistakes are what RL then unlearns)")

    @model_validator(mode="after")
    def _one_way_to_name_environments(self):
        if self.envs and self.model_fields_set & {"env", "env_options"}:
            raise ValueError("give either agentic.env (with env_options) or agentic.envs, not both")
        labels = [e.label for e in self.envs]
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            raise ValueError(f"agentic.envs labels must differ; {repeated} repeat (give each entry a 'name')")
        return self

    def environments(self) -> list[EnvSettings]:
        """Every environment of the run with every key filled in (the section's value where an
        entry left it out); one entry, at key ``agentic``, for the ``env`` form. Each holds the
        config's own ``env_options`` dict, so options validated in place reach the pipeline."""
        if not self.envs:
            return [EnvSettings("agentic", self.env, self.env, self.env_options, self.role, self.groups_per_step,
                                self.validation_episodes, self.max_turns, self.instruction)]
        return [EnvSettings(f"agentic.envs[{i}]", e.env, e.label, e.env_options, _or(e.role, self.role),
                            _or(e.groups_per_step, self.groups_per_step),
                            _or(e.validation_episodes, self.validation_episodes), _or(e.max_turns, self.max_turns),
                            _or(e.instruction, self.instruction))
                for i, e in enumerate(self.envs)]


def _or(value, default):
    return default if value is None else value


@dataclass(frozen=True)
class EnvSettings:
    """One environment of an agentic run, every setting resolved (:meth:`AgenticConfig.environments`)."""

    key: str  # the config key of its entry, for messages: agentic, or agentic.envs[i]
    env: str
    label: str
    env_options: dict[str, Any]
    role: str
    groups_per_step: int
    validation_episodes: int
    max_turns: int
    instruction: str


class DistillConfig(Strict):
    """The ``distill`` pipeline: a student (actor_train) pulled toward a teacher (an infer role,
    ``roles.reference`` unless ``teacher`` names another, usually with its own ``model_path``) on
    responses given with the data or written by the teacher."""

    teacher: str = Field("reference", description="the teacher's role: a key of roles with kind infer")

    loss: str = Field("forward_kl", description="a registered distillation loss (forward_kl, reverse_kl, "
                      "adaptive_kl, skewed_forward_kl, skewed_reverse_kl, jsd, ...)")
    loss_options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the loss "
                                         "(alpha of the skewed KLs, beta of jsd, head_mass of adaptive_kl)")
    temperature: float = Field(
        1.0, gt=0, description="both models' logits are divided by it; the loss is scaled by T^2")
    top_k: int | None = Field(None, ge=1, description="distil on the teacher's k most likely tokens only (what "
                              "the teacher sends per position); None: the whole vocabulary")
    responses: Literal["given", "teacher"] = Field(
        "given", description="given: each row's demonstration (else its ground_truth); teacher: the teacher "
        "writes one response per prompt (rollout.max_new_tokens, rollout.temperature)")
    batch_size: int = Field(32, ge=1, description="prompts per optimizer step")


class RolloutConfig(Strict):
    """Generation: how many prompts and samples per step, how they are sampled, and the scheduler
    that collects them."""

    scheduler: str = Field(
        "sync", description="a registered rollout scheduler: sync, or async (generation runs on while the policy "
        "trains)")
    request_size: int | None = Field(
        None, ge=1, description="samples per generation request; each request is scored as soon as it "
        "finishes while the next one generates (None = one request per inference worker)")
    async_generation_ratio: float = Field(
        0.0, ge=0, description="async scheduler: how many steps generation may run ahead of training "
        "(0 = synchronous; fractional = part of a batch); samples are never staler than ceil(ratio) steps")
    max_running_requests: int = Field(2, ge=1, description="async scheduler: requests queued per inference worker")
    max_additional_running_prompts: int = Field(
        0, ge=0, description="async scheduler: redundant groups in flight so a batch fills without stragglers")
    prompts_per_step: int = Field(32, ge=1, description="prompts per RL step, each sampled num_return_sequences times")
    num_return_sequences: int = Field(8, ge=1, description="group size")
    max_new_tokens: int = Field(8, ge=1, description="most tokens generated per response")
    temperature: float = Field(
        1.0, ge=0, description="sampling temperature (0 = greedy); log-probs are computed at it too")
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling: draw from the smallest set of tokens whose probability "
        "reaches top_p")
    top_k: int = Field(
        0, ge=0, description="top-k sampling: draw from the top_k most probable tokens only (0 = all), before "
        "top_p; log-probs stay those of the whole distribution, as the trainer computes them")

    def sampling(self, temperature: float | None = None) -> dict:
        """The keyword arguments of an inference strategy's ``generate`` for these settings, at
        ``temperature`` (None: this config's). ``top_k`` only when it cuts, so a strategy written
        before it existed still takes the default settings."""
        t = self.temperature if temperature is None else temperature
        return {"max_new_tokens": self.max_new_tokens, "temperature": t, "top_p": self.top_p,
                **({"top_k": self.top_k} if self.top_k else {})}


class RewardNormConfig(Strict):
    """Step 2 of reward shaping: ``(score - mean) / std``, each statistic over its own scope."""

    mean: Literal["none", "batch", "group", "running"] = Field(
        "none", description="what the subtracted mean is taken over: nothing, the batch, the sample's group, or the "
        "run so far")
    std: Literal["none", "batch", "group", "running"] = Field(
        "none", description="what the dividing std is taken over: nothing, the batch, the sample's group, or the run "
        "so far")


class KLPenaltyConfig(Strict):
    """Step 5 of reward shaping: ``r_t -= beta * kl_t(actor || reference)`` (0 disables it)."""

    coef: float = Field(0.0, ge=0, description="beta; the initial beta when adaptive")
    estimator: str = Field("k1", description="registered KL estimator")
    adaptive: bool = Field(False, description="adapt beta toward target_kl (Ziegler et al. 2019)")
    target_kl: float = Field(0.1, gt=0, description="per-sequence KL the adaptive controller aims at")
    horizon: int = Field(10000, ge=1, description="adaptive controller horizon in samples")


class RangeConfig(Strict):
    """An open interval (low, high)."""

    low: float = Field(0.0, description="lower bound (exclusive)")
    high: float = Field(1.0, description="upper bound (exclusive)")

    @model_validator(mode="after")
    def _ordered(self):
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class DynamicSamplingConfig(Strict):
    """DAPO-style dynamic sampling: drop groups that fail a filter and draw more prompts."""

    filter: Literal["none", "mean", "std"] = Field(
        "none", description="none; mean: keep groups whose mean score is in (mean_low, mean_high); std: keep groups "
        "whose score std exceeds std_min")
    mean_low: float = Field(0.0, description="mean filter keeps groups with mean score in (mean_low, mean_high)")
    mean_high: float = Field(1.0, description="upper bound of the mean filter (exclusive)")
    std_min: float = Field(0.0, ge=0, description="std filter keeps groups whose score std exceeds this")
    max_rounds: int = Field(4, ge=1, description="collection rounds per step before training on what is kept")


class AlgorithmConfig(Strict):
    """The RL objective: advantage estimator, policy loss, KL terms, and reward shaping in the order
    of :mod:`roll_core.algorithms.shaping`."""

    advantage_estimator: str = Field(
        "grpo", description="a registered advantage estimator (grpo, gae, reinforce_plus_plus, rloo, gigpo, ...)")
    advantage_estimator_options: dict[str, Any] = Field(
        default_factory=dict, description="options of an advantage estimator registered with an options model")
    policy_loss: str = Field(
        "ppo_clip", description="a registered policy loss (ppo_clip, dual_clip, gspo, cispo, tis, topr, kimi, ...)")
    policy_loss_options: dict[str, Any] = Field(
        default_factory=dict, description="options of a policy loss registered with an options model "
        "(validated by that model: names, types and values)")
    kl_estimator: str = Field("k3", description="estimator of the KL loss term (kl_loss_coef)")
    kl_loss_coef: float = Field(0.0, ge=0, description="weight of the KL(actor || reference) loss term")
    kl_metric: bool = Field(False, description="report train/kl against roles.reference even when nothing else "
                            "reads it (a reference forward pass per step); otherwise a reference that no KL term, "
                            "KL penalty, OPD or estimator reads is not started at all")
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus (subtracted from the loss)")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: importance ratios below 1 - this are clipped")
    clip_ratio_high: float = Field(
        0.2, ge=0, description="PPO clip: ratios above 1 + this are clipped (larger than clip_ratio_low: DAPO's "
        "clip-higher)")
    dual_clip_c: float = Field(3.0, gt=1, description="dual_clip: loss of negative advantages capped at c * |A|")
    tis_cap: float = Field(2.0, gt=0, description="tis: truncation of the trainer/sampler importance weight")
    topr_positive_weight: float = Field(
        1.0, ge=0, description="topr: weight of the term of samples with positive reward")
    topr_negative_weight: float = Field(
        1.0, ge=0, description="topr: weight of the term of samples with negative reward")
    kimi_tau: float = Field(0.1, ge=0, description="kimi: weight of the squared log-ratio")
    raft_threshold: float = Field(0.0, description="raft: samples with score above this are accepted")
    gigpo_step_weight: float = Field(1.0, ge=0, description="gigpo: weight of the step-level advantage")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="token losses to one number: the mean over the batch's tokens, or per sequence "
        "first (its tokens' sum, mean, or sum over a fixed length as in Dr. GRPO), then the mean over sequences")
    norm_adv_by_std: bool = Field(True, description="GRPO/GiGPO: divide by the group std (False = Dr. GRPO)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of future rewards (gae, reinforce_plus_plus)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda: 1 = Monte Carlo returns, 0 = one-step TD")
    ppo_epochs: int = Field(1, ge=1, description="passes of the update over each batch")
    old_log_probs: Literal["auto", "recompute"] = Field(
        "auto", description="auto: when the update is a single optimizer step per batch (one epoch, one "
        "mini-batch, no KL reward penalty, an estimator that does not read them), the old log-probs are "
        "the update's own, detached, instead of a separate forward pass; recompute: always that pass")
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="samples per optimizer step; None = the whole batch")
    max_grad_norm: float = Field(
        1.0, gt=0, description="gradients are clipped to this global norm; a step whose norm is not finite is "
        "skipped")
    value_clip: float | None = Field(0.2, gt=0, description="critic: clip range of the value loss (None = unclipped)")
    # reward shaping and sample masks, applied in the order of roll_core.algorithms.shaping
    max_length_mask: bool = Field(False, description="drop responses cut off at rollout.max_new_tokens")
    difficulty_mask: RangeConfig | None = Field(
        None, description="train only groups whose mean score is in (low, high)")
    reward_norm: RewardNormConfig = RewardNormConfig()
    reward_clip: float | None = Field(
        None, gt=0, description="scores clipped to [-c, c] after normalisation (None: not clipped)")
    kl_penalty: KLPenaltyConfig = KLPenaltyConfig()
    whiten_rewards: bool = Field(
        False, description="normalise the token-level rewards over the batch's response tokens (zero mean, unit std)")
    whiten_advantages: bool = Field(
        False, description="normalise the advantages over the batch's response tokens (zero mean, unit std)")
    advantage_clip: float | None = Field(None, gt=0, description="advantages clipped to [-c, c] (None: not clipped)")
    opd_coef: float = Field(0.0, ge=0, description="add this times the opd advantage (log pi_teacher - log pi_old "
                            "per token, the teacher being roles.reference) to the estimator's: on-policy "
                            "distillation beside a reward")
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()


class DeviceRange(Strict):
    """``range(start, stop)`` of global device indices, written as data (never an eval'd string)."""

    start: int = Field(0, ge=0, description="first global device index")
    stop: int = Field(gt=0, description="one past the last")


class Placed(Strict):
    """Where a role's workers run. ``device_mapping`` lists global device indices (device ``d`` is
    local GPU ``d % gpus_per_node`` of node ``d // gpus_per_node``); every worker takes
    ``num_devices_per_worker`` consecutive entries, so the mapping also fixes ``num_workers``.
    Roles without a mapping run on CPU workers. Roles whose mappings overlap are colocated and
    time-share the devices (the pipeline offloads one before the other runs); disjoint mappings run
    disaggregated."""

    num_workers: int = Field(
        1, ge=1, description="workers of the role: data-parallel replicas, or the ranks that hold one sharded model")
    device_mapping: list[int] | DeviceRange | None = Field(
        None, description="global device indices, as a list or {start, stop}; None = CPU workers")
    num_devices_per_worker: int = Field(1, ge=1, description="devices each worker takes from device_mapping")

    @model_validator(mode="before")
    @classmethod
    def _workers_from_mapping(cls, data):
        """A mapping of N devices means N / num_devices_per_worker workers, unless num_workers says
        otherwise (then it is an error, reported below)."""
        if isinstance(data, dict) and data.get("device_mapping") is not None and "num_workers" not in data:
            mapping = data["device_mapping"]
            n = len(range(mapping.get("start", 0), mapping["stop"])) if isinstance(mapping, dict) and "stop" in mapping \
                else len(mapping) if isinstance(mapping, list) else None
            per = data.get("num_devices_per_worker", 1)
            if n and isinstance(per, int) and per > 0 and n % per == 0:
                data = {**data, "num_workers": n // per}
        return data

    @model_validator(mode="after")
    def _mapping_fits(self):
        devices = self.devices
        if devices is None:
            return self
        if not devices:
            raise ValueError("device_mapping is empty; leave it out to run on CPU")
        if len(set(devices)) != len(devices):
            dup = sorted({d for d in devices if devices.count(d) > 1})
            raise ValueError(f"device_mapping lists devices {dup} twice: two workers of one role cannot share a device")
        if len(devices) % self.num_devices_per_worker:
            raise ValueError(f"device_mapping has {len(devices)} devices, which does not divide into workers of "
                             f"num_devices_per_worker={self.num_devices_per_worker}")
        workers = len(devices) // self.num_devices_per_worker
        if self.num_workers != workers:
            raise ValueError(f"num_workers={self.num_workers} but device_mapping ({len(devices)} devices, "
                             f"{self.num_devices_per_worker} per worker) makes {workers} workers; drop num_workers")
        return self

    @property
    def devices(self) -> list[int] | None:
        m = self.device_mapping
        return list(range(m.start, m.stop)) if isinstance(m, DeviceRange) else m

    def worker_devices(self) -> list[list[int]] | None:
        """Global device indices of each worker."""
        devices, per = self.devices, self.num_devices_per_worker
        return None if devices is None else [devices[i : i + per] for i in range(0, len(devices), per)]


_KIND = ("which workers host the role: train, infer, critic, reward or env; fixed for the built-in roles, "
         "required for a role of your own")

RoleThreads = Annotated[int | None, Field(
    ge=1, description="intra-op threads of this role's workers during RL steps, when roles may run at once "
    "(executor: ray); warm-up and the evaluations before and after RL, when one role works alone, use the run's "
    "torch_threads. None = torch_threads throughout")]


PackSequences = Annotated[bool | None, Field(
    description="run this role's forward passes on packed rows: no padding, and the samples of a group share "
    "one copy of their prompt (roll_core.strategies.packing; same log-probs, fewer tokens). None = on where the "
    "strategy supports it (registered with packed_sequences=True) and the model's attention takes a 4-D mask")]
PackMaxLength = Annotated[int, Field(
    ge=1, description="widest packed row in tokens (pack_sequences); a group that needs more is split over rows, "
    "each repeating the prompt. A sample longer than this gets a row of its own")]


class _TrainedRoleConfig(Placed):
    """A trained role. Several workers train data-parallel: each gets an equal share of every
    mini-batch and gradients are summed over ``torch.distributed`` (gloo on CPU, nccl on GPU)."""

    strategy: str = Field(
        "hf", description="a registered train (or critic) strategy: hf, fsdp2, deepspeed, megatron, ...")
    strategy_options: dict[str, Any] = Field(
        default_factory=dict, description="the strategy's own settings (a vllm engine's arguments), checked against "
        "the options model it registered")
    torch_threads: RoleThreads = None
    lr: float = Field(3e-4, gt=0, description="learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    micro_batch_size: int = Field(
        64, ge=1, description="samples per forward-backward pass; gradients accumulate over a mini-batch")
    pack_sequences: PackSequences = None
    pack_max_length: PackMaxLength = 1024
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="size forward-backward passes by tokens (prompt + response, no padding) instead of "
        "micro_batch_size samples; every data-parallel rank runs as many passes as the rank that needs most")
    compile: bool = Field(
        False, description="compile the model's decoder layers with torch.compile, shapes dynamic "
        "(roll_core.strategies.compiled): elementwise work fused, faster passes from tens of millions of parameters "
        "up, after a first pass that compiles (tens of seconds on CPU). Needs a strategy registered with "
        "compiles=True and a C++ compiler")


class LoraConfig(Strict):
    """Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on the trained policy or PPO's
    critic, through ``peft``: ``W x + (alpha / rank) B A x`` with ``A [rank, in]``, ``B [out, rank]``
    trained and ``W`` frozen. On the policy, only the adapters reach the inference engines, which
    merge them onto the base weights, and a reference role without a ``model_path`` becomes the base
    model itself (the adapters disabled on actor_train's workers), so no second copy is loaded. On
    the critic, the fresh value head trains whole beside the adapters. Needs
    ``pip install 'roll-core[lora]'``."""

    rank: int = Field(8, ge=1, description="r: the adapters' inner dimension")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (training only)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="names (suffixes) of the linear layers that get adapters, or every linear "
        "layer but the output head; roll validate checks the names against model.path's architecture")
    save: Literal["adapter", "merged"] = Field(
        "adapter", description="what a checkpoint's model holds: the adapter alone (adapter/, loadable with "
        "peft onto the base model), or the adapter plus the merged weights as a plain model (model/)")


class TrainRoleConfig(_TrainedRoleConfig):
    """A trained policy (kind ``train``: a registered train strategy)."""

    kind: Literal["train"] = Field("train", description=_KIND)


class ActorTrainRoleConfig(TrainRoleConfig):
    """The policy being trained (kind ``train``)."""

    lora: LoraConfig | None = Field(None, description="train low-rank adapters instead of every weight")


class InferRoleConfig(Placed):
    """An inference engine (kind ``infer``: a registered infer strategy): generation and log-probs."""

    kind: Literal["infer"] = Field("infer", description=_KIND)
    strategy: str = Field("hf", description="a registered infer strategy: hf, vllm, sglang, ...")
    strategy_options: dict[str, Any] = Field(
        default_factory=dict, description="the strategy's own settings (a vllm engine's arguments), checked against "
        "the options model it registered")
    torch_threads: RoleThreads = None
    pack_sequences: PackSequences = None
    pack_max_length: PackMaxLength = 1024
    model_path: str | None = Field(
        None, description="load this model instead of the policy's (a reference role used as distillation teacher)"
    )


class CriticRoleConfig(_TrainedRoleConfig):
    """The value model of PPO (``advantage_estimator: gae``): the policy's backbone with a scalar head.
    A fresh head learns faster than the policy may move, hence a higher default learning rate."""

    kind: Literal["critic"] = Field("critic", description=_KIND)
    lr: float = Field(
        1e-3, gt=0, description="learning rate of the value model (higher than the policy's: its head starts fresh)")
    lora: LoraConfig | None = Field(
        None, description="train low-rank adapters on the backbone (and the value head whole) instead of every weight")


class RewardFailures(Placed):
    """What a reward worker does when a reward misbehaves, as a plugin author's bug would make it.

    A call that does not finish within ``timeout_s`` per sample is abandoned and its worker is
    replaced by a fresh one (the run goes on); a score that is NaN or infinite never reaches
    training. Each applies its policy: ``zero`` scores those samples 0 and counts them
    (``reward/timeouts``, ``reward/nonfinite``), ``error`` stops the run with a message naming the
    reward and its plugin."""

    timeout_s: float = Field(30.0, gt=0, description="seconds one sample may take to score (a call of n samples "
                             "gets n times that)")
    on_timeout: Literal["zero", "error"] = Field("zero", description="a sample not scored in time: score 0 and "
                                                 "count it, or stop the run")
    on_nonfinite: Literal["error", "zero"] = Field("error", description="a NaN or infinite score: stop the run "
                                                   "naming the reward, or score 0 and count it")

    def failure_policy(self) -> dict:
        return {"timeout_s": self.timeout_s, "on_timeout": self.on_timeout, "on_nonfinite": self.on_nonfinite}


class _RewardRole(RewardFailures):
    """Where a reward role scores: its own workers, or the driver process."""

    placement: Literal["auto", "driver", "workers"] = Field(
        "auto", description="where the role's rewards score: workers (processes of their own on the ray executor, "
        "which contain a reward that hangs or crashes), driver (in the driver process: no round trip per generation "
        "request), or auto: the driver when every reward of the role is lightweight (exact_match, multiple_choice; "
        "Reward.lightweight) and the role has one CPU worker, workers otherwise")

    @model_validator(mode="after")
    def _driver_is_one_process(self):
        if self.placement == "driver" and (self.num_workers > 1 or self.device_mapping is not None):
            raise ValueError("placement 'driver' scores in the driver process, one CPU worker: it takes neither "
                             f"num_workers above 1 (got {self.num_workers}) nor a device_mapping; use placement: "
                             "workers")
        return self


class RewardRoleConfig(_RewardRole):
    """The reward of every sample whose domain has no entry in ``roles.domain_rewards`` (an LLM judge
    that loads a model is a reward too: its workers get their own ``device_mapping``)."""

    kind: Literal["reward"] = Field("reward", description=_KIND)
    name: str = Field("exact_match", description="a registered reward (roll list-plugins)")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the reward's constructor options, checked against its signature or "
        "options model")


class WeightedRewardConfig(Strict):
    """One reward of a domain and its weight."""

    name: str = Field(description="a registered reward")
    options: dict[str, Any] = Field(default_factory=dict, description="the reward's constructor options")
    weight: float = Field(1.0, description="its weight in the domain's score, sum(weight * reward)")


class DomainRewardConfig(_RewardRole):
    """The reward workers of one domain. The score is ``sum(weight * reward)`` over ``rewards``."""

    kind: Literal["reward"] = Field("reward", description=_KIND)
    rewards: list[WeightedRewardConfig] = Field(
        min_length=1, description="the rewards whose weighted sum scores this domain's samples")


class EnvRoleConfig(Strict):
    """Environment workers of the ``agentic`` pipeline (kind ``env``): each environment of the run
    gets ``num_workers`` of them (Ray actors on the ray executor), each holding ``envs_per_worker``
    environments."""

    kind: Literal["env"] = Field("env", description=_KIND)
    num_workers: int = Field(1, ge=1, description="env workers of each environment that uses this role")
    cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves for each env worker: 0 lets them run "
                        "anywhere; more makes Ray spread them over the cluster's nodes")
    envs_per_worker: int | None = Field(None, ge=1, description="environment slots per worker; None: enough "
                                        "for every episode in flight")


# A role of one's own (any key of ``roles`` but the built-in ones), told apart by its ``kind``.
OwnRole = Annotated[Union[TrainRoleConfig, InferRoleConfig, CriticRoleConfig, EnvRoleConfig],
                    Field(discriminator="kind")]
RoleConfig = Union[ActorTrainRoleConfig, TrainRoleConfig, InferRoleConfig, CriticRoleConfig, RewardRoleConfig,
                   DomainRewardConfig, EnvRoleConfig]
OWN_ROLE_MODELS: dict[str, type[BaseModel]] = {m.model_fields["kind"].default: m
                                                for m in get_args(get_args(OwnRole)[0])}
OWN_ROLE_KINDS = tuple(OWN_ROLE_MODELS)


def nested_models(annotation) -> list[type[BaseModel]]:
    """The config models an annotation holds, however nested (``X | None``, ``dict[str, X]``, a union)."""
    found, todo = [], [annotation]
    while todo:
        a = todo.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        todo += list(get_args(a))
    return found


@dataclass(frozen=True)
class RewardEntry:
    """One reward of a reward role: the config key of its entry (``.name`` and ``.options`` follow
    it), its registered name, its options and its weight in the role's sum."""

    key: str
    name: str
    options: dict[str, Any]
    weight: float


class RolesConfig(Strict):
    """Every role of the run, by name; each is an entry with a ``kind`` (train, infer, critic,
    reward, env) that says which workers host it. The built-in names have fixed kinds. Any other
    key is a role of your own and must name its kind (``roles.teacher: {kind: infer, model_path:
    ...}``); the pipeline or key that names it spawns it (``distill.teacher``, ``agentic.envs[].role``,
    a third-party pipeline's ``RoleGroups.model_role``). :meth:`named` lists them all."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    __pydantic_extra__: dict[str, OwnRole] = Field(init=False)

    actor_train: ActorTrainRoleConfig = ActorTrainRoleConfig()
    actor_infer: InferRoleConfig = InferRoleConfig()
    reference: InferRoleConfig | None = Field(
        InferRoleConfig(), description="frozen copy of the initial policy; null disables it (no KL)"
    )
    reward: RewardRoleConfig = RewardRoleConfig()
    domain_rewards: dict[str, DomainRewardConfig] = Field(
        default_factory=dict, description="per-domain rewards, each on its own workers (rows carry 'domain')"
    )
    eval_reward: RewardRoleConfig | None = Field(
        None, description="the reward that scores held-out evaluations (eval/accuracy) instead of the training "
        "rewards: a verifier while RL trains on a reward model; null: the training rewards score them too")
    critic: CriticRoleConfig | None = Field(None, description="value model; needed by advantage_estimator gae")
    env: EnvRoleConfig = Field(EnvRoleConfig(), description="the agentic pipeline's environment workers")

    def reward_roles(self) -> dict[str, tuple[RewardRoleConfig | DomainRewardConfig, list[RewardEntry]]]:
        """Every reward role by its config key (``roles.reward``, ``roles.domain_rewards.D``,
        ``roles.eval_reward``), with the rewards it sums."""
        def one(key: str, role: RewardRoleConfig) -> list[RewardEntry]:
            return [RewardEntry(key, role.name, role.options, 1.0)]

        roles: dict[str, tuple[RewardRoleConfig | DomainRewardConfig, list[RewardEntry]]] = {
            "roles.reward": (self.reward, one("roles.reward", self.reward))}
        for domain, spec in self.domain_rewards.items():
            key = f"roles.domain_rewards.{domain}"
            roles[key] = (spec, [RewardEntry(f"{key}.rewards[{i}]", r.name, r.options, r.weight)
                                 for i, r in enumerate(spec.rewards)])
        if self.eval_reward is not None:
            roles["roles.eval_reward"] = (self.eval_reward, one("roles.eval_reward", self.eval_reward))
        return roles

    def own(self) -> dict[str, TrainRoleConfig | InferRoleConfig | CriticRoleConfig | EnvRoleConfig]:
        """The roles of one's own (keys other than the built-in ones)."""
        return dict(self.model_extra or {})

    def named(self) -> dict[str, RoleConfig]:
        """Every configured role by its key in ``roles`` (a domain's reward as ``domain_rewards.D``)."""
        builtin = {name: getattr(self, name)
                   for name in ("actor_train", "actor_infer", "reference", "critic", "reward", "eval_reward")}
        return {**{n: r for n, r in builtin.items() if r is not None},
                **{f"domain_rewards.{d}": spec for d, spec in self.domain_rewards.items()}, "env": self.env,
                **self.own()}


class TrainerConfig(Strict):
    """The training loop: steps, evaluation and checkpoint cadence, resume, dumps and the step-0 gate."""

    max_steps: int = Field(200, ge=0, description="steps of the run (RL steps for rlvr and agentic)")
    eval_every: int = Field(50, ge=0, description="0 = only before and after RL")
    save_every: int = Field(50, ge=0, description="0 = only at the end")
    keep_checkpoints: int = Field(
        2, ge=1, description="checkpoints kept; older ones are removed once a new one is complete")
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: continue from the latest checkpoint in output_dir")
    dump_rollouts_every: int = Field(0, ge=0, description="write the training batch of every N-th step to "
                                     "<output_dir>/rollouts (roll show-rollouts reads it, roll replay trains on it); "
                                     "0 = never")
    max_initial_mismatch: float | None = Field(
        None, gt=0, description="stop an rlvr run at step 0 when actor_train's log-probs of actor_infer's samples "
        "differ from actor_infer's by more than this per token on average (train/infer_log_prob_gap at step 0); "
        "None: report it only")


class RayConfig(Strict):
    """The Ray cluster (executor: ray)."""

    address: str | None = Field(None, description="join this cluster; None starts a local one")
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local cluster roll starts; None: Ray's default (every core)")
    worker_niceness: int = Field(
        0, ge=0, le=19, description="scheduling niceness of the workers of the local cluster roll starts. Ray's "
        "own default, 15, lets the driver and Ray's daemons preempt a worker whenever they run, which stalls its "
        "whole thread team (13% slower quickstart steps on 2 cores); a joined cluster keeps its setting")
    hybrid_engine: bool | Literal["auto"] = Field(
        "auto", description="build actor_infer's worker inside actor_train's worker process, as a hybrid "
        "engine: one process, its calls in order, the weight update handed over in memory. It needs a "
        "rollout that waits for the update (rollout.scheduler, agentic.rollout), CPU workers without device_mapping, one worker of each role, "
        "the same torch_threads and an engine that serves one request at a time. auto: on wherever it can be")
    colocate_controller: bool | Literal["auto"] = Field(
        "auto", description="run the pipeline's controller (its loop: scheduling, rewards, advantages, logging, "
        "checkpoints) inside the run's one worker process, when every role lives there: one CPU worker of "
        "actor_train with actor_infer inside it (the hybrid engine), rewards scored in the controller, no reference, "
        "critic or environment workers of their own. A step then makes no Ray calls; `roll run` streams the run's "
        "output and restarts the worker from the last checkpoint if it dies. auto: on wherever it can be")


class RuntimeConfig(Strict):
    """The distributed runtime: cluster shape, weight sync and fault tolerance."""

    num_gpus_per_node: int | None = Field(
        None, ge=1, description="devices per node for device_mapping; None = read from the Ray cluster")
    num_nodes: int | None = Field(None, ge=1, description="nodes with devices; with num_gpus_per_node, "
                                  "lets `roll validate` check mappings without a cluster")
    weight_sync: str = Field(
        "auto", description="a registered weight-sync backend. collective: buckets broadcast through a "
        "torch.distributed group from each sending training rank to the inference workers; object_store: "
        "buckets passed through Ray / memory; shared_memory: buckets written to a buffer in /dev/shm that every "
        "inference worker maps (one node); in_process: the engine in the trainer's process (ray.hybrid_engine, or "
        "executor local) computes with the trainer's own tensors, or is handed the buckets in memory; auto: for a "
        "rollout that waits for the update, in_process on the local executor and under the hybrid engine, else "
        "shared_memory when actor_train and actor_infer have no device_mapping and ray.address is unset, "
        "collective otherwise; object_store where a scheduler generates while the policy trains")
    weight_bucket_mb: float = Field(64, gt=0, description="size of one weight-sync bucket")
    max_restarts: int = Field(1, ge=0, description="restarts of the workers from the last checkpoint after "
                              "a worker process dies or stops answering; 0 = stop at the first failure")
    worker_timeout_s: float = Field(1800, gt=0, description="a worker call that takes longer counts as a dead worker")
    cpu_matmul: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="the kernel of the linear layers of models on CPU (hf strategies): onednn, torch's "
        "oneDNN fp32 kernel (on an AMD EPYC with AVX-512 2-3x the speed of MKL's sgemm, torch's default; on an "
        "Intel Xeon, or an AMD EPYC with AVX2 only, level or slower); torch, torch's default; auto: onednn on AMD "
        "CPUs with AVX-512 where this torch build offers it, torch elsewhere. The same fp32 arithmetic either way")
    pack_decoding_weights: bool = Field(
        True, description="hf engines on CPU pack each large fp32 linear weight once per generate call into the "
        "layout of MKL's sgemm (torch's default kernel), or of oneDNN's on AMD CPUs, and compute the decoding steps' "
        "small products from it instead of reordering the weight at every step; a 95M model generated 1.2x faster "
        "on an Intel Xeon (MKL) and 1.3x on an AMD EPYC (oneDNN). The copies hold 1-5x the bytes of those weights "
        "during the call; where they would take more than half the memory available, nothing is packed. Not for "
        "layers on oneDNN (runtime.cpu_matmul) or under bf16 autocast; the same fp32 arithmetic")
    cudnn_attention: bool = Field(
        False, description="workers with a GPU let PyTorch's attention use cuDNN's kernel (bf16 and fp16 inputs). "
        "Off by default: cuDNN builds a plan for every new shape (tens of ms of CPU each), and RL's shapes change "
        "at every decoding step and batch; on an H200 it made bf16 generation of a 95M model 4x slower than fp32. "
        "Off, PyTorch takes its flash or memory-efficient kernels. No effect on CPU or in vLLM, SGLang, Megatron")
    reuse_freed_memory: bool = Field(
        True, description="workers that compute on CPU (no device_mapping) keep the memory they free for their next "
        "allocations instead of handing it back to the kernel (glibc's mallopt: no mmap, no trimming), so a step does "
        "not fault its activations in again; on the 95M benchmark model, updates 1.1-1.2x faster. The process keeps "
        "its peak until it exits. No effect outside glibc")


#: The sections of :class:`RollConfig` that only some pipelines read; each pipeline names its own in
#: ``Pipeline.config_sections`` (a resume ignores changes to the others).
PIPELINE_SECTIONS = frozenset({"warmup", "dpo", "reward_model", "distill", "agentic"})


class RollConfig(Strict):
    """A run: every section below, checked before any worker starts (``roll validate``)."""

    exp_name: str = Field("quickstart", description="the run's name (the swanlab and wandb trackers' project)")
    output_dir: str = Field("runs/quickstart", description="checkpoints, metrics and logs of the run")
    seed: int = Field(
        42, description="seed of every random stream; each role and data order draws from its own offset of it")
    pipeline: str = Field("rlvr", description="a registered pipeline: rlvr, sft, dpo, online_dpo, reward_model, "
                          "distill, agentic, or a plugin's")
    executor: Literal["ray", "local"] = Field(
        "ray", description="ray: every worker a Ray actor; local: every worker in this process (debuggers, no Ray)")
    torch_threads: int = Field(2, ge=1, description="intra-op threads of every worker (same in both executors)")
    ray: RayConfig = RayConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    warmup: WarmupConfig = WarmupConfig()
    dpo: DPOConfig = DPOConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    distill: DistillConfig = DistillConfig()
    agentic: AgenticConfig = AgenticConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    roles: RolesConfig = RolesConfig()
    trainer: TrainerConfig = TrainerConfig()
    trackers: list[str] = Field(
        default_factory=lambda: ["stdout", "jsonl", "tensorboard"], description="registered trackers that receive "
        "every step's metrics, all at once: stdout, jsonl, tensorboard, swanlab, wandb")

    @model_validator(mode="after")
    def _cross_checks(self):
        algo = self.algorithm
        if self.data.domains and (self.data.train_file or self.data.eval_file):
            raise ValueError("data.domains replaces data.train_file / data.eval_file: give each domain its own files")
        if algo.opd_coef > 0 and self.roles.reference is None:
            raise ValueError("algorithm.opd_coef > 0 needs a teacher: roles.reference (with its model_path)")
        if (algo.kl_loss_coef > 0 or algo.kl_penalty.coef > 0) and self.roles.reference is None:
            raise ValueError("algorithm.kl_loss_coef / kl_penalty.coef > 0 need a reference role (roles.reference is null)")
        repeated = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if repeated:
            raise ValueError(f"trackers lists {', '.join(repeated)} more than once; each would log every step again")
        self._check_placement()
        if algo.ppo_mini_batch_size is not None:
            samples = self.rollout.prompts_per_step * self.rollout.num_return_sequences
            if samples % algo.ppo_mini_batch_size:
                raise ValueError(f"algorithm.ppo_mini_batch_size ({algo.ppo_mini_batch_size}) must divide the "
                                 f"samples per step (prompts_per_step * num_return_sequences = {samples})")
        return self

    def role(self, name: str, kind: str | None = None) -> RoleConfig:
        """The role at key ``roles.<name>``, checked to be of ``kind`` when given."""
        roles = self.roles.named()
        role = roles.get(name)
        if role is None:
            fitting = [n for n, r in roles.items() if kind in (None, r.kind)]
            raise ValueError(f"roles.{name} is not configured; configured{f' {kind}' if kind else ''} roles: "
                             f"{', '.join(fitting) or '(none)'}")
        if kind is not None and role.kind != kind:
            raise ValueError(f"roles.{name} is a {role.kind} role, not {kind}")
        return role

    def named_role_problems(self, key: str, name: str, kind: str) -> list[str]:
        """What is wrong with key ``key`` naming role ``name`` of ``kind`` (nothing where it is
        configured and of that kind): for a pipeline's ``config_problems``."""
        try:
            self.role(name, kind)
        except ValueError as exc:
            return [f"key '{key}': {exc}"]
        return []

    def rl_threads(self, role: str) -> int:
        """Intra-op threads of a model role's workers during RL steps (``roles.<role>.torch_threads``)."""
        return getattr(self.role(role), "torch_threads", None) or self.torch_threads

    def reference_on_actor(self) -> bool:
        """Whether the reference is actor_train's base model (LoRA, no ``model_path``): no workers of its own."""
        ref = self.roles.reference
        return ref is not None and ref.model_path is None and self.roles.actor_train.lora is not None

    def placed_roles(self) -> dict[str, Placed]:
        """Every role whose workers may hold devices, by the key it has in ``roles`` (env workers hold
        none; a LoRA run's reference is actor_train's workers)."""
        return {name: role for name, role in self.roles.named().items()
                if isinstance(role, Placed) and not (name == "reference" and self.reference_on_actor())}

    def model_roles(self) -> dict[str, TrainRoleConfig | InferRoleConfig | CriticRoleConfig]:
        """Roles hosted by a strategy (kind train, infer or critic), by key."""
        return {n: r for n, r in self.roles.named().items()
                if isinstance(r, (TrainRoleConfig, InferRoleConfig, CriticRoleConfig))}

    def compiled_roles(self) -> dict[str, TrainRoleConfig | CriticRoleConfig]:
        """Trained roles whose decoder layers are compiled (``compile: true``), by key."""
        return {n: r for n, r in self.model_roles().items()
                if isinstance(r, (TrainRoleConfig, CriticRoleConfig)) and r.compile}

    def _check_placement(self) -> None:
        from roll_core.runtime.placement import check_mappings

        check_mappings(self)
