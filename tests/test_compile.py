"""A role's ``compile: true`` (:mod:`roll_core.strategies.compiled`): the decoder layers run
compiled, with the eager model's outputs, gradients and update, on batches whose shapes change
without recompiling; the config asks for a strategy that compiles and a C++ compiler."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from roll_core.algorithms.objective import ActorObjective
from roll_core.config import load_and_check
from roll_core.config.schema import ActorTrainRoleConfig, AlgorithmConfig, CriticRoleConfig, TrainRoleConfig
from roll_core.errors import ConfigError
from roll_core.strategies import cpu_matmul
from roll_core.strategies import packed_attention
from roll_core.strategies.compiled import OutsideCompiledCode, compile_layers, decoder_layers
from roll_core.strategies.cpu_matmul import OneDNNLinear
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.strategies.models import load_causal_lm
from roll_core.testing import full_weights, training_batch
from roll_core.training import UpdateSpec, update


def _compiled(layer) -> bool:
    return hasattr(layer.forward, "_torchdynamo_orig_callable")


def test_each_decoder_layer_is_compiled_and_nothing_else(tiny_model_path):
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(compile=True), seed=0)
    layers = decoder_layers(trainer.model)
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * trainer.model.config.num_hidden_layers
    assert all(_compiled(m) for m in layers)
    assert not any(_compiled(m) for m in trainer.model.modules() if m not in layers)
    eager = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(), seed=0)
    assert not any(_compiled(m) for m in eager.model.modules())
    # names are untouched: checkpoints and weight sync see the same parameters
    assert [n for n, _ in trainer.full_parameters()] == [n for n, _ in eager.full_parameters()]
    # what compiled layers call as it is, TorchDynamo now skips: oneDNN's layers and packed attention
    marked = {m.__name__: m for m in OutsideCompiledCode._every}
    assert {"_onednn_forward", "_attend_pieces"} <= marked.keys() and packed_attention._attend_pieces in marked.values()
    assert all(getattr(m.fn, "_torchdynamo_disable", False) for m in marked.values())


def test_a_process_that_compiles_nothing_never_imports_torchdynamo():
    """TorchDynamo's import (1.5 s on 2 cores) waits for the first compile: ``roll validate``, reward
    and environment workers and a Ray run's driver import the strategies and workers without it."""
    code = "import sys, roll_core.runtime.workers, roll_core.strategies.hf; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_decoder_layers_are_found_inside_a_wrapper_and_under_a_subclass(tiny_model_path):
    """A wrapper that names no layer itself (peft's model around the causal LM) and a layer whose class
    was swapped for a subclass (FSDP2's ``FSDPLlamaDecoderLayer``) still yield every decoder layer."""
    model = load_causal_lm(str(tiny_model_path))
    wrapper = torch.nn.Module()
    wrapper.inner = model
    first = model.model.layers[0]
    first.__class__ = type("FSDPLlamaDecoderLayer", (type(first),), {})
    assert decoder_layers(wrapper) == list(model.model.layers) and len(model.model.layers) == 2


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="Linear names no decoder layer .* set compile: false"):
        compile_layers(torch.nn.Linear(2, 2))


def test_a_worker_without_a_cpp_compiler_refuses_before_compiling(tiny_model_path, monkeypatch):
    # the config check ran on the driver's machine; a Ray worker may run on another that has none
    model = load_causal_lm(str(tiny_model_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("roll_core.strategies.compiled.shutil.which", lambda name: None)
    with pytest.raises(ValueError, match=f"compile: true on {platform.node()}: torch.compile needs a C\\+\\+ "
                                         "compiler and none was found"):
        compile_layers(model)
    assert decoder_layers(model) and not any(map(_compiled, decoder_layers(model)))  # nothing was compiled


@pytest.fixture
def matmul_mode():
    """Sets this process's ``runtime.cpu_matmul`` for a test and restores it after."""
    saved = cpu_matmul._mode
    yield cpu_matmul.configure
    cpu_matmul._mode = saved


@pytest.mark.parametrize("pack, kernel", [(True, "torch"), (False, "torch"), (True, "onednn"), ("pieces", "torch")])
def test_compiled_updates_are_the_eager_updates_at_changing_shapes(tiny_model_path, matmul_mode, request, pack, kernel):
    """Two updates on batches of other sizes and widths: the same metrics and weights as eager, and
    no recompilation after the first (shapes are dynamic). On oneDNN's kernel (``runtime.cpu_matmul``)
    the compiled code calls out to it at each linear layer. With ``pieces``, packed rows attend piece
    by piece (:mod:`roll_core.strategies.packed_attention`), whose plan changes sizes each batch."""
    if kernel == "onednn" and not cpu_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN kernel")
    if kernel == "onednn" and torch.cuda.is_available():
        pytest.skip("the strategies put the model on the GPU, where the CPU kernel is not used")
    if pack == "pieces":
        request.getfixturevalue("every_row_by_pieces")
    matmul_mode(kernel)
    first = training_batch(vocab=90)
    second = first.select(torch.arange(5))  # fewer samples,
    second.tensors["responses"] = second["responses"][:, :3]  # narrower responses
    for key in ("response_mask", "loss_mask", "old_log_probs", "ref_log_probs", "infer_log_probs", "advantages"):
        second.tensors[key] = second[key][:, :3]
    objective = ActorObjective.from_config(AlgorithmConfig())
    spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=8)
    results = []
    for compiled in (False, True):
        trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(pack_sequences=bool(pack), compile=compiled),
                                  seed=0)
        assert any(isinstance(m, OneDNNLinear) for m in trainer.model.modules()) == (kernel == "onednn")
        metrics = [update(trainer, first, objective, spec)]
        with torch._dynamo.config.patch(error_on_recompile=True):
            metrics.append(update(trainer, second, objective, spec))
        results.append((metrics, full_weights(trainer)))
    (eager, eager_weights), (compiled, compiled_weights) = results
    for one, other in zip(eager, compiled):
        for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
            assert other[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    for name, value in eager_weights.items():
        torch.testing.assert_close(compiled_weights[name], value, atol=5e-5, rtol=1e-4, msg=name)
    assert eager[0]["train/grad_norm"] > 1e-3  # the updates moved something


def test_compiled_gradients_are_the_eager_gradients(tiny_model_path):
    """Every parameter's gradient, not only the update's norm: Adam's sign-like first step would
    hide a gradient that is wrong in scale."""
    batch = training_batch(vocab=90)
    grads = []
    for compiled in (False, True):
        trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(compile=compiled), seed=0)
        out = trainer._outputs(batch, ("log_probs",), temperature=1.0)
        (out["log_probs"] * batch["response_mask"].to(trainer.device)).sum().backward()
        grads.append({n: p.grad for n, p in trainer.model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in grads[0].values()) > 0.1


def test_compiled_lora_layers_are_the_eager_ones_with_adapters_on_off_and_folded(tiny_model_path, tmp_path):
    """LoRA's adapters sit inside the compiled layers: the adapters' gradients, the policy, the base
    (adapters disabled: a LoRA run's reference) and the policy after a fold are the eager ones."""
    pytest.importorskip("peft")
    batch = training_batch(vocab=90)
    results = []
    for compiled in (False, True):
        role = ActorTrainRoleConfig(lora={"rank": 8}, compile=compiled)
        trainer = HFTrainStrategy(str(tiny_model_path), role, seed=0)
        assert any(_compiled(m) for m in trainer.model.modules()) == compiled
        with torch.no_grad():  # B away from its zero start, so that A has gradients and the adapters change outputs
            generator = torch.Generator().manual_seed(1)
            for name, param in trainer.model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        out = trainer._outputs(batch, ("log_probs",), temperature=1.0)
        (out["log_probs"] * batch["response_mask"].to(trainer.device)).sum().backward()
        result = {"grad " + n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
        result["policy"], result["base"] = trainer.compute_log_probs(batch, 1.0), trainer.base_log_probs(batch, 1.0)
        trainer.export_model(str(tmp_path / f"warm-{compiled}"))
        trainer.fold_adapters(str(tmp_path / f"warm-{compiled}"))
        result["folded"] = trainer.compute_log_probs(batch, 1.0)
        result["folded base"] = trainer.base_log_probs(batch, 1.0)
        results.append(result)
    eager, compiled_ = results
    assert len([k for k in eager if k.startswith("grad ")]) == 28 and all(".lora_" in k for k in eager if "grad" in k)
    for key, value in eager.items():
        torch.testing.assert_close(compiled_[key], value, atol=1e-5, rtol=1e-4, msg=key)
    assert float((eager["policy"] - eager["base"]).abs().max()) > 0.1  # the adapters matter
    torch.testing.assert_close(compiled_["folded base"], compiled_["policy"], atol=1e-5, rtol=0)  # folded in


def test_compiled_critic_values_are_the_eager_values(tiny_model_path):
    batch = training_batch(vocab=90)
    critics = [HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(compile=c), seed=0) for c in (False, True)]
    assert any(_compiled(m) for m in critics[1].model.modules())
    values = [critic.forward(batch, ("values",), 1.0)["values"] for critic in critics]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=1e-5)
    assert float(values[0].abs().sum()) > 0.01


def test_compile_needs_a_strategy_that_compiles(plain_train_strategy):
    plugins = plain_train_strategy
    with pytest.raises(ConfigError, match="'roles.actor_train.compile': train strategy 'plain' does not compile its "
                                          "model; train strategies that do: .*fsdp2.*hf"):
        load_and_check(None, ["roles.actor_train.strategy=plain", "roles.actor_train.compile=true"], plugins)
    load_and_check(None, ["roles.actor_train.strategy=plain"], plugins)  # off by default
    load_and_check(None, ["roles.actor_train.compile=true"], plugins)  # hf does
    load_and_check(None, ["roles.actor_train.compile=true", "roles.actor_train.lora={rank: 4}"], plugins)  # with LoRA


def test_compile_needs_a_cpp_compiler(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("roll_core.strategies.compiled.shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="'roles.actor_train.compile': torch.compile needs a C\\+\\+ compiler and "
                                          "none was found .*apt-get install g\\+\\+"):
        load_and_check(None, ["roles.actor_train.compile=true"])
    load_and_check(None, [])  # not asked for, not needed
    monkeypatch.setenv("CXX", "my-c++")
    monkeypatch.setattr("roll_core.strategies.compiled.shutil.which", lambda name: name if name == "my-c++" else None)
    load_and_check(None, ["roles.actor_train.compile=true"])  # $CXX counts
