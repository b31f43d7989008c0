"""Gradient accumulation does not change the update: the same mini-batch as 1 x 8 and 8 x 1
micro-batches gives the same loss and the same gradients, for every aggregation mode, through the
real ``hf`` strategies (actor and critic) driven by the core updater."""

import pytest
import torch

from roll_core.algorithms.objective import ActorObjective, CriticObjective
from roll_core.config import load_config
from roll_core.data import Batch
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.testing import training_batch
from roll_core.training import UpdateSpec, accumulate_gradients, update

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def grads(strategy, batch, loss_fn, micro):
    strategy.zero_grad()
    metrics = accumulate_gradients(strategy, batch, loss_fn, micro)
    return metrics, {n: p.grad.clone() for n, p in strategy.model.named_parameters() if p.grad is not None}


def compare(make, batch, loss_fn, loss_key):
    m8, g8 = grads(make(), batch, loss_fn, 8)
    m1, g1 = grads(make(), batch, loss_fn, 1)
    assert m1[loss_key] == pytest.approx(m8[loss_key], rel=1e-5, abs=1e-7)
    assert g1.keys() == g8.keys() and g1
    for name in g8:
        torch.testing.assert_close(g1[name], g8[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_actor_gradients_do_not_depend_on_micro_batch_size(tiny_model_path, mode, loss):
    cfg = load_config(None, [f"algorithm.loss_agg_mode={mode}", f"algorithm.policy_loss={loss}",
                             "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coef=0.01",
                             "rollout.max_new_tokens=5"])

    def make():
        return HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)

    batch = training_batch(make().model.config.vocab_size)
    compare(make, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout), "train/pg_loss")


@pytest.mark.parametrize("mode", MODES)
def test_critic_gradients_do_not_depend_on_micro_batch_size(tiny_model_path, mode):
    cfg = load_config(None, [f"algorithm.loss_agg_mode={mode}", "roles.critic.lr=1e-3", "rollout.max_new_tokens=5"])

    def make():
        return HFCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=0)

    batch = training_batch(make().model.config.vocab_size)
    compare(make, batch, CriticObjective.from_config(cfg.algorithm, cfg.rollout), "critic/value_loss")


def test_a_nan_loss_skips_the_update_and_reports_it(tiny_model_path):
    cfg = load_config(None, ["rollout.max_new_tokens=5"])
    strategy = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    batch = training_batch(strategy.model.config.vocab_size)
    batch.tensors["advantages"][0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in strategy.model.named_parameters()}
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    metrics = update(strategy, batch, loss_fn, spec)
    assert metrics["train/skipped_updates"] == 1.0
    for name, param in strategy.model.named_parameters():
        assert torch.equal(param, before[name]), name  # weights untouched, not poisoned
    batch.tensors["advantages"][0, 0] = 0.0
    assert update(strategy, batch, loss_fn, spec)["train/skipped_updates"] == 0.0


@pytest.mark.parametrize("loss", ["ppo_clip", "tis"])
def test_the_update_own_log_probs_equal_recomputed_old_log_probs(tiny_model_path, loss):
    """``algorithm.old_log_probs: auto`` drops the separate old-log-prob pass when the update is
    one optimizer step: training without ``old_log_probs`` (each micro-batch uses its own forward
    pass, detached) gives the same gradients as with log-probs recomputed by the same model."""
    cfg = load_config(None, [f"algorithm.policy_loss={loss}", "rollout.max_new_tokens=5"])

    def make():
        return HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)

    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    strategy = make()
    batch = training_batch(strategy.model.config.vocab_size)
    batch.tensors["old_log_probs"] = strategy.compute_log_probs(batch, cfg.rollout.temperature)
    m_old, g_old = grads(strategy, batch, loss_fn, 4)
    reused = Batch({k: v for k, v in batch.tensors.items() if k != "old_log_probs"})
    m_new, g_new = grads(make(), reused, loss_fn, 4)
    assert m_new["train/pg_loss"] == pytest.approx(m_old["train/pg_loss"], rel=1e-5, abs=1e-7)
    for name in g_old:
        torch.testing.assert_close(g_new[name], g_old[name], rtol=1e-4, atol=1e-6, msg=name)
