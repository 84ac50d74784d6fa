"""Teacher-forced likelihood of reference answers after a cached context: a continuous measure of what a cache
(full or compacted) keeps of the answers a model can give from it.

Teacher forcing scores each answer token given the answer's earlier tokens, so a cache can score well on an answer
it would not generate (given a number's first digits, the model may complete it from what other kept entries hold):
read it beside generated answers, not instead of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..generation import context_copy


@dataclass(frozen=True)
class ReferenceAnswers:
    """Question + answer token sequences, right padded: ``ids [B, n]``; answer ``b`` occupies positions
    ``starts[b] .. ends[b] - 1`` of row ``b`` (right padding never reaches earlier tokens under causal attention)."""

    ids: torch.Tensor
    starts: list[int]
    ends: list[int]

    @classmethod
    def build(cls, questions: list[torch.Tensor], answers: list[torch.Tensor], pad_id: int) -> ReferenceAnswers:
        """Rows ``question ‖ answer`` from 1-D id tensors (``questions[b]`` and ``answers[b]`` pair up).

        Raises:
            ValueError: the lists are empty or of different lengths, a question or an answer is empty or not 1-D.
        """
        if not questions or len(questions) != len(answers):
            raise ValueError(
                f"questions and answers must be non-empty lists of the same length, got {len(questions)} and "
                f"{len(answers)}"
            )
        for name, items in (("questions", questions), ("answers", answers)):
            if any(not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() == 0 for t in items):
                raise ValueError(f"every item of {name} must be a non-empty 1-D tensor of token ids")
        rows = [torch.cat([q, a]) for q, a in zip(questions, answers)]
        ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = row
        return cls(ids, [len(q) for q in questions], [len(r) for r in rows])

    def nll(self, model: PreTrainedModel, cache: Cache) -> torch.Tensor:
        """``[B]`` float64: each answer's mean per-token negative log-likelihood (nats), teacher forced after the
        cached context. The forward runs on a fresh copy of ``cache`` (`context_copy`); ``cache`` is not changed."""
        with torch.no_grad():
            logits = model(
                self.ids.to(model.device), cache=context_copy(cache, len(self.starts)), use_cache=True
            ).logits
        per_answer = []
        for b, (start, end) in enumerate(zip(self.starts, self.ends)):
            log_probs = torch.log_softmax(logits[b, start - 1 : end - 1].double(), dim=-1)
            targets = self.ids[b, start:end].to(log_probs.device)
            per_answer.append(-log_probs.gather(1, targets[:, None]).mean())
        return torch.stack(per_answer).cpu()
