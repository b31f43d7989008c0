"""The ``sglang`` inference strategy: roll's :class:`~roll_core.strategy.InferStrategy` on an SGLang engine.

SGLang's offline ``sglang.Engine`` runs its scheduler in child processes and answers coroutines on
its own event loop (``engine.loop``); its synchronous methods run that loop until they are done.
roll hands the engine to the core's :class:`~roll_core.strategies.engine_loop.EngineLoop` (one
thread owns it, many caller threads submit) through :class:`SGLangSteps`, which makes it look
step-based: a request is an ``async_generate`` task on the engine's loop, a step runs the loop until
a request finishes. So requests from concurrent calls share SGLang's continuous batching, and the
synchronous methods run between steps, when the loop is idle. What each part uses of SGLang's
public API:

* ``generate``: ``async_generate(input_ids=..., sampling_params=..., return_logprob=True, rid=...)``,
  one request per row; the sampled tokens' log-probs are ``meta_info["output_token_logprobs"]``.
  SGLang computes those where it samples, after its top-k and top-p cuts; roll's are before the
  cuts, so with ``rollout.top_k`` or ``rollout.top_p < 1`` they are recomputed by
  ``compute_log_probs`` (:func:`~roll_core.strategies.engines.engine_cuts`).
* ``compute_log_probs``: the sequences as prompts with ``logprob_start_len`` at the response, read
  from ``meta_info["input_token_logprobs"]``; at a temperature other than 1 (or for distributions)
  the whole vocabulary (``top_logprobs_num``) re-normalised at the temperature.
* abort: ``engine.tokenizer_manager.abort_request(rid=...)`` when the scheduler cancels a call.
* the weight-update protocol: ``begin_update`` waits for running requests and holds new ones,
  ``load`` is ``update_weights_from_tensor(named_tensors=bucket, flush_cache=False)`` (the engine's
  ``load_weights`` fuses and shards Hugging Face-named tensors itself), ``end_update`` is
  ``flush_cache()`` and resumes.
* colocation: ``offload``/``reload`` are ``release_memory_occupation()`` /
  ``resume_memory_occupation()`` (weights and KV cache leave the GPU while the trainer runs; needs
  ``enable_memory_saver``, on by ``release_on_offload``).

SGLang needs CUDA, so this runs on GPU machines only; the tests here check the roll side against a
fake engine with SGLang's API (``tests/fake_sglang.py``) and run the real engine where it imports
(see the plugin's README for what was verified where).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import torch

from roll_core.data import Batch
from roll_core.strategies.engine_loop import EngineLoop
from roll_core.strategies.engines import check_engine_version, engine_cuts, import_engine, samples_before_cuts
from roll_core.strategies.sequences import (packed_responses, padding_id, prompt_token_lists, rescaled_log_probs,
                                            response_end_ids)
from roll_core.strategy import InferStrategy, request_cancelled
from roll_sglang import SUPPORTED_SGLANG
from roll_sglang.options import SGLangOptions

INSTALL_HINT = ("the sglang strategy needs the SGLang engine (CUDA only): pip install 'roll-sglang[engine]'; "
                "see plugins/roll_sglang/README.md")


class SGLangSteps:
    """An ``sglang.Engine`` behind the step interface :class:`EngineLoop` drives (see the module
    docstring). Only the loop thread calls it."""

    def __init__(self, engine: Any, poll_s: float = 0.005):
        self.engine, self.poll_s = engine, poll_s
        self.running: dict[str, asyncio.Task] = {}
        self.aborting: set[asyncio.Task] = set()  # aborted; run until SGLang answers them

    def add_request(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> None:
        coroutine = self.engine.async_generate(input_ids=input_ids, rid=rid, **params)
        self.running[rid] = self.engine.loop.create_task(coroutine)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.aborting)

    def step(self) -> list[SimpleNamespace]:
        tasks = [*self.running.values(), *self.aborting]
        self.engine.loop.run_until_complete(asyncio.wait(tasks, timeout=self.poll_s,
                                                         return_when=asyncio.FIRST_COMPLETED))
        self.aborting = {t for t in self.aborting if not t.done()}
        done = [rid for rid, task in self.running.items() if task.done()]
        # the task itself is the output: its result (or the request's own error) is read by the caller
        return [SimpleNamespace(request_id=rid, finished=True, task=self.running.pop(rid)) for rid in done]

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self.running.pop(rid, None)
            if task is not None:
                self.engine.tokenizer_manager.abort_request(rid=rid)
                self.aborting.add(task)


def _pairs(entries) -> list[tuple[float, int]]:
    """SGLang's log-prob entries ``(logprob, token_id, text)`` as ``(logprob, token_id)``."""
    return [(float(e[0]), int(e[1])) for e in entries]


class SGLangInferStrategy(InferStrategy):
    """Generation and log-probs on an SGLang engine (see the module docstring)."""

    concurrent_requests = True

    def __init__(self, model_path: str, role_config, seed: int):
        from transformers import AutoConfig

        self.options = SGLangOptions.model_validate(getattr(role_config, "strategy_options", {}) or {})
        sglang = import_engine("sglang", INSTALL_HINT)
        check_engine_version("sglang", sglang.__version__, SUPPORTED_SGLANG, "roll-sglang")
        self.engine = sglang.Engine(**self.options.engine_kwargs(model_path, seed))
        self.loop = EngineLoop(SGLangSteps(self.engine), name="sglang-engine-loop")
        hf_config = AutoConfig.from_pretrained(model_path)
        self.vocab_size = hf_config.vocab_size
        self.pad_token_id = padding_id(hf_config)
        # without its tokenizer (skip_tokenizer_init) SGLang stops at the configs' end ids alone: the
        # tokenizer's EOS is named here, so that every engine ends a response at the same ids
        self.end_ids = response_end_ids(model_path)
        self.released = False
        self.version = 0

    def _run(self, sequences: list[list[int]], params: list[dict[str, Any]]) -> list[dict | None]:
        """SGLang's output dict per sequence (None for a request aborted because the call was cancelled)."""
        outputs = self.loop.run(sequences, params, cancelled=request_cancelled)
        return [None if out is None else out.task.result() for out in outputs]

    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int = 0) -> Batch:
        cut = engine_cuts(temperature, top_p, top_k)
        top_p, top_k = cut or (1.0, -1)
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                    "stop_token_ids": self.end_ids}
        prompts = prompt_token_lists(batch["prompt_ids"], batch["prompt_mask"])
        params = [{"sampling_params": sampling, "return_logprob": True}] * len(prompts)
        # SGLang's log-probs are those of the cut distribution, roll's are before the cuts
        return samples_before_cuts(self.loop, batch, cut, lambda: self._samples(prompts, params),
                                   lambda sampled: self.compute_log_probs(sampled, temperature))

    def _samples(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """``responses``, ``response_mask`` and ``infer_log_probs`` of one request per prompt."""
        tokens, log_probs = [], []
        for out in self._run(prompts, params):
            if out is None or out["meta_info"]["finish_reason"].get("type") == "abort":
                tokens.append([])
                log_probs.append([])
                continue
            pairs = _pairs(out["meta_info"]["output_token_logprobs"])
            tokens.append([t for _, t in pairs])
            log_probs.append([lp for lp, _ in pairs])
        return packed_responses(tokens, log_probs, self.pad_token_id)

    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        prompts, responses = prompt_token_lists(batch["prompt_ids"], batch["prompt_mask"]), batch["responses"]
        lengths = [int(n) for n in batch["response_mask"].sum(-1).tolist()]
        sequences = [p + responses[i, :n].tolist() for i, (p, n) in enumerate(zip(prompts, lengths))]
        full_vocab = distribution or temperature not in (0.0, 1.0)
        params = [{"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
                   "logprob_start_len": len(p), **({"top_logprobs_num": self.vocab_size} if full_vocab else {})}
                  for p in prompts]
        width = responses.shape[1]
        result = torch.zeros((len(sequences), width, self.vocab_size) if distribution else (len(sequences), width))
        for i, (out, prompt, n) in enumerate(zip(self._run(sequences, params), prompts, lengths)):
            if out is None or n == 0:
                continue
            targets = sequences[i][len(prompt):]
            if not full_vocab:
                result[i, :n] = torch.tensor([lp for lp, _ in _pairs(out["meta_info"]["input_token_logprobs"])[:n]])
                continue
            raw = torch.full((n, self.vocab_size), float("-inf"))
            for row, entries in enumerate(out["meta_info"]["input_top_logprobs"][:n]):
                for lp, token in _pairs(entries):
                    raw[row, token] = lp
            result[i, :n] = rescaled_log_probs(raw, targets, temperature, distribution)
        return result

    # -- the weight-update protocol --------------------------------------------------------------
    def begin_update(self, version: int) -> None:
        self.version = version
        self.loop.pause()  # running requests finish on the old weights; new ones wait for end_update

    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.loop.call(lambda: self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False))

    def end_update(self) -> None:
        self.loop.call(self.engine.flush_cache)  # cached prefixes were computed with the old weights
        self.loop.resume()

    def close(self) -> None:
        """Stop the loop thread, then the engine's scheduler and detokenizer processes."""
        self.loop.close()
        self.engine.shutdown()

    # -- colocation ------------------------------------------------------------------------------
    def offload(self) -> None:
        if not self.options.release_on_offload or self.released:
            return
        self.loop.pause()
        self.loop.call(self.engine.release_memory_occupation)
        self.released = True

    def reload(self) -> None:
        if not self.released:
            return
        self.loop.call(self.engine.resume_memory_occupation)
        self.released = False
        self.loop.resume()
