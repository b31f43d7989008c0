"""The ``sft``, ``dpo`` and ``distill`` pipelines' own work, on workers whose "model" is a formula.

Their whole runs on the tiny model (``test_seams.py``) show that each pipeline learns; they cannot say
whether a step trained on the right targets, against the right reference or teacher values, or
whether an evaluation averaged over the right tokens. Here every role is a :class:`Formula` worker:
at a response position holding token ``t`` its next-token distribution is
``softmax(scale * (1 + t mod 5) * ((v * (t + 1)) mod 7) / temperature)`` over the vocabulary ``v``:
its values in another order and at another sharpness per token, another sharpness per role
(``scale``), so each log-prob, sequence sum and KL the pipelines compute has a
value the tests work out by hand (:func:`token_logp`), and the updates the pipelines start are
recorded instead of run. Each test takes a second or less.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import write_jsonl

from roll_core.data import PromptStream
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import SEED_OFFSETS
from roll_core.runtime import LocalExecutor

SCALES = {"actor_train": 0.3, "reference": 0.7}  # each role's formula


class Formula:
    """A model role's worker (see the module docstring); ``updates`` records what ``update`` was given,
    ``calls`` the batches it scored."""

    def __init__(self, scale: float, vocab: int, *_devices):
        self.scale, self.vocab = scale, vocab
        self.updates: list[tuple] = []
        self.calls: list[int] = []

    def log_dist(self, responses: torch.Tensor, temperature: float) -> torch.Tensor:
        v = torch.arange(self.vocab, dtype=torch.float64)
        t = responses[..., None]
        logits = self.scale * (1 + t % 5) * ((v * (t + 1)) % 7) / temperature
        return logits.log_softmax(-1).float()

    def compute_log_probs(self, batch, temperature: float, distribution: bool = False):
        self.calls.append(len(batch))
        dist = self.log_dist(batch["responses"], temperature)
        return dist if distribution else dist.gather(-1, batch["responses"][..., None]).squeeze(-1)

    def top_k_log_probs(self, batch, temperature: float, k: int):
        # as wide as this replica's longest response: replicas answer at different widths
        width = int(batch["response_mask"].sum(-1).max())
        return self.log_dist(batch["responses"][:, :width], temperature).topk(k, dim=-1)

    def generate(self, batch, **sampling):
        """Each prompt's last two tokens, as its response; ``sampling`` recorded in ``calls``."""
        from roll_core.data import Batch

        self.calls.append(sampling)
        responses = batch["prompt_ids"][:, -2:]
        return Batch({**batch.tensors, "responses": responses, "response_mask": torch.ones_like(responses)})

    def update(self, batch, loss_fn, spec):
        self.updates.append((batch, loss_fn, spec))
        return {"rows": float(len(batch))}


def logp(scale: float, at: int, v: int, vocab: int) -> float:
    """log p(v) at a position holding token ``at``, under :class:`Formula` at temperature 1 (by hand,
    in floats)."""
    logits = [scale * (1 + at % 5) * ((u * (at + 1)) % 7) for u in range(vocab)]
    top = max(logits)
    return logits[v] - top - math.log(sum(math.exp(x - top) for x in logits))


def token_logp(scale: float, token: int, vocab: int) -> float:
    """log p(token) at the position holding it: a response token's log-prob."""
    return logp(scale, token, token, vocab)


def target_ids(tokenizer, text: str) -> list[int]:
    """The response tokens a target is trained as: its characters, then EOS."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def with_formula_roles(pipeline, replicas: dict[str, int] | None = None):
    """``pipeline.roles.model_roles`` (which every model role goes through) spawns :class:`Formula`
    workers (``replicas[name]`` data-parallel ones, default 1) instead of loading models; returns the
    groups by role name."""
    vocab = len(pipeline.tokenizer)

    def model_role(name, model_path, role_cfg=None):
        n = (replicas or {}).get(name, 1)
        group = pipeline.roles.spawn(name, Formula, [(SCALES[name], vocab)] * n, None)
        group.dp_ranks = list(range(n))
        return group

    pipeline.roles.model_roles = lambda *roles: [model_role(*role) for role in roles]
    return pipeline.roles.groups


def on_formulas(pipeline_cls, cfg, replicas: dict[str, int] | None = None):
    """A ``pipeline_cls`` run of ``cfg``, prepared and built on :class:`Formula` workers (see
    :func:`with_formula_roles`); returns the pipeline and its groups by role name."""
    pipeline = pipeline_cls(cfg, LocalExecutor())
    pipeline.prepare()
    groups = with_formula_roles(pipeline, replicas)
    pipeline.build()
    return pipeline, groups


def first_draw(pipeline, rows: list[dict], stream: str, n: int) -> list[dict]:
    """The ``n`` rows a pipeline's first step takes from ``rows``: its stream is seeded with the run's
    seed plus ``SEED_OFFSETS[stream]``."""
    return PromptStream(rows, pipeline.config.seed + SEED_OFFSETS[stream]).next(n)


def responses_text(tokenizer, batch) -> list[str]:
    return [tokenizer.decode(r[m.bool()]) for r, m in zip(batch["responses"], batch["response_mask"])]


# -- sft ----------------------------------------------------------------------------------------------

# Each pipeline's training rows are its held-out rows plus this one, so that neither passes for the other.
TRAIN_ONLY = [{"prompt": "3+4=", "ground_truth": "007", "demonstration": "007", "rejected": "017"}]

SFT_ROWS = [{"prompt": "12+30=", "ground_truth": "042", "demonstration": "042"},
            {"prompt": "55+21=", "ground_truth": "076"},  # no demonstration: not trained on
            {"prompt": "9+9=", "ground_truth": "018", "demonstration": "18"}]
DEMONSTRATED = [SFT_ROWS[0], SFT_ROWS[2], *TRAIN_ONLY]  # the training rows a step may take


def sft_pipeline(tiny_config, tmp_path, *overrides, replicas=None):
    from roll_core.pipelines.sft import SFTPipeline

    cfg = tiny_config("pipeline=sft", f"data.train_file={write_jsonl(tmp_path / 'train.jsonl', SFT_ROWS + TRAIN_ONLY)}",
                      f"data.eval_file={write_jsonl(tmp_path / 'eval.jsonl', SFT_ROWS)}", *overrides)
    pipeline, groups = on_formulas(SFTPipeline, cfg, replicas)
    return pipeline, groups["actor_train"].handles[0]


def test_sft_steps_train_on_the_demonstrations_with_the_warmup_settings(tiny_config, tmp_path):
    pipeline, actor = sft_pipeline(tiny_config, tmp_path, "warmup.batch_size=4", "warmup.lr=0.02",
                                   "roles.actor_train.micro_batch_size=2", "algorithm.max_grad_norm=0.5")
    assert pipeline.max_steps == 5  # warmup.steps
    assert pipeline.step(1) == {"rows": 4.0}
    batch, loss_fn, spec = actor.updates[0]
    drawn = first_draw(pipeline, DEMONSTRATED, "warmup_data", 4)
    eos = pipeline.tokenizer.eos_token
    assert responses_text(pipeline.tokenizer, batch) == [r["demonstration"] + eos for r in drawn]
    assert loss_fn.metric == "warmup/loss"
    assert (spec.optimizer, spec.lr, spec.micro_batch_size, spec.max_grad_norm, spec.metric_prefix) == (
        "warmup", 0.02, 2, 0.5, "warmup")


@pytest.mark.parametrize("ranks", [1, 2])
def test_sft_packs_its_batches_when_asked_with_a_row_for_every_rank(tiny_config, tmp_path, ranks):
    """Four examples of 8-11 tokens fit one packed row; over two data-parallel ranks a row of
    padding alone joins it, so each rank has a row."""
    pipeline, _ = sft_pipeline(tiny_config, tmp_path, "warmup.batch_size=4", "warmup.packing=true",
                               "warmup.max_length=64", replicas={"actor_train": ranks})
    pipeline.step(1)
    parts = [worker.updates[0][0] for worker in pipeline.actor.handles]
    assert [len(part) for part in parts] == [1] * ranks and all("position_ids" in part for part in parts)
    drawn = first_draw(pipeline, DEMONSTRATED, "warmup_data", 4)
    trained = [int(part["response_mask"].sum()) for part in parts]
    assert trained == [sum(len(r["demonstration"]) + 1 for r in drawn)] + [0] * (ranks - 1)  # and each EOS


def test_sft_refuses_data_without_demonstrations(tiny_config, tmp_path):
    from roll_core.pipelines.sft import SFTPipeline

    cfg = tiny_config("pipeline=sft", f"data.train_file={write_jsonl(tmp_path / 't.jsonl', SFT_ROWS[1:2])}")
    pipeline = SFTPipeline(cfg, LocalExecutor())
    pipeline.prepare()
    with_formula_roles(pipeline)
    with pytest.raises(ConfigError, match="no training row has a 'demonstration'"):
        pipeline.build()


def test_sft_held_out_loss_is_the_mean_over_target_tokens(tiny_config, tmp_path):
    """The demonstration is the target where a row has one, else its ground truth; the loss is the
    mean of -log p over every target token (EOS included), not a mean of per-row means."""
    pipeline, actor = sft_pipeline(tiny_config, tmp_path)
    vocab = len(pipeline.tokenizer)
    tokens = [t for r in SFT_ROWS for t in target_ids(pipeline.tokenizer, r.get("demonstration") or r["ground_truth"])]
    expected = -sum(token_logp(SCALES["actor_train"], t, vocab) for t in tokens) / len(tokens)
    assert pipeline.evaluate()["eval/loss"] == pytest.approx(expected, rel=1e-5)
    assert len(tokens) == 4 + 4 + 3


# -- dpo ----------------------------------------------------------------------------------------------

DPO_ROWS = [{"prompt": "1+2=", "ground_truth": "003", "rejected": "013"},
            {"prompt": "4+4=", "ground_truth": "008", "chosen": "8", "rejected": "018"},  # its own chosen
            {"prompt": "7+5=", "ground_truth": "012"},  # not a pair
            {"prompt": "9+3=", "ground_truth": "012", "rejected": "0122"}]
PAIRS = [(r["prompt"], r.get("chosen", r["ground_truth"]), r["rejected"]) for r in DPO_ROWS if "rejected" in r]


def dpo_pipeline(tiny_config, tmp_path, *overrides, rows=DPO_ROWS, train_only=TRAIN_ONLY, held_out=None):
    from roll_core.pipelines.dpo import DPOPipeline

    cfg = tiny_config("pipeline=dpo", "roles.actor_train.micro_batch_size=2",
                      f"data.train_file={write_jsonl(tmp_path / 'train.jsonl', rows + train_only)}",
                      f"data.eval_file={write_jsonl(tmp_path / 'eval.jsonl', held_out or rows)}", *overrides)
    return on_formulas(DPOPipeline, cfg)


def sequence_logp(tokenizer, role: str, text: str, average: bool = False) -> float:
    ids = target_ids(tokenizer, text)
    total = sum(token_logp(SCALES[role], t, len(tokenizer)) for t in ids)
    return total / len(ids) if average else total


def test_preference_pairs_take_chosen_from_ground_truth_where_a_row_has_none():
    from roll_core.pipelines.dpo import preference_pairs

    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in preference_pairs(DPO_ROWS)] == PAIRS


@pytest.mark.parametrize("average", [False, True])
def test_a_dpo_step_trains_each_pair_chosen_then_rejected_against_the_reference(tiny_config, tmp_path, average):
    pipeline, groups = dpo_pipeline(tiny_config, tmp_path, "dpo.batch_size=3", "dpo.beta=0.25",
                                    f"dpo.average_log_probs={str(average).lower()}")
    assert pipeline.step(1) == {"rows": 6.0}
    batch, loss_fn, spec = groups["actor_train"].handles[0].updates[0]
    drawn = first_draw(pipeline, pipeline.train_pairs, "preference_data", 3)
    tok = pipeline.tokenizer
    texts = [t for p in drawn for t in (p["chosen"], p["rejected"])]
    assert responses_text(tok, batch) == [t + tok.eos_token for t in texts]
    assert tok.batch_decode(batch["prompt_ids"], skip_special_tokens=True) == [p["prompt"] for p in drawn for _ in "cr"]
    assert batch["pair"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["chosen"].tolist() == [True, False] * 3
    expected = [sequence_logp(tok, "reference", t, average) for t in texts]
    assert batch["reference_logp"].tolist() == pytest.approx(expected, rel=1e-5)
    assert (loss_fn.beta, loss_fn.average_log_probs, spec.micro_batch_size, spec.metric_prefix) == (
        0.25, average, 2, "dpo")


def test_dpo_evaluation_scores_every_held_out_pair_and_asks_the_reference_once(tiny_config, tmp_path):
    pipeline, groups = dpo_pipeline(tiny_config, tmp_path, "dpo.beta=0.5")
    first, second = pipeline.evaluate(), pipeline.evaluate()
    assert first == second
    assert groups["reference"].handles[0].calls == [6]  # the frozen reference: once for all evaluations
    assert groups["actor_train"].handles[0].calls == [6, 6]
    tok, beta = pipeline.tokenizer, 0.5
    gaps = [(sequence_logp(tok, "actor_train", c) - sequence_logp(tok, "reference", c),
             sequence_logp(tok, "actor_train", r) - sequence_logp(tok, "reference", r)) for _, c, r in PAIRS]
    h = [c - r for c, r in gaps]
    assert first["eval/loss"] == pytest.approx(sum(math.log1p(math.exp(-beta * x)) for x in h) / 3, rel=1e-5)
    assert first["eval/rewards/margin"] == pytest.approx(beta * sum(h) / 3, abs=1e-5)
    assert first["eval/rewards/chosen"] == pytest.approx(beta * sum(c for c, _ in gaps) / 3, abs=1e-5)
    assert first["eval/rewards/accuracy"] == pytest.approx(sum(x > 0 for x in h) / 3)
    assert 0 < first["eval/rewards/accuracy"] < 1  # the formulas prefer some chosen answers, not all


VALUED = [{**r, "reference_chosen_logp": -1.0, "reference_rejected_logp": -2.0} for r in DPO_ROWS]


@pytest.mark.parametrize("overrides, rows, held_out, message", [
    (["dpo.reference=precomputed"], VALUED, VALUED[:3] + DPO_ROWS[3:], "precomputed needs"),
    ([], DPO_ROWS[2:3], DPO_ROWS, "no training row is a preference pair"),
], ids=["a-held-out-pair-without-values", "no-pairs"])
def test_dpo_refuses_what_it_cannot_train_before_any_worker(tiny_config, tmp_path, overrides, rows, held_out, message):
    with pytest.raises(ConfigError, match=message):
        dpo_pipeline(tiny_config, tmp_path, *overrides, rows=rows, train_only=[], held_out=held_out)


def test_dpo_refuses_odd_micro_batches_at_validation():
    from roll_core.config import load_and_check

    with pytest.raises(ConfigError, match="key 'roles.actor_train.micro_batch_size': dpo keeps each pair in one "
                                          "micro-batch, so it must be even, got 3"):
        load_and_check(None, ["pipeline=dpo", "roles.actor_train.micro_batch_size=3"])


def test_dpo_takes_precomputed_reference_values_pair_by_pair(tiny_config, tmp_path):
    rows = [{**r, "reference_chosen_logp": -i - 0.25, "reference_rejected_logp": -i - 0.5}
            for i, r in enumerate(r for r in DPO_ROWS if "rejected" in r)]
    pipeline, groups = dpo_pipeline(tiny_config, tmp_path, "dpo.reference=precomputed", "dpo.batch_size=3", rows=rows,
                                    train_only=[])
    assert "reference" not in groups
    pipeline.step(1)
    batch = groups["actor_train"].handles[0].updates[0][0]
    drawn = first_draw(pipeline, pipeline.train_pairs, "preference_data", 3)
    assert batch["reference_logp"].tolist() == [v for p in drawn for v in (p["reference_chosen_logp"],
                                                                           p["reference_rejected_logp"])]


def test_a_reference_free_loss_starts_no_reference_and_takes_its_own_options(tiny_config, tmp_path):
    # SimPO: no reference role, zeros in its place (precomputed values not asked for), gamma from loss_options
    pipeline, groups = dpo_pipeline(tiny_config, tmp_path, "dpo.loss=simpo", "dpo.beta=2", "dpo.reference=precomputed",
                                    "dpo.loss_options={gamma: 0.3}",  # means: simpo registers average_log_probs
                                    "dpo.batch_size=3", "roles.reference=null")
    assert "reference" not in groups and pipeline.loss_fn.options == (("gamma", 0.3),)
    pipeline.step(1)
    assert groups["actor_train"].handles[0].updates[0][0]["reference_logp"].tolist() == [0.0] * 6
    tok, beta = pipeline.tokenizer, 2.0
    h = [sequence_logp(tok, "actor_train", c, True) - sequence_logp(tok, "actor_train", r, True) for _, c, r in PAIRS]
    evaluation = pipeline.evaluate()
    by_hand = sum(math.log1p(math.exp(-(beta * x - 0.3))) for x in h) / 3
    assert evaluation["eval/loss"] == pytest.approx(by_hand, rel=1e-5)
    assert evaluation["eval/rewards/margin"] == pytest.approx(beta * sum(h) / 3, abs=1e-5)


# -- distill ------------------------------------------------------------------------------------------

DISTILL_ROWS = [{"prompt": "12+30=", "ground_truth": "042", "demonstration": "42"},
                {"prompt": "55+21=", "ground_truth": "076"},
                {"prompt": "9+9=", "ground_truth": "018"},
                {"prompt": "5+5=", "ground_truth": "010", "demonstration": "0010"}]
TARGETS = [r.get("demonstration") or r["ground_truth"] for r in DISTILL_ROWS]


def distill_pipeline(tiny_config, tmp_path, *overrides, replicas=None):
    from roll_core.pipelines.distill import DistillPipeline

    cfg = tiny_config("pipeline=distill", "roles.actor_train.micro_batch_size=4",
                      f"data.train_file={write_jsonl(tmp_path / 'train.jsonl', DISTILL_ROWS + TRAIN_ONLY)}",
                      f"data.eval_file={write_jsonl(tmp_path / 'eval.jsonl', DISTILL_ROWS)}", *overrides)
    return on_formulas(DistillPipeline, cfg, replicas)


def test_distill_evaluation_is_kl_teacher_to_student_per_response_token(tiny_config, tmp_path):
    pipeline, _ = distill_pipeline(tiny_config, tmp_path)
    vocab = len(pipeline.tokenizer)

    def kl(at):  # KL(teacher || student) at a position holding token ``at``, over the vocabulary
        teacher, student = ([logp(SCALES[role], at, v, vocab) for v in range(vocab)]
                            for role in ("reference", "actor_train"))
        return sum(math.exp(t) * (t - s) for t, s in zip(teacher, student))

    tokens = [t for text in TARGETS for t in target_ids(pipeline.tokenizer, text)]
    expected = sum(kl(t) for t in tokens) / len(tokens)
    assert pipeline.evaluate()["eval/kl_to_teacher"] == pytest.approx(expected, rel=1e-4)


def test_a_distill_step_trains_on_the_given_responses_and_the_teachers_whole_distribution(tiny_config, tmp_path):
    pipeline, groups = distill_pipeline(tiny_config, tmp_path, "distill.batch_size=4", "distill.temperature=2.0")
    assert pipeline.step(1) == {"rows": 4.0}
    batch, loss_fn, spec = groups["actor_train"].handles[0].updates[0]
    drawn = first_draw(pipeline, DISTILL_ROWS + TRAIN_ONLY, "distill_data", 4)
    tok = pipeline.tokenizer
    assert responses_text(tok, batch) == [(r.get("demonstration") or r["ground_truth"]) + tok.eos_token for r in drawn]
    teacher = Formula(SCALES["reference"], len(tok)).log_dist(batch["responses"], 2.0)
    assert torch.equal(batch["teacher_logp"], teacher) and "teacher_index" not in batch
    assert (loss_fn.temperature, spec.micro_batch_size, spec.metric_prefix) == (2.0, 4, "distill")


def test_distill_trains_on_responses_the_teacher_writes_when_asked(tiny_config, tmp_path):
    pipeline, groups = distill_pipeline(tiny_config, tmp_path, "distill.batch_size=4", "distill.responses=teacher",
                                        "rollout.max_new_tokens=5", "rollout.temperature=0.5")
    pipeline.step(1)
    batch = groups["actor_train"].handles[0].updates[0][0]
    drawn = first_draw(pipeline, DISTILL_ROWS + TRAIN_ONLY, "distill_data", 4)
    tok = pipeline.tokenizer
    assert responses_text(tok, batch) == [r["prompt"][-2:] for r in drawn]  # the formula's "answers"
    assert groups["reference"].handles[0].calls[0] == {"max_new_tokens": 5, "temperature": 0.5, "top_p": 1.0}


def test_distill_joins_each_teacher_replicas_top_k_at_the_batchs_width(tiny_config, tmp_path):
    """Two teacher replicas score half the batch each and answer as wide as their own longest
    response; the step pads both to the batch's width with zeros."""
    from roll_core.pipelines.batches import demonstration_batch

    pipeline, _ = distill_pipeline(tiny_config, tmp_path, "distill.top_k=3", "distill.temperature=2.0",
                                   replicas={"reference": 2})
    rows = [{"prompt": "1+1=", "target": t} for t in ("1", "12", "123", "1")]
    batch = pipeline._with_teacher(demonstration_batch(pipeline.tokenizer, rows, target="target"))
    lengths = batch["response_mask"].sum(-1).tolist()
    assert lengths == [2, 3, 4, 2]  # replica 0 answers 3 positions wide, replica 1 four
    values, index = Formula(SCALES["reference"], len(pipeline.tokenizer)).log_dist(batch["responses"], 2.0).topk(3, -1)
    assert batch["teacher_logp"].shape == batch["teacher_index"].shape == (4, batch["responses"].shape[1], 3)
    for row in range(4):
        n = max(lengths[:2]) if row < 2 else max(lengths[2:])  # its replica's width
        assert torch.equal(batch["teacher_logp"][row, :n], values[row, :n])
        assert torch.equal(batch["teacher_index"][row, :n], index[row, :n])
        assert not batch["teacher_logp"][row, n:].any() and not batch["teacher_index"][row, n:].any()


def test_distill_refuses_a_teacher_with_another_tokenizer(tiny_config, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from roll_core.pipelines.distill import DistillPipeline

    other = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "</s>": 1, "0": 2, "1": 3}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=other, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "t")
    cfg = tiny_config("pipeline=distill", f"roles.reference.model_path={tmp_path / 't'}")
    with pytest.raises(ConfigError, match=r"roles.reference.model_path': the teacher's tokenizer .* differs"):
        DistillPipeline(cfg, LocalExecutor()).prepare()
