"""``reward_model``: train a reward model on preference pairs, RLHF's step between SFT and PPO.

The model is ``roles.critic``: the checkpoint (``model.path``) with a fresh one-label score head, on
any strategy that hosts a critic. Each step takes ``reward_model.batch_size`` pairs (rows with a
``rejected`` response, as ``dpo`` reads them) in a seeded, resumable order and makes one optimizer
step on the Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)``, each response's score being
the head's output after the prompt and the whole response. The held-out metric is the preference
accuracy: the share of held-out pairs whose chosen response scores higher.

At the end the trained model is also written as a Hugging Face sequence classifier with one label,
``<output_dir>/reward_model/``, the format roll-rewards' ``reward_model`` reward (and other
libraries) score with; it reads its score where training did, at the end of prompt + response.
The head's bias is left out of that export: it adds the same constant to every score, which no
preference depends on.

    roll run pipeline=reward_model 'roles.critic={}' trainer.max_steps=60 trainer.eval_every=20 \\
        output_dir=runs/rm
    roll run roles.reward.name=reward_model roles.reward.options.model_path=runs/rm/reward_model \\
        output_dir=runs/rlhf                                                 # then RL against it
"""

from __future__ import annotations

from pathlib import Path

from roll_core.algorithms.objective import RewardModelObjective
from roll_core.config.loader import image_sources
from roll_core.data import PromptStream
from roll_core.pipelines.dpo import load_pairs, odd_micro_batch, pair_batch
from roll_core.pipelines.runtime import SEED_OFFSETS, ActorLoop, start_update, values
from roll_core.strategies.models import export_sequence_classifier
from roll_core.training import UpdateSpec

EXPORT = "reward_model"  # the sequence classifier's directory in output_dir


class RewardModelPipeline(ActorLoop):
    headline = ("eval/reward_model/rewards/accuracy", "held-out preference accuracy", "{:.1%}", "reward model steps")
    trained_role = "critic"
    config_sections = frozenset({"reward_model"})

    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        problems = super().config_problems(cfg, plugins)
        if cfg.roles.critic is None:
            return problems + ["key 'roles.critic': pipeline reward_model trains roles.critic (the model with a score "
                               "head), which is not configured: add roles.critic={} (or its strategy, lr, ...)"]
        images = image_sources(cfg, plugins)
        if images:  # transformers has no sequence classifier for image-text models to export
            problems.append(f"pipeline reward_model exports a Hugging Face sequence classifier, which transformers "
                            f"builds for text models only, and the data has images ({images[0]}); train a reward "
                            f"model on text data")
        lora = cfg.roles.critic.lora
        if lora is not None and lora.save != "merged":  # after_steps reads the checkpoint's model/
            problems.append("key 'roles.critic.lora.save': pipeline reward_model exports the trained model from its "
                            "last checkpoint's model/, which a LoRA critic writes with save: merged only; set "
                            "roles.critic.lora.save=merged")
        return problems + odd_micro_batch(cfg, "critic")

    def prepare(self) -> None:
        cfg = self.config
        self.model, self.tokenizer = self.policy()
        self.train_pairs, self.eval_pairs = load_pairs("reward_model", cfg.data, self.plugins, self.tokenizer)
        self.loss_fn = RewardModelObjective()
        self.spec = UpdateSpec(max_grad_norm=cfg.algorithm.max_grad_norm,
                               micro_batch_size=cfg.roles.critic.micro_batch_size, metric_prefix="reward_model")

    def build(self) -> None:
        self.actor = self.roles.model_role("critic", self.model, self.config.roles.critic)
        self.stream = PromptStream(self.train_pairs, self.config.seed + SEED_OFFSETS["preference_data"])

    def step(self, step: int) -> dict[str, float]:
        batch = pair_batch(self.tokenizer, self.stream.next(self.config.reward_model.batch_size))
        return self.executor.get(start_update(self.actor, batch, self.loss_fn, self.spec))[0]

    def evaluate(self) -> dict[str, float]:
        """The loss and score metrics of the held-out pairs (no gradient)."""
        if not self.eval_pairs:
            return {}
        batch = pair_batch(self.tokenizer, self.eval_pairs)
        _, metrics = self.loss_fn({"values": values(self.executor, self.actor, batch)}, batch, 0.0, float(len(batch)))
        return {f"eval/{k}": v for k, v in metrics.items()}

    def after_steps(self) -> None:
        checkpoint = self.checkpoints.latest()
        assert checkpoint is not None  # the last step always saves
        out = Path(self.config.output_dir) / EXPORT
        export_sequence_classifier(checkpoint / self.trained_role / "model", out, self.tokenizer)
        print(f"reward model written to {out} (a sequence classifier: roles.reward.name=reward_model "
              f"roles.reward.options.model_path={out})", flush=True)

