"""`text-classification`: a sequence-classification head, labels from the model's id2label."""

from __future__ import annotations

from typing import Any

import torch

from inference.child.handlers.base import Handler, top_label


class ClassificationHandler(Handler):
    """Softmax over the head's logits: the top label, its score and every label's score."""

    kind = "classifier"

    def postprocess(self, output: Any, attention_mask: torch.Tensor) -> list[dict[str, Any]]:
        probs = torch.softmax(output.logits.float(), dim=-1).cpu()
        id2label = self.model.config.id2label
        labels = [str(id2label.get(i, i)) for i in range(probs.shape[-1])]
        return [top_label(labels, row) for row in probs.tolist()]
