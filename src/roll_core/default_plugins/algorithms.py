"""Built-in advantage estimators, policy losses, KL estimators, preference and distillation losses
(see ``roll list-plugins``)."""

from roll_core.hookspecs import hookimpl

_ADV = "roll_core.algorithms.advantages"
_LOSS = "roll_core.algorithms.losses"
_KL = "roll_core.algorithms.kl"
_PREF = "roll_core.algorithms.preference"
_KD = "roll_core.algorithms.distill"


@hookimpl
def roll_register_advantage_estimators(register):
    register("gae", f"{_ADV}:gae", description="generalized advantage estimation with a critic (PPO)",
             needs=("critic",))
    register("grpo", f"{_ADV}:grpo", description="group-normalised outcome advantage (GRPO / Dr. GRPO)",
             group_baseline=True)
    register("rloo", f"{_ADV}:rloo", description="leave-one-out baseline", group_baseline=True)
    register("reinforce", f"{_ADV}:reinforce", description="discounted return, no baseline")
    register("reinforce_plus_plus", f"{_ADV}:reinforce_plus_plus", description="batch-whitened discounted return")
    register("reinforce_plus_plus_baseline", f"{_ADV}:reinforce_plus_plus_baseline",
             description="group-mean baseline, then batch whitening", group_baseline=True)
    register("raft", f"{_ADV}:raft", description="1 for accepted samples, 0 otherwise (RAFT / RAFT++)")
    register("step_reinforce", f"{_ADV}:step_reinforce", description="per-turn discounted return, batch-whitened")
    register("agentic_reinforce", f"{_ADV}:agentic_reinforce",
             description="per-turn discounted return minus the group's mean episode return (StarPO)",
             group_baseline=True)
    register("gigpo", f"{_ADV}:gigpo", description="episode-group plus step-group (state hash) advantage",
             group_baseline=True)
    register("opd", f"{_ADV}:opd", description="on-policy distillation: teacher minus student log-prob",
             needs=("reference",), reads_old_log_probs=True)


@hookimpl
def roll_register_policy_losses(register):
    register("ppo_clip", f"{_LOSS}:ppo_clip", description="PPO clipped surrogate, asymmetric clip range")
    register("dual_clip", f"{_LOSS}:dual_clip", description="PPO clip plus a cap on negative-advantage losses")
    register("vanilla_pg", f"{_LOSS}:vanilla_pg", description="-A * log pi")
    register("gspo", f"{_LOSS}:gspo", description="sequence-level importance ratio (GSPO)")
    register("tis", f"{_LOSS}:tis", description="PPO clip with truncated sampler/trainer importance weights")
    register("topr", f"{_LOSS}:topr", description="tapered off-policy REINFORCE, separate +/- weights")
    register("cispo", f"{_LOSS}:cispo", description="clipped, detached IS weight on every token (MiniMax-M1)")
    register("kimi", f"{_LOSS}:kimi", description="-A log pi + tau/2 (log ratio)^2 (Kimi k1.5)")


@hookimpl
def roll_register_kl_estimators(register):
    register("k1", f"{_KL}:k1", description="log p - log q")
    register("k2", f"{_KL}:k2", description="0.5 (log p - log q)^2 (mse)")
    register("k3", f"{_KL}:k3", description="exp(q - p) - (q - p) - 1, low variance")
    register("abs", f"{_KL}:abs_kl", description="|log p - log q|")
    register("full", f"{_KL}:full", description="exact KL over the vocabulary", distribution=True)


@hookimpl
def roll_register_preference_losses(register):
    register("dpo_sigmoid", f"{_PREF}:dpo_sigmoid", description="DPO's -log sigmoid(beta h), cDPO label smoothing")
    register("ipo", f"{_PREF}:ipo", description="IPO: (h - 1/(2 beta))^2, a bounded preference gap")
    register("simpo", f"{_PREF}:simpo", reads_reference=False, average_log_probs=True,
             description="SimPO: -log sigmoid(beta h' - gamma) on the policy's mean log-probs, no reference")


@hookimpl
def roll_register_distill_losses(register):
    register("forward_kl", f"{_KD}:forward_kl", description="KL(teacher || student), mean-seeking")
    register("reverse_kl", f"{_KD}:reverse_kl", description="KL(student || teacher), mode-seeking (MiniLLM)")
    register("adaptive_kl", f"{_KD}:adaptive_kl", description="forward and reverse KL weighted by head/tail gaps (AKL)")
    register("skewed_forward_kl", f"{_KD}:skewed_forward_kl", description="KL(p || a p + (1-a) q) (DistiLLM)")
    register("skewed_reverse_kl", f"{_KD}:skewed_reverse_kl", description="KL(q || a q + (1-a) p) (DistiLLM)")
    register("jsd", f"{_KD}:jsd", description="generalised Jensen-Shannon divergence (GKD)")
