"""Built-in verifiable tasks that roll generates itself (no data-set download anywhere).

``carry_addition`` is the embedded default. Prompts are fixed-width sums (``"47+38="``, ``"05+19="``)
and the verifiable answer is the true sum written with a fixed number of digits (``"085"``, ``"024"``);
fixed widths give every character a fixed role, which a 2-layer model learns in a few hundred steps. The supervised demonstrations come from a *careless teacher*
that, whenever the units column carries, forgets the carry with probability
``teacher_carry_error`` (``47+38=`` -> ``"075"`` instead of ``"085"``). A model warmed up on those
demonstrations imitates the teacher: under greedy decoding it answers every carrying sum wrong,
while sampling still finds the right answer a fraction of the time. That is exactly the situation
RL with a verifiable reward is for: the reward tells right from wrong where the demonstrations
could not, and held-out accuracy rises well above what imitation reached.

Plain addition with clean demonstrations is the wrong default: supervised training alone solves it,
so RL would have nothing to show.

Every row is a dict with ``prompt``, ``ground_truth``, ``demonstration`` and ``domain``; a JSONL file
with the same keys is accepted by the data config, so user data and built-in data flow the same way.
A carrying sum also has ``rejected``, the teacher's carry-forgetting answer: with ``ground_truth``
as the chosen answer that makes a preference pair for the ``dpo`` pipeline.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field


class CarryAdditionConfig(BaseModel):
    """Options of the ``carry_addition`` task."""

    model_config = ConfigDict(extra="forbid")

    max_operand: int = Field(99, ge=9, description="operands are drawn from 0..max_operand")
    num_eval: int = Field(500, ge=1, description="held-out pairs, never seen in training")
    teacher_carry_error: float = Field(
        0.8, ge=0.0, le=1.0, description="probability the teacher drops the units carry"
    )
    seed: int = 1234


def careless_sum(a: int, b: int, forget_carry: bool) -> int:
    """The teacher's answer: the true sum, minus the units carry when it forgets it."""
    carries = (a % 10) + (b % 10) >= 10
    return a + b - (10 if carries and forget_carry else 0)


class CarryAdditionTask:
    """Generates the train and held-out splits of ``carry_addition`` deterministically."""

    name = "carry_addition"

    def __init__(self, config: CarryAdditionConfig | None = None):
        self.config = config or CarryAdditionConfig()
        cfg = self.config
        rng = random.Random(cfg.seed)
        pairs = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
        rng.shuffle(pairs)
        if cfg.num_eval >= len(pairs):
            raise ValueError(
                f"carry_addition: num_eval={cfg.num_eval} leaves no training pairs "
                f"(only {len(pairs)} pairs with max_operand={cfg.max_operand})"
            )
        self._eval_pairs = pairs[: cfg.num_eval]
        self._train_pairs = pairs[cfg.num_eval :]
        # The teacher's mistakes are drawn once per pair, so a demonstration is a fixed data set.
        self._forgets = [rng.random() < cfg.teacher_carry_error for _ in self._train_pairs]

    @classmethod
    def from_options(cls, options: dict) -> "CarryAdditionTask":
        """Build from the config's ``data.options`` (validated, unknown keys rejected)."""
        return cls(CarryAdditionConfig.model_validate(options))

    def _row(self, a: int, b: int, demonstration: int | None = None) -> dict:
        width = len(str(self.config.max_operand))
        answer_width = len(str(2 * self.config.max_operand))
        row = {
            "prompt": f"{a:0{width}d}+{b:0{width}d}=",
            "ground_truth": f"{a + b:0{answer_width}d}",
            "domain": "arithmetic",
        }
        if demonstration is not None:
            row["demonstration"] = f"{demonstration:0{answer_width}d}"
        if careless_sum(a, b, True) != a + b:  # a carrying sum: a preference pair for ``dpo``
            row["rejected"] = f"{careless_sum(a, b, True):0{answer_width}d}"
        return row

    def train_rows(self) -> list[dict]:
        return [
            self._row(a, b, careless_sum(a, b, forget))
            for (a, b), forget in zip(self._train_pairs, self._forgets)
        ]

    def eval_rows(self) -> list[dict]:
        return [self._row(a, b) for a, b in self._eval_pairs]


class PythonExprConfig(BaseModel):
    """Options of the ``python_expr`` task."""

    model_config = ConfigDict(extra="forbid")

    max_coef: int = Field(9, ge=2, description="coefficients are drawn from 2..max_coef")
    max_const: int = Field(99, ge=1, description="constants are drawn from 0..max_const")
    num_eval: int = Field(100, ge=1, description="held-out functions, never seen in training")
    teacher_syntax_error: float = Field(
        0.8, ge=0.0, le=1.0, description="probability the teacher writes '3x' for '3*x'"
    )
    seed: int = 4321


class PythonExprTask:
    """``python_expr``: a code-style task whose answers are checked by running them.

    Prompts are linear functions in math notation (``"7x+23:"``); the answer is a Python program
    defining them (``"f=lambda x:7*x+23"``). The ground truth is not a string to match but tests for
    the ``code`` reward of ``roll-rewards`` (``{"style": "assert", "tests": "assert f(0)==23\\n..."}``),
    so any correct program scores 1 (``lambda x:23+7*x`` too). The demonstrations come from a
    teacher who writes math, not Python: with probability ``teacher_syntax_error`` it drops the
    ``*`` (``7x``, a SyntaxError). As with ``carry_addition``, imitation tops out where the teacher
    does and running the code tells right from wrong.
    """

    name = "python_expr"

    def __init__(self, config: PythonExprConfig | None = None):
        self.config = config or PythonExprConfig()
        cfg = self.config
        rng = random.Random(cfg.seed)
        pairs = [(a, b) for a in range(2, cfg.max_coef + 1) for b in range(cfg.max_const + 1)]
        rng.shuffle(pairs)
        if cfg.num_eval >= len(pairs):
            raise ValueError(f"python_expr: num_eval={cfg.num_eval} leaves no training functions "
                             f"(only {len(pairs)} with max_coef={cfg.max_coef}, max_const={cfg.max_const})")
        self._eval, self._train = pairs[: cfg.num_eval], pairs[cfg.num_eval :]
        self._sloppy = [rng.random() < cfg.teacher_syntax_error for _ in self._train]

    @classmethod
    def from_options(cls, options: dict) -> "PythonExprTask":
        return cls(PythonExprConfig.model_validate(options))

    @staticmethod
    def _row(a: int, b: int, sloppy: bool | None = None) -> dict:
        tests = "\n".join(f"assert f({x})=={a * x + b}" for x in (0, 1, 3, -2))
        row = {"prompt": f"{a}x+{b}:", "ground_truth": {"style": "assert", "tests": tests}, "domain": "code"}
        if sloppy is not None:
            row["demonstration"] = f"f=lambda x:{a}{'' if sloppy else '*'}x+{b}"
        return row

    def train_rows(self) -> list[dict]:
        return [self._row(a, b, s) for (a, b), s in zip(self._train, self._sloppy)]

    def eval_rows(self) -> list[dict]:
        return [self._row(a, b) for a, b in self._eval]


# name -> RGB of the shapes ``color_shapes`` draws; the careless teacher names ORANGE and PURPLE by
# their neighbours
COLORS = {"red": (220, 40, 40), "orange": (240, 140, 20), "yellow": (230, 220, 40), "green": (40, 180, 60),
          "blue": (40, 80, 220), "purple": (150, 60, 200)}
CONFUSED = {"orange": "red", "purple": "blue"}


class ColorShapesConfig(BaseModel):
    """Options of the ``color_shapes`` task."""

    model_config = ConfigDict(extra="forbid")

    image_size: int = Field(16, ge=4, description="images are image_size x image_size pixels")
    num_train: int = Field(3000, ge=1, description="training images")
    num_eval: int = Field(300, ge=1, description="held-out images, drawn apart from the training ones")
    teacher_confusion: float = Field(
        0.8, ge=0.0, le=1.0, description="probability the teacher calls orange 'red' and purple 'blue'")
    seed: int = 2468


class ColorShapesTask:
    """``color_shapes``: the image-text task (for ``model.tiny.vision``). Each prompt is an image
    of one filled rectangle on black, of random size, place and shade, and the question
    ``"<image>color:"``; the answer is the rectangle's colour, one of :data:`COLORS`.

    As in ``carry_addition``, the demonstrations come from a careless teacher: with probability
    ``teacher_confusion`` it calls an orange shape "red" and a purple one "blue". Imitation answers
    those two colours wrong under greedy decoding (about a third of the held-out images), and a
    reward that checks the answer against the image's true colour lets RL fix what imitation
    could not. An orange or purple shape's row also has ``rejected``, the teacher's name for it: with
    ``ground_truth`` as the chosen answer, a preference pair for ``dpo``. The images are ``[H, W, 3]``
    uint8 arrays, drawn from ``seed`` alone.
    """

    name = "color_shapes"
    PROMPT = "<image>color:"

    def __init__(self, config: ColorShapesConfig | None = None):
        import numpy as np

        self.config = cfg = config or ColorShapesConfig()
        rng = np.random.default_rng(cfg.seed)
        names = list(COLORS)
        total = cfg.num_train + cfg.num_eval
        self._colors = [names[i] for i in rng.integers(len(names), size=total)]
        self._images = [self._draw(rng, COLORS[c]) for c in self._colors]
        self._confused = rng.random(cfg.num_train) < cfg.teacher_confusion

    def _draw(self, rng, rgb):
        import numpy as np

        size = self.config.image_size
        image = np.zeros((size, size, 3), dtype=np.uint8)
        h, w = (int(v) for v in rng.integers(max(2, size // 4), size // 2 + 2, size=2))
        top, left = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        shade = np.clip(np.array(rgb) + rng.integers(-25, 26, size=3), 0, 255)
        image[top:top + h, left:left + w] = shade
        return image

    @classmethod
    def from_options(cls, options: dict) -> "ColorShapesTask":
        return cls(ColorShapesConfig.model_validate(options))

    def _row(self, i: int, confused: bool | None = None) -> dict:
        color = self._colors[i]
        row = {"prompt": self.PROMPT, "images": [self._images[i]], "ground_truth": color, "domain": "vision"}
        if confused is not None:
            row["demonstration"] = CONFUSED.get(color, color) if confused else color
        if color in CONFUSED:  # a preference pair for ``dpo``: the true colour over the teacher's
            row["rejected"] = CONFUSED[color]
        return row

    def train_rows(self) -> list[dict]:
        return [self._row(i, bool(c)) for i, c in enumerate(self._confused)]

    def eval_rows(self) -> list[dict]:
        return [self._row(i) for i in range(self.config.num_train, self.config.num_train + self.config.num_eval)]
