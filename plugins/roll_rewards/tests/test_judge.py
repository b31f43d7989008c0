"""``llm_judge`` against a real OpenAI-compatible HTTP server on localhost (failures, slow answers and
bad keys simulated by the server), and through roll's own ``hf`` inference strategy on the tiny model."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roll_core.rewards import RewardInput
from roll_rewards.judge import JudgeError, LLMJudgeReward


class JudgeServer:
    """``POST /v1/chat/completions``: answers 'Score: 10' when the graded answer contains the
    reference, else 'Score: 2'. ``fail_first`` requests get 503, ``slow_s`` delays every answer."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_first, self.slow_s, self.status, self.reply = 0, 0.0, 200, None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                if len(server.requests) <= server.fail_first:
                    return self._send(503, {"error": "overloaded"}, {"Retry-After": "0"})
                if server.status != 200:
                    return self._send(server.status, {"error": {"message": "invalid api key"}})
                time.sleep(server.slow_s)
                prompt = body["messages"][-1]["content"]
                reference = prompt.split("Reference answer:\n")[1].split("\n")[0]
                graded = prompt.split("Answer to grade:\n")[1].split("\n")[0]
                text = server.reply or f"Looks {'right' if reference in graded else 'wrong'}.\nScore: " \
                       f"{10 if reference in graded else 2}"
                self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})

            def _send(self, status, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.httpd.shutdown()


def _samples():
    return [RewardInput("Capital of France?", "It is Paris.", "Paris"),
            RewardInput("Capital of Italy?", "Milan, surely.", "Rome")]


def test_http_judge_scores_and_sends_key_from_env(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    judge = LLMJudgeReward(base_url=server.url, model="judge-1", api_key_env="JUDGE_KEY", backoff_s=0)
    assert judge.score_batch(_samples()) == [1.0, 0.2]
    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["model"] == "judge-1" and req["body"]["temperature"] == 0.0


def test_http_judge_retries_server_errors(server):
    server.fail_first = 2
    judge = LLMJudgeReward(base_url=server.url, model="m", max_retries=3, backoff_s=0, concurrency=1)
    assert judge.score(_samples()[0]) == 1.0
    assert len(server.requests) == 3 and judge.stats["retries"] == 2


def test_http_judge_gives_up_after_retries_with_a_clear_error(server):
    server.fail_first = 100
    judge = LLMJudgeReward(base_url=server.url, model="m", max_retries=2, backoff_s=0)
    with pytest.raises(JudgeError, match="failed after 3 attempts; last error: HTTP 503"):
        judge.score(_samples()[0])
    lenient = LLMJudgeReward(base_url=server.url, model="m", max_retries=0, on_error="score", error_score=0.5)
    assert lenient.score(_samples()[0]) == 0.5 and lenient.stats["failed"] == 1


def test_http_judge_timeout_is_retried_then_reported(server):
    server.slow_s = 1.0
    judge = LLMJudgeReward(base_url=server.url, model="m", timeout_s=0.2, max_retries=1, backoff_s=0)
    t0 = time.perf_counter()
    with pytest.raises(JudgeError, match="no answer within timeout_s=0.2"):
        judge.score(_samples()[0])
    assert time.perf_counter() - t0 < 1.5  # two 0.2 s attempts, not two full answers
    assert len(server.requests) == 2


def test_http_judge_does_not_retry_a_bad_key(server):
    server.status = 401
    judge = LLMJudgeReward(base_url=server.url, model="m", max_retries=5, backoff_s=0)
    with pytest.raises(JudgeError, match="HTTP 401.*not retried"):
        judge.score(_samples()[0])
    assert len(server.requests) == 1


def test_unparseable_judgement_scores_error_score(server):
    server.reply = "I would rather not say."
    judge = LLMJudgeReward(base_url=server.url, model="m", error_score=0.0)
    assert judge.score_batch(_samples()) == [0.0, 0.0] and judge.stats["unparsed"] == 2
    # what the run reports per step (reward/llm_judge/...): the counts since the last report
    assert judge.metrics() == {"requests": 2.0, "retries": 0.0, "failed": 0.0, "unparsed": 2.0}
    judge.score(_samples()[0])
    assert judge.metrics() == {"requests": 1.0, "retries": 0.0, "failed": 0.0, "unparsed": 1.0}


@pytest.mark.parametrize("text, verdict, expected", [
    ("Score: 7", "score", 0.7), ("score = 12", "score", 1.0), ("Score: -3", "score", 0.0),
    ("first Score: 2 then Score: 9", "score", 0.9), ("Yes, mostly. Final: no", "yes_no", 0.0),
    ("Verdict: YES", "yes_no", 1.0), ("nothing", "yes_no", None),
])
def test_parse(text, verdict, expected):
    judge = LLMJudgeReward(base_url="http://unused/v1", model="m", verdict=verdict)
    assert judge.parse(text) == expected


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="needs base_url"):
        LLMJudgeReward()
    with pytest.raises(ValueError, match="unknown field"):
        LLMJudgeReward(base_url="http://x/v1", model="m", template="{question}")
    with pytest.raises(ValueError, match="needs model_path"):
        LLMJudgeReward(backend="roll")


def test_roll_backend_judges_with_a_roll_inference_strategy(tiny_model_path):
    # The untrained tiny model writes noise; what is checked is the path: prompts rendered, one
    # batched generation through the registered 'hf' strategy, every judgement parsed or counted.
    judge = LLMJudgeReward(backend="roll", model_path=str(tiny_model_path), max_tokens=6,
                           template="Q:{prompt} A:{response} S:", score_pattern=r"(\d)", max_score=9)
    scores = judge.score_batch(_samples() * 3)
    assert len(scores) == 6 and all(0.0 <= s <= 1.0 for s in scores)
    assert judge.stats["requests"] == 6
    assert type(judge.engine).__name__ == "HFInferStrategy"
