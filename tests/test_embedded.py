import pytest
import torch

from roll_core.embedded.model import build_char_tokenizer, build_tiny_model
from roll_core.embedded.tasks import CarryAdditionConfig, CarryAdditionTask, careless_sum


def test_tokenizer_is_one_token_per_character_and_roundtrips():
    tok = build_char_tokenizer()
    ids = tok("47+38=085", add_special_tokens=False)["input_ids"]
    assert len(ids) == 9
    assert tok.decode(ids) == "47+38=085"


def test_tiny_model_loads_with_auto_classes(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert (tiny_model_path / "model.safetensors").exists()
    out = model(**tok(["12+34="], return_tensors="pt", add_special_tokens=False))
    assert out.logits.shape == (1, 6, len(tok))


def test_build_is_deterministic_and_reused(tmp_path):
    from safetensors.torch import load_file

    a = load_file(build_tiny_model(tmp_path / "a") / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b") / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    mtime = (tmp_path / "a" / "model.safetensors").stat().st_mtime
    build_tiny_model(tmp_path / "a")
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime == mtime


def test_careless_teacher():
    assert careless_sum(47, 38, forget_carry=True) == 75  # units carry forgotten
    assert careless_sum(47, 38, forget_carry=False) == 85
    assert careless_sum(41, 38, forget_carry=True) == 79  # no carry, nothing to forget


def test_task_splits_are_disjoint_fixed_width_and_noisy():
    task = CarryAdditionTask(CarryAdditionConfig(num_eval=200, teacher_carry_error=0.7, seed=5))
    train, held = task.train_rows(), task.eval_rows()
    assert len(train) + len(held) == 100 * 100 and len(held) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(len(r["prompt"]) == 6 and len(r["ground_truth"]) == 3 for r in train + held)
    carry = [r for r in train if int(r["prompt"][1]) + int(r["prompt"][4]) >= 10]
    wrong = sum(r["demonstration"] != r["ground_truth"] for r in carry) / len(carry)
    assert 0.65 < wrong < 0.75
    assert all(r["demonstration"] == r["ground_truth"] for r in train if r not in carry)


def test_task_rejects_bad_options():
    with pytest.raises(ValueError):
        CarryAdditionTask.from_options({"teacher_carry_eror": 0.5})
    with pytest.raises(ValueError, match="leaves no training pairs"):
        CarryAdditionTask.from_options({"max_operand": 9, "num_eval": 100})


def test_widths_follow_max_operand_and_carrying_sums_pair_the_teachers_mistake():
    """Operands as wide as ``max_operand``, answers as wide as twice it; every carrying sum (and only
    those) has the teacher's carry-forgetting answer as ``rejected``, at the answer's width."""
    task = CarryAdditionTask(CarryAdditionConfig(max_operand=120, num_eval=50))
    rows = {r["prompt"]: r for r in task.train_rows() + task.eval_rows()}
    assert len(rows) == 121 * 121
    assert {k: rows["047+038="][k] for k in ("ground_truth", "rejected")} == {"ground_truth": "085", "rejected": "075"}
    assert "rejected" not in rows["041+038="] and rows["120+120="]["ground_truth"] == "240"
    assert all(("rejected" in r) == (int(p[2]) + int(p[6]) >= 10) for p, r in rows.items())


def test_python_expr_splits_its_functions_and_tests_each_at_four_points():
    from roll_core.embedded.tasks import PythonExprConfig, PythonExprTask

    task = PythonExprTask(PythonExprConfig(max_coef=3, max_const=9, num_eval=5, teacher_syntax_error=0.5))
    train, held = task.train_rows(), task.eval_rows()
    prompts = [r["prompt"] for r in train + held]
    assert len(held) == 5 and sorted(prompts) == sorted(f"{a}x+{b}:" for a in (2, 3) for b in range(10))
    row = next(r for r in train + held if r["prompt"] == "3x+7:")
    assert row["ground_truth"] == {"style": "assert", "tests": "assert f(0)==7\nassert f(1)==10\nassert f(3)==16\n"
                                                               "assert f(-2)==1"}
    for r in train:  # the teacher writes Python, or math ("3x") where it is sloppy
        a, b = r["prompt"].rstrip(":").split("x+")
        assert r["demonstration"] in (f"f=lambda x:{a}*x+{b}", f"f=lambda x:{a}x+{b}")
    assert not any("demonstration" in r for r in held)
    always = PythonExprTask(PythonExprConfig(max_coef=3, max_const=9, num_eval=5, teacher_syntax_error=1.0))
    assert all("*" not in r["demonstration"] for r in always.train_rows())
    with pytest.raises(ValueError, match="num_eval=20 leaves no training functions"):
        PythonExprTask(PythonExprConfig(max_coef=3, max_const=9, num_eval=20))
