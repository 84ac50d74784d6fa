"""`MixedPrecisionLayer`: one global-attention layer of PASK's cache (`StructuredMixedPrecisionCache`).

Layout, for a batch of ``B`` sequences with ``H_kv`` KV heads:

* recent region ``keys`` / ``values`` ``[B, H_kv, r, D]``: the newest tokens (slots ``first_recent .. seen - 1``,
  the current step's included), in the model's dtype;
* high store: ``keys``, ``values`` ``[B, H_kv, n_H, D]`` in the model's dtype, with a slot map ``[B, n_H]``;
* low store: ``key_codes`` / ``value_codes`` uint8 ``[B, H_kv, n_L, ceil(D/2)]`` and ``key_scales`` /
  ``value_scales`` fp16 ``[B, H_kv, n_L, 1]`` (`quantize_int4`), with a slot map ``[B, n_L]``; with
  ``int4_keys="centred"`` the keys are quantised after centring (`hf_structkv.quant.int4_centred`) by ``key_centre`` /
  ``key_spread`` fp16 ``[B, H_kv, 1, D]``, fitted to each row's real prompt tokens when the prompt is first committed
  (the real slots are those the prompt's last query row sees, recorded by `partitions` during the prompt forward)
  and fixed from then on. With ``int4_keys="centred-g128"`` there are ``G + 1`` centres ``[B, H_kv, G + 1, D]``
  (`key_centres`: one per group of 128 prompt slots, the last the whole prompt's) and one low store per centre
  (``group_stores`` for the prompt's groups, ``low`` for the tokens after the prompt): a token's store is chosen by
  its position (`key_groups`), and attention reads each store as a centred INT4 partition of its own.

Released tokens are stored nowhere. A token stays in the recent region until it is more than ``window`` tokens old;
its scheduled action is applied at the beginning of the next ``update`` (the commit point: a ``crop`` between a
speculative forward and the next one never has to restore destroyed precision). Every visible key is in exactly
one place; attention merges the three partitions with shared FP32 statistics (`mixed_precision_attention`).
The attention mask keeps transformers' layout (one column per slot, ``get_mask_sizes = (seen + q, 0)``); each
partition reads the columns of its slots, so padding and absolute positions survive gaps.

**A compacted context before the suffix** (``context=``, e.g. a tool catalogue read once and compacted offline): each
global layer then holds a reference to the context's `CompactedLayer` and serves its prefix as a fourth partition
(`PrefixPartition`: ragged per KV head, per-entry biases, visible to every row), read only through
``CompactedLayer.served_prefix`` at each forward (BF16 or INT4 heads alike); nothing of it is copied, so every
conversation built on one context shares its tensors. The prefix occupies logical slots ``0 .. T - 1``
(``T = original_length``): the layer starts with ``first_recent = T``, so the suffix's slots, the slot maps, the
schedule's positions, the mask columns (the placeholders of `generation_inputs` are columns of ones) and ``crop`` all
keep the plain layer's arithmetic, and nothing below ``T`` can be cropped. Why a reference and not a third layer
type: the compacted layer stays what a `CompactedCache` serves (it knows nothing of policies), the mixed layer adds one
partition and one offset, and the attention function stays one function merging partitions in FP32 statistics.
Sliding-window layers serve the context's window as a `CompactedCache` does (`SharedContextSlidingLayer`, see
`composed_context`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention.attention_mass import AttentionMass
from ..attention.kwargs import MIXED_KWARG
from ..attention.masks import slot_visibility
from ..attention.mixed_reference import (
    DensePartition,
    Int4Partition,
    Partition,
    PrefixPartition,
    attention_mass,
    head_output_projections,
    projected_value_norms,
)
from ..policy.costs import Action
from ..quant.int4 import quantize_int4
from ..quant.int4_centred import check_int4_keys, key_centres, key_groups, quantize_int4_centred
from .action_schedule import ActionSchedule
from .compacted_layers import CompactedLayer
from .slot_store import SlotStore


def _gather_visibility(visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``visible`` ``[B, q, seen]`` read at ``positions`` ``[B, n]`` (``-1`` = empty slot -> invisible)."""
    index = positions.long().clamp_min(0).unsqueeze(1).expand(-1, visible.shape[1], -1)
    return visible.gather(-1, index) & (positions >= 0).unsqueeze(1)


def _slot_mass(masses: list[torch.Tensor], positions: list[torch.Tensor], seen: int) -> torch.Tensor:
    """Per-partition masses (each ``[B, n_part]``) scattered to their slots ``positions`` (each ``[B, n_part]``,
    ``-1`` for an empty slot), ``[B, seen]``."""
    slot_mass = torch.zeros(masses[0].shape[0], seen, device=masses[0].device)
    for mass, slots in zip(masses, positions, strict=True):
        slot_mass.scatter_add_(1, slots.long().clamp_min(0), mass * (slots >= 0))
    return slot_mass


class MixedPrecisionLayer(CacheLayerMixin):
    """A global-attention layer of a `StructuredMixedPrecisionCache` (layout in the module docstring).

    Args:
        group: the layer group (0 lower, 1 middle, 2 upper) whose actions this layer applies.
        schedule: the cache's shared `ActionSchedule`.
        window: tokens kept in the recent region at full precision before their action applies (>= 1).
        statistics: the cache's `AttentionMass` when its policy asks for attention statistics, else ``None``.
        context: a compacted context's layer whose prefix precedes this layer's slots (module docstring), or
            ``None``.
        int4_keys: ``"row"``, ``"centred"`` or ``"centred-g128"``: how the keys of INT4 tokens are stored (module
            docstring).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        group: int,
        schedule: ActionSchedule,
        window: int,
        statistics: AttentionMass | None = None,
        context: CompactedLayer | None = None,
        int4_keys: str = "row",
    ):
        super().__init__()
        self.group = group
        self.schedule = schedule
        self.window = window
        self.statistics = statistics
        self.context = context
        self.int4_keys = check_int4_keys(int4_keys)
        self.context_length = 0 if context is None else context.original_length
        self.first_recent = self.context_length
        self.high = SlotStore()
        self.low = SlotStore()
        self.group_stores: list[SlotStore] = []  # centred-g128: the low stores of the prompt's groups
        self.prompt_real: torch.Tensor | None = None  # [B, P]: the prompt's real slots, until the centre is fitted
        self.prompt_length = 0  # P, set when the centres are fitted
        self.key_centre: torch.Tensor | None = None  # [B, H_kv, G + 1, D] fp16, centred keys only (G = 0: centred)
        self.key_spread: torch.Tensor | None = None

    # ------------------------------------------------------------------ transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True
        self.schedule.begin(key_states.shape[0], self.first_recent + key_states.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_):
        """Commit the actions of tokens that left the recent window (once the whole prompt is cached:
        `ActionSchedule.may_commit`), then append ``[B, H_kv, q, D]`` states.

        Puts this layer into ``kwargs["mixed_precision_layer"]`` for the registered attention function.

        Returns:
            The recent region ``[B, H_kv, r, D]`` (the stores reach attention through the kwargs).
        """
        if kwargs is None:
            raise RuntimeError(
                "this model's attention calls cache.update(...) without its attention kwargs; "
                "StructuredMixedPrecisionCache supports models whose attention passes `kwargs=kwargs` to the cache"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.schedule.may_commit(self.get_seq_length()):  # a prompt in several forwards stays whole until cached
            self.fit_key_centre()
            self.commit()
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        kwargs[MIXED_KWARG] = self
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.first_recent + (0 if self.keys is None else self.keys.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------------------ storage
    def fit_key_centre(self) -> None:
        """With centred INT4 keys, fit ``key_centre`` / ``key_spread`` (`key_centres`) to the prompt's real keys the
        first time the whole prompt is cached, and open one low store per prompt group (a no-op afterwards, and for
        row keys)."""
        if self.int4_keys == "row" or self.key_centre is not None:
            return
        real = self.prompt_real
        if real is None or real.shape[-1] != self.keys.shape[-2]:
            real = torch.ones(self.keys.shape[0], self.keys.shape[-2], dtype=torch.bool, device=self.keys.device)
        self.key_centre, self.key_spread = key_centres(self.keys, real, self.int4_keys)
        self.prompt_length = self.keys.shape[-2]
        self.group_stores = [SlotStore() for _ in range(self.key_centre.shape[2] - 1)]
        self.prompt_real = None

    def low_stores(self) -> list[SlotStore]:
        """The INT4 stores, in the order of ``key_centre``'s centres: the prompt's groups, then ``low``."""
        return [*self.group_stores, self.low]

    def num_low_entries(self) -> int:
        """Live INT4 entries over every low store."""
        return sum(store.num_entries() for store in self.low_stores())

    def commit(self) -> None:
        """Apply the scheduled action of every recent token older than ``window``: keep (high store), quantise
        (low store) or release. Never undone."""
        leaving = self.keys.shape[-2] - self.window
        if leaving <= 0:
            return
        actions = self.schedule.actions(self.first_recent, leaving, self.group).to(self.keys.device)  # [B, k]
        positions = torch.arange(self.first_recent, self.first_recent + leaving, device=self.keys.device)
        old_keys, old_values = self.keys[..., :leaving, :], self.values[..., :leaving, :]
        self.high.append({"keys": old_keys, "values": old_values}, positions, actions == Action.H)
        lowered = actions == Action.L
        if bool(lowered.any()):
            stores, groups = self.low_stores(), None
            if self.key_centre is None:
                key_codes, key_scales = quantize_int4(old_keys)
            elif len(stores) == 1:  # centred keys: one centre for every row
                key_codes, key_scales = quantize_int4_centred(old_keys, self.key_centre, self.key_spread)
            else:
                groups = key_groups(positions - self.context_length, self.prompt_length, self.int4_keys)  # [k]
                centre, spread = self.key_centre[:, :, groups], self.key_spread[:, :, groups]  # [B, H_kv, k, D]
                key_codes, key_scales = quantize_int4_centred(old_keys, centre, spread)
            value_codes, value_scales = quantize_int4(old_values)
            fields = {
                "key_codes": key_codes,
                "key_scales": key_scales,
                "value_codes": value_codes,
                "value_scales": value_scales,
            }
            if groups is None:  # row and centred keys: one store, nothing to split
                stores[0].append(fields, positions, lowered)
            else:
                for group in groups.unique().tolist():
                    columns = groups == group
                    chosen = {name: field[..., columns, :] for name, field in fields.items()}
                    stores[group].append(chosen, positions[columns], lowered[:, columns])
        self.keys, self.values = self.keys[..., leaving:, :], self.values[..., leaving:, :]
        self.first_recent += leaving

    def partitions(
        self, attention_mask: torch.Tensor | None, q_len: int, module: torch.nn.Module | None = None
    ) -> list[Partition]:
        """The compacted prefix (with a context), the high store, the low store and the recent region, each store
        with its bool visibility ``[B, q, n]``.

        Args:
            attention_mask: the mask over every slot (prefix slots included), ``None`` = causal.
            module: the attention module being served: ``served_prefix`` checks its model.
        """
        batch, seen = self.keys.shape[0], self.get_seq_length()
        visible = slot_visibility(attention_mask, batch, q_len, seen, self.keys.device)
        if self.int4_keys != "row" and self.key_centre is None:  # a prompt forward: its real slots
            self.prompt_real = visible[:, -1, self.context_length :]
        parts: list[Partition] = []
        if self.context is not None:
            parts.append(PrefixPartition(self.context.served_prefix(module)))
        if self.high.num_entries():
            fields, positions = self.high.view()
            parts.append(DensePartition(fields["keys"], fields["values"], _gather_visibility(visible, positions)))
        for group, store in enumerate(self.low_stores()):
            if not store.num_entries():
                continue
            fields, positions = store.view()
            centre = spread = None
            if self.key_centre is not None:
                centre, spread = self.key_centre[:, :, group : group + 1], self.key_spread[:, :, group : group + 1]
            parts.append(
                Int4Partition(
                    fields["key_codes"],
                    fields["key_scales"],
                    fields["value_codes"],
                    fields["value_scales"],
                    self.keys.shape[-1],
                    self.values.shape[-1],
                    _gather_visibility(visible, positions),
                    centre,
                    spread,
                )
            )
        parts.append(DensePartition(self.keys, self.values, visible[..., self.first_recent :]))
        return parts

    def record_attention(
        self,
        query: torch.Tensor,
        partitions: list[Partition],
        scaling: float,
        softcap: float | None = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        """Add this forward's attention mass per slot to the cache's `AttentionMass` (a no-op without statistics).

        Args:
            query: ``[B, H_q, q, D]``; partitions: what `partitions` returned for this forward.
            module: the attention module (its ``o_proj``), needed when the statistics are value-weighted.

        Raises:
            ValueError: statistics are requested while attention runs on the Triton backend.
        """
        stats = self.statistics
        if stats is None:
            return
        seen, q_len = self.get_seq_length(), query.shape[-2]
        recent = partitions[-1]
        if seen == q_len:  # first forward: the recent region holds every slot
            stats.set_prompt(recent.visible[:, -1])
        rows = stats.counted_rows(seen - q_len, q_len)
        if rows is None:
            return
        from ..attention.backend import BACKEND_ENV, choose_backend

        if choose_backend(query) == "triton":
            raise ValueError(
                "attention statistics (H2O / SnapKV / MiKV / CriticalKV baselines) are computed by the torch reference "
                f"only: set {BACKEND_ENV}=torch, or use a policy without attention statistics"
            )
        counted = [replace(part, visible=part.visible[:, rows]) for part in partitions]
        positions = [self.high.view()[1]] if self.high.num_entries() else []
        positions += [store.view()[1] for store in self.low_stores() if store.num_entries()]
        positions.append(torch.arange(self.first_recent, seen, device=query.device).expand(query.shape[0], -1))
        norms = None
        if stats.value_weighted:
            projections = head_output_projections(module, query.shape[1], recent.values.shape[-1]).to(query.device)
            norms = [projected_value_norms(part, projections) for part in partitions]
        mass, weighted = attention_mass(query[:, :, rows], counted, scaling, softcap, norms)  # one pass, both sums
        weighted = None if weighted is None else _slot_mass(weighted, positions, seen)
        stats.add(self.group, _slot_mass(mass, positions, seen), weighted)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` slots (a negative value removes that many from the end). Tokens already
        quantised or released stay so: only accounting and not-yet-committed tokens are restored.

        Raises:
            ValueError: the crop would cut into the compacted context.
        """
        seen = self.get_seq_length()
        length = seen + max_length if max_length < 0 else min(max_length, seen)
        if length < self.context_length:
            raise ValueError(
                f"cannot crop to {length} tokens: the compacted context of {self.context_length} tokens cannot be cut"
            )
        self.high.crop(length)
        for store in self.low_stores():
            store.crop(length)
        if length >= self.first_recent:
            keep = length - self.first_recent
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        else:
            self.keys, self.values = self.keys[..., :0, :], self.values[..., :0, :]
            self.first_recent = length

    def select_rows(self, indices: torch.Tensor) -> None:
        """Batch row ``i`` becomes old row ``indices[i]``."""
        if not self.is_initialized:
            return
        indices = indices.to(self.keys.device)
        self.keys, self.values = self.keys.index_select(0, indices), self.values.index_select(0, indices)
        self.high.select_rows(indices)
        for store in self.low_stores():
            store.select_rows(indices)
        if self.key_centre is not None:
            self.key_centre = self.key_centre.index_select(0, indices)
            self.key_spread = self.key_spread.index_select(0, indices)
        if self.prompt_real is not None:
            self.prompt_real = self.prompt_real.index_select(0, indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.select_rows(torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(torch.arange(self.keys.shape[0], device=self.keys.device)[indices])

    def reset(self) -> None:
        self.__init__(self.group, self.schedule, self.window, self.statistics, self.context, self.int4_keys)

    def context_nbytes(self) -> int:
        """Bytes of the compacted context's stored tensors (shared with every cache built on it; 0 without one)."""
        tensors = [] if self.context is None else self.context.context_tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    def nbytes(self) -> int:
        """Allocated bytes: the compacted context, recent region, both stores with their scales and slot maps
        (padding included), a centred key layout's centre and spread."""
        held = [] if self.keys is None else [self.keys, self.values]
        held += [t for t in (self.key_centre, self.key_spread) if t is not None]
        recent = sum(t.numel() * t.element_size() for t in held)
        return self.context_nbytes() + recent + self.high.nbytes() + sum(s.nbytes() for s in self.low_stores())

    def full_nbytes(self) -> int:
        """Bytes of the same slots in a ``DynamicLayer`` of the model's dtype (a compacted context counted once, at
        its original length, as `CompactedLayer.full_nbytes` does)."""
        if self.keys is None:
            return 0
        batch, heads, _, head_dim = self.keys.shape
        per_slot = heads * (head_dim + self.values.shape[-1]) * self.keys.element_size()
        return (batch * (self.get_seq_length() - self.context_length) + self.context_length) * per_slot
