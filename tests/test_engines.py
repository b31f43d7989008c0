"""The helpers engine plugins share (``roll_core.strategies.engines``): the install hint for a
missing engine, the version warning, and the check of ``strategy_options.engine_args``."""

from __future__ import annotations

import warnings

import pytest

from roll_core.strategies.engines import check_engine_args, check_engine_version, engine_cuts, import_engine


def test_a_missing_engine_gets_the_install_hint_and_a_present_one_imports():
    with pytest.raises(ImportError) as err:
        import_engine("roll_no_such_engine", "pip install 'roll-x[engine]'")
    assert str(err.value) == "pip install 'roll-x[engine]'"
    assert import_engine("json", "never shown").__name__ == "json"


def test_an_engine_missing_a_dependency_keeps_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "roll_fake_engine.py").write_text("import roll_fake_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="roll_fake_missing_dependency"):
        import_engine("roll_fake_engine", "never shown")


def test_a_version_outside_the_tested_range_is_warned_about_once_local_suffixes_are_dropped():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_engine_version("vllm", "0.32.0+cpu", (">=0.32", "<0.33"), "roll-vllm")  # in range: silent
        check_engine_version("vllm", "0.32.9", (">=0.32", "<0.33"), "roll-vllm")
        check_engine_version("vllm", "0.32.1.dev5+g1a2b.cpu", (">=0.32", "<0.33"), "roll-vllm")  # a nightly
    with pytest.warns(UserWarning) as caught:
        check_engine_version("vllm", "0.33.0", (">=0.32", "<0.33"), "roll-vllm")
    assert str(caught[0].message) == ("roll-vllm is tested with vllm<0.33,>=0.32; vllm 0.33.0 is installed and may "
                                      "not work (pin a supported version if generation or weight updates fail)")
    with pytest.warns(UserWarning):
        check_engine_version("sglang", "0.5.22", (">=0.5.23", "<0.6"), "roll-sglang")


def test_engine_args_are_checked_against_the_engines_own_names():
    known = ["swap_space", "block_size", "max_model_len"]
    assert check_engine_args({"swap_space": 4}, known, ["max_model_len"], "vLLM engine") == {"swap_space": 4}
    with pytest.raises(ValueError) as err:
        check_engine_args({"swap_spac": 4}, known, ["max_model_len"], "vLLM engine")
    assert str(err.value) == "unknown vLLM engine argument 'swap_spac'. Did you mean 'swap_space'?"
    with pytest.raises(ValueError) as err:
        check_engine_args({"max_model_len": 64}, known, ["max_model_len"], "vLLM engine")
    assert str(err.value) == ("'max_model_len' is an option of its own: set strategy_options.max_model_len, "
                              "not engine_args.max_model_len")
    with pytest.raises(ValueError) as err:  # an engine argument that an option of another name sets
        check_engine_args({"max_model_len": 64}, known, {"max_model_len": "max_length"}, "vLLM engine", "engine_kw")
    assert str(err.value) == ("'max_model_len' is an option of its own: set strategy_options.max_length, "
                              "not engine_kw.max_model_len")


@pytest.mark.parametrize("cut", [None, (0.9, -1)])
def test_samples_and_their_rescoring_run_inside_one_whole_call_when_the_draw_cut(cut):
    """A weight update may not land between an engine's draw and its re-scoring of what it drew."""
    import contextlib

    import torch

    from roll_core.data import Batch
    from roll_core.strategies.engines import samples_before_cuts

    events = []

    class Loop:
        @contextlib.contextmanager
        def whole_call(self):
            events.append("begin")
            yield
            events.append("end")

    def samples():
        events.append("draw")
        return {"responses": torch.tensor([[5, 6]]), "infer_log_probs": torch.tensor([[-0.5, -0.25]])}

    def rescore(batch):
        events.append("rescore")
        assert torch.equal(batch["responses"], torch.tensor([[5, 6]]))
        return torch.tensor([[-1.0, -2.0]])

    batch = samples_before_cuts(Loop(), Batch({"prompt_ids": torch.tensor([[1]])}), cut, samples, rescore)
    assert events == (["begin", "draw", "rescore", "end"] if cut else ["draw"])
    expected = [[-1.0, -2.0]] if cut else [[-0.5, -0.25]]
    assert batch["infer_log_probs"].tolist() == expected and batch["prompt_ids"].tolist() == [[1]]


@pytest.mark.parametrize("temperature, top_p, top_k, expected", [
    (1.0, 1.0, 0, None),  # no cut asked for: the engine's own log-probs are roll's
    (0.0, 0.5, 20, None),  # greedy decoding cuts nothing
    (0.7, 0.9, 0, (0.9, -1)),  # top_k 0 is -1 for the engines
    (1.0, 1.0, 20, (1.0, 20)),
])
def test_engine_cuts_are_the_engines_parameters_when_a_draw_cuts_the_distribution(temperature, top_p, top_k, expected):
    assert engine_cuts(temperature, top_p, top_k) == expected
