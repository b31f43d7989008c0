"""``llm_judge``: an LLM grades each response, for domains without a verifier (open-ended QA, writing).

Two backends, one grading contract:

* ``backend: http``: any OpenAI-compatible ``/chat/completions`` endpoint (vLLM's and SGLang's
  servers, hosted APIs). ``base_url`` is e.g. ``http://judge:8000/v1``; the API key is read from the
  environment variable named by ``api_key_env`` when the worker starts, so no secret is ever written
  into a config or a checkpoint. Requests run ``concurrency`` at a time, each with ``timeout_s``;
  connection errors, timeouts, 408/409/429 and 5xx are retried ``max_retries`` times with
  exponential backoff (``backoff_s * 2**attempt``, or the server's ``Retry-After``). Other 4xx fail at
  once: retrying a bad key or a wrong model name only wastes the run's time.
* ``backend: roll``: a judge model loaded in the reward worker through any registered roll inference
  strategy (``strategy: hf``, or ``vllm`` where installed) from the local ``model_path``; all of a
  call's samples are judged in one batched, greedy generation.

The judge prompt is ``template`` filled with ``{prompt}``, ``{response}``, ``{ground_truth}`` and
``{max_score}``. ``verdict: score`` reads the last ``Score: N`` (``score_pattern``) and returns
``N / max_score`` clipped to [0, 1]; ``verdict: yes_no`` reads the last ``yes``/``no``. A judgement
that cannot be parsed scores ``error_score`` (and is counted in ``stats``). A request that still
fails after its retries raises (the run stops with the reward's name and the endpoint's error) unless
``on_error: score``, which scores it ``error_score`` and goes on.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from roll_core.rewards import Reward, RewardInput

DEFAULT_TEMPLATE = (
    "You grade answers. Compare the answer with the reference and judge whether it is correct and "
    "complete.\n\nQuestion:\n{prompt}\n\nReference answer:\n{ground_truth}\n\nAnswer to grade:\n"
    "{response}\n\nReply with a short justification, then a last line 'Score: N' where N is an "
    "integer from 0 to {max_score}."
)
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class JudgeError(RuntimeError):
    """The judge endpoint failed after all retries (or with an error that retrying cannot fix)."""


class LLMJudgeReward(Reward):
    def __init__(
        self,
        backend: Literal["http", "roll"] = "http",
        *,
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        model_path: str | None = None,
        strategy: str = "hf",
        template: str = DEFAULT_TEMPLATE,
        system: str | None = None,
        verdict: Literal["score", "yes_no"] = "score",
        score_pattern: str = r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
        max_score: float = 10.0,
        temperature: float = 0.0,
        max_tokens: int = 256,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        on_error: Literal["raise", "score"] = "raise",
        error_score: float = 0.0,
    ):
        if backend not in ("http", "roll"):
            raise ValueError(f"llm_judge: backend must be 'http' or 'roll', got {backend!r}")
        if verdict not in ("score", "yes_no"):
            raise ValueError(f"llm_judge: verdict must be 'score' or 'yes_no', got {verdict!r}")
        if on_error not in ("raise", "score"):
            raise ValueError(f"llm_judge: on_error must be 'raise' or 'score', got {on_error!r}")
        if max_score <= 0 or timeout_s <= 0 or max_retries < 0 or concurrency < 1:
            raise ValueError("llm_judge: max_score and timeout_s must be > 0, max_retries >= 0, concurrency >= 1")
        try:
            template.format(prompt="", response="", ground_truth="", max_score=max_score)
        except (KeyError, IndexError) as exc:
            raise ValueError(f"llm_judge: template has an unknown field {exc}; use {{prompt}}, {{response}}, "
                             "{ground_truth} and {max_score} (double other braces)") from None
        self.backend, self.template, self.system = backend, template, system
        self.verdict, self.pattern = verdict, re.compile(score_pattern, re.IGNORECASE)
        self.max_score, self.temperature, self.max_tokens = float(max_score), temperature, max_tokens
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.concurrency, self.on_error, self.error_score = concurrency, on_error, float(error_score)
        self.stats = {"requests": 0, "retries": 0, "failed": 0, "unparsed": 0}
        self._reported = dict(self.stats)  # what metrics() has returned so far
        self._lock = threading.Lock()  # stats are counted from the request threads
        if backend == "http":
            if not base_url or not model:
                raise ValueError("llm_judge with backend 'http' needs base_url (e.g. http://host:8000/v1) and model")
            import httpx

            headers = {}
            if api_key_env and os.environ.get(api_key_env):
                headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
            self.url, self.model = base_url.rstrip("/") + "/chat/completions", model
            self.client = httpx.Client(headers=headers, timeout=timeout_s)
        else:
            if not model_path:
                raise ValueError("llm_judge with backend 'roll' needs model_path (a local Hugging Face model)")
            self._load_local(model_path, strategy)

    @classmethod
    def contract_examples(cls):
        """None here: judging needs a live endpoint or a judge model (tests/test_judge.py runs both)."""
        return []

    def metrics(self) -> dict[str, float]:
        """Requests, retries, failed requests and unparsable verdicts since the last call (the run
        reports them as ``reward/llm_judge/<key>``)."""
        with self._lock:
            out = {k: float(v - self._reported[k]) for k, v in self.stats.items()}
            self._reported = dict(self.stats)
        return out

    def _count(self, *keys: str | None, n: int = 1) -> None:
        with self._lock:
            for key in keys:
                if key:
                    self.stats[key] += n

    # -- the grading contract -----------------------------------------------------------------
    def render(self, sample: RewardInput) -> str:
        return self.template.format(prompt=sample.prompt, response=sample.response,
                                    ground_truth=sample.ground_truth, max_score=int(self.max_score)
                                    if self.max_score.is_integer() else self.max_score)

    def parse(self, judgement: str) -> float | None:
        """The judgement's score in [0, 1], or None when it gives none."""
        if self.verdict == "yes_no":
            words = re.findall(r"\b(yes|no)\b", judgement, re.IGNORECASE)
            return None if not words else float(words[-1].lower() == "yes")
        found = self.pattern.findall(judgement)
        if not found:
            return None
        return min(max(float(found[-1]) / self.max_score, 0.0), 1.0)

    def _to_score(self, judgement: str | None) -> float:
        if judgement is None:
            return self.error_score
        value = self.parse(judgement)
        if value is None:
            self._count("unparsed")
            return self.error_score
        return value

    def score(self, sample: RewardInput) -> float:
        return self.score_batch([sample])[0]

    def score_batch(self, samples: list[RewardInput]) -> list[float]:
        prompts = [self.render(s) for s in samples]
        if self.backend == "roll":
            judgements = self._generate_local(prompts)
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(prompts), 1))) as pool:
                judgements = list(pool.map(self._ask_guarded, prompts))
        return [self._to_score(j) for j in judgements]

    # -- http ---------------------------------------------------------------------------------
    def _ask_guarded(self, prompt: str) -> str | None:
        try:
            return self.ask(prompt)
        except JudgeError:
            self._count("failed")
            if self.on_error == "raise":
                raise
            return None

    def ask(self, prompt: str) -> str:
        """One chat completion, with retries. Returns the judge's text."""
        import httpx

        messages = ([{"role": "system", "content": self.system}] if self.system else [])
        messages.append({"role": "user", "content": prompt})
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        last = ""
        for attempt in range(self.max_retries + 1):
            self._count("requests", "retries" if attempt else None)
            wait = self.backoff_s * 2**attempt
            try:
                response = self.client.post(self.url, json=body)
            except httpx.TimeoutException:
                last = f"no answer within timeout_s={self.timeout_s}"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    try:
                        return response.json()["choices"][0]["message"]["content"] or ""
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise JudgeError(f"{self.url} answered 200 without choices[0].message.content: "
                                         f"{response.text[:200]!r}") from None
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code not in RETRY_STATUS:
                    raise JudgeError(f"{self.url} refused the request ({last}); not retried")
                retry_after = response.headers.get("retry-after", "")
                if retry_after.replace(".", "", 1).isdigit():
                    wait = min(float(retry_after), 60.0)
            if attempt < self.max_retries:
                time.sleep(wait)
        raise JudgeError(f"{self.url} failed after {self.max_retries + 1} attempts; last error: {last}")

    # -- a roll inference strategy ------------------------------------------------------------
    def _load_local(self, model_path: str, strategy: str) -> None:
        from transformers import AutoTokenizer

        from roll_core.config.schema import InferRoleConfig
        from roll_core.plugins import get_plugins

        cls = get_plugins().infer_strategies.get(strategy)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.engine = cls(model_path, InferRoleConfig(strategy=strategy), 0)  # built from its role's config alone

    def _chat(self, prompt: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system}] if self.system else [])
            messages.append({"role": "user", "content": prompt})
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt

    def _generate_local(self, prompts: list[str]) -> list[str]:
        from roll_core.data import Batch
        from roll_core.rollout.sync import tokenize_prompts

        ids, mask = tokenize_prompts(self.tokenizer, [self._chat(p) for p in prompts])
        out = self.engine.generate(Batch({"prompt_ids": ids, "prompt_mask": mask}),
                                   max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=1.0)
        self._count("requests", n=len(prompts))
        return self.tokenizer.batch_decode(out["responses"], skip_special_tokens=True)
