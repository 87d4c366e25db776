"""What a request does to the target's logits before sampling, and what it reads back.

`LogitAdjust`: OpenAI's logit_bias and its presence and frequency penalties,
    mu[j] -> mu[j] + bias[j] - c[j] * frequency - (c[j] > 0) * presence,
where c[j] counts the times token j was generated before this position (the prompt is not
counted, as in OpenAI's description and vLLM's implementation). A verify pass's row i sees the
tokens generated so far plus drafts[:i], exactly what a plain step at that position would see,
so speculative decoding samples from the same adjusted distributions as plain decoding.

`TokenLogprob`: the log-probability of an emitted token, and the most likely alternatives, under
the adjusted logits before temperature and top-p (the model's distribution as the request
shaped it; the temperature and nucleus only decide how it is sampled).
"""

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the `top` most likely tokens, most likely first


class LogitAdjust:
    """bias: {token id: added logit}; presence, frequency: the penalties (0 leaves them off).
    `apply(logits, drafts)` adjusts a pass's rows; `emitted(tokens)` counts what was generated."""

    def __init__(self, bias: dict[int, float] | None = None, presence=0.0, frequency=0.0):
        self.bias = dict(bias or {})
        self.presence, self.frequency = float(presence), float(frequency)
        self.counts: Counter[int] = Counter()
        self._bias_ids = torch.tensor(list(self.bias), dtype=torch.long)
        self._bias_values = torch.tensor(list(self.bias.values()), dtype=torch.float32)

    @property
    def penalised(self) -> bool:
        return self.presence != 0 or self.frequency != 0

    def emitted(self, tokens: list[int]) -> None:
        if self.penalised:
            self.counts.update(tokens)

    def apply(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """[n, V] (or [V]) logits -> float32 adjusted logits; row i follows drafts[:i]."""
        out = logits.float().clone()
        rows = out.reshape(-1, out.shape[-1])  # a view: [n, V]
        if self.bias:
            rows[:, self._bias_ids] += self._bias_values
        if not self.penalised:
            return out
        n = rows.shape[0]
        drafts = list(drafts[: n - 1])  # row i + 1 follows drafts[: i + 1]
        ids = list(dict.fromkeys([*self.counts, *drafts]))
        if not ids:
            return out
        column = {token: j for j, token in enumerate(ids)}
        counts = torch.zeros(n, len(ids))  # [n, tokens]: c[j] as each row sees it
        counts[:, : len(self.counts)] = torch.tensor(list(self.counts.values()), dtype=torch.float)
        for i, token in enumerate(drafts):
            counts[i + 1 :, column[token]] += 1
        # one formula, subtracted once: each row is bit for bit what a plain step computes
        rows[:, ids] -= counts * self.frequency + (counts > 0) * self.presence
        return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of tokens[i] under row i of [n, V] adjusted logits, with each row's
    `top` most likely tokens."""
    logprobs = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    best = logprobs[: len(tokens)].topk(top, dim=-1) if top > 0 else None
    out = []
    for i, token in enumerate(tokens):
        alternatives = []
        if best is not None:
            alternatives = list(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True))
        out.append(TokenLogprob(token, chosen[i], alternatives))
    return out
