"""Sequence packing for supervised steps (``warmup.packing``): the layout, and that a packed update
is the padded update (same loss, same weights), so packing only removes padding."""

from __future__ import annotations

import types

import pytest
import torch

from roll_core import hookimpl
from roll_core.algorithms.objective import SupervisedObjective
from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import load_tokenizer
from roll_core.pipelines.batches import demonstration_batch, packed_demonstration_batch
from roll_core.strategies.hf import HFTrainStrategy
from roll_core.strategies.models import load_causal_lm
from roll_core.testing import full_weights
from roll_core.training import UpdateSpec, update

ROWS = [{"prompt": "12+34=", "demonstration": "46"}, {"prompt": "1+1=", "demonstration": "2"},
        {"prompt": "99+1=", "demonstration": "100"}, {"prompt": "7+8=", "demonstration": "15"}]


def test_examples_pack_longest_first_with_positions_restarting(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path))
    # token counts (prompt + answer + EOS): 12+34=46 -> 9, 1+1=2 -> 6, 99+1=100 -> 9, 7+8=15 -> 7
    batch = packed_demonstration_batch(tokenizer, ROWS, max_length=16)
    ids = torch.cat([batch["prompt_ids"], batch["responses"]], 1)
    target = torch.cat([torch.zeros(len(ids), 1, dtype=torch.long), batch["response_mask"]], 1)
    # first fit, longest first (9, 9, 7, 6): 12+34 opens row 0, 99+1 does not fit there and opens
    # row 1, 7+8 fills row 0 to 16, 1+1 joins row 1 (15, then one padding slot)
    assert ids.shape == (2, 16)
    assert tokenizer.decode(ids[0]) == "12+34=46</s>7+8=15</s>"
    assert batch["position_ids"][0].tolist() == [*range(9), *range(7)]
    assert batch["position_ids"][1].tolist() == [*range(9), *range(6), 0]  # the last slot: padding
    assert tokenizer.decode(ids[1][target[1].bool()]) == "100</s>2</s>"  # the loss: answers and EOS only
    assert int(target.sum()) == sum(len(r["demonstration"]) + 1 for r in ROWS)
    assert len(packed_demonstration_batch(tokenizer, ROWS, max_length=16, multiple_of=4)) == 4  # padding rows


def test_an_example_longer_than_a_row_is_an_error(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path))
    with pytest.raises(ConfigError, match="an example of 9 tokens does not fit warmup.max_length=8; raise it"):
        packed_demonstration_batch(tokenizer, ROWS, max_length=8)


def test_a_packed_update_is_the_padded_update(tiny_model_path):
    """The examples of a row see only themselves: same per-token log-probs, loss and weights."""
    tokenizer = load_tokenizer(str(tiny_model_path))
    cfg = load_config(None, ["roles.actor_train.micro_batch_size=2"])
    spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=2, optimizer="warmup", lr=1e-3, metric_prefix="warmup")
    results = []
    for batch in (demonstration_batch(tokenizer, ROWS), packed_demonstration_batch(tokenizer, ROWS, max_length=16)):
        trainer = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
        logp = trainer.compute_log_probs(batch, 1.0)[batch["response_mask"].bool()]
        metrics = update(trainer, batch, SupervisedObjective("warmup/loss"), spec)
        results.append((logp, metrics["warmup/loss"], full_weights(trainer)))
    (padded_logp, padded_loss, padded_weights), (packed_logp, packed_loss, packed_weights) = results
    # the same target tokens in another order (packing sorts longest first): compare as sorted sets
    torch.testing.assert_close(packed_logp.sort().values, padded_logp.sort().values, atol=1e-5, rtol=0)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    for name, value in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], value, atol=1e-5, rtol=1e-4, msg=name)
    initial = dict(load_causal_lm(str(tiny_model_path)).named_parameters())
    assert max(float((packed_weights[n] - initial[n]).abs().max()) for n in initial) > 5e-4  # Adam moved them ~lr


def test_packing_needs_a_strategy_that_takes_packed_sequences(roll_plugins):
    def roll_register_strategies(register):
        register("plain", "roll_core.strategies.hf:HFTrainStrategy", kind="train")

    plugins = roll_plugins(("t", types.SimpleNamespace(roll_register_strategies=hookimpl(roll_register_strategies))))
    with pytest.raises(ConfigError, match="'warmup.packing': train strategy 'plain' does not take packed sequences; "
                                          "strategies that do: .*hf"):
        load_and_check(None, ["warmup.packing=true", "roles.actor_train.strategy=plain"], plugins)
    load_and_check(None, ["warmup.packing=true"], plugins)  # hf does


def test_sft_with_packing_lowers_the_held_out_loss(tiny_config):
    from roll_core.pipelines.sft import SFTPipeline
    from roll_core.runtime.executor import LocalExecutor

    cfg = tiny_config("pipeline=sft", "warmup.steps=40", "warmup.packing=true", "warmup.max_length=128",
                      "trainer.max_steps=40", "trainer.eval_every=40")
    summary = SFTPipeline(cfg, LocalExecutor()).run()
    before, after = summary["before"]["eval/loss"], summary["after"]["eval/loss"]
    assert after < 0.6 * before, (before, after)
