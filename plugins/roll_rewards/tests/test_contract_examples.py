"""Every reward's own contract examples (``contract_examples``) score as they say, checked in this
process by the same checker as ``roll check-plugin rewards``."""

from roll_core.contracts import check_plugin


def test_every_reward_passes_its_contract_examples():
    report = check_plugin("rewards")
    failed = [(r.component, r.check, r.detail) for r in report.results if r.status == "failed"]
    assert not failed
    checked = {r.component for r in report.results if r.check == "sample inputs" and r.status == "ok"}
    # only the LLM judge has no examples (it needs an endpoint or a model)
    assert checked == {f"rewards:{n}" for n in ("code", "ifeval", "math_verify", "multiple_choice", "shaped",
                                                "trl_function", "verl_compute_score")}
