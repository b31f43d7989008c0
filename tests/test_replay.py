"""Rollout dumps, ``roll show-rollouts`` and ``roll replay``: a dumped step trained again reproduces
the recorded loss and gradient norm. The dump's readable side (each sample's text and values, the
printed facts) is checked on batches made by hand, whose padding holds values that must not count."""

import json
from pathlib import Path

import pytest
import torch

from roll_core.cli import main
from roll_core.errors import RollError
from roll_core.pipelines.checkpoint import CheckpointManager
from roll_core.pipelines.replay import ReplayedStep, largest_gap, parse_steps, plan, replay, report
from roll_core.data import Batch
from roll_core.pipelines.rollout_dump import dump_pairs, dump_path, dumped_steps, export_pairs, load_dump


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory):
    """4 RL steps, every batch dumped, checkpoints at 0, 2 and 4; an entropy bonus so that every
    step has a loss and a gradient even when a group's rewards are all equal."""
    from roll_core.config import load_config
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    run = tmp_path_factory.mktemp("dumped") / "run"
    cfg = load_config(None, [f"output_dir={run}", "executor=local", "warmup.steps=200", "rollout.prompts_per_step=8",
                             "rollout.num_return_sequences=4", "trainer.max_steps=4", "trainer.eval_every=0",
                             "trainer.save_every=2", "trainer.keep_checkpoints=5", "data.eval_size=8",
                             "trackers=[jsonl]", "trainer.dump_rollouts_every=1", "algorithm.entropy_coef=0.01",
                             "algorithm.ppo_mini_batch_size=16"])  # two optimizer steps per update
    RLVRPipeline(cfg, LocalExecutor()).run()
    return run


def test_every_step_is_dumped_as_the_update_received_it(dumped_run):
    assert dumped_steps(dumped_run) == [1, 2, 3, 4]
    batch = load_dump(dumped_run, 2)
    assert len(batch) == 32 and {"responses", "advantages", "infer_log_probs", "scores"} <= set(batch.tensors)
    rows = [json.loads(line) for line in dump_path(dumped_run, 2, "jsonl").read_text().splitlines()]
    assert len(rows) == 32 and rows[0]["prompt"] == batch["prompt"][0]
    assert rows[0]["scores"] == pytest.approx(float(batch["scores"][0]))
    assert rows[0]["response_tokens"] == int(batch["response_mask"][0].sum())


def test_show_rollouts_prints_a_step_and_names_the_dumped_steps_when_asked_for_another(dumped_run, capsys):
    assert main(["show-rollouts", str(dumped_run), "--step", "3", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 3: 32 samples, the first 2") and out.count("--- sample") == 2
    assert "  prompt:   '" in out and "  response: '" in out and "  expected: '" in out
    assert main(["show-rollouts", str(dumped_run), "--step", "3", "--limit", "0"]) == 0  # 0: every sample
    out = capsys.readouterr().out
    assert out.startswith("step 3: 32 samples\n") and out.count("--- sample") == 32
    assert main(["show-rollouts", str(dumped_run), "--step", "9"]) == 2
    assert "no rollout dump of step 9; dumped steps: 1-4" in capsys.readouterr().err


def test_export_pairs_takes_each_groups_best_and_worst_answer_of_the_dumped_steps(dumped_run, tmp_path, capsys):
    out = tmp_path / "pairs" / "p.jsonl"
    assert main(["export-pairs", str(dumped_run), "--steps", "2-3", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert capsys.readouterr().out.strip() == f"{len(rows)} pairs from steps 2-3 -> {out}"
    for step in (2, 3):
        batch = load_dump(dumped_run, step)
        mine = [r for r in rows if r["step"] == step]
        groups = {}
        for i, g in enumerate(batch["group_index"].tolist()):
            groups.setdefault(g, []).append(i)
        untied = [g for g, members in groups.items() if len({float(batch["scores"][i]) for i in members}) > 1]
        assert len(mine) == len(untied) > 0
        for row, g in zip(mine, sorted(untied)):
            members = groups[g]
            first = members[0]
            assert row["prompt"] == batch["prompt"][first] and row["ground_truth"] == batch["ground_truth"][first]
            best = max(members, key=lambda i: (float(batch["scores"][i]), -i))  # the first of the best
            worst = min(members, key=lambda i: (float(batch["scores"][i]), i))
            assert (row["chosen"], row["rejected"]) == (batch["response_text"][best], batch["response_text"][worst])
            assert row["chosen_score"] == float(batch["scores"][best]) > row["rejected_score"] == float(
                batch["scores"][worst])
    with pytest.raises(RollError, match=r"no rollout dumps in steps 7-8 \(dumped: 1-4"):
        export_pairs(dumped_run, out, (7, 8))
    with pytest.raises(RollError, match="only rlvr and online_dpo dumps hold scored responses"):
        dump_pairs(Batch({"scores": torch.ones(2)}))


def test_replay_reproduces_the_recorded_loss_and_gradient_norm(dumped_run, capsys, monkeypatch):
    # roll replay quiets transformers' bars through the environment, as roll run does: keep that in this test
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from roll_core.pipelines.replay import replay

    losses = []
    for steps, start in (((3, 4), 2), ((1, 1), 0), (None, 2)):
        replayed = replay(dumped_run, steps, progress=lambda _: None)
        assert [r.step for r in replayed] == ([3, 4] if steps != (1, 1) else [1])
        for r in replayed:
            assert r.replayed["train/grad_norm"] > 0  # the entropy bonus: a gradient even where all rewards tie
            assert r.gap("pg_loss") < 1e-5 and r.gap("grad_norm") < 1e-5, (r.recorded, r.replayed)
            losses.append(r.recorded["train/pg_loss"])
    assert any(loss != 0 for loss in losses)  # not only steps whose groups all tied
    assert main(["replay", str(dumped_run), "--steps", "3-4"]) == 0
    out = capsys.readouterr().out
    assert "from the checkpoint at step 2" in out and "largest gap:" in out


def test_a_lora_run_replays_its_adapters_on_the_base_they_were_trained_on(tmp_path, monkeypatch):
    """The warm-up folds into warm-model/, so the checkpoint's adapter names that base, not the tiny model."""
    pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as above
    from roll_core.config import load_config
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    run = tmp_path / "run"
    cfg = load_config(None, [f"output_dir={run}", "executor=local", "warmup.steps=20", "rollout.prompts_per_step=4",
                             "rollout.num_return_sequences=4", "trainer.max_steps=2", "trainer.eval_every=0",
                             "trainer.save_every=2", "data.eval_size=8", "trackers=[jsonl]",
                             "trainer.dump_rollouts_every=1", "algorithm.entropy_coef=0.01",
                             "roles.actor_train.lora={rank: 4}", "roles.actor_train.lr=0.01"])
    RLVRPipeline(cfg, LocalExecutor()).run()
    adapter = json.loads((run / "checkpoints" / "step_000000" / "actor_train" / "adapter" / "adapter_config.json")
                         .read_text())
    assert adapter["base_model_name_or_path"] == str(run / "warm-model")
    replayed = replay(run, (1, 2), progress=lambda _: None)
    assert [r.step for r in replayed] == [1, 2]
    for r in replayed:
        assert r.replayed["train/grad_norm"] > 0
        assert r.gap("pg_loss") < 1e-5 and r.gap("grad_norm") < 1e-5, (r.recorded, r.replayed)
    (run / "warm-model" / "config.json").unlink()
    with pytest.raises(RollError, match=r"was trained on .*warm-model, which is not there"):
        replay(run, (1, 2), progress=lambda _: None)


def test_replay_fails_on_a_batch_that_is_not_the_one_trained_on(dumped_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as above
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dumped_run, copy)
    saved = torch.load(dump_path(copy, 3, "pt"), weights_only=False)
    # shifted, not scaled: every group of a step can be solved (all advantages 0), as on a GPU it was
    saved["tensors"]["advantages"] = saved["tensors"]["advantages"] + 1.0
    torch.save(saved, dump_path(copy, 3, "pt"))
    assert main(["replay", str(copy), "--steps", "3"]) == 1
    assert "not reproduced" in capsys.readouterr().err
    assert main(["replay", str(copy), "--steps", "3", "--tolerance", "1e9"]) == 0  # a gap the user allows
    (copy / "metrics.jsonl").unlink()  # a run without the jsonl tracker: replayed, with nothing to compare
    capsys.readouterr()
    assert main(["replay", str(copy), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    row = out.splitlines()[-1].split()
    assert row[0] == "3" and row[1::3] == ["-", "-"] and row[3::3] == ["-", "-"]  # no recorded value, no gap
    assert "largest gap" not in out


def test_replay_says_which_dumps_or_checkpoint_it_lacks(dumped_run, tmp_path):
    assert plan(dumped_run, (4, 4))[0][0] == 2 and plan(dumped_run, (4, 4))[1] == [3, 4]
    assert parse_steps("11-13") == (11, 13) and parse_steps("7") == (7, 7)
    with pytest.raises(RollError, match="a range goes up"):
        parse_steps("5-3")
    with pytest.raises(RollError, match=r"from the checkpoint at step 4 needs the dumps of steps 5-6; missing: 5-6 "
                                        r"\(dumped: 1-4"):
        plan(dumped_run, (5, 6))
    with pytest.raises(RollError, match="has no rollout dumps"):
        plan(tmp_path, None)
    with pytest.raises(RollError, match=r"is not a run directory: it has no config.json \(roll run writes it there\)"):
        replay(tmp_path)
    assert Path(dumped_run / "checkpoints" / "step_000002").is_dir()
    config = json.loads((dumped_run / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pipeline": "online_dpo", "algorithm": {}}))
    with pytest.raises(RollError, match=f"replays the policy updates of pipelines agentic, rlvr; {tmp_path} ran "
                                        f"pipeline online_dpo"):
        replay(tmp_path)


def test_the_replayable_pipelines_are_named_past_one_that_fails_to_import(roll_plugins):
    from roll_core.pipelines.replay import replayable
    from roll_core.testing import hooks

    plugins = roll_plugins(("broken", hooks(roll_register_pipelines=lambda register: register(
        "broken", "no_such_module:Pipeline"))))
    assert replayable(plugins) == ["agentic", "rlvr"]


def test_an_agentic_run_replays_its_episodes_updates(roll_plugins, tiny_config, monkeypatch):
    """The agentic pipeline's dumps are its update's batches too (episodes' turns, advantages by
    GiGPO): replayed from the checkpoint before them, they give the recorded loss and norm."""
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as above
    from test_agentic_pipeline import Echo

    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor
    from roll_core.testing import hooks

    roll_plugins(("echo", hooks(roll_register_envs=lambda register: register("echo", Echo))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=0", "algorithm.advantage_estimator=gigpo",
                      "trainer.max_steps=3", "agentic.groups_per_step=3", "agentic.group_size=2",
                      "agentic.validation_episodes=0", "rollout.max_new_tokens=3", "trainer.save_every=1",
                      "trainer.keep_checkpoints=5", "trainer.dump_rollouts_every=1", "algorithm.entropy_coef=0.01")
    AgenticPipeline(cfg, LocalExecutor()).run()
    replayed = replay(Path(cfg.output_dir), (2, 3), progress=lambda _: None)
    assert [r.step for r in replayed] == [2, 3]
    for r in replayed:
        assert r.replayed["train/grad_norm"] > 0
        assert r.gap("pg_loss") < 1e-5 and r.gap("grad_norm") < 1e-5, (r.recorded, r.replayed)


def _run_dir(root: Path, dumped: list[int], checkpoints: list[int]) -> Path:
    """A run's directory as ``plan`` reads it: empty dump files, and empty checkpoints saved as a run
    saves them (all kept)."""
    for step in dumped:
        dump_path(root, step, "pt").parent.mkdir(parents=True, exist_ok=True)
        dump_path(root, step, "pt").touch()
    saver = CheckpointManager(root / "checkpoints", keep=len(checkpoints))
    for step in checkpoints:
        saver.save(step, lambda directory: None, {})
    return root


def test_by_default_replay_takes_the_unbroken_dumps_after_the_latest_checkpoint_before_the_last_one(tmp_path):
    """Dumps 1-3, 5, 6 and checkpoints at 0 and 2: the last dump is 6, the checkpoint before it 2, and
    of the dumps after it only 3 follows without a gap (4 was not dumped)."""
    run = _run_dir(tmp_path / "gap", [1, 2, 3, 5, 6], [0, 2])
    assert plan(run, None) == ((2, run / "checkpoints" / "step_000002"), [3])
    assert plan(run, (1, 2)) == ((0, run / "checkpoints" / "step_000000"), [1, 2])
    # after the checkpoint at 2 the first dump is 5: nothing follows it unbroken, which is an error, not
    # an empty replay
    with pytest.raises(RollError, match="from the checkpoint at step 2 needs the dumps of steps 3; missing: 3 "):
        plan(_run_dir(tmp_path / "none", [1, 5], [2]), None)
    with pytest.raises(RollError, match="has no checkpoint before step 1"):
        plan(_run_dir(tmp_path / "late", [1, 2], [1]), (1, 2))


@pytest.mark.parametrize("text, message", [("0", "steps start at 1"), ("0-2", "steps start at 1"), ("x", "give a step"),
                                           ("3-x", "give a step"), ("2-1", "steps start at 1 and a range goes up")])
def test_bad_step_ranges_are_named(text, message):
    with pytest.raises(RollError, match=f"--steps '{text}': {message}"):
        parse_steps(text)


def test_the_report_compares_what_both_sides_have_and_names_the_largest_gap():
    """A metric one side lacks (a step the run logged no gradient norm for) is shown as '-', not an error."""
    both = ReplayedStep(1, {"train/pg_loss": 1.0, "train/grad_norm": 2.0},
                        {"train/pg_loss": 1.5, "train/grad_norm": 2.25})
    one_sided = ReplayedStep(2, {"train/pg_loss": 1.0}, {"train/grad_norm": 3.0})  # nothing comparable
    assert (both.gap("pg_loss"), both.gap("grad_norm")) == (0.5, 0.25)
    assert (one_sided.gap("pg_loss"), one_sided.gap("grad_norm")) == (None, None)
    assert largest_gap([both, one_sided]) == 0.5 and largest_gap([one_sided]) is None
    lines = report([both, one_sided]).splitlines()
    assert lines[1].split() == ["1", "1", "1.5", "5.0e-01", "2", "2.25", "2.5e-01"]
    assert lines[2].split() == ["2", "1", "-", "-", "-", "3", "-"]
    assert lines[-1] == "largest gap: 5.0e-01"
    assert report([one_sided]).splitlines()[-1].split()[0] == "2"  # no gap line without a gap


# -- the dump's readable side, on batches made by hand -----------------------------------------------

def _ids(tokenizer, text: str, width: int, left: bool = False) -> tuple[list[int], list[int]]:
    """``text``'s character tokens padded to ``width`` (on the left for a prompt) and their mask."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pad = [tokenizer.pad_token_id] * (width - len(ids))
    mask = [1] * len(ids)
    return (pad + ids, [0] * len(pad) + mask) if left else (ids + pad, mask + [0] * len(pad))


def _rlvr_batch():
    """Two samples of an RL step: prompts and responses of different lengths, per-token advantages and
    log-probs whose padded positions hold values that must not count, two reward components."""
    from roll_core.data import Batch
    from roll_core.embedded.model import build_char_tokenizer

    tok = build_char_tokenizer()
    (p0, pm0), (p1, pm1) = _ids(tok, "9=", 4, left=True), _ids(tok, "1+2=", 4, left=True)
    (r0, rm0), (r1, rm1) = _ids(tok, "3</s>", 3), _ids(tok, "12</s>", 3)
    batch = Batch({"prompt_ids": torch.tensor([p0, p1]), "prompt_mask": torch.tensor([pm0, pm1]),
                   "responses": torch.tensor([r0, r1]), "response_mask": torch.tensor([rm0, rm1]),
                   "scores": torch.tensor([1.0, 0.25]),
                   "advantages": torch.tensor([[0.5, 0.5, 9.0], [-1.0, -2.0, -3.0]]),
                   "infer_log_probs": torch.tensor([[-0.1, -0.2, -7.0], [-1.0, -0.5, -0.25]]),
                   "ref_log_probs": torch.tensor([[-0.3, -0.3, -7.0], [-2.0, -1.0, -1.0]]),
                   "version": torch.tensor([4, 3]), "group": torch.tensor([[0], [1]])},
                  {"reward_components": [{"exact": 1.0, "format": 0.5}, {"exact": 0.25}],
                   "ground_truth": ["3", "003"], "domain": ["math", "math"]})
    return batch, tok


def test_a_dumped_sample_reads_as_text_with_its_values_over_its_own_tokens():
    from roll_core.pipelines.rollout_dump import readable_rows

    batch, tok = _rlvr_batch()
    first, second = readable_rows(batch, tok)
    assert first.pop("reward_components") == {"exact": 1.0, "format": 0.5}
    assert first == pytest.approx({
        "index": 0, "prompt": "9=", "response": "3</s>", "scores": 1.0, "advantage": 0.5,
        "infer_log_probs_sum": -0.3, "ref_log_probs_sum": -0.6, "domain": "math", "ground_truth": "3", "version": 4,
        "response_tokens": 2})  # no 2-D "group"
    assert (second["prompt"], second["response"], second["response_tokens"]) == ("1+2=", "12</s>", 3)
    assert (second["advantage"], second["infer_log_probs_sum"]) == pytest.approx((-2.0, -1.75))


def test_an_episode_reads_as_the_policys_turns_and_the_environments_replies(tmp_path):
    from roll_core.data import Batch
    from roll_core.pipelines.rollout_dump import readable_rows, show, write_dump

    _, tok = _rlvr_batch()
    prompt, prompt_mask = _ids(tok, "go", 2)
    tokens, mask = _ids(tok, "abcde", 7)
    empty, none = _ids(tok, "", 7)
    batch = Batch({"prompt_ids": torch.tensor([prompt, prompt]), "prompt_mask": torch.tensor([prompt_mask] * 2),
                   "responses": torch.tensor([tokens, empty]), "response_mask": torch.tensor([mask, none]),
                   "action_mask": torch.tensor([[1, 1, 0, 0, 1, 0, 0], [0] * 7]),
                   "advantages": torch.tensor([[2.0] * 7, [5.0] * 7])}, {"env": ["echo", "maze"]})
    episode, nothing = readable_rows(batch, tok)
    assert episode["turns"] == [{"role": "policy", "text": "ab"}, {"role": "environment", "text": "cd"},
                                {"role": "policy", "text": "e"}]
    assert (nothing["turns"], nothing["advantage"], nothing["response_tokens"]) == ([], 0.0, 0)  # no tokens: no mean
    write_dump(tmp_path, 1, batch, tok)
    assert show(tmp_path, limit=1).splitlines()[1:] == [
        "--- sample 0  advantage=2 env=echo response_tokens=5", "  prompt:   'go'",
        "  policy      'ab'", "  environment 'cd'", "  policy      'e'"]


def test_show_rollouts_prints_the_last_dump_its_facts_rounded_and_components_where_there_are_several(tmp_path):
    from roll_core.pipelines.rollout_dump import show, write_dump

    batch, tok = _rlvr_batch()
    write_dump(tmp_path, 5, batch, tok)
    batch.tensors["scores"] = torch.tensor([2 / 3, 0.0])
    write_dump(tmp_path, 7, batch, tok)
    lines = show(tmp_path, limit=1).splitlines()  # the last step dumped
    assert lines[0] == "step 7: 2 samples, the first 1"
    assert lines[1] == ("--- sample 0  scores=0.6667 advantage=0.5 infer_log_probs_sum=-0.3 version=4 domain=math "
                        "response_tokens=2 components=exact:1,format:0.5")
    assert lines[2:] == ["  prompt:   '9='", "  response: '3</s>'", "  expected: '3'"]
    everything = show(tmp_path, step=5, limit=2).splitlines()
    assert everything[0] == "step 5: 2 samples"  # the limit covers them all
    assert everything[5] == "--- sample 1  scores=0.25 advantage=-2 infer_log_probs_sum=-1.75 version=3 domain=math " \
                            "response_tokens=3"  # one component: the score says it
    assert torch.equal(load_dump(tmp_path, 5)["advantages"], batch["advantages"])
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
        "step_000005.jsonl", "step_000005.pt", "step_000007.jsonl", "step_000007.pt"]
    (tmp_path / "rollouts" / "step_000007.jsonl").unlink()  # stopped between the batch and its readable copy
    with pytest.raises(RollError, match=r"the dump of step 7 has no readable copy \(step_000007.jsonl is missing"):
        show(tmp_path)


def test_a_dump_that_fails_while_saving_leaves_no_file_under_its_name(tmp_path, monkeypatch):
    from roll_core.pipelines import rollout_dump

    batch, tok = _rlvr_batch()

    def half_saved(obj, path):
        Path(path).write_bytes(b"half a pickle")
        raise OSError("disk full")

    monkeypatch.setattr(rollout_dump.torch, "save", half_saved)
    with pytest.raises(OSError, match="disk full"):
        rollout_dump.write_dump(tmp_path, 3, batch, tok)
    assert not dump_path(tmp_path, 3, "pt").exists() and dumped_steps(tmp_path) == []


def test_step_ranges_and_the_missing_step_message():
    from roll_core.pipelines.rollout_dump import step_ranges

    assert step_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert step_ranges([]) == ""
    with pytest.raises(RollError, match=r"of step 2; dumped steps: none \(set trainer.dump_rollouts_every"):
        load_dump(Path("/nonexistent-run"), 2)
