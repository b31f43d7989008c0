"""Registration only: targets are lazy strings, so listing plugins imports neither sympy nor math-verify."""

from roll_core import hookimpl


@hookimpl
def roll_register_rewards(register):
    register("math_verify", "roll_rewards.math:MathVerifyReward",
             description="symbolic equivalence of the final answer (math-verify), with timeouts")
    register("code", "roll_rewards.code:CodeReward",
             description="runs the response's program against tests (stdio / assert / pytest) in a sandbox")
    register("multiple_choice", "roll_rewards.choice:MultipleChoiceReward",
             description="final choice letter (A-J) against the gold letter")
    register("trl_function", "roll_rewards.adapters:TRLRewardFunction",
             description="a TRL-style f(prompts, completions, **columns) -> list[float | None], by import path")
    register("verl_compute_score", "roll_rewards.adapters:VerlComputeScore",
             description="a verl-style compute_score(data_source, solution_str, ground_truth, extra_info)")
    register("ifeval", "roll_rewards.ifeval:IFEvalReward",
             description="IFEval-style instruction checks (word counts, keywords, formats, case, ...)")
    register("shaped", "roll_rewards.penalties:ShapedReward",
             description="any reward plus a format penalty and DAPO's soft overlong penalty")
    register("reward_model", "roll_rewards.reward_model:RewardModelReward",
             description="a trained reward model's score (a local Hugging Face sequence classifier, one label)")
    register("llm_judge", "roll_rewards.judge:LLMJudgeReward",
             description="an LLM grades the response: OpenAI-compatible HTTP endpoint or a roll inference strategy")
