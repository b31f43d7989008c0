"""A stand-in for the ``sglang`` module with the parts of its public API roll-sglang uses, for machines
where SGLang cannot be installed (it needs CUDA). The model is real (a transformers model on CPU), so
the log-probs it reports are those of its weights and roll's plumbing can be checked against the hf
trainer; what is faked is the serving machinery (scheduler processes, KV cache, CUDA kernels).

Followed from SGLang's API: ``Engine(**server_args)`` with ``.loop`` (its event loop) and
``.tokenizer_manager.abort_request(rid=...)``; ``async_generate(input_ids, sampling_params, rid,
return_logprob, logprob_start_len, top_logprobs_num)`` returning ``{"output_ids", "meta_info":
{"id", "finish_reason": {"type": ...}, "output_token_logprobs", "input_token_logprobs",
"input_top_logprobs"}}`` with ``(logprob, token_id, text)`` entries; the synchronous
``update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``, ``flush_cache()``,
``release_memory_occupation(tags=None)`` and ``resume_memory_occupation(tags=None)``.
"""

from __future__ import annotations

import asyncio

import torch

__version__ = "0.5.23"

SERVER_ARGS = {"model_path", "dtype", "random_seed", "context_length", "mem_fraction_static", "disable_radix_cache",
               "tp_size", "enable_memory_saver", "skip_tokenizer_init", "log_level"}


class TokenizerManager:
    def __init__(self):
        self.aborted: set[str] = set()

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborted.add(rid)


class Engine:
    def __init__(self, **kwargs):
        from transformers import AutoModelForCausalLM

        unknown = set(kwargs) - SERVER_ARGS
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        self.server_args = kwargs
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = TokenizerManager()
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=torch.float32).eval()
        self.generator = torch.Generator().manual_seed(kwargs.get("random_seed", 0))
        self.calls: list[str] = []
        self.released = False
        self.max_running = self.running = 0

    def _log_dist(self, ids: list[int]) -> torch.Tensor:
        """``log_softmax(logits)`` ``[len(ids), V]``: position t predicts token t + 1."""
        with torch.no_grad():
            return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)

    async def async_generate(self, input_ids, sampling_params, rid, return_logprob=False, logprob_start_len=None,
                             top_logprobs_num=None):
        if self.released:
            raise RuntimeError("generate while the memory occupation is released")
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            return await self._generate(list(input_ids), sampling_params, rid, logprob_start_len, top_logprobs_num)
        finally:
            self.running -= 1

    async def _generate(self, ids, sampling, rid, start, top_k):
        prompt_len = len(ids)
        eos = self.model.config.eos_token_id  # an id or a list of them
        ends = {*(eos if isinstance(eos, list) else [eos]), *(sampling.get("stop_token_ids") or ())}  # as SGLang
        temperature = sampling.get("temperature", 1.0)
        meta = {"id": rid, "output_token_logprobs": [], "finish_reason": {"type": "length"}}
        for _ in range(sampling["max_new_tokens"]):
            await asyncio.sleep(0)  # other requests get their turn: continuous batching, one token each
            if rid in self.tokenizer_manager.aborted:
                meta["finish_reason"] = {"type": "abort"}
                break
            logits = self._log_dist(ids)[-1]
            if temperature == 0:
                token = int(logits.argmax())
                log_probs = logits
            else:  # like SGLang, the log-probs of the distribution drawn from: after the top-k and top-p cuts
                probs = _cut(torch.softmax(logits / temperature, -1), sampling.get("top_k", -1),
                             sampling.get("top_p", 1.0))
                log_probs = probs.log()
                token = int(torch.multinomial(probs, 1, generator=self.generator))
            meta["output_token_logprobs"].append((float(log_probs[token]), token, None))
            ids.append(token)
            if token in ends:
                meta["finish_reason"] = {"type": "stop"}
                break
        if start is not None:
            dist = self._log_dist(ids)
            positions = range(start, prompt_len)
            meta["input_token_logprobs"] = [(None if p == 0 else float(dist[p - 1, ids[p]]), ids[p], None)
                                            for p in positions]
            if top_k:
                meta["input_top_logprobs"] = [
                    None if p == 0 else [(float(lp), int(t), None) for lp, t in zip(*dist[p - 1].topk(top_k))]
                    for p in positions]
        return {"output_ids": ids[prompt_len:], "meta_info": meta}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        state = self.model.state_dict()
        unknown = [name for name, _ in named_tensors if name not in state]
        if unknown:
            return False, f"unknown parameters {unknown}"
        with torch.no_grad():
            for name, tensor in named_tensors:
                state[name].copy_(tensor)
        self.calls.append(f"update_weights_from_tensor(flush_cache={flush_cache})")
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush_cache")

    def release_memory_occupation(self, tags=None):
        self.released = True
        self.calls.append("release_memory_occupation")

    def resume_memory_occupation(self, tags=None):
        self.released = False
        self.calls.append("resume_memory_occupation")

    def shutdown(self):
        self.loop.close()


def _cut(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``probs`` ``[V]`` cut to the ``top_k`` heaviest (-1: all), then to the nucleus of ``top_p``, renormalised."""
    if top_k > 0:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
    if top_p < 1.0:
        ordered = probs.sort(descending=True).values
        last = ordered[int(((ordered.cumsum(0) - ordered) < top_p * probs.sum()).sum()) - 1]
        probs = torch.where(probs >= last, probs, 0.0)
    return probs / probs.sum()
