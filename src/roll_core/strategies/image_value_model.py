"""PPO's value model for LLaVA-style image-text checkpoints: transformers has a token-classification
model for text decoders (what :func:`~roll_core.strategies.models.load_value_model` loads) but
none for image-text models. :class:`LlavaForTokenClassification` is that model: the checkpoint's
``LlavaModel`` (vision tower, projector, decoder) and a ``score`` head of ``num_labels`` outputs per
position, in place of the language-model head.

``load_value_model`` builds it for a checkpoint whose config has a ``vision_config``, the policy's
or a critic's own (``model/``, ``architectures: ["LlavaForTokenClassification"]``); outside roll,
``LlavaForTokenClassification.from_pretrained(path)`` loads one. It is not registered with
``AutoModelForTokenClassification``, which would change what that class builds for every LLaVA
config in the process. Its weights keep LLaVA's names (``model.vision_tower...``,
``model.language_model...``), which transformers' renaming for LLaVA checkpoints maps as it does for
``LlavaForConditionalGeneration``.
"""

from __future__ import annotations

import torch
from transformers import LlavaConfig
from transformers.modeling_outputs import TokenClassifierOutput
from transformers.models.llava.modeling_llava import LlavaModel, LlavaPreTrainedModel


class LlavaForTokenClassification(LlavaPreTrainedModel):
    """``logits`` ``[B, T, num_labels]``: the score head over the decoder's last hidden states,
    the prompt's image tokens read as in ``LlavaForConditionalGeneration``."""

    def __init__(self, config: LlavaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LlavaModel(config)
        self.score = torch.nn.Linear(config.get_text_config().hidden_size, config.num_labels or 1)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, **kwargs):
        kwargs.pop("use_cache", None)  # a value pass keeps no cache
        hidden = self.model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden))

