"""What attention over a compacted layer reads: the compacted prefix and the tokens appended after it.

The torch reference (`compacted_attention`), the fused SDPA path and the Triton kernel all take these two tuples.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class CompactedPrefix(NamedTuple):
    """The kept entries of every KV head of one layer, stacked head after head (ragged: ``L_h`` entries for head ``h``,
    ``N = Σ_h L_h``), shared by every row of the batch and visible to every query.

    Attributes:
        keys: ``[N, D]`` kept post-RoPE keys, KV head ``h`` in rows ``offsets[h]:offsets[h+1]``.
        values: ``[N, D_v]`` kept (refit) values, same layout.
        bias: ``[N]`` FP32 logit biases (log multipliers), added to the entries' scores.
        offsets: ``H_kv + 1`` non-decreasing row offsets (Python ints).
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    offsets: list[int]

    @property
    def num_kv_heads(self) -> int:
        return len(self.offsets) - 1

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys [L_h, D], values [L_h, D_v], bias [L_h])`` of KV head ``h``."""
        rows = slice(self.offsets[h], self.offsets[h + 1])
        return self.keys[rows], self.values[rows], self.bias[rows]


class AppendedTokens(NamedTuple):
    """The tokens each batch row appended after the prefix (question, generated text, the current step), as the cache
    layer's ``update`` returns them, with the model's attention mask over them.

    Attributes:
        keys: ``[B, H_kv, n, D]``.
        values: ``[B, H_kv, n, D_v]``.
        mask: ``None`` (causal, bottom-right aligned: query ``i`` of ``q`` sees keys ``0 .. n - q + i``), a boolean
            mask (True = visible) or an additive float mask, broadcastable to ``[B, 1, q, n]``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None


def check_inputs(prefix: object, appended: object) -> None:
    """TypeError naming the argument unless ``prefix`` is a `CompactedPrefix` and ``appended`` `AppendedTokens`."""
    for name, value, kind in (("prefix", prefix, CompactedPrefix), ("appended", appended, AppendedTokens)):
        if not isinstance(value, kind):
            fields = ", ".join(kind._fields)
            raise TypeError(f"{name} must be given as {kind.__name__}({fields}), got {type(value).__name__}")
