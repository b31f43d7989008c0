"""Tool use: answer an arithmetic question, calling a calculator or running Python on the way.

Each seed poses one question, e.g. ``What is (37 * 48) + 19?``. Every reply is one of:

* ``calc: <expression>``: the calculator evaluates ``+ - * / // % **`` and parentheses over numbers
  (an AST walk, no ``eval``; exponents up to 64) and answers ``= <value>``;
* ``python: <code>``: the program runs in roll-rewards' code sandbox, the isolation the ``code``
  reward's programs get (bubblewrap namespaces, no network, a non-root user, seccomp, and CPU,
  wall-clock, memory, process and output limits: ``roll_rewards.sandbox``), and its stdout (or its
  failure) comes back, cut to ``max_output_chars``. Needs ``pip install 'roll-envs[tools]'``;
* ``answer: <number>``: ends the episode, reward 1 when it equals the true value (within 1e-6).

A reply that is none of these, or a tool call that fails, costs ``invalid_action_penalty`` (-0.1)
and the episode goes on; after ``max_steps`` replies it is truncated. ``tools`` chooses which tools
exist (by default both when roll-rewards is installed, else the calculator); the question says which. ``info``: ``success``,
``state_hash`` (the question and the tool results so far), ``tool_calls``.

Expert (``expert_action``): ``calc:`` the question's expression, then ``answer:`` the result.
"""

from __future__ import annotations

import ast
import importlib.util
import operator
import random
import textwrap
import zlib
from typing import Any

from roll_core.envs import Env

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, big powers)."""
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return walk(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(str(exc)) from None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class ToolUse(Env):
    def __init__(self, tools: list[str] | None = None, max_steps: int = 4, invalid_action_penalty: float = -0.1,
                 max_output_chars: int = 200, python_wall_seconds: float = 5.0):
        if tools is None:
            tools = ["calculator", "python"] if importlib.util.find_spec("roll_rewards") else ["calculator"]
        self.tools = list(tools)
        unknown = set(self.tools) - {"calculator", "python"}
        if unknown or not self.tools:
            raise ValueError(f"tools must name some of 'calculator', 'python'; got {self.tools}")
        self.max_steps, self.invalid_action_penalty = max_steps, invalid_action_penalty
        self.max_output_chars, self.python_wall_seconds = max_output_chars, python_wall_seconds
        self._limits = None
        if "python" in self.tools:
            try:
                from roll_rewards.sandbox import SandboxLimits
            except ImportError:
                raise ValueError("the python tool runs programs in roll-rewards' sandbox: pip install "
                                 "'roll-envs[tools]' (or pass tools: [calculator])") from None
            self._limits = SandboxLimits(cpu_seconds=max(1, int(python_wall_seconds)), wall_seconds=python_wall_seconds,
                                         memory_mb=256, max_processes=8)
        self.expression, self.value = "", 0.0
        self._steps, self._history, self._last_result = 0, "", None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-"])
        self.expression = f"({a} * {b}) {op} {c}"
        self.value = calculate(self.expression)
        self._steps, self._history, self._last_result = 0, "", None
        tools = " or ".join(f"'{'calc' if t == 'calculator' else t}: ...'" for t in self.tools)
        return f"What is {self.expression}? Reply {tools} to use a tool, 'answer: N' to answer.", self._info(False)

    def _info(self, success: bool, **extra) -> dict[str, Any]:
        state = zlib.crc32(f"{self.expression}|{self._history}".encode())
        return {"success": success, "state_hash": state, **extra}

    def _run_python(self, code: str) -> str:
        from roll_rewards.sandbox import run_python

        result = run_python(textwrap.dedent(code).strip(), limits=self._limits)
        if not result.ok:
            last = (result.stderr.strip().splitlines() or [""])[-1]
            raise ValueError(f"python {result.status}: {last}" if last else f"python {result.status}")
        return result.stdout.strip()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        out_of_steps = self._steps >= self.max_steps
        kind, _, body = action.strip().partition(":")
        kind = kind.strip().lower()
        try:
            if kind == "answer":
                correct = abs(float(body.strip()) - self.value) < 1e-6
                return ("correct" if correct else "wrong"), float(correct), True, False, self._info(correct)
            if kind == "calc" and "calculator" in self.tools:
                self._last_result = _number(calculate(body))
                output = f"= {self._last_result}"
            elif kind == "python" and "python" in self.tools:
                output = "output: " + self._run_python(body)[: self.max_output_chars]
            else:
                raise ValueError(f"no tool or answer in the reply (tools: {', '.join(self.tools)})")
        except ValueError as exc:
            message = f"error: {exc}"[: self.max_output_chars]
            return message, self.invalid_action_penalty, False, out_of_steps, self._info(False, tool_calls=self._steps)
        self._history += output + ";"
        return output, 0.0, False, out_of_steps, self._info(False, tool_calls=self._steps)

    def expert_action(self) -> str | None:
        if not self.expression:
            return None
        if self._last_result is None and "calculator" in self.tools:
            return f"calc: {self.expression}"
        return f"answer: {_number(self.value)}"
