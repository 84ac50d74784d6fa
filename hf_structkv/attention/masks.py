"""The mask function registered next to hf_structkv's attention.

It is transformers' ``sdpa_mask`` except for sliding-window masks over a padded batch, where the window is measured
in token positions (``cumsum(attention_mask) - 1``) rather than in cache slots. Without padding both are the same;
with the padding of a batch of questions placed after a shared context, slot distance would let padding eat into a
row's window, so a row would not see what it sees when run alone.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import prepare_padding_mask, remap_positions_for_packed_sequence, sdpa_mask


def structkv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Same arguments and result as ``transformers.masking_utils.sdpa_mask`` (boolean ``[B, 1, q, kv]`` or None)."""
    arguments = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        **kwargs,
    )
    if mask_function is not None:
        arguments["mask_function"] = mask_function
    if local_size is None or attention_mask is None or attention_mask.ndim != 2 or bool(attention_mask.all()):
        return sdpa_mask(**arguments)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # [B, kv_offset + kv_length]
    positions = padding.long().cumsum(-1) - 1
    arguments["mask_function"] = remap_positions_for_packed_sequence(mask_function, positions)
    arguments["allow_is_causal_skip"] = False
    return sdpa_mask(**arguments)


def slot_visibility(mask: torch.Tensor | None, batch: int, q_len: int, seen: int, device: torch.device) -> torch.Tensor:
    """Bool ``[B, q, seen]``: which of a layer's ``seen`` slots each of the ``q`` query rows sees, from the mask the
    attention function received (``None`` = causal over the last ``q`` slots; boolean or additive ``[B, 1, q, seen]``).

    Raises:
        ValueError: the mask covers another number of slots.
    """
    if mask is None:
        slots = torch.arange(seen, device=device)
        rows = torch.arange(q_len, device=device).unsqueeze(-1) + (seen - q_len)
        return (slots <= rows).expand(batch, q_len, seen)
    if mask.shape[-1] != seen:
        raise ValueError(f"the attention mask covers {mask.shape[-1]} slots, the cache layer holds {seen}")
    visible = mask if mask.dtype == torch.bool else mask > float("-inf")
    return visible[:, 0].expand(batch, q_len, seen)
