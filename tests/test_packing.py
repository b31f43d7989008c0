"""Sequence packing. For supervised steps (``warmup.packing``): the layout, and that a packed update
is the padded update (same loss, same weights), so packing only removes padding. For every forward
pass of a role (``roles.<role>.pack_sequences``, :mod:`roll_core.strategies.packing`): a group's
prompt is computed once, the outputs and gradients are the padded layout's, and micro-batches can be
sized by tokens (``max_tokens_per_micro_batch``)."""

from __future__ import annotations

import types

import pytest
import torch

from roll_core.algorithms.objective import SupervisedObjective
from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import load_tokenizer
from roll_core.pipelines.batches import demonstration_batch, packed_demonstration_batch
from roll_core.algorithms.objective import ActorObjective
from roll_core.config.schema import CriticRoleConfig, TrainRoleConfig
from roll_core.data import Batch
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.strategies.models import load_causal_lm
from roll_core.strategies.packing import model_config, pack_sequences, packed_forward, packed_inputs
from roll_core.testing import full_weights, grouped_training_batch

from conftest import packed_rows, two_prompt_groups
from roll_core.training import UpdateSpec, micro_batches, update

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
    assert all(t.dtype == torch.long for t in batch.tensors.values())
    assert batch["prompt_mask"].shape == batch["prompt_ids"].shape == (2, 1)
    # an example exactly a row long fits; rows of 13 give three (9 | 9 | 7 + 6), padded to four, and
    # by default no padding rows
    assert len(packed_demonstration_batch(tokenizer, ROWS, max_length=9)) == 4
    assert len(packed_demonstration_batch(tokenizer, ROWS, max_length=13, multiple_of=4)) == 4
    assert len(packed_demonstration_batch(tokenizer, ROWS[:1], max_length=16)) == 1


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
    # Adam's first step moves a weight by lr * g / (|g| + eps): sign-like where |g| >> eps, but where
    # a gradient is near eps (1e-8) float noise from the other summation order shows at up to ~lr. One
    # such weight of 65,536 moved 1.1e-5 apart (lr 1e-3) with transformers 5.23's initialisation, so
    # the bound is 5% of lr; leakage between a row's examples moves many weights by up to 2 * lr.
    for name, value in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], value, atol=5e-5, rtol=1e-4, msg=name)
    initial = dict(load_causal_lm(str(tiny_model_path)).named_parameters())
    assert max(float((packed_weights[n] - initial[n]).abs().max()) for n in initial) > 5e-4  # Adam moved them ~lr


def test_packing_needs_a_strategy_that_takes_packed_sequences(plain_train_strategy):
    plugins = plain_train_strategy
    with pytest.raises(ConfigError, match="'warmup.packing': train strategy 'plain' does not take packed sequences; "
                                          "train strategies that do: .*hf"):
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


# -- packed forward passes (roles.<role>.pack_sequences) -------------------------------------------
def test_a_group_shares_one_prompt_and_each_answer_sees_only_it_and_itself():
    packed = packed_rows(two_prompt_groups(), max_length=1024)
    # unit A (3 + 2 + 1 = 6 tokens) fills a row of 6 (the largest unit); unit B (2 + 3) takes the next
    assert packed.input_ids.tolist() == [[5, 6, 7, 10, 11, 12], [8, 9, 13, 14, 15, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 0]]  # answer 2 restarts at 3
    assert packed.branches.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 0]]
    # each answer token's logits come from the position before it: the prompt's last, then its own
    assert packed.source.tolist() == [[2, 3, 0], [2, 0, 0], [7, 8, 9]]
    allowed = packed.attention_mask("sdpa", torch.float32)[:, 0]
    assert allowed[0, 5].tolist() == [True, True, True, False, False, True]  # answer 2: the prompt and itself
    assert allowed[0, 4].tolist() == [True, True, True, True, True, False]
    assert allowed[1, 2].tolist() == [True, True, True, False, False, False]
    assert allowed[1, 5].tolist() == [False] * 5 + [True]  # padding sees itself only: no empty softmax row
    additive = packed.attention_mask("eager", torch.float32)[0, 0, 5]
    assert additive[3] == torch.finfo(torch.float32).min and additive[0] == 0.0


def test_a_group_wider_than_max_length_repeats_its_prompt():
    packed = packed_rows(two_prompt_groups(), max_length=4)
    # rows are at least as wide as the longest sample alone (5). Group A (6 tokens) goes first:
    # A + answer 1 fills row 0; answer 2 opens a unit with the prompt repeated in a new row (4 of 5);
    # B (5) fits neither row and takes a third
    assert packed.input_ids.tolist() == [[5, 6, 7, 10, 11], [5, 6, 7, 12, 0], [8, 9, 13, 14, 15]]
    assert packed.source.tolist() == [[2, 3, 0], [7, 0, 0], [11, 12, 13]]
    assert packed.units.tolist() == [[0] * 5, [1, 1, 1, 1, -1], [2] * 5]


def test_groups_of_uneven_length_share_rows_instead_of_padding_to_the_widest():
    """One group of 8 tokens (prompt 1, seven 1-token answers) and four of 5 (prompt k, answers
    10k..10k+3), in rows of 8. A unit per group would take 5 rows (40 positions, 12 padding); response
    by response, a group's answers spill into the next row with the prompt repeated: 4 rows."""
    prompts = [1] * 7 + [k for k in (2, 3, 4, 5) for _ in range(4)]
    answers = [10 + i for i in range(7)] + [10 * k + i for k in (2, 3, 4, 5) for i in range(4)]
    batch = Batch({"prompt_ids": torch.tensor(prompts)[:, None], "prompt_mask": torch.ones(23, 1, dtype=torch.long),
                   "responses": torch.tensor(answers)[:, None], "response_mask": torch.ones(23, 1, dtype=torch.long)})
    packed = packed_rows(batch, max_length=8)
    assert packed.input_ids.tolist() == [[1, 10, 11, 12, 13, 14, 15, 16],
                                         [2, 20, 21, 22, 23, 3, 30, 31],   # group 3 starts in row 1 ...
                                         [3, 32, 33, 4, 40, 41, 42, 43],   # ... and goes on here, prompt repeated
                                         [5, 50, 51, 52, 53, 0, 0, 0]]
    assert packed.position_ids[2].tolist() == [0, 1, 1, 0, 1, 1, 1, 1]
    assert packed.units[2].tolist() == [3, 3, 3, 4, 4, 4, 4, 4]
    # answer 31 (sample 12) is predicted from its prompt in row 1 (flat 8 + 5), answer 32 (sample 13)
    # from the repeated prompt in row 2 (flat 16)
    assert packed.source[11:15, 0].tolist() == [13, 13, 16, 16]


def test_rows_narrow_while_as_few_suffice():
    """Groups of 10, 4 and 2 tokens (1-token prompt and answers): at the largest group's width, 2
    rows of 10 with 4 slots empty. At 9 the big group's last answer spills over with its prompt
    repeated and 2 rows still hold everything; at 8 they would not."""
    prompts = [1] * 9 + [2] * 3 + [3]
    answers = [10 + i for i in range(9)] + [20, 21, 22, 30]
    batch = Batch({"prompt_ids": torch.tensor(prompts)[:, None], "prompt_mask": torch.ones(13, 1, dtype=torch.long),
                   "responses": torch.tensor(answers)[:, None], "response_mask": torch.ones(13, 1, dtype=torch.long)})
    assert packed_rows(batch, max_length=1024).input_ids.tolist() == [[1, 10, 11, 12, 13, 14, 15, 16, 17],
                                                                [1, 18, 2, 20, 21, 22, 3, 30, 0]]


def test_packing_refuses_masks_that_are_not_plain_padding():
    batch = two_prompt_groups()
    holes = batch["response_mask"].clone()
    holes[2] = torch.tensor([1, 0, 1])
    with pytest.raises(ValueError, match="response_mask must be 1 on a prefix"):
        pack_sequences(batch["prompt_ids"], batch["prompt_mask"], batch["responses"], holes, max_length=8,
                       pad_token_id=0)
    no_prompt = batch["prompt_mask"].clone()
    no_prompt[2] = 0
    with pytest.raises(ValueError, match="a prompt of at least one token"):
        pack_sequences(batch["prompt_ids"], no_prompt, batch["responses"], batch["response_mask"], max_length=8,
                       pad_token_id=0)
    right_padded = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="prompt_mask must be 1 on a suffix"):
        pack_sequences(batch["prompt_ids"], right_padded, batch["responses"], batch["response_mask"], max_length=8,
                       pad_token_id=0)


def test_attention_without_4d_masks_runs_padded_unless_packing_was_asked_for():
    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2",
                                                               pad_token_id=0))
    batch = two_prompt_groups()
    assert packed_inputs(model, batch, TrainRoleConfig()) is None
    with pytest.raises(ValueError, match="pack_sequences: true needs attention that takes a 4-D mask"):
        packed_inputs(model, batch, TrainRoleConfig(pack_sequences=True))
    model.config._attn_implementation = "sdpa"
    assert packed_inputs(model, batch, TrainRoleConfig(pack_sequences=False)) is None
    assert packed_inputs(model, batch, TrainRoleConfig()).input_ids.shape == (2, 6)
    engine = types.SimpleNamespace(config={"zero_optimization": {}}, module=model)  # DeepSpeed's engine wraps it
    assert packed_inputs(engine, batch, TrainRoleConfig()).input_ids.shape == (2, 6)
    model.config.sliding_window = 4  # the longest sequence (B: 2 + 3 tokens) passes it: the model's own mask must run
    assert packed_inputs(model, batch, TrainRoleConfig()) is None
    with pytest.raises(ValueError, match="a sequence of 5 tokens passes the model's sliding window"):
        packed_inputs(model, batch, TrainRoleConfig(pack_sequences=True))
    model.config.sliding_window = 5
    assert packed_inputs(model, batch, TrainRoleConfig()) is not None


@pytest.mark.parametrize("attention, max_length, pieces", [("sdpa", 1024, False), ("sdpa", 1024, True),
                                                       ("eager", 1024, False), ("sdpa", 12, True)])
def test_packed_passes_give_the_padded_outputs_and_gradients(tiny_model_path, request, attention, max_length, pieces):
    """At 12 tokens per row a group's answers spread over rows, its prompt repeated in each. With
    ``pieces``, every row attends piece by piece (:mod:`roll_core.strategies.packed_attention`),
    which these narrow rows would not otherwise do."""
    if pieces:
        request.getfixturevalue("every_row_by_pieces")
    batch = grouped_training_batch(vocab=90)
    mask = batch["response_mask"].float()
    wanted = ("log_probs", "entropy", "log_dist")
    results = []
    for pack in (False, True):
        trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(pack_sequences=pack, pack_max_length=max_length),
                                  seed=0)
        trainer.model.set_attn_implementation(attention)
        out = trainer._outputs(batch, wanted, temperature=0.7)
        mask = mask.to(trainer.device)  # the outputs are on the model's device (a GPU where there is one)
        (out["log_probs"] * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        results.append(({k: v * (mask[..., None] if v.dim() == 3 else mask) for k, v in out.items()}, grads))
    (padded, padded_grads), (packed, packed_grads) = results
    for name in wanted:
        torch.testing.assert_close(packed[name], padded[name], atol=1e-5, rtol=1e-5, msg=name)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert float(padded["log_probs"].abs().sum()) > 1.0  # the comparison is not of zeros


def test_packed_values_are_the_padded_values(tiny_model_path):
    batch = grouped_training_batch(vocab=90)
    values = [HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(pack_sequences=pack), seed=0)
              .forward(batch, ("values",), 1.0)["values"] for pack in (False, True)]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=1e-5)
    assert float(values[0].abs().sum()) > 0.01


def token_parts(lengths: list[int], *args) -> list[list[int]]:
    """The samples (by index) of each of ``micro_batches(batch, *args)``, for a batch whose samples
    have ``lengths`` tokens (responses only, no prompt)."""
    batch = Batch({"prompt_mask": torch.zeros(len(lengths), 1, dtype=torch.long), "index": torch.arange(len(lengths)),
                   "response_mask": (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()})
    return [micro["index"].tolist() for micro in micro_batches(batch, *args)]


def test_micro_batches_by_tokens_fill_up_to_the_budget_and_match_the_busiest_rank(monkeypatch):
    def parts(*args):
        return token_parts([3, 3, 3, 3, 10], *args)

    assert parts(2) == [[0, 1], [2, 3], [4]]  # by samples
    assert parts(64, 6) == [[0, 1], [2, 3], [4]]  # 6 tokens each; the 10-token sample alone
    assert parts(64, 100) == [[0, 1, 2, 3, 4]]
    groups = []
    monkeypatch.setattr("roll_core.training.all_reduce_max", lambda value, group=None: groups.append(group) or 4)
    # another rank needs 4 passes: the largest splittable part halves
    assert parts(64, 6, "the group") == [[0], [1], [2, 3], [4]]
    assert groups == ["the group"]
    monkeypatch.setattr("roll_core.training.all_reduce_max", lambda value, group=None: 9)
    assert parts(64, 6) == [[0], [1], [2], [3], [4]]  # never more parts than samples


def test_an_update_in_token_sized_micro_batches_is_the_one_pass_update(tiny_model_path):
    from roll_core.config.schema import AlgorithmConfig

    batch = grouped_training_batch(vocab=90)
    objective = ActorObjective.from_config(AlgorithmConfig())
    results = []
    for role in (TrainRoleConfig(pack_sequences=False), TrainRoleConfig(max_tokens_per_micro_batch=20)):
        trainer = HFTrainStrategy(str(tiny_model_path), role, seed=0)
        assert len(micro_batches(batch, 8, role.max_tokens_per_micro_batch)) == (1 if role.max_tokens_per_micro_batch
                                                                                  is None else 4)
        metrics = update(trainer, batch, objective, UpdateSpec(max_grad_norm=1.0, micro_batch_size=8))
        results.append((metrics, full_weights(trainer)))
    (one, one_weights), (tokens, token_weights) = results
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
        assert tokens[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    # Adam's first step: a weight whose gradient is near eps moves by up to ~lr on float noise (see
    # test_a_packed_update_is_the_padded_update); on a GPU other kernels sum in other orders. 5% of lr
    bound = 0.05 * TrainRoleConfig().lr
    for name, value in one_weights.items():
        torch.testing.assert_close(token_weights[name], value, atol=bound, rtol=1e-4, msg=name)


def test_role_packing_keys_need_a_strategy_that_takes_packed_sequences(plain_train_strategy):
    plugins = plain_train_strategy
    for key in ("pack_sequences=true", "max_tokens_per_micro_batch=4096"):
        with pytest.raises(ConfigError, match=f"'roles.actor_train.{key.split('=')[0]}': train strategy 'plain' does "
                                              "not take packed sequences; train strategies that do: .*hf"):
            load_and_check(None, ["roles.actor_train.strategy=plain", f"roles.actor_train.{key}"], plugins)
    load_and_check(None, ["roles.actor_train.strategy=plain"], plugins)  # unset: that strategy runs padded
    load_and_check(None, ["roles.actor_train.max_tokens_per_micro_batch=4096", "roles.reference.pack_sequences=true"],
                   plugins)


def test_a_role_s_settings_and_the_model_s_own_choices_reach_the_packing():
    """``pack_max_length`` comes from the role; a sliding window the model does not use
    (``use_sliding_window: false``, as Qwen2's configs ship) does not stop packing; a wrapper's model
    is found only where the wrapper's own config is not a model's."""
    config = types.SimpleNamespace(_attn_implementation="sdpa", pad_token_id=0, sliding_window=4,
                                   use_sliding_window=False)
    model, batch = types.SimpleNamespace(config=config), two_prompt_groups()
    assert packed_inputs(model, batch, TrainRoleConfig()).input_ids.shape == (2, 6)  # the window is off
    assert packed_inputs(model, batch, TrainRoleConfig(pack_max_length=4)).input_ids.shape == (3, 5)
    inner = types.SimpleNamespace(config=types.SimpleNamespace(pad_token_id=0))
    assert model_config(types.SimpleNamespace(config=config, module=inner)) is config
    assert model_config(types.SimpleNamespace(config={"zero_optimization": {}}, module=inner)) is inner.config


def test_a_packed_forward_pass_keeps_no_cache(tiny_model_path):
    model = load_causal_lm(str(tiny_model_path))
    packed = packed_rows(two_prompt_groups(), max_length=1024)
    out = packed_forward(model, packed, torch.device("cpu"))
    assert out.logits.shape[:2] == packed.input_ids.shape
    assert out.past_key_values is None  # training passes need no KV cache: it would only hold memory


def test_the_widest_part_halves_by_tokens_where_another_rank_needs_more_passes(monkeypatch):
    def parts(lengths, max_tokens, needed):
        monkeypatch.setattr("roll_core.training.all_reduce_max", lambda value, group=None: needed)
        return token_parts(lengths, 64, max_tokens)

    # parts of 2 and 4 tokens (2 samples each) and one of 1: the wider one splits, not the first
    assert parts([1, 1, 3, 1, 1], 4, 4) == [[0, 1], [2], [3], [4]]
    assert parts([2] * 6, 12, 2) == [[0, 1, 2], [3, 4, 5]]  # at the middle token
    assert parts([1, 1, 1, 1, 20], 24, 2) == [[0, 1, 2, 3], [4]]  # the middle is past the last split point


def test_groups_go_longest_first_and_a_unit_may_fill_a_row_exactly():
    """Groups of 3, 2 and 5 tokens, in that order (neither by size nor by their prompts' tokens): the
    largest fills a row of 5; the 2-token unit completes the 3-token one's row."""
    packed = pack_sequences(torch.tensor([[6], [2], [8], [8]]), torch.ones(4, 1, dtype=torch.long),
                            torch.tensor([[7, 7], [3, 0], [4, 4], [5, 5]]),
                            torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]), max_length=1024, pad_token_id=0)
    assert packed.input_ids.tolist() == [[8, 4, 4, 5, 5], [6, 7, 7, 2, 3]]


def test_a_packed_mask_has_the_model_s_dtype_and_refuses_attention_without_4d_masks():
    packed = packed_rows(two_prompt_groups(), max_length=1024)
    assert packed.attention_mask("eager", torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"4-D mask \(sdpa, eager, .*'flash_attention_2'"):
        packed.attention_mask("flash_attention_2", torch.float32)


def test_rows_narrow_to_the_narrowest_width_that_keeps_their_number():
    """A group of 11 tokens (prompt 1, answers of 3, 3 and 4) and one of 4, rows at most 8 wide:
    3 rows of 8 hold them, so do 3 rows of 7, and 6 would take 4. The search must try 7."""
    prompts = torch.tensor([[10, 10], [0, 11], [0, 11], [0, 11]])
    responses = torch.tensor([[3, 3, 0, 0], [3, 3, 3, 0], [3, 3, 3, 0], [3, 3, 3, 3]])
    packed = pack_sequences(prompts, (prompts > 0).long(), responses, (responses > 0).long(), max_length=8,
                            pad_token_id=0)
    assert packed.input_ids.tolist() == [[11, 3, 3, 3, 3, 3, 3], [11, 3, 3, 3, 3, 0, 0], [10, 10, 3, 3, 0, 0, 0]]


def test_rows_within_five_percent_of_full_are_left_at_their_width():
    """A group of 198 tokens (prompt 1, answers of 56, 51, 51, 18 and 21) and one of 2, rows at most
    105 wide: 2 rows of 105 hold them (99 and 103 tokens, the big group's prompt three times), 10
    slots beyond the 200 of content, exactly 5% of it. Rows that full are left as they are (the search
    for a narrower width costs more than it can save), although 2 rows of 103 would hold them too.
    A random search over batches found this one."""
    lengths = [56, 51, 51, 18, 21, 1]
    prompts = torch.tensor([[1]] * 5 + [[2]])
    mask = torch.tensor([[1] * n + [0] * (56 - n) for n in lengths])
    packed = pack_sequences(prompts, torch.ones_like(prompts), 50 * mask, mask, max_length=105, pad_token_id=0)
    assert packed.input_ids.shape == (2, 105)
    assert sorted(int(n) for n in (packed.input_ids != 0).sum(-1)) == [99, 103]
