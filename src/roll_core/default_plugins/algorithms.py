"""Built-in advantage estimators, policy losses and KL estimators."""

from roll_core.hookspecs import hookimpl

_ADV = "roll_core.algorithms.advantages"
_LOSS = "roll_core.algorithms.losses"
_KL = "roll_core.algorithms.kl"


@hookimpl
def roll_register_advantage_estimators(register):
    register("grpo", f"{_ADV}:grpo", description="group-normalised outcome advantage (GRPO / Dr. GRPO)")
    register("rloo", f"{_ADV}:rloo", description="leave-one-out baseline")
    register("reinforce_plus_plus", f"{_ADV}:reinforce_plus_plus", description="batch-whitened discounted return")


@hookimpl
def roll_register_policy_losses(register):
    register("ppo_clip", f"{_LOSS}:ppo_clip", description="PPO clipped surrogate, asymmetric clip range")
    register("vanilla_pg", f"{_LOSS}:vanilla_pg", description="-A * log pi")


@hookimpl
def roll_register_kl_estimators(register):
    register("k1", f"{_KL}:k1", description="log p - log q")
    register("k2", f"{_KL}:k2", description="0.5 (log p - log q)^2")
    register("k3", f"{_KL}:k3", description="exp(q - p) - (q - p) - 1, low variance")
