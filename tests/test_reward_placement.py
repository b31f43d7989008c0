"""Where a reward role scores (``placement``): lightweight rewards in the driver, every other reward
on reward workers of its own, and one router over groups of both kinds.

Fast unit tests; the Ray runs that check where the reward landed (``placement.json``) are
``test_pipeline.py::test_same_seed_same_metrics_local_and_ray`` (the driver, or two workers) and
``test_multi_domain.py::test_two_domain_run_reports_per_domain_metrics`` (both in one run).
"""


import pytest

from roll_core.config.schema import DomainRewardConfig, RewardRoleConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import scores_in_driver
from roll_core.rewards import ExactMatch, Reward, RewardInput
from roll_core.rollout.rewards import RewardRouter
from roll_core.runtime import LocalExecutor
from roll_core.runtime.reward_worker import RewardWorker
from roll_core.testing import hooks


class Judge(Reward):
    """Stands for a reward that may be slow or hang: not lightweight (the default)."""

    def score(self, sample):
        return 0.5


@pytest.fixture
def registry(roll_plugins):
    return roll_plugins(("mine", hooks(
        roll_register_rewards=lambda register: register("judge", Judge)))).rewards


def test_only_the_built_in_string_checks_declare_themselves_lightweight():
    assert ExactMatch.lightweight and not Reward.lightweight and not Judge.lightweight


@pytest.mark.parametrize("spec, names, in_driver", [
    ({}, ["exact_match"], True),                                    # auto: one CPU worker, lightweight
    ({"placement": "workers"}, ["exact_match"], False),
    ({"num_workers": 2}, ["exact_match"], False),                   # several workers were asked for
    ({"device_mapping": [0]}, ["exact_match"], False),              # a device is a worker's
    ({}, ["judge"], False),                                         # may hang: contained in a worker
    ({"placement": "driver"}, ["judge"], True),                     # the user's call
])
def test_auto_puts_one_worker_of_lightweight_rewards_in_the_driver(registry, spec, names, in_driver):
    assert scores_in_driver(RewardRoleConfig(**spec), names, registry) is in_driver


def test_a_domain_scores_in_the_driver_only_if_every_one_of_its_rewards_is_lightweight(registry):
    light = DomainRewardConfig(rewards=[{"name": "exact_match"}])
    mixed = DomainRewardConfig(rewards=[{"name": "exact_match"}, {"name": "judge", "weight": 0.5}])
    assert scores_in_driver(light, ["exact_match"], registry)
    assert not scores_in_driver(mixed, ["exact_match", "judge"], registry)


def test_placement_driver_with_several_workers_or_devices_is_a_config_error(tiny_config):
    with pytest.raises(ConfigError, match=r"placement 'driver' .* num_workers above 1 \(got 2\)"):
        tiny_config("roles.reward.placement=driver", "roles.reward.num_workers=2")
    with pytest.raises(ConfigError, match=r"placement 'driver'.*device_mapping"):
        tiny_config("roles.domain_rewards={code: {rewards: [{name: exact_match}], placement: driver, "
                    "device_mapping: [0]}}")
    with pytest.raises(ConfigError, match=r"driver.*workers|auto"):
        tiny_config("roles.reward.placement=drivers")


class Deferred(LocalExecutor):
    """Calls whose futures are not their results: only this executor's ``get`` opens them, as only
    Ray's opens a Ray future."""

    name = "deferred"

    def invoke(self, handle, method, args, kwargs):
        return ("deferred", super().invoke(handle, method, args, kwargs))

    def get(self, futures):
        if isinstance(futures, list):
            return [self.get(f) for f in futures]
        assert futures[0] == "deferred", "a future opened by another executor"
        return futures[1]


def test_one_router_mixes_driver_groups_and_worker_groups_each_through_its_own_executor(roll_plugins):
    roll_plugins()
    in_driver = LocalExecutor().spawn("reward", RewardWorker, [([("exact_match", {}, 1.0)], None)])
    on_workers = Deferred().spawn("reward/code", RewardWorker, [([("exact_match", {}, 2.0)], None)] * 2)
    router = RewardRouter(in_driver, {"code": on_workers})
    router.ready()
    samples = [RewardInput("p", "x", "x", "code"), RewardInput("p", "x", "x"), RewardInput("p", "x", "y", "code"),
               RewardInput("p", "y", "y", "code")]
    scores, components, seconds = router.gather(router.submit(samples))
    assert scores == [2.0, 1.0, 0.0, 2.0]
    assert components[1] == {"exact_match": 1.0} and components[3] == {"exact_match": 1.0}
    assert 0.0 <= seconds < 1.0  # the workers' own scoring time, summed: microseconds here
    # a domain's single samples take its workers in turn
    tickets = [router.submit([RewardInput("p", "x", "x", "code")]) for _ in range(3)]
    assert [t.parts[0][2] for t in tickets] == [0, 1, 0]  # the three above took both, in turn
    assert [router.gather(t)[0] for t in tickets] == [[2.0]] * 3
