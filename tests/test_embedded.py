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
