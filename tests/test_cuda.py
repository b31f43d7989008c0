"""The CUDA paths of the core strategies, run where a GPU is present (skipped elsewhere, so in CI).

On a GPU the strategies put their models on ``cuda`` and their process groups on nccl; on this
project's CI machines they never do. What must hold on one GPU: the ``hf`` strategy on CUDA computes
the CPU model's log-probs (fp32), ``fsdp2`` over nccl matches ``hf`` through one core update, bf16
stays near fp32, AdamW steps on torch's fused CUDA kernel as its loop would, the sampler's decoding
step draws top-p from the nucleus (by sort there), and a whole ``rlvr`` run on the ``local`` executor
trains. Run::

    pytest tests/test_cuda.py -v
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from conftest import metrics_of

from roll_core.config import load_config
from roll_core.strategies.hf import HFTrainStrategy
from roll_core.testing import assert_trainer_matches_hf, training_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

UPDATE = ["algorithm.ppo_epochs=2", "algorithm.ppo_mini_batch_size=4", "algorithm.kl_loss_coef=0.1",
          "algorithm.entropy_coef=0.01", "algorithm.max_grad_norm=0.5", "roles.actor_train.micro_batch_size=2"]


def test_hf_on_cuda_computes_the_cpu_log_probs(tiny_model_path, monkeypatch):
    import roll_core.strategies.hf as hf

    cfg = load_config(None, UPDATE)
    trainer = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    monkeypatch.setattr(hf, "default_device", lambda: torch.device("cpu"))
    on_cpu = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    assert trainer.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
    assert not next(on_cpu.model.parameters()).is_cuda
    batch = training_batch(trainer.model.config.vocab_size)
    mask = batch["response_mask"]
    for name in ("log_probs", "entropy"):
        got, expected = (s.forward(batch, (name,), 1.0)[name].cpu() for s in (trainer, on_cpu))
        torch.testing.assert_close(got * mask, expected * mask, atol=1e-4, rtol=0, msg=name)


def test_fsdp2_over_nccl_matches_hf(tiny_model_path):
    import torch.distributed as dist

    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy

    cfg = load_config(None, UPDATE)
    trainer = FSDP2TrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    assert dist.get_backend() == "nccl"
    reference = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    assert_trainer_matches_hf(trainer, reference, cfg)


def test_adamw_on_cuda_steps_fused_as_its_loop_would(tiny_model_path, monkeypatch):
    import roll_core.strategies.hf as hf

    cfg = load_config(None, UPDATE)
    fused = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    monkeypatch.setattr(hf, "fused_adamw", lambda params: None)  # torch's default: the for-each loop
    loop = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    assert fused.optimizers["default"].defaults["fused"] is True
    assert loop.optimizers["default"].defaults["fused"] is None
    assert_trainer_matches_hf(loop, fused, cfg)  # two mini-batches x two epochs, every weight within 1e-5


def test_a_local_rlvr_run_trains_on_the_gpu(tmp_path):
    run = subprocess.run([sys.executable, "-m", "roll_core.cli", "run", f"output_dir={tmp_path / 'run'}",
                          "executor=local", "trainer.max_steps=10", "trainer.eval_every=10", "trainer.save_every=0",
                          "data.eval_size=64", "trackers=[jsonl]"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics_of(tmp_path / "run")
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    print("held-out accuracy on CUDA:", accuracy)
    assert len(accuracy) >= 2 and accuracy[-1] > accuracy[0]


def test_next_tokens_on_cuda_draw_from_the_nucleus_in_proportion_with_log_softmax_log_probs():
    from roll_core.strategies.sequences import next_tokens

    shares = torch.tensor([0.5, 0.3, 0.15, 0.05])  # a nucleus of 0.81 holds the first three
    tokens, _ = next_tokens(shares.log().repeat(40_000, 1).cuda(), 1.0, 0.81, torch.Generator("cuda").manual_seed(0))
    drawn = torch.bincount(tokens.cpu(), minlength=4) / 40_000
    torch.testing.assert_close(drawn, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.01, rtol=0)
    # a real vocabulary: every token from its row's nucleus (as a sort defines it), log_softmax's log-probs
    logits = torch.randn(64, 151_936, generator=torch.Generator().manual_seed(0)).cuda() * 6
    probs, order = (logits / 0.7).softmax(-1).sort(-1, descending=True)
    ahead = probs.cumsum(-1) - probs  # the mass of the tokens before each in the order
    outside = (ahead >= 0.9).scatter(-1, order, ahead >= 0.9)
    for seed in range(5):
        token, logp = next_tokens(logits.clone(), 0.7, 0.9, torch.Generator("cuda").manual_seed(seed))
        assert not outside.gather(-1, token[:, None]).any()
        expected = (logits / 0.7).log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        torch.testing.assert_close(logp, expected, atol=2e-5, rtol=1e-5)


def _scaled_model(tiny_model_path):
    """The tiny model on CUDA with larger random weights, so each prompt decodes its own tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval().cuda()
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.3)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    enc = tok(["1+2=", "33+44=", "5=", "12+7="] * 4, return_tensors="pt", padding=True, add_special_tokens=False)
    return model, tok, enc["input_ids"].cuda(), enc["attention_mask"].cuda()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_decoding_steps_replayed_from_a_cuda_graph_decode_what_the_eager_sampler_does(tiny_model_path, precision,
                                                                                      monkeypatch):
    from roll_core.strategies import cuda_graph
    from roll_core.strategies.precision import autocast
    from roll_core.strategies.sequences import response_log_probs, sample_responses

    model, tok, ids, mask = _scaled_model(tiny_model_path)
    captures, replays = [], []
    capture, replay = cuda_graph.Replay._capture, torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(cuda_graph.Replay, "_capture", lambda self: captures.append(1) or capture(self))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self))
    with torch.no_grad(), autocast(torch.device("cuda"), precision):
        alone = sample_responses(model, ids, mask, max_new_tokens=8, eos_token_id=-1, pad_token_id=tok.pad_token_id,
                                 temperature=0)[0].tolist()
        # an end id that the prompts reach at different steps, so rows finish while others decode
        end = max({t for row in alone for t in row},
                  key=lambda t: len({row.index(t) if t in row else 8 for row in alone}))
        eager = sample_responses(model, ids, mask, max_new_tokens=8, eos_token_id=end, pad_token_id=tok.pad_token_id,
                                 temperature=0)
        graphed = cuda_graph.sample_responses(model, ids, mask, max_new_tokens=8, eos_token_id=end,
                                              pad_token_id=tok.pad_token_id, temperature=0)
    assert len(set(map(tuple, alone))) > 1 and len(captures) == 1 and len(replays) == graphed[0].shape[1] - 2
    assert graphed[0].tolist() == eager[0].tolist() and graphed[1].tolist() == eager[1].tolist()
    torch.testing.assert_close(graphed[2], eager[2], atol=5e-2 if precision == "bf16" else 1e-5, rtol=0)
    # sampled: each token's log-prob is a fresh forward pass's (fp32 only: bf16's passes differ by shape)
    if precision == "fp32":
        with torch.no_grad():
            resp, rmask, logp = cuda_graph.sample_responses(model, ids, mask, max_new_tokens=8, eos_token_id=end,
                                                            pad_token_id=tok.pad_token_id, temperature=0.7,
                                                            generator=torch.Generator("cuda").manual_seed(0))
            recomputed = response_log_probs(model, torch.cat([ids, resp], 1), torch.cat([mask, rmask], 1),
                                            resp.shape[1], temperature=0.7)
        torch.testing.assert_close(recomputed * rmask, logp, atol=1e-4, rtol=1e-4)


def test_the_hf_engine_on_cuda_decodes_with_graphs_and_its_log_probs_are_the_trainers(tiny_model_path, monkeypatch):
    from roll_core.strategies import cuda_graph
    from roll_core.strategies.hf import HFInferStrategy
    from roll_core.testing import assert_engine_cuts_before_log_probs

    captures = []
    capture = cuda_graph.Replay._capture
    monkeypatch.setattr(cuda_graph.Replay, "_capture", lambda self: captures.append(1) or capture(self))
    cfg = load_config(None)
    engine = HFInferStrategy(str(tiny_model_path), cfg.roles.actor_infer, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns and turns the graphs off
        assert_engine_cuts_before_log_probs(engine, HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train,
                                                                    seed=0), atol=1e-4)
    assert engine.cuda_graphs and len(captures) == 4  # one per generate call
