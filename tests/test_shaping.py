"""Reward shaping, sample masks and group filters, against numbers computed by hand."""


import math

import pytest
import torch

from roll_core.algorithms.shaping import (
    AdaptiveKLController, RewardShaper, RunningMoments, keep_groups, outcome_token_rewards,
)
from roll_core.config.schema import AlgorithmConfig
from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.plugins import get_plugins


def shaper(**algo):
    return RewardShaper(AlgorithmConfig(**algo), get_plugins())


def scored(scores, groups, width=2, **extra):
    scores = torch.tensor(scores, dtype=torch.float32)
    mask = torch.ones(len(scores), width, dtype=torch.long)
    return Batch({"scores": scores, "group_index": torch.tensor(groups), "response_mask": mask,
                  "old_log_probs": torch.zeros(len(scores), width), **extra})


def test_outcome_token_rewards_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    r = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert r.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]


def test_reward_norm_litePPO_group_mean_batch_std():
    # scores 1, 0 | 1, 1: group means .5, .5, 1, 1 -> centred .5, -.5, 0, 0
    # batch std (unbiased) of [1, 0, 1, 1]: mean .75, var (.0625 * 3 + .5625) / 3 = .25, std .5
    # -> 1, -1, 0, 0 ; with the reinforce estimator (gamma 1) that is the advantage of every token
    s = shaper(advantage_estimator="reinforce", reward_norm={"mean": "group", "std": "batch"})
    batch = scored([1, 0, 1, 1], [0, 0, 1, 1])
    s.shape(batch)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mean, std, expected", [
    # scores [2, 4, 6, 8], groups [0, 0, 1, 1]
    ("batch", "none", [-3.0, -1.0, 1.0, 3.0]),                     # mean 5
    ("none", "batch", [2 / 2.581989, 4 / 2.581989, 6 / 2.581989, 8 / 2.581989]),  # std sqrt(20/3)
    ("group", "group", [-0.707107, 0.707107, -0.707107, 0.707107]),  # (x - 3) / sqrt(2) ...
])
def test_reward_norm_scopes(mean, std, expected):
    s = shaper(reward_norm={"mean": mean, "std": std})
    out = s.normalize(torch.tensor([2.0, 4.0, 6.0, 8.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-4, rtol=0)


def test_running_norm_uses_every_score_so_far():
    # step 1 scores [0, 2], step 2 [4]: running mean of 0, 2, 4 = 2, unbiased std 2 -> (4 - 2) / 2 = 1
    s = shaper(reward_norm={"mean": "running", "std": "running"})
    s.normalize(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]))
    out = s.normalize(torch.tensor([4.0]), torch.tensor([0]))
    assert float(out) == pytest.approx(1.0, abs=1e-5)
    # the state survives a checkpoint round trip
    restored = shaper(reward_norm={"mean": "running", "std": "running"})
    restored.load_state_dict(s.state_dict())
    assert restored.running.mean == pytest.approx(2.0) and restored.running.std == pytest.approx(2.0)


def test_running_moments_match_the_whole_sample():
    m = RunningMoments()
    data = torch.tensor([1.0, 5.0, 2.0, 8.0, 3.0])
    m.update(data[:2])
    m.update(data[2:])
    assert m.mean == pytest.approx(float(data.mean())) and m.std == pytest.approx(float(data.std()))


def test_reward_clip_after_normalisation():
    # batch mean of [0, 10] is 5 -> centred -5, 5 -> clipped to -2, 2 (clip comes after normalisation)
    s = shaper(advantage_estimator="reinforce", reward_norm={"mean": "batch"}, reward_clip=2.0)
    batch = scored([0, 10], [0, 1])
    s.shape(batch)
    assert batch["token_level_rewards"][:, -1].tolist() == [-2.0, 2.0]


def test_fixed_kl_penalty_on_every_token():
    # k1 = old - ref = 0.5 on each of 2 tokens; beta 0.1 -> each token -0.05 ; score 1 on the last
    s = shaper(advantage_estimator="reinforce", kl_penalty={"coef": 0.1, "estimator": "k1"})
    batch = scored([1.0], [0], old_log_probs=torch.tensor([[0.0, 0.0]]), ref_log_probs=torch.tensor([[-0.5, -0.5]]))
    metrics = s.shape(batch)
    torch.testing.assert_close(batch["token_level_rewards"], torch.tensor([[-0.05, 0.95]]))
    assert metrics["shaping/kl_penalty_kl"] == pytest.approx(1.0)  # per-sequence sum 0.5 + 0.5
    assert metrics["shaping/kl_coef"] == pytest.approx(0.1)


def test_adaptive_kl_controller_by_hand():
    # target .1, observed .3 -> error clip(3 - 1) = .2 ; n 64, horizon 640 -> beta * (1 + .2 * .1) = 1.02 beta
    c = AdaptiveKLController(0.5, target=0.1, horizon=640)
    c.update(0.3, 64)
    assert c.value == pytest.approx(0.51)
    # observed .05 -> error .05 / .1 - 1 = -.5 -> clipped to -.2 -> * (1 - .02)
    c.update(0.05, 64)
    assert c.value == pytest.approx(0.51 * 0.98)


def test_adaptive_kl_penalty_updates_beta_after_use():
    s = shaper(advantage_estimator="reinforce",
               kl_penalty={"coef": 0.1, "estimator": "k1", "adaptive": True, "target_kl": 0.5, "horizon": 10})
    batch = scored([1.0], [0], old_log_probs=torch.tensor([[0.0, 0.0]]), ref_log_probs=torch.tensor([[-0.5, -0.5]]))
    metrics = s.shape(batch)
    assert metrics["shaping/kl_coef"] == pytest.approx(0.1)  # the step used the current beta ...
    # ... then kl 1.0 vs target .5: error clip(1) = .2, n 1, horizon 10 -> 0.1 * 1.02
    assert s.beta == pytest.approx(0.102)
    assert s.state_dict()["kl_coef"] == pytest.approx(0.102)


def test_whiten_rewards_keeps_the_mean():
    # token rewards [[0, 1], [0, 3]] over 4 tokens: mean 1, unbiased var (1 + 0 + 1 + 4) / 3 = 2,
    # std 1.414214; (x - 1) / 1.414214 + 1 -> [0.292893, 1], [0.292893, 2.414214] (mean still 1)
    s = shaper(advantage_estimator="reinforce", whiten_rewards=True)
    batch = scored([1.0, 3.0], [0, 1])
    s.shape(batch)
    torch.testing.assert_close(batch["token_level_rewards"], torch.tensor([[0.292893, 1.0], [0.292893, 2.414214]]),
                               atol=1e-4, rtol=0)


def test_whiten_and_clip_advantages():
    # reinforce with scores 0, 4 on two tokens each: advantages (returns) 0, 0, 4, 4 -> whitened
    # mean 2, unbiased std 2.309401 -> -0.866, -0.866, 0.866, 0.866 ; clip 0.5 -> -.5, .5
    s = shaper(advantage_estimator="reinforce", whiten_advantages=True, advantage_clip=0.5)
    batch = scored([0.0, 4.0], [0, 1])
    s.shape(batch)
    torch.testing.assert_close(batch["advantages"], torch.tensor([[-0.5, -0.5], [0.5, 0.5]]), atol=1e-5, rtol=0)


def test_max_length_mask_removes_truncated_samples_from_the_loss():
    s = shaper(advantage_estimator="reinforce", max_length_mask=True)
    batch = scored([1.0, 1.0], [0, 1], truncated=torch.tensor([True, False]))
    metrics = s.shape(batch)
    assert batch["loss_mask"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert batch["advantages"][0].abs().sum() == 0 and metrics["shaping/masked_samples"] == 1.0


def test_difficulty_mask_keeps_groups_with_mean_inside_the_range():
    # group means: g0 (1, 1) = 1 -> out ; g1 (1, 0) = .5 -> in ; g2 (0, 0) = 0 -> out   (range (0, 1))
    s = shaper(difficulty_mask={"low": 0.0, "high": 1.0})
    batch = scored([1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 2, 2])
    s.shape(batch)
    assert batch["loss_mask"][:, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_keep_groups_mean_and_std_filters():
    from roll_core.config.schema import DynamicSamplingConfig

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    mean = keep_groups(scores, groups, DynamicSamplingConfig(filter="mean"))
    # means 1, .5, 0, .5 -> only groups 1 and 3 are strictly inside (0, 1)
    assert mean.tolist() == [False, False, True, True, False, False, True]
    std = keep_groups(scores, groups, DynamicSamplingConfig(filter="std"))
    # std 0, .7071, 0, and group 3 has one sample (no spread) -> only group 1
    assert std.tolist() == [False, False, True, True, False, False, False]
    assert keep_groups(scores, groups, DynamicSamplingConfig()).all()


def test_masked_samples_do_not_count_in_loss_denominators():
    from roll_core.algorithms.objective import loss_denominators

    batch = Batch({"response_mask": torch.ones(3, 4), "loss_mask": torch.tensor([[1.0] * 4, [0.0] * 4, [1, 1, 0, 0]])})
    assert loss_denominators(batch) == (6.0, 2.0)


def test_config_rejects_a_mini_batch_that_does_not_divide_the_step():
    from roll_core.config.loader import load_config
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        load_config(None, ["rollout.prompts_per_step=4", "rollout.num_return_sequences=2",
                           "algorithm.ppo_mini_batch_size=3"])
    with pytest.raises(ConfigError, match="low"):
        load_config(None, ["algorithm.difficulty_mask.low=0.9", "algorithm.difficulty_mask.high=0.1"])


def test_advantage_whitening_leaves_masked_samples_out_of_its_statistics():
    # reinforce, scores 0, 4 and a truncated 100 (max_length_mask): whitening over the first two
    # rows only: values 0, 0, 4, 4 -> mean 2, unbiased std 2.309401 -> -0.866025, +0.866025 ; the
    # masked row gets 0 (with the 100 in the statistics the first two would be about -0.58)
    s = shaper(advantage_estimator="reinforce", whiten_advantages=True, max_length_mask=True)
    batch = scored([0.0, 4.0, 100.0], [0, 1, 2], truncated=torch.tensor([False, False, True]))
    s.shape(batch)
    torch.testing.assert_close(batch["advantages"], torch.tensor([[-0.866025, -0.866025], [0.866025, 0.866025],
                                                                  [0.0, 0.0]]), atol=1e-5, rtol=0)


def test_shape_hands_every_batch_field_to_the_estimator_and_stores_what_it_returns(roll_plugins):
    """The estimator sees the batch's values, old and reference log-probs, turns and state hashes;
    its advantages (masked) and returns land in the batch, with the mean |advantage| per token."""
    import types

    from roll_core import hookimpl

    seen = {}

    def recording(inputs, config):
        seen["inputs"] = inputs
        return torch.tensor([[2.0, -1.0], [3.0, 5.0]]), torch.tensor([[7.0, 8.0], [9.0, 10.0]])

    @hookimpl
    def roll_register_advantage_estimators(register):
        register("recording", recording)

    plugins = roll_plugins(("rec", types.SimpleNamespace(roll_register_advantage_estimators=roll_register_advantage_estimators)))
    fields = {"values": torch.tensor([[0.1, 0.2], [0.3, 0.4]]), "ref_log_probs": torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]),
              "turn_index": torch.tensor([[0, 1], [0, -1]]), "state_hash": torch.tensor([[11, 12], [13, 14]])}
    batch = Batch({"scores": torch.tensor([1.0, 2.0]), "group_index": torch.tensor([0, 0]),
                   "response_mask": torch.tensor([[1, 1], [1, 0]]),
                   "old_log_probs": torch.tensor([[-0.5, -0.6], [-0.7, -0.8]]), **fields})
    metrics = RewardShaper(AlgorithmConfig(advantage_estimator="recording"), plugins).shape(batch)

    got = seen["inputs"]
    for name in ("values", "turn_index", "state_hash"):
        assert torch.equal(getattr(got, name), fields[name]), name
    assert torch.equal(got.teacher_log_probs, fields["ref_log_probs"])
    assert torch.equal(got.old_log_probs, batch["old_log_probs"])
    # the score sits on the last valid token: row 1 has one token, so index 0
    assert got.token_level_rewards.tolist() == [[0.0, 1.0], [2.0, 0.0]]
    assert batch["advantages"].tolist() == [[2.0, -1.0], [3.0, 0.0]]  # masked by the loss mask
    assert batch["returns"].tolist() == [[7.0, 8.0], [9.0, 10.0]]
    assert metrics["advantage/abs_mean"] == pytest.approx((2 + 1 + 3) / 3)


def test_an_estimator_without_optional_fields_gets_none(roll_plugins):
    import types

    from roll_core import hookimpl

    seen = {}

    @hookimpl
    def roll_register_advantage_estimators(register):
        register("recording", lambda inputs, config: (seen.setdefault("x", inputs), (inputs.token_level_rewards,) * 2)[1])

    plugins = roll_plugins(("rec", types.SimpleNamespace(roll_register_advantage_estimators=roll_register_advantage_estimators)))
    batch = Batch({"scores": torch.tensor([1.0]), "group_index": torch.tensor([0]), "response_mask": torch.ones(1, 2)})
    RewardShaper(AlgorithmConfig(advantage_estimator="recording"), plugins).shape(batch)
    got = seen["x"]
    assert (got.values, got.old_log_probs, got.teacher_log_probs, got.turn_index, got.state_hash) == (None,) * 5


def test_keep_groups_without_a_filter_keeps_every_row_as_a_bool_mask():
    from roll_core.config.schema import DynamicSamplingConfig

    keep = keep_groups(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 0, 1]), DynamicSamplingConfig(filter="none"))
    assert keep.dtype == torch.bool and keep.tolist() == [True, True, True]


def test_a_fixed_kl_penalty_keeps_its_coefficient():
    # kl_penalty not adaptive: beta stays at coef step after step, whatever the measured KL
    s = shaper(advantage_estimator="reinforce", kl_penalty={"coef": 0.1, "estimator": "k1"})
    for _ in range(2):
        batch = scored([1, 0], [0, 0], ref_log_probs=torch.full((2, 2), -1.0))
        assert s.shape(batch)["shaping/kl_coef"] == pytest.approx(0.1)


def test_adaptive_kl_coefficient_survives_a_checkpoint_and_old_states_load():
    kl = {"coef": 0.1, "estimator": "k1", "adaptive": True, "target_kl": 0.01, "horizon": 10}
    first = shaper(advantage_estimator="reinforce", kl_penalty=kl)
    first.shape(scored([1, 0], [0, 0], ref_log_probs=torch.full((2, 2), -1.0)))
    assert first.beta != pytest.approx(0.1)  # the controller moved it
    resumed = shaper(advantage_estimator="reinforce", kl_penalty=kl)
    resumed.load_state_dict(first.state_dict())
    assert resumed.beta == first.beta
    older = shaper(advantage_estimator="reinforce", kl_penalty=kl)
    older.load_state_dict({**first.state_dict(), "kl_coef": None})  # a checkpoint without the controller
    assert older.beta == pytest.approx(0.1)
    fixed = shaper(advantage_estimator="reinforce")
    fixed.load_state_dict(first.state_dict())  # a fixed coefficient ignores a saved controller
    assert fixed.beta == 0.0


def test_truncated_rows_train_unless_max_length_mask_is_on():
    truncated = torch.tensor([True, False])
    assert shaper().sample_mask(scored([1, 0], [0, 0], truncated=truncated)).tolist() == [1.0, 1.0]
    assert shaper(max_length_mask=True).sample_mask(scored([1, 0], [0, 0], truncated=truncated)).tolist() == [0.0, 1.0]


def test_length_and_difficulty_masks_combine():
    # group 0 (mean .5) passes the difficulty mask, group 1 (mean 1) does not; row 0 is truncated
    s = shaper(max_length_mask=True, difficulty_mask={"low": 0.0, "high": 1.0})
    batch = scored([1, 0, 1, 1], [0, 0, 1, 1], truncated=torch.tensor([True, False, False, False]))
    assert s.sample_mask(batch).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_batch_std_of_two_scores_and_of_one():
    # [1, 3]: unbiased std sqrt(2); no centring -> 1 / 1.414214, 3 / 1.414214
    out = shaper(reward_norm={"mean": "none", "std": "batch"}).normalize(torch.tensor([1.0, 3.0]), torch.tensor([0, 1]))
    torch.testing.assert_close(out, torch.tensor([0.707107, 2.121320]), atol=1e-5, rtol=0)
    # one score has no std: divide by 1 (+ EPS), not NaN
    one = shaper(reward_norm={"mean": "none", "std": "batch"}).normalize(torch.tensor([3.0]), torch.tensor([0]))
    assert float(one[0]) == pytest.approx(3.0 / (1.0 + 1e-6), abs=1e-6)


def test_kl_penalty_with_a_distribution_estimator_and_padding():
    # estimator "full" reads old_log_dist / ref_log_dist [B, R, V]. Row 0: both tokens; row 1: one token
    # (padding masked). KL per token: old = (.5, .5), ref = (.25, .75) -> .5 ln(.5/.25) + .5 ln(.5/.75) = 0.143841
    # identical distributions give 0. seq KL = mean over rows of row sums = (2 * 0.143841 + 0.143841) / 2
    old = torch.log(torch.tensor([0.5, 0.5])).expand(2, 2, 2).clone()
    ref = torch.log(torch.tensor([0.25, 0.75])).expand(2, 2, 2).clone()
    ref[1, 1] = old[1, 1] + 5.0  # garbage on the padded token of row 1 must not count
    batch = scored([1, 0], [0, 0], old_log_dist=old, ref_log_dist=ref,
                   ref_log_probs=torch.zeros(2, 2))
    batch.tensors["response_mask"] = torch.tensor([[1, 1], [1, 0]])
    s = shaper(advantage_estimator="reinforce", kl_penalty={"coef": 1.0, "estimator": "full"})
    metrics = s.shape(batch)
    per_token = 0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)
    assert metrics["shaping/kl_penalty_kl"] == pytest.approx(1.5 * per_token, rel=1e-5)
    # the penalty is subtracted from every valid token's reward: row 1's only token gets 0 - 1.0 * KL
    assert float(batch["token_level_rewards"][1, 0]) == pytest.approx(0.0 - per_token, rel=1e-5)
    assert float(batch["token_level_rewards"][1, 1]) == 0.0


def test_an_estimator_with_its_own_options_model(roll_plugins):
    """``algorithm.advantage_estimator_options`` is checked against the estimator's registered model
    and reaches it as ``options=``."""
    import types

    from pydantic import BaseModel, ConfigDict, Field

    from roll_core import hookimpl
    from roll_core.algorithms.advantages import grpo
    from roll_core.config import check_registry_names, load_config

    class Scale(BaseModel):
        model_config = ConfigDict(extra="forbid")
        factor: float = Field(1.0, gt=0)

    def scaled(inputs, config, options: Scale):
        adv, ret = grpo(inputs, config)
        return options.factor * adv, ret

    @hookimpl
    def roll_register_advantage_estimators(register):
        register("scaled", scaled, options=Scale)

    plugins = roll_plugins(("scale", types.SimpleNamespace(roll_register_advantage_estimators=roll_register_advantage_estimators)))
    batch = scored([1, 0], [0, 0])
    RewardShaper(AlgorithmConfig(advantage_estimator="scaled", advantage_estimator_options={"factor": 3}), plugins).shape(batch)
    # grpo on (1, 0): +-1 / std(sqrt(.5)) = +-0.707107, times 3
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([2.121320, -2.121320]), atol=1e-5, rtol=0)

    cfg = load_config(None, ["algorithm.advantage_estimator=scaled", "algorithm.advantage_estimator_options.factr=2"])
    with pytest.raises(ConfigError, match=r"for advantage estimator 'scaled': unknown option 'factr'\. Did you mean 'factor'\?"):
        check_registry_names(cfg, plugins)
    cfg = load_config(None, ["algorithm.advantage_estimator=scaled", "algorithm.advantage_estimator_options.factor=0"])
    with pytest.raises(ConfigError, match=r"advantage_estimator_options.factor' for advantage estimator 'scaled': "
                                          r"Input should be greater than 0"):
        check_registry_names(cfg, plugins)
    cfg = load_config(None, ["algorithm.advantage_estimator=grpo", "algorithm.advantage_estimator_options.factor=2"])
    with pytest.raises(ConfigError, match="advantage estimator 'grpo' takes no options"):
        check_registry_names(cfg, plugins)


def test_an_options_model_that_does_not_import_is_named_by_validate(roll_plugins):
    import types

    from roll_core import hookimpl
    from roll_core.algorithms.advantages import grpo
    from roll_core.config import check_registry_names, load_config

    @hookimpl
    def roll_register_advantage_estimators(register):
        register("broken", grpo, options="no_such_package.options:Model")

    plugins = roll_plugins(("brk", types.SimpleNamespace(roll_register_advantage_estimators=roll_register_advantage_estimators)))
    cfg = load_config(None, ["algorithm.advantage_estimator=broken"])
    with pytest.raises(ConfigError, match=r"advantage estimator 'broken' \(plugin 'brk'\) registered options that "
                                          r"failed to load: ModuleNotFoundError"):
        check_registry_names(cfg, plugins)


def test_opd_coef_adds_the_distillation_advantage_to_the_estimators():
    """grpo on scores [1, 0] in one group gives +-1/sqrt(2) per token (unbiased std of [1, 0] is
    1/sqrt(2), so (1 - 0.5) / 0.7071 = 0.7071); opd_coef 0.5 adds half of teacher minus old."""
    teacher = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    old = torch.tensor([[-1.5, -1.0], [-0.5, -1.0]])
    batch = scored([1.0, 0.0], [0, 0], ref_log_probs=teacher)
    batch.update(old_log_probs=old)
    metrics = shaper(opd_coef=0.5).shape(batch)
    a = 1 / math.sqrt(2)
    expected = torch.tensor([[a + 0.25, a - 0.5], [-a + 0.0, -a - 1.0]])
    torch.testing.assert_close(batch["advantages"], expected)
    assert metrics["advantage/opd_abs_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 2.0) / 4)


def test_opd_coef_needs_a_teacher():
    from roll_core.config import load_config

    with pytest.raises(ConfigError, match="algorithm.opd_coef > 0 needs a teacher: roles.reference"):
        load_config(None, ["algorithm.opd_coef=1.0", "roles.reference=null"])
