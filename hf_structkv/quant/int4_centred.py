"""Centred per-row INT4 keys: PASK's row layout after each channel is centred and scaled by prompt-wide vectors.

A model's keys have a few channels with a large offset and range (a RoPE'd key's outlier channels); a per-row scale
``max|k| / 7`` then spends the 15 codes of every row on those channels and rounds the others to zero. Subtracting a
per-channel centre ``μ`` and dividing by a per-channel spread ``s`` first puts every channel on one footing:

    k̂ = s ⊙ (code · scale) + μ,      codes and row scales = `quantize_int4`((k − μ) / s)

with ``μ`` the mean of the prompt's real (unpadded) keys of one batch row and KV head, ``s`` their largest
``|k − μ|`` per channel, both rounded to FP16 and fixed for every later token of that row (a generated token beyond
the prompt's range is still quantised per row, its codes cover it). ``s`` is floored at 1/256 of the head's largest
channel spread (and at the smallest normal FP16, ``2**-14``) so that a constant channel does not blow up a later
token's row scale. A row without a real prompt token gets ``μ = 0`` and ``s = 1`` (the plain row layout).

Attention reads the codes without forming ``k̂``: ``q · k̂ = (q ⊙ s) · (code · scale) + q · μ``, i.e. the row
layout's dot product for the query ``q ⊙ s`` and one logit shift ``q · μ`` shared by every entry of the partition.
A row costs what the row layout costs (``ceil(D / 2)`` code bytes and one FP16 scale); ``μ`` and ``s`` are two FP16
vectors per batch row and KV head. On 32 BFCL prompts of the embedded model this cut the attention error of the
INT4 tokens from 0.129 to 0.064 (median) and 0.568 to 0.169 (p90) (``benchmarks/int4_key_layouts.py``, RESULTS).

**Centres per group of prompt tokens** (``centred-g128``): the prompt's slots ``0 .. P - 1`` fall into groups of
`KEY_GROUP_TOKENS` consecutive slots (the last one may be shorter), each with its own ``μ_g`` and ``s_g`` fitted to
its real keys as above; a token after the prompt (a generated one) is centred by the whole prompt's ``μ`` and ``s``,
as in ``centred``. So a row's centre is chosen by its position (`key_groups`), never stored per row: a cache keeps one
INT4 store per group and attention reads each as a centred store of its own (one logit shift per group). Two FP16
vectors per group and KV head (2 bytes a row at D = 64). On the same 32 prompts, groups of 128 consecutive *stored*
tokens (`int4_key_layouts.py`'s ``row/centred/g128``, close to this where most prompt tokens are stored) reached
0.051 / 0.132 (median / p90).
"""

from __future__ import annotations

import torch

from .int4 import dequantize_int4, quantize_int4

SPREAD_FLOOR = 1.0 / 256
"""The smallest channel spread, as a fraction of the head's largest channel spread."""
SMALLEST_NORMAL_FP16 = 2.0**-14
KEY_GROUP_TOKENS = 128
"""Prompt slots per centre in the ``centred-g128`` layout."""


def key_centre(keys: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The centre ``μ`` and spread ``s`` of each batch row's and KV head's real keys (module docstring).

    Args:
        keys: ``[B, H_kv, n, D]`` floating point.
        real: bool ``[B, n]``: the tokens that count (a prompt's unpadded tokens).

    Returns:
        ``(centre, spread)``, each fp16 ``[B, H_kv, 1, D]``; ``spread > 0``.
    """
    if not isinstance(keys, torch.Tensor) or not keys.is_floating_point() or keys.dim() != 4:
        raise TypeError(f"keys must be a floating-point tensor [B, H_kv, n, D], got {getattr(keys, 'shape', keys)!r}")
    if (
        not isinstance(real, torch.Tensor)
        or real.dtype != torch.bool
        or tuple(real.shape)
        != (
            keys.shape[0],
            keys.shape[2],
        )
    ):
        raise ValueError(f"real must be a bool tensor [B={keys.shape[0]}, n={keys.shape[2]}], got {real!r}")
    weight = real.to(torch.float32)[:, None, :, None]  # [B, 1, n, 1]
    count = weight.sum(dim=2, keepdim=True)  # [B, 1, 1, 1]
    centre = (keys.float() * weight).sum(dim=2, keepdim=True) / count.clamp_min(1)
    centre = centre.half()
    deviation = ((keys.float() - centre.float()).abs() * weight).amax(dim=2, keepdim=True)  # [B, H_kv, 1, D]
    floor = (deviation.amax(dim=-1, keepdim=True) * SPREAD_FLOOR).clamp_min(SMALLEST_NORMAL_FP16)
    spread = torch.maximum(deviation, floor).half()
    empty = count == 0
    return torch.where(empty, torch.zeros_like(centre), centre), torch.where(empty, torch.ones_like(spread), spread)


def key_centres(prompt_keys: torch.Tensor, real: torch.Tensor, int4_keys: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The centres and spreads of a centred layout (module docstring), fitted to a prompt's real keys.

    Args:
        prompt_keys: ``[B, H_kv, P, D]`` floating point; real: bool ``[B, P]``.
        int4_keys: ``"centred"`` or ``"centred-g128"``.

    Returns:
        ``(centres, spreads)``, each fp16 ``[B, H_kv, G + 1, D]``: `key_centre` of each group of `KEY_GROUP_TOKENS`
        prompt slots (``G = ceil(P / KEY_GROUP_TOKENS)`` groups with ``centred-g128``, none with ``centred``) and,
        last, of the whole prompt. `key_groups` indexes them.
    """
    if check_int4_keys(int4_keys) == "row":
        raise ValueError("int4_keys='row' stores no centre: key_centres needs 'centred' or 'centred-g128'")
    starts = range(0, prompt_keys.shape[-2], KEY_GROUP_TOKENS) if int4_keys == "centred-g128" else ()
    size = KEY_GROUP_TOKENS
    fits = [key_centre(prompt_keys[..., a : a + size, :], real[:, a : a + size]) for a in starts]
    fits.append(key_centre(prompt_keys, real))
    return torch.cat([c for c, _ in fits], dim=2), torch.cat([s for _, s in fits], dim=2)


def key_groups(positions: torch.Tensor, prompt_length: int, int4_keys: str) -> torch.Tensor:
    """The index into `key_centres` of the tokens at ``positions`` (any shape, counted from the prompt's first slot):
    ``position // KEY_GROUP_TOKENS`` for a prompt token with ``centred-g128``, else the whole prompt's (the last).

    Returns:
        int64, the shape of ``positions``.
    """
    positions = positions.long()
    if check_int4_keys(int4_keys) != "centred-g128":
        return torch.zeros_like(positions)
    whole = -(-prompt_length // KEY_GROUP_TOKENS)
    return torch.where(positions < prompt_length, positions // KEY_GROUP_TOKENS, whole)


def quantize_int4_centred(
    x: torch.Tensor, centre: torch.Tensor, spread: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int4` of ``(x − centre) / spread``.

    Args:
        x: ``[B, H_kv, n, D]``; centre / spread: fp16 ``[B, H_kv, 1, D]`` (`key_centre`) or one per row
            ``[B, H_kv, n, D]`` (`key_centres` indexed by `key_groups`).

    Returns:
        ``(codes, scales)`` as `quantize_int4`: uint8 ``[B, H_kv, n, ceil(D / 2)]``, fp16 ``[B, H_kv, n, 1]``.
    """
    return quantize_int4((x.float() - centre.float()) / spread.float())


def dequantize_int4_centred(
    codes: torch.Tensor, scales: torch.Tensor, centre: torch.Tensor, spread: torch.Tensor, d: int
) -> torch.Tensor:
    """FP32 ``k̂ = spread ⊙ (code · scale) + centre`` ``[..., n, d]`` (centre / spread ``[..., 1, d]`` or
    ``[..., n, d]``)."""
    return dequantize_int4(codes, scales, d) * spread.float() + centre.float()


def served_keys(keys: torch.Tensor, real: torch.Tensor, int4_keys: str) -> torch.Tensor:
    """``keys`` as an INT4 store of layout ``int4_keys`` serves them (quantised and dequantised), the first
    ``P = real.shape[-1]`` being the prompt whose real keys the centres are fitted to (`key_centres`, `key_groups`).

    Args:
        keys: ``[B, H_kv, N, D]`` floating point (``N >= P``); real: bool ``[B, P]``.

    Returns:
        FP32 ``[B, H_kv, N, D]``.
    """
    if check_int4_keys(int4_keys) == "row":
        codes, scales = quantize_int4(keys)
        return dequantize_int4(codes, scales, keys.shape[-1])
    prompt = real.shape[-1]
    centres, spreads = key_centres(keys[..., :prompt, :], real, int4_keys)
    groups = key_groups(torch.arange(keys.shape[-2], device=keys.device), prompt, int4_keys)
    centre, spread = centres[:, :, groups], spreads[:, :, groups]  # [B, H_kv, N, D]
    codes, scales = quantize_int4_centred(keys, centre, spread)
    return dequantize_int4_centred(codes, scales, centre, spread, keys.shape[-1])


INT4_KEY_LAYOUTS = ("row", "centred", "centred-g128")
"""How a mixed-precision cache stores the keys of its INT4 (``L``) tokens: ``row`` (PASK B.5: `quantize_int4` per
token row), ``centred`` (`quantize_int4_centred` with the prompt's `key_centre`) or ``centred-g128`` (with the
`key_centre` of the token's group of `KEY_GROUP_TOKENS` prompt slots; a later token: the prompt's)."""
QUANTIZERS = {
    "row": "int4-symmetric-row-fp16-scale",
    "centred": "int4-centred-keys-row-fp16-scale",
    "centred-g128": "int4-centred-keys-g128-row-fp16-scale",
}
"""The ``quantizer`` convention a policy file records for each key layout (values per row in both)."""


def int4_keys_of_quantizer(quantizer: object, where: str) -> str:
    """The key layout whose `QUANTIZERS` name is ``quantizer``.

    Raises:
        ValueError: naming ``where`` (the file) and the known quantizers.
    """
    for layout, name in QUANTIZERS.items():
        if quantizer == name:
            return layout
    raise ValueError(
        f"{where} names the quantizer {quantizer!r}; this hf_structkv implements {sorted(QUANTIZERS.values())}"
    )


def check_int4_keys(int4_keys: object) -> str:
    """``int4_keys`` if it names one of `INT4_KEY_LAYOUTS`.

    Raises:
        ValueError: any other value.
    """
    if not isinstance(int4_keys, str) or int4_keys not in INT4_KEY_LAYOUTS:
        raise ValueError(f"int4_keys must be one of {INT4_KEY_LAYOUTS}, got {int4_keys!r}")
    return int4_keys
