"""pytest fixtures for roll and for plugin authors (registered through the ``pytest11`` entry point).

* ``roll_plugins(*plugins)``: a fresh plugin manager with the installed plugins plus the given
  ``(name, object)`` pairs, installed as the process-wide one for the duration of the test.
* ``hooks(**implementations)``: a plugin object from plain functions, for ``roll_plugins``.
* ``tiny_model_path``: the embedded tiny model, built once per test session.
* ``tiny_config(**overrides)``: a validated quickstart config shrunk to a few fast steps.
* ``left_padded_prompts(...)``: a batch of prompts in roll's layout, for inference-engine tests.
* ``assert_engine_matches_trainer(engine, trainer, temperature, atol)``: the contract of an
  inference strategy's log-probs, for engine plugins' tests.
* ``assert_engine_cuts_before_log_probs(engine, trainer, atol)``: ``top_k`` and ``top_p`` cut an
  inference strategy's draw, and its log-probs are those before the cuts.
* ``assert_engine_stops_at_every_end_id(engine, make_engine, model_path, directory)``: an inference
  strategy ends a response at its tokenizer's EOS and at every id the model's configs name.
* ``training_batch(vocab)``: a fixed PPO batch (padding on both sides, a masked-out sample).
* ``assert_trainer_matches_hf(trainer, reference, cfg)``: the contract of a training backend: the
  same log-probs and, after one core update, the same weights as the ``hf`` strategy.
* ``data_parallel_update(model_path, cfg, batch, world)``: one update of ``actor_train`` on
  ``world`` Ray workers, through the pipeline's own dispatch, for data-parallel equivalence tests.
* ``assert_checkpoint_resumes_exactly(make_trainer, cfg, directory)``: save after one update, and
  a fresh strategy loaded from it continues bit-exactly; the exported model holds the saved weights.
* ``assert_registered_lazily(kind, name, module)``: a plugin registers a strategy without importing
  its engine.
* ``assert_run_survives_a_killed_worker(run_dir, *overrides)``: a five-step Ray run whose inference
  worker is SIGKILLed before step 3 restarts from its step-2 checkpoint and finishes (a training
  backend's kill-and-resume test).
"""

from __future__ import annotations

from typing import Any

import pytest


def hooks(**implementations):
    """A plugin object whose hooks are the given functions, for a test's own plugin::

        roll_plugins(("judge", hooks(roll_register_rewards=lambda register: register("judge", Judge))))
    """
    from types import SimpleNamespace

    from roll_core.hookspecs import hookimpl

    return SimpleNamespace(**{name: hookimpl(fn) for name, fn in implementations.items()})


@pytest.fixture
def roll_plugins():
    from roll_core.plugins import load_plugins, reset_plugins

    def make(*extra, entry_points: bool = True):
        plugins = load_plugins(list(extra), entry_points=entry_points)
        reset_plugins(plugins)
        return plugins

    yield make
    reset_plugins(None)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from roll_core.embedded.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("roll-tiny") / "model")


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory):
    """The embedded model with its vision tower (``model.tiny.vision`` at its defaults)."""
    from roll_core.config.schema import TinyModelConfig, TinyVisionConfig
    from roll_core.embedded.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("roll-tiny-vlm") / "model",
                            TinyModelConfig(vision=TinyVisionConfig()))


@pytest.fixture(scope="session")
def tiny_vlm_tokenizer(tiny_vlm_path):
    """The tokenizer of :func:`tiny_vlm_path`'s model (its image token included)."""
    from roll_core.pipelines.runtime import load_tokenizer

    return load_tokenizer(str(tiny_vlm_path))


@pytest.fixture(scope="session")
def tiny_vlm(tiny_vlm_path):
    """:func:`tiny_vlm_path`'s model, loaded in eval mode (shared: tests must not change its weights)."""
    from roll_core.strategies.models import load_causal_lm

    return load_causal_lm(str(tiny_vlm_path)).eval()


@pytest.fixture
def tiny_config(tmp_path):
    """A factory for small, fast configs: a handful of steps on a handful of prompts."""
    from roll_core.config import load_config

    def make(*overrides: str):
        base = [
            f"output_dir={tmp_path / 'run'}", "executor=local", "warmup.steps=5",
            "rollout.prompts_per_step=4", "rollout.num_return_sequences=4", "trainer.max_steps=3",
            "trainer.eval_every=0", "trainer.save_every=0", "data.eval_size=16", "trackers=[jsonl]",
        ]
        return load_config(None, base + list(overrides))

    return make


def left_padded_prompts(rows: int = 6, width: int = 5, seed: int = 0):
    """A :class:`~roll_core.data.Batch` of ``rows`` left-padded prompts ``[rows, width]`` of three
    different lengths, BOS (id 1) first, random tokens of the tiny model's vocabulary after it."""
    import torch

    from roll_core.data import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        n = width - (i % 3)
        ids[i, width - n:] = torch.cat([torch.tensor([1]), torch.randint(5, 90, (n - 1,), generator=g)])
        mask[i, width - n:] = 1
    return Batch({"prompt_ids": ids, "prompt_mask": mask})


def assert_engine_matches_trainer(engine, trainer, temperature: float, atol: float, max_new_tokens: int = 6):
    """An inference strategy's sampled-token log-probs, its ``compute_log_probs`` and its full
    distributions equal the training strategy's for the same weights (within ``atol``), on
    :func:`left_padded_prompts`. The sampled tokens' log-probs are those of the distribution they
    were drawn from (after temperature), as the trainer computes them."""
    import torch

    batch = engine.generate(left_padded_prompts(), max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=1.0)
    mask = batch["response_mask"]
    assert batch["responses"].shape == mask.shape == batch["infer_log_probs"].shape and mask.sum() > 0
    expected = trainer.forward(batch, ("log_probs",), temperature)["log_probs"]
    torch.testing.assert_close(batch["infer_log_probs"] * mask, expected * mask, atol=atol, rtol=0)
    torch.testing.assert_close(engine.compute_log_probs(batch, temperature) * mask, expected * mask, atol=atol, rtol=0)
    small = batch.select(slice(0, 2))  # full distributions [2, R, V]
    dist_mask = small["response_mask"][..., None]
    expected_dist = trainer.forward(small, ("log_dist",), temperature)["log_dist"]
    got = engine.compute_log_probs(small, temperature, distribution=True)
    torch.testing.assert_close(got * dist_mask, expected_dist * dist_mask, atol=atol, rtol=0)


def assert_engine_cuts_before_log_probs(engine, trainer, atol: float, max_new_tokens: int = 6):
    """An inference strategy's ``top_k`` and ``top_p`` cut the draw, not the log-probs: with
    ``top_k=1`` it decodes as it does greedily, and with either cut the sampled tokens'
    ``infer_log_probs`` are the trainer's at the temperature, before the cuts (a log-prob of the cut
    distribution would be 0 at ``top_k=1``)."""
    import torch

    greedy = engine.generate(left_padded_prompts(), max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)
    for temperature, top_p, top_k in ((1.0, 1.0, 1), (0.7, 0.3, 0), (1.0, 0.9, 3)):
        batch = engine.generate(left_padded_prompts(), max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k)
        mask = batch["response_mask"]
        if top_k == 1:
            assert torch.equal(batch["responses"], greedy["responses"]), "top_k=1 must decode as greedy decoding does"
        expected = trainer.forward(batch, ("log_probs",), temperature)["log_probs"]
        torch.testing.assert_close(batch["infer_log_probs"] * mask, expected * mask, atol=atol, rtol=0)


def model_with_more_end_ids(model_path, directory, tokenizer_eos: int, config_eos: int):
    """A copy of the model at ``model_path`` in ``directory`` whose tokenizer's EOS is the token
    ``tokenizer_eos``, and whose ``config.json`` names ``config_eos`` besides its own end id (its
    generation config keeps the original one): two ways real checkpoints name an end of turn."""
    import json
    import shutil
    from pathlib import Path

    from transformers import AutoTokenizer

    from roll_core.strategies.sequences import token_ids

    directory = Path(directory)
    shutil.copytree(model_path, directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(tokenizer_eos)
    tokenizer.save_pretrained(str(directory))
    config = json.loads((directory / "config.json").read_text())
    ends = token_ids(config.get("eos_token_id"), config_eos)  # the config's own: an id, a list or none
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": ends}))
    return directory


def assert_engine_stops_at_every_end_id(engine, make_engine, model_path, directory, max_new_tokens: int = 5):
    """An inference strategy ends a response at the first of these ids it decodes: its tokenizer's
    EOS, and every id of the model's ``config.json`` and generation config. ``engine`` decodes the
    model at ``model_path`` greedily; the first tokens of two of its responses become the end ids of a
    copy in ``directory`` (:func:`model_with_more_end_ids`), the first its tokenizer's EOS and the
    second one more id of its config; ``make_engine(path)`` builds the strategy on that copy, whose
    greedy responses must then stop right there, and every response at its first end id."""
    import torch

    from roll_core.strategies.sequences import response_end_ids

    greedy = dict(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)
    plain = engine.generate(left_padded_prompts(), **greedy)
    ends = response_end_ids(model_path)
    firsts = [row[0].item() for row, keep in zip(plain["responses"], plain["response_mask"]) if keep.sum() > 1]
    candidates = list(dict.fromkeys(t for t in firsts if t not in ends))  # first tokens the model decodes on from
    assert len(candidates) >= 2, f"too few responses go on past their first token: {plain['responses'].tolist()}"
    by_tokenizer, by_config = candidates[:2]
    copy = model_with_more_end_ids(model_path, directory, by_tokenizer, by_config)
    out = make_engine(str(copy)).generate(left_padded_prompts(), **greedy)
    every_end = torch.tensor([*ends, by_tokenizer, by_config])
    lengths = out["response_mask"].sum(-1)
    for row, (tokens, n) in enumerate(zip(out["responses"], lengths.tolist())):
        first = plain["responses"][row, 0].item()
        if first in (by_tokenizer, by_config):
            assert n == 1 and tokens[0].item() == first, f"row {row} must end at its first token {first}: {tokens}"
        went_on = torch.isin(tokens[: n - 1], every_end).any()
        assert n >= 1 and not went_on, f"row {row} went on past an end id: {tokens}"
        assert n == max_new_tokens or tokens[n - 1] in every_end, f"row {row} stopped before an end id: {tokens}"


def training_batch(vocab: int):
    """A fixed batch of 8 PPO samples ``[8, 4 + 5]`` over token ids below ``vocab``: a left-padded
    prompt, right-padded responses, one sample masked out of the loss, and every field the actor and
    critic losses read (old, reference and inference log-probs, advantages, values, returns)."""
    import torch

    from roll_core.data import Batch

    g = torch.Generator().manual_seed(0)
    rows, p, r = 8, 4, 5
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    response_mask = torch.ones(rows, r, dtype=torch.long)
    response_mask[2, 3:] = 0  # right padding
    response_mask[5, 1:] = 0
    loss_mask = response_mask.float().clone()
    loss_mask[6] = 0  # a sample masked out of the loss
    return Batch({
        "prompt_ids": torch.randint(3, vocab, (rows, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "responses": torch.randint(3, vocab, (rows, r), generator=g) * response_mask,
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        "old_log_probs": -torch.rand(rows, r, generator=g) * 3,
        "ref_log_probs": -torch.rand(rows, r, generator=g) * 3,
        "infer_log_probs": -torch.rand(rows, r, generator=g) * 3,
        "advantages": torch.randn(rows, r, generator=g) * loss_mask,
        "values": torch.randn(rows, r, generator=g),
        "returns": torch.randn(rows, r, generator=g),
    })


def image_training_batch(model_path):
    """:func:`training_batch`'s fields over image prompts of ``color_shapes`` for the image-reading
    model at ``model_path``: samples 0-3 one prompt (the same image), 4 and 5 the same text over two
    different images (two prompts, which only the images tell apart), 6 and 7 others."""
    from roll_core.embedded.tasks import ColorShapesTask
    from roll_core.multimodal import encode_prompts
    from roll_core.pipelines.runtime import load_tokenizer

    tokenizer = load_tokenizer(str(model_path))
    rows = ColorShapesTask().eval_rows()
    batch = training_batch(tokenizer.convert_tokens_to_ids("<image>"))  # response ids below the image token
    prompts = encode_prompts(tokenizer, [rows[0]] * 4 + rows[1:5])
    return batch.update(**prompts)


def grouped_training_batch(vocab: int = 90):
    """:func:`training_batch`'s 8 samples with samples 0-3 and 4-5 sharing a prompt (two GRPO
    groups): packed (:mod:`roll_core.strategies.packing`), a group's responses follow each other
    after one copy of its prompt."""
    batch = training_batch(vocab)
    for tensor in (batch["prompt_ids"], batch["prompt_mask"]):
        tensor[1:4] = tensor[0]
        tensor[5] = tensor[4]
    return batch


def full_weights(trainer) -> dict:
    """Every weight a training strategy sends to the inference engines, ``{hf name: tensor}``
    (what rank 0 of a data-parallel group yields; under tensor or pipeline parallelism, this rank's)."""
    return {name: tensor for bucket in trainer.weight_buckets(1 << 40) for name, tensor in bucket}


def critic_update(critic, cfg, batch) -> dict[str, float]:
    """One core update (:func:`roll_core.training.update`) of a critic strategy on ``batch`` with
    ``cfg``'s (a ``RollConfig``) value loss, epochs and mini-batches: what PPO's critic step does.
    Returns its ``critic/`` metrics."""
    from roll_core.algorithms.objective import CriticObjective
    from roll_core.training import UpdateSpec, update

    loss_fn: Any = CriticObjective.from_config(cfg.algorithm, cfg.rollout)  # a LossFn (structural)
    return update(critic, batch, loss_fn, UpdateSpec.from_config(cfg.algorithm, cfg.roles.critic, prefix="critic"))


def assert_critic_adapter_gives(directory, model_path: str, batch, values) -> None:
    """A LoRA critic's ``adapter/`` at ``directory`` as a user loads it: peft's format with the value
    head under its own names, which ``PeftModel.from_pretrained`` puts on a value model built from
    ``model_path`` with another fresh head, and which then gives ``values`` for ``batch``."""
    from pathlib import Path

    import torch
    from peft import PeftModel
    from safetensors import safe_open

    from roll_core.strategies.models import full_sequence, load_value_model
    from roll_core.strategies.sequences import position_ids_from_mask

    with safe_open(str(Path(directory) / "adapter_model.safetensors"), framework="pt") as f:
        saved = sorted(f.keys())
    assert [k for k in saved if ".lora_" not in k] == ["base_model.model.score.bias", "base_model.model.score.weight"]
    base = load_value_model(model_path, torch.device("cpu"), seed=9)  # a head the saved one replaces
    loaded = PeftModel.from_pretrained(base, str(directory)).eval()
    ids, mask = full_sequence(batch)
    with torch.no_grad():
        out = loaded(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[..., 0]
    width = batch["responses"].shape[1]
    torch.testing.assert_close(out[:, -width - 1:-1] * batch["response_mask"], values, atol=1e-5, rtol=0)


def hf_role(role_config):
    """``role_config`` for the ``hf`` strategy, the reference a backend is checked against: the
    role's ``strategy_options`` are the backend's own (DeepSpeed's ZeRO stage, say), not ``hf``'s."""
    return role_config.model_copy(update={"strategy": "hf", "strategy_options": {}})


# Attention's key biases get no gradient in exact arithmetic: q.(k + b) adds q.b to every score of a
# query, and softmax ignores a shift. What reaches them is rounding noise, which Adam scales up and which
# another summation order draws differently (FSDP2 against hf on a Zen 2 EPYC: 1.3e-6 apart after moves
# of 6e-6), so no backend's key biases are compared with the reference's.
NOISE_ONLY_WEIGHTS = ("self_attn.k_proj.bias",)


def assert_trainer_matches_hf(trainer, reference, cfg, *, log_prob_atol: float = 1e-4, weight_atol: float = 1e-5,
                              metric_keys=("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"),
                              batch=None):
    """A training backend computes what the ``hf`` strategy computes, on ``batch`` (default:
    :func:`training_batch`).

    ``trainer`` and ``reference`` (an ``HFTrainStrategy``) start from the same checkpoint and
    ``cfg`` (a ``RollConfig``) gives the objective and the update (``ppo_epochs`` x mini-batches).
    Checks, in order: log-probs and entropy within ``log_prob_atol``; one core update
    (:func:`roll_core.training.update`) with the same metrics; then every weight within
    ``weight_atol`` of the reference's (attention's key biases aside: :data:`NOISE_ONLY_WEIGHTS`), and
    the weights really moved. Returns the trainer's metrics."""
    import torch

    from roll_core.algorithms.objective import ActorObjective
    from roll_core.training import UpdateSpec, update

    batch = batch if batch is not None else training_batch(reference.model.config.vocab_size)
    mask = batch["response_mask"]
    for name in ("log_probs", "entropy"):
        got, expected = (s.forward(batch, (name,), 1.0)[name] for s in (trainer, reference))
        torch.testing.assert_close(got * mask, expected * mask, atol=log_prob_atol, rtol=0, msg=name)
    before = {name: tensor.clone() for name, tensor in full_weights(reference).items()}
    loss_fn: Any = ActorObjective.from_config(cfg.algorithm, cfg.rollout)  # a LossFn (structural)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    expected_metrics = update(reference, batch, loss_fn, spec)
    metrics = update(trainer, batch, loss_fn, spec)
    for key in metric_keys:
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-3, abs=1e-5), key
    got, expected = full_weights(trainer), full_weights(reference)
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    for name, value in expected.items():
        if not name.endswith(NOISE_ONLY_WEIGHTS):
            torch.testing.assert_close(got[name].float(), value, atol=weight_atol, rtol=1e-4, msg=name)
    assert max(float((expected[n] - before[n]).abs().max()) for n in expected) > 10 * weight_atol  # it moved
    return metrics


def data_parallel_update(model_path: str, cfg, batch, world: int):
    """One core update of ``cfg.roles.actor_train`` on ``world`` Ray workers, each given its
    data-parallel shard through the pipeline's own dispatch (``WorkerGroup.data_parallel``, with the
    data-parallel ranks the strategies report, ``TrainWorker.update``).

    Returns ``(metrics per rank, {name: tensor} sent by each rank, log-probs of batch per rank)``."""
    import ray

    from roll_core.algorithms.objective import ActorObjective
    from roll_core.runtime.executor import RayExecutor
    from roll_core.runtime.workers import TrainWorker
    from roll_core.training import UpdateSpec

    executor = RayExecutor(num_cpus=max(2, world), timeout_s=300)
    try:
        role = cfg.roles.actor_train
        group = executor.spawn("actor_train", TrainWorker, [("actor_train", model_path, role, cfg, 0)] * world)
        address = executor.get(group.call("node_address"))[0]
        group.dp_ranks = executor.get([executor.invoke(h, "setup", (address, r, world), {})
                                       for r, h in enumerate(group.handles)])
        loss_fn, spec = ActorObjective.from_config(cfg.algorithm, cfg.rollout), UpdateSpec.from_config(cfg.algorithm, role)
        metrics = executor.get(group.data_parallel("update", batch, mini_batch_size=spec.mini_batch_size,
                                                   loss_fn=loss_fn, spec=spec))
        buckets = executor.get(group.call("weight_bucket_list", 1 << 30))
        log_probs = executor.get(group.call("compute_log_probs", batch, 1.0))
        return metrics, [dict(b for bucket in rank for b in bucket) for rank in buckets], log_probs
    finally:
        executor.shutdown()
        ray.shutdown()


_KILL_INFER_BEFORE_STEP_3 = """
import os, signal, sys
from roll_core.pipelines.rlvr import RLVRPipeline

original, calls = RLVRPipeline.step, []

def step(self, n):
    calls.append(1)
    if len(calls) == 3:  # SIGKILL an inference worker's process, as an OOM killer would
        os.kill(self.executor.get(self.infer.call("pid"))[0], signal.SIGKILL)
    return original(self, n)

RLVRPipeline.step = step
from roll_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_with_a_killed_worker(run_dir, *overrides: str, timeout_s: float = 600):
    """``roll run`` of a small five-step quickstart on Ray (checkpoints every 2 steps, one restart
    allowed unless ``overrides`` say otherwise) whose inference worker is SIGKILLed before step 3
    by the driver (so the controller stays there, ``ray.colocate_controller=false``). Returns the
    finished ``subprocess.CompletedProcess``."""
    import subprocess
    import sys
    from pathlib import Path

    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    script = run_dir.parent / f"{run_dir.name}-kill.py"
    script.write_text(_KILL_INFER_BEFORE_STEP_3)
    args = ["run", f"output_dir={run_dir}", "executor=ray", "warmup.steps=20", "rollout.prompts_per_step=4",
            "rollout.num_return_sequences=4", "trainer.eval_every=0", "data.eval_size=16", "trackers=[jsonl]",
            "torch_threads=1", "trainer.max_steps=5", "trainer.save_every=2", "runtime.max_restarts=1",
            "ray.colocate_controller=false", *overrides]
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout_s)


def assert_run_survives_a_killed_worker(run_dir, *overrides: str) -> None:
    """:func:`run_with_a_killed_worker` restarts every worker from the step-2 checkpoint (the
    training backend reloads its own) and completes all five steps, each logged once."""
    import json
    from pathlib import Path

    from roll_core.trackers import read_metrics

    out = run_with_a_killed_worker(run_dir, *overrides)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "a worker process died" in out.stdout and "Restarting every worker from the last checkpoint" in out.stdout
    assert "resumed from" in out.stdout and "step_000002" in out.stdout
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["restarts"] == 1
    steps = [row["step"] for row in read_metrics(Path(run_dir) / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4, 5]


def assert_checkpoint_resumes_exactly(make_trainer, cfg, directory) -> None:
    """``make_trainer(seed)`` builds a training strategy of ``cfg.roles.actor_train``. After one core
    update it saves a checkpoint under ``directory`` and updates again; a strategy built with another
    seed and loaded from the checkpoint must make the same second update bit for bit (so weights,
    optimizer moments and phases were all saved), and ``directory/model`` must load with
    transformers as the weights at the save."""
    import torch

    from roll_core.algorithms.objective import ActorObjective
    from roll_core.strategies.models import load_causal_lm
    from roll_core.training import UpdateSpec, update

    loss_fn: Any = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    trainer = make_trainer(0)
    batch = training_batch(_vocab(trainer))
    update(trainer, batch, loss_fn, spec)
    trainer.save_checkpoint(str(directory))
    saved = {name: tensor.clone() for name, tensor in full_weights(trainer).items()}
    update(trainer, batch, loss_fn, spec)
    expected = full_weights(trainer)

    exported = dict(load_causal_lm(str(directory / "model")).named_parameters())
    assert exported.keys() == saved.keys(), sorted(set(exported) ^ set(saved))
    for name, value in saved.items():
        torch.testing.assert_close(exported[name].detach(), value, atol=0, rtol=0, msg=name)

    resumed = make_trainer(1)
    resumed.load_checkpoint(str(directory))
    update(resumed, batch, loss_fn, spec)
    for name, value in full_weights(resumed).items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)


def _vocab(trainer) -> int:
    """The vocabulary size of a strategy's Hugging Face config, wherever its model keeps it (a
    wrapping engine's own ``config`` may be something else)."""
    for holder in (trainer, getattr(trainer, "module", None), getattr(trainer, "model", None)):
        for name in ("hf_config", "config"):
            config = getattr(holder, name, None)
            if config is not None and hasattr(config, "vocab_size"):
                return int(config.vocab_size)
    raise AttributeError(f"{type(trainer).__name__} exposes no Hugging Face config")


def assert_registered_lazily(kind: str, name: str, module: str) -> None:
    """In a fresh interpreter the installed plugins register ``name`` as a ``kind`` strategy
    (``train``, ``infer``, ``critic``) or in the registry ``kind`` (``envs``, ``rewards``, ...), and
    ``module`` (the engine, the heavy dependency) is still not imported."""
    import subprocess
    import sys

    registry = f"{kind}_strategies" if kind in ("train", "infer", "critic") else kind
    code = (f"import sys; from roll_core.plugins import get_plugins; p = get_plugins(); "
            f"assert {name!r} in p.registry('{registry}'), p.registry('{registry}'); "
            f"assert {module!r} not in sys.modules, 'imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
