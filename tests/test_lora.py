"""LoRA on actor_train (``roles.actor_train.lora``): what must hold.

Only the adapters train; a sync sends them alone (over 10x fewer bytes than the model on the tiny
model) and the inference side, merging them onto its base weights, computes the trainer's
log-probs; the reference is the base model with the adapters disabled; a saved adapter loads with
peft onto the base model and gives the same log-probs; a merged save is a plain model; a checkpoint
resumes exactly; bad settings are refused before any worker starts. The RLVR run that trains with
LoRA is in ``test_pipeline.py``-style below, marked slow.
"""

from __future__ import annotations

import ast
import json
import sys
import warnings

import pytest
import torch
from safetensors import safe_open

from conftest import metrics_of

from roll_core.algorithms.objective import ActorObjective
from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.strategies.hf import HFInferStrategy, HFTrainStrategy
from roll_core.strategies import lora
from roll_core.strategies.lora import AdapterMerger
from roll_core.strategies.models import full_sequence, load_causal_lm
from roll_core.strategies.sequences import position_ids_from_mask
from roll_core.testing import full_weights, training_batch
from roll_core.training import UpdateSpec, update

pytest.importorskip("peft", reason="LoRA needs peft: pip install 'roll-core[lora]'")

LORA = ["roles.actor_train.lora={rank: 8, alpha: 16}", "algorithm.kl_loss_coef=0.1", "algorithm.ppo_epochs=2",
        "algorithm.ppo_mini_batch_size=4", "roles.actor_train.micro_batch_size=2", "roles.actor_train.lr=0.01"]


def _trained(model_path, *overrides):
    cfg = load_config(None, LORA + list(overrides))
    trainer = HFTrainStrategy(str(model_path), cfg.roles.actor_train, seed=0)
    batch = training_batch(trainer.model.config.vocab_size)
    update(trainer, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout),
           UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))
    return cfg, trainer, batch


def _log_probs_of(model, batch):
    ids, mask = full_sequence(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    width = batch["responses"].shape[1]
    picked = torch.log_softmax(logits[:, -width - 1:-1].float(), -1).gather(-1, batch["responses"][..., None])
    return picked.squeeze(-1) * batch["response_mask"]


def test_only_the_adapters_train(tiny_model_path):
    cfg, trainer, _ = _trained(tiny_model_path)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    (optimizer,) = trainer.optimizers.values()
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        trainer.model.get_parameter(n).numel() for n in trainable)
    base = dict(load_causal_lm(str(tiny_model_path)).named_parameters())
    for name, param in trainer.model.get_base_model().named_parameters():
        if ".lora_" not in name:
            torch.testing.assert_close(param.detach().cpu(), base[name.replace(".base_layer.", ".")].detach(),
                                       atol=0, rtol=0)


def test_a_seed_gives_the_same_fresh_adapters_and_leaves_the_global_rng_alone(tiny_model_path):
    """peft draws A from the global RNG; roll seeds that draw from the strategy's seed, so runs of
    one seed start from the same adapters in any process (the global RNG is not seeded anywhere)."""
    role = load_config(None, LORA).roles.actor_train

    def adapters(seed):
        model = HFTrainStrategy(str(tiny_model_path), role, seed=seed).model
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A." in n}

    before = torch.random.get_rng_state()
    first, again, other = adapters(0), adapters(0), adapters(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_a_sync_sends_the_adapters_and_the_inference_side_merges_them(tiny_model_path):
    from roll_core.runtime.workers import InferWorker

    cfg, trainer, batch = _trained(tiny_model_path)
    sent = full_weights(trainer)
    assert sent and all(n.endswith((".lora_A", ".lora_B")) for n in sent)
    adapter_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    model_bytes = sum(p.numel() * p.element_size() for p in load_causal_lm(str(tiny_model_path)).parameters())
    assert model_bytes >= 10 * adapter_bytes, (model_bytes, adapter_bytes)

    engine = InferWorker("actor_infer", str(tiny_model_path), cfg.roles.actor_infer, cfg, seed=0)
    engine.setup()
    before = engine.compute_log_probs(batch, 1.0)
    # 1 KiB buckets: a layer's A and B arrive in different buckets
    buckets = list(trainer.weight_buckets(1024))
    assert any(n.endswith(".lora_A") for n, _ in buckets[0]) and not any(n.endswith(".lora_B") for n, _ in buckets[0])
    engine.update_weights(1, buckets)
    expected = trainer.compute_log_probs(batch, 1.0)
    torch.testing.assert_close(engine.compute_log_probs(batch, 1.0), expected, atol=1e-5, rtol=0)
    assert float((expected - before).abs().max()) > 1e-2  # the adapters changed the policy
    engine.update_weights(2, buckets)  # merged onto the base again, not onto the last merge
    torch.testing.assert_close(engine.compute_log_probs(batch, 1.0), expected, atol=1e-5, rtol=0)


def test_the_merge_is_w_plus_b_a_and_refuses_half_a_sync(tmp_path):
    from safetensors.torch import save_file

    save_file({"layer.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "other.weight": torch.ones(1)},
              str(tmp_path / "model.safetensors"))
    merger = AdapterMerger(str(tmp_path))
    a, b = torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0], [0.5]])  # rank 1: B A = [[2, -2], [0.5, -0.5]]
    assert merger.merge([("layer.lora_A", a)]) == []
    ((name, merged),) = merger.merge([("layer.lora_B", b)])
    assert name == "layer.weight"
    torch.testing.assert_close(merged, torch.tensor([[3.0, 0.0], [3.5, 3.5]]))
    # a full tensor for a targeted weight replaces the base the next merge starts from, as a copy (the
    # bucket may be a view of a buffer the next sync writes again), and the bucket's other tensors follow
    full = torch.zeros(2, 2)
    out = dict(merger.merge([("layer.weight", full), ("other.weight", torch.ones(1)), ("layer.lora_A", a)]))
    assert out.keys() == {"layer.weight", "other.weight"}
    full.fill_(7.0)
    merged = dict(merger.merge([("layer.lora_B", b)]))["layer.weight"]
    torch.testing.assert_close(merged, b @ a)
    merger.merge([("layer.lora_A", a)])
    with pytest.raises(RuntimeError, match="half-sent adapters for \\['layer'\\]"):
        merger.finish()
    merger.merge([(f"l{i}.lora_A", a) for i in range(6)])  # many: the first five are named
    with pytest.raises(RuntimeError, match="for \\['l0', 'l1', 'l2', 'l3', 'l4'\\]$"):
        merger.finish()
    with pytest.raises(KeyError, match="no weight 'missing.weight'"):
        merger.merge([("missing.lora_A", a), ("missing.lora_B", b)])


def test_the_reference_is_the_base_model_with_the_adapters_disabled(tiny_model_path):
    cfg, trainer, batch = _trained(tiny_model_path)
    engine = HFInferStrategy(str(tiny_model_path), cfg.roles.actor_infer, seed=0)
    base = engine.compute_log_probs(batch, 1.0)
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0), base, atol=0, rtol=0)
    assert float((trainer.compute_log_probs(batch, 1.0) - base).abs().max()) > 1e-2  # the adapters are back on
    # the full distributions too (a reference for the `full` KL estimator), at the temperature asked for
    torch.testing.assert_close(trainer.base_log_probs(batch, 0.7, distribution=True),
                               engine.compute_log_probs(batch, 0.7, distribution=True), atol=0, rtol=0)
    plain = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train.model_copy(update={"lora": None}), seed=0)
    with pytest.raises(RuntimeError, match="^base_log_probs needs roles.actor_train.lora$"):
        plain.base_log_probs(batch, 1.0)


def test_a_saved_adapter_loads_with_peft_and_gives_the_same_log_probs(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # a rank and a dropout other than peft's defaults (8, 0), so that each must reach peft's config
    _, trainer, batch = _trained(tiny_model_path, "roles.actor_train.lora.rank=4", "roles.actor_train.lora.dropout=0.1")
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "model").exists()  # save: adapter (the default) writes no full model
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["lora_dropout"] == 0.1
    assert config["bias"] == "none" and config["base_model_name_or_path"] == str(tiny_model_path)
    with safe_open(str(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        saved = list(f.keys())  # peft's names (the adapter's own name left out), the adapters alone
    assert saved and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved), saved[:3]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "ckpt" / "adapter")).eval()
    torch.testing.assert_close(_log_probs_of(loaded, batch), trainer.compute_log_probs(batch, 1.0), atol=1e-6, rtol=0)


def test_a_merged_save_is_a_plain_model_with_the_policys_log_probs(tiny_model_path, tmp_path):
    _, trainer, batch = _trained(tiny_model_path, "roles.actor_train.lora.save=merged")
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    plain = load_causal_lm(str(tmp_path / "ckpt" / "model")).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    with safe_open(str(tmp_path / "ckpt" / "model" / "model.safetensors"), framework="pt") as f:
        assert f.keys() and not [k for k in f.keys() if "lora" in k]  # none written (loading would ignore them)
    torch.testing.assert_close(_log_probs_of(plain, batch), trainer.compute_log_probs(batch, 1.0), atol=1e-5, rtol=0)


def test_a_checkpoint_resumes_exactly(tiny_model_path, tmp_path):
    cfg, trainer, batch = _trained(tiny_model_path)
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    update(trainer, batch, loss_fn, spec)
    resumed = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=1)  # other fresh adapters
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    update(resumed, batch, loss_fn, spec)
    expected = full_weights(trainer)
    for name, value in full_weights(resumed).items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("overrides, message", [
    (["roles.reference.device_mapping=[0]", "roles.actor_train.device_mapping=[1]", "roles.actor_infer.device_mapping=[2]"],
     "drop its device_mapping"),
    (["roles.actor_train.lora.rnk=4"], "unknown key 'roles.actor_train.lora.rnk'. Did you mean 'rank'?"),
])
def test_bad_settings_are_refused_before_any_worker_starts(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("?", "\\?").replace(".", "\\.")):
        load_and_check(None, ["roles.actor_train.lora={rank: 4}", *overrides])


def test_a_strategy_registered_without_lora_is_refused(plain_train_strategy):
    with pytest.raises(ConfigError, match="train strategy 'plain' does not train LoRA adapters; strategies that do: "
                                          "fsdp2, hf"):
        load_and_check(None, ["roles.actor_train.lora={rank: 4}", "roles.actor_train.strategy=plain"],
                       plugins=plain_train_strategy)


def test_missing_peft_is_named_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs peft, which is not installed: pip install 'roll-core\[lora\]'"):
        load_and_check(None, ["roles.actor_train.lora={rank: 4}"])


def test_wrapping_hides_the_deprecation_warning_peft_triggers(tiny_model_path):
    from roll_core.strategies import lora

    settings = load_config(None, LORA).roles.actor_train.lora
    model = load_causal_lm(str(tiny_model_path))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.is_gradient_checkpointing  # what peft reads: this transformers does warn  # noqa: B018
        lora.wrap(model, settings, str(tiny_model_path), seed=0)
    assert [str(w.message) for w in seen if "is_gradient_checkpointing" in str(w.message)] == [
        str(seen[0].message)]  # only the direct read above warned


def test_a_strategy_without_peft_names_the_install_command(monkeypatch):
    from roll_core.strategies import lora

    monkeypatch.setitem(sys.modules, "peft", None)  # what an environment without peft imports
    with pytest.raises(ConfigError, match=r"^LoRA \(roles.actor_train.lora, roles.critic.lora\) needs peft: "
                                          r"pip install 'roll-core\[lora\]'$"):
        lora._peft()


def test_unknown_target_modules_list_the_models_linear_layers(tiny_model_path, tmp_path):
    layers = r"; its linear layers are \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"
    unknown = ["roles.actor_train.lora={target_modules: [q_proj, qkv]}"]
    cfg = load_config(None, unknown)
    with pytest.raises(ConfigError, match=r"^roles.actor_train.lora.target_modules: \['qkv'\] are not linear layers "
                                          r"of " + str(tiny_model_path) + layers):
        HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    # and before any worker starts, on the model's architecture alone: the embedded one, or a directory's
    for model in ("tiny", str(tiny_model_path)):
        with pytest.raises(ConfigError, match=r"key 'roles.actor_train.lora.target_modules': \['qkv'\] are not "
                                              r"linear layers of " + model + layers):
            load_and_check(None, unknown + [f"model.path={model}"])
        load_and_check(None, ["roles.actor_train.lora={target_modules: [q_proj, down_proj]}", f"model.path={model}"])
    from transformers import OPTConfig  # another architecture: its own layer names are read, not the tiny model's

    OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64).save_pretrained(
        tmp_path / "opt")
    assert lora.architecture_linear_names(str(tmp_path / "opt")) == ["fc1", "fc2", "k_proj", "out_proj", "q_proj",
                                                                     "v_proj"]


def test_a_reference_on_the_actor_places_no_workers_of_its_own():
    cfg = load_and_check(None, ["roles.actor_train.lora={rank: 4}"])
    assert cfg.reference_on_actor() and "reference" not in cfg.placed_roles()
    teacher = load_config(None, ["roles.actor_train.lora={rank: 4}", "roles.reference.model_path=/teacher"])
    assert not teacher.reference_on_actor() and "reference" in teacher.placed_roles()


def test_folding_keeps_the_policy_and_makes_it_the_base(tiny_model_path, tmp_path):
    """After a LoRA warm-up the adapters fold into the base: the policy is unchanged, the adapters
    disabled now give it (the RL reference), fresh adapters start at zero (A drawn from the strategy's
    seed, the same at every fold, the global RNG untouched), a saved adapter names the folded base, and a strategy resumed
    from it loads that base."""
    cfg, trainer, batch = _trained(tiny_model_path)
    policy = trainer.compute_log_probs(batch, 1.0)
    trainer.export_model(str(tmp_path / "warm"))
    rng = torch.random.get_rng_state()
    trainer.fold_adapters(str(tmp_path / "warm"))
    assert torch.equal(torch.random.get_rng_state(), rng)
    torch.testing.assert_close(trainer.compute_log_probs(batch, 1.0), policy, atol=1e-5, rtol=0)
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0), policy, atol=1e-5, rtol=0)
    assert all(float(t.abs().max()) == 0 for n, t in full_weights(trainer).items() if n.endswith(".lora_B"))
    drawn = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_A." in n}
    for a in drawn.values():  # as nn.Linear initializes (peft's fresh A): uniform within 1 / sqrt(fan_in)
        assert 0.9 / a.shape[1] ** 0.5 < float(a.abs().max()) <= 1 / a.shape[1] ** 0.5
    trainer.fold_adapters(str(tmp_path / "warm"))  # folds nothing (B = 0) and draws A from the seed again
    assert drawn and all(torch.equal(p, drawn[n]) for n, p in trainer.model.named_parameters() if ".lora_A." in n)

    update(trainer, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout),
           UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    saved = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tmp_path / "warm")
    resumed = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=1)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(resumed.compute_log_probs(batch, 1.0), trainer.compute_log_probs(batch, 1.0),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(resumed.base_log_probs(batch, 1.0), policy, atol=1e-5, rtol=0)
    resumed.save_checkpoint(str(tmp_path / "again"))  # and its own adapters name that base too
    assert json.loads((tmp_path / "again" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(tmp_path / "warm")


@pytest.fixture(scope="module")
def warm_policy(tmp_path_factory):
    """The default tiny model after 300 supervised steps (the quickstart's warm-up, shortened): LoRA
    adapts a model that already knows something, as it does a pretrained one."""
    from roll_core.pipelines.sft import SFTPipeline
    from roll_core.runtime.executor import LocalExecutor

    run = tmp_path_factory.mktemp("warm")
    cfg = load_config(None, [f"output_dir={run}", "executor=local", "pipeline=sft", "warmup.steps=300",
                             "data.eval_size=16", "trainer.save_every=0", "trackers=[jsonl]"])
    SFTPipeline(cfg, LocalExecutor()).run()
    return run / "checkpoints" / "step_000300" / "actor_train" / "model"


def test_lora_rlvr_raises_accuracy_and_syncs_only_adapter_bytes(warm_policy, tmp_path):
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "executor=local", f"model.path={warm_policy}",
                             "warmup.steps=0", "roles.actor_train.lora={rank: 8}", "roles.actor_train.lr=3e-3",
                             "trainer.max_steps=60", "trainer.eval_every=60", "trainer.save_every=0",
                             "data.eval_size=128", "trackers=[jsonl]", "algorithm.kl_metric=true"])
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    summary = pipeline.run()
    assert "reference" not in pipeline.roles.groups  # the reference ran on actor_train's workers
    before, after = summary["before_rl"]["eval/accuracy"], summary["after_rl"]["eval/accuracy"]
    print(f"LoRA RLVR: {before:.1%} -> {after:.1%}")
    assert after >= before + 0.1, (before, after)
    rows = metrics_of(tmp_path / "run")
    synced = {r["weight_sync/bytes"] for r in rows if "weight_sync/bytes" in r}
    model_bytes = sum(p.numel() * p.element_size() for p in load_causal_lm(str(warm_policy)).parameters())
    assert len(synced) == 1 and model_bytes >= 10 * synced.pop()
    first = next(r for r in rows if r["step"] == 1)
    assert first["train/kl"] == pytest.approx(0, abs=1e-6)  # the reference: the policy RL started from
    saved = tmp_path / "run" / "checkpoints" / "step_000060" / "actor_train"
    assert (saved / "adapter" / "adapter_model.safetensors").exists() and not (saved / "model").exists()


def test_a_lora_warm_up_folds_into_the_base_the_reference_and_the_engines_use(tmp_path):
    """With the warm-up on, its adapters fold into warm-model/: RL's reference (the base with the
    adapters disabled) is the warmed-up policy, and the engines merge the new adapters onto it."""
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "executor=local", "warmup.steps=20",
                             "roles.actor_train.lora={rank: 8}", "warmup.lr=1e-2", "trainer.max_steps=2",
                             "trainer.eval_every=0", "trainer.save_every=0", "data.eval_size=16",
                             "rollout.prompts_per_step=4", "trackers=[jsonl]", "algorithm.kl_metric=true"])
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    pipeline.run()
    rows = metrics_of(tmp_path / "run")
    first = next(r for r in rows if r["step"] == 1)
    assert first["train/kl"] == pytest.approx(0, abs=1e-6)  # without the fold: KL to the untrained base
    warm = load_causal_lm(str(tmp_path / "run" / "warm-model"))
    assert not (tmp_path / "run" / "warm-model-tmp").exists()  # the export's scratch directory is gone
    (engine,) = pipeline.infer.handles
    assert engine.merger.model_path == str(tmp_path / "run" / "warm-model")
    trainer = pipeline.actor.handles[0].strategy
    batch = training_batch(warm.config.vocab_size)
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0), _log_probs_of(warm, batch), atol=1e-5, rtol=0)


def test_an_adapter_of_other_layers_is_refused_on_load(tiny_model_path, tmp_path):
    _, trainer, _ = _trained(tiny_model_path)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    cfg = load_config(None, LORA + ["roles.actor_train.lora.target_modules=[q_proj]"])
    narrower = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    with pytest.raises(ValueError, match="adapter weights this model does not have") as refused:
        narrower.load_checkpoint(str(tmp_path / "ckpt"))
    assert len(ast.literal_eval(str(refused.value).rsplit(": ", 1)[1])) == 5  # the first five of many


def test_the_merge_finds_weights_a_checkpoint_keeps_under_older_names(tiny_vlm_path):
    """transformers saves LLaVA's weights as ``vision_tower...``/``language_model.model...`` and
    loads them as ``model.vision_tower...``/``model.language_model...``: the base comes from the
    loaded model where the checkpoint lacks the module's name."""
    from roll_core.strategies.models import load_causal_lm

    weights = dict(load_causal_lm(str(tiny_vlm_path)).named_parameters())
    merger = AdapterMerger(str(tiny_vlm_path))
    for module in ("model.vision_tower.encoder.layers.0.self_attn.k_proj", "model.language_model.layers.1.mlp.up_proj"):
        base = weights[module + ".weight"].detach()
        a, b = torch.ones(2, base.shape[1]), torch.full((base.shape[0], 2), 0.5)
        ((name, merged),) = merger.merge([(module + ".lora_A", a), (module + ".lora_B", b)])
        assert name == module + ".weight"
        torch.testing.assert_close(merged, base + b @ a)
    merger.finish()  # the sync ends: the loaded model's other weights are let go, the targets' bases kept
    assert merger._loaded == {} and len(merger.base) == 2
    ((_, again),) = merger.merge([(module + ".lora_A", a), (module + ".lora_B", b)])
    torch.testing.assert_close(again, base + b @ a)
