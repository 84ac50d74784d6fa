"""`TeacherForcedCache`: the retention schedule of a `StructuredMixedPrecisionCache` replayed over a known token
sequence in one forward (teacher forcing), for the likelihood of a reference reply under a policy.

In ``generate`` over a `StructuredMixedPrecisionCache`, forward ``k >= 1`` processes the token at position
``p = P + k - 1`` (``P`` prompt tokens) and, before its attention, commits every token at a position ``j < p - window``
(`MixedPrecisionLayer.commit`): from then on ``j`` is served at full precision (action ``H``), dequantised from
per-row INT4 (``L``, `quantize_int4` of its keys and values) or not at all (``R``). The prompt forward (positions
``< P``) commits nothing. When the tokens are known in advance, one forward over positions ``P .. P + T - 2`` can
give each query row the cache exactly as that step of ``generate`` saw it: row ``p`` sees key ``j`` at full precision
while ``j >= p - window`` or its action is ``H``, dequantised when it is committed with ``L``, and not when committed
with ``R``. Quantisation is per token row (centred keys: by the prompt's centres and spreads, fixed before the first
commit), so a committed key's served value does not depend on the other generated tokens, and
the replay equals step-by-step decoding with the same cache and schedule up to floating-point summation order
(``tests/test_teacher_forced.py``, in float64). In float32 that rounding noise (a token's K/V computed in a batch
forward here, in a one-token forward in ``generate``) can move a committed value across an INT4 rounding boundary:
the replay then serves that token one code step apart, a difference far above the float noise of the other tokens.
Actions come from the same `ActionSchedule` the mixed-precision cache uses (a
`TagSource` over the known tags; prefill plan, sinks and stop tokens included); attention is the same registered
function and the same `mixed_precision_attention` over two partitions with per-row visibility.

The prompt forward is the same under every schedule, so `with_schedule` starts a new replay from a cache that holds
the prompt, sharing its tensors (never copied, never written in place).

Policies that decide from attention statistics (the H2O / SnapKV / MiKV baselines) are refused: their decisions
depend on the attention of the step in which they are taken, which one forward over all steps does not reproduce.
"""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from ..attention.kwargs import MIXED_KWARG
from ..attention.masks import slot_visibility
from ..attention.mixed_reference import DensePartition, Int4Partition
from ..policy.costs import Action, GroupCosts
from ..policy.retention import RetentionPolicy, check_retention_policy
from ..quant.int4 import quantize_int4
from ..quant.int4_centred import check_int4_keys, key_centres, key_groups, quantize_int4_centred
from ..structure.tag_source import TagSource
from .action_schedule import ActionSchedule
from .layer_types import SLIDING_TYPES, model_layer_types

__all__ = ["TeacherForcedCache", "TeacherForcedLayer"]


class TeacherForcedLayer(CacheLayerMixin):
    """A global-attention layer of a `TeacherForcedCache`: every token's K/V at full precision ``[B, H_kv, n, D]``;
    attention reads two partitions built per forward (`partitions`).

    Args:
        group: the layer group whose actions this layer applies.
        schedule: the cache's `ActionSchedule`.
        window: the policy's recent window.
        first_commit: the first position whose forward commits (the prompt length ``P``).
        int4_keys: ``"row"``, ``"centred"`` or ``"centred-g128"``, as `MixedPrecisionLayer`: centred keys take the
            centres and spreads of the prompt's real keys (the prompt slots the first committing row sees), as
            generation fits them, one INT4 partition per centre.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, group: int, schedule: ActionSchedule, window: int, first_commit: int, int4_keys: str = "row"):
        super().__init__()
        self.group, self.schedule, self.window, self.first_commit = group, schedule, window, first_commit
        self.int4_keys = check_int4_keys(int4_keys)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True
        self.schedule.begin(key_states.shape[0], key_states.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_):
        """Append ``[B, H_kv, q, D]`` states; put this layer into ``kwargs["mixed_precision_layer"]``."""
        if kwargs is None:
            raise RuntimeError("this model's attention calls cache.update(...) without its attention kwargs")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        kwargs[MIXED_KWARG] = self
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def committed(self, q_len: int) -> torch.Tensor:
        """Bool ``[q, n]``: key ``j`` is committed when query row ``i`` (position ``n - q + i``) runs."""
        seen = self.get_seq_length()
        rows = torch.arange(seen - q_len, seen, device=self.keys.device).unsqueeze(-1)
        slots = torch.arange(seen, device=self.keys.device)
        return (rows >= self.first_commit) & (slots < rows - self.window)

    def partitions(
        self, attention_mask: torch.Tensor | None, q_len: int, module: torch.nn.Module | None = None
    ) -> list[DensePartition | Int4Partition]:
        """The full-precision partition (every token, visible where uncommitted or kept ``H``) and, when some token
        is lowered, the INT4 partitions of the lowered tokens (visible where committed; one per centre of a
        ``centred-g128`` layout, as the cache's low stores); visibility ``[B, q, n]``.
        (``module``, the attention module, is what the registered function passes every mixed-precision layer; a
        replay holds no compacted prefix that would need it.)"""
        batch, seen = self.keys.shape[0], self.get_seq_length()
        visible = slot_visibility(attention_mask, batch, q_len, seen, self.keys.device)
        actions = self.schedule.actions(0, seen, self.group).to(self.keys.device)  # [B, n]
        committed = self.committed(q_len).unsqueeze(0)  # [1, q, n]
        kept = ~committed | (actions == Action.H).unsqueeze(1)
        parts: list[DensePartition | Int4Partition] = [DensePartition(self.keys, self.values, visible & kept)]
        lowered = (actions == Action.L).any(0).nonzero().squeeze(-1)  # columns lowered in some row
        if lowered.numel() and bool(committed.any()):  # the prompt forward commits nothing
            low_visible = (visible & committed & (actions == Action.L).unsqueeze(1))[..., lowered]
            value_codes, value_scales = quantize_int4(self.values[..., lowered, :])
            dims = self.keys.shape[-1], self.values.shape[-1]
            if self.int4_keys == "row":
                key_codes, key_scales = quantize_int4(self.keys[..., lowered, :])
                parts.append(Int4Partition(key_codes, key_scales, value_codes, value_scales, *dims, low_visible))
                return parts
            prompt, first_row = self.first_commit, max(self.first_commit - (seen - q_len), 0)
            real = visible[:, first_row, :prompt]  # [B, P]: the real prompt slots a row past the prompt sees
            centres, spreads = key_centres(self.keys[..., :prompt, :], real, self.int4_keys)  # [B, H_kv, G + 1, D]
            groups = key_groups(lowered, prompt, self.int4_keys)
            for group in groups.unique().tolist():
                part = groups == group
                centre, spread = centres[:, :, group : group + 1], spreads[:, :, group : group + 1]
                key_codes, key_scales = quantize_int4_centred(self.keys[..., lowered[part], :], centre, spread)
                codes = (key_codes, key_scales, value_codes[..., part, :], value_scales[..., part, :])
                parts.append(Int4Partition(*codes, *dims, low_visible[..., part], centre, spread))
        return parts

    def record_attention(self, *args, **kwargs) -> None:
        """No attention statistics are recorded in a replay (the cache refuses policies that need them)."""

    def reset(self) -> None:
        self.__init__(self.group, self.schedule, self.window, self.first_commit, self.int4_keys)


class TeacherForcedCache(Cache):
    """A transformers ``Cache`` that replays a mixed-precision cache's schedule over known tokens (module docstring).

    Feed the prompt first (one forward), then the known continuation in one forward; the logits of each row are those
    of the corresponding ``generate`` step under ``policy`` and ``prefill_plan``.

    Args:
        model: the model (switched to hf_structkv's attention) or its config.
        policy: a `RetentionPolicy` without attention statistics (a `PolicyTable`, an intervention).
        tags: the `TagSource` of the known continuation (its tags decide the generated tokens' actions).
        prefill_plan: optional int ``[B, P, groups]`` prompt actions (`ActionSchedule`).
        int4_keys: ``"row"``, ``"centred"`` or ``"centred-g128"``: the INT4 key layout of the cache being replayed
            (``None``: ``policy``'s, as that cache takes it; `with_schedule` keeps this one).

    Raises:
        TypeError: ``model``, ``policy`` or ``tags`` of the wrong type.
        ValueError: a policy with attention statistics, one built for other layer dimensions, or an unknown
            ``int4_keys``.
    """

    def __init__(
        self,
        model,
        policy: RetentionPolicy,
        tags: TagSource,
        prefill_plan: torch.Tensor | None = None,
        int4_keys: str | None = None,
    ):
        from ..attention.registry import enable

        config = model if isinstance(model, PretrainedConfig) else getattr(model, "config", None)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"model must be a transformers model or its config, got {type(model).__name__}")
        if not isinstance(tags, TagSource):
            raise TypeError(f"tags must be a TagSource (prompt_length, num_tagged, tag_at), got {type(tags).__name__}")
        if tags.prompt_length is None:
            raise ValueError("tags.prompt_length must be known: the replay commits from the first generated position")
        if not isinstance(model, PretrainedConfig):
            enable(model)
        self.text_config = config.get_text_config()
        self.tags = tags
        self.schedule = self._schedule(policy, prefill_plan)  # checks the policy
        int4_keys = check_int4_keys(policy.int4_keys if int4_keys is None else int4_keys)
        layers = []
        for idx, layer_type in enumerate(model_layer_types(self.text_config)):
            if layer_type in SLIDING_TYPES:
                layers.append(DynamicSlidingWindowLayer(sliding_window=self.text_config.sliding_window))
            else:
                group = self.schedule.costs.group_of_layer(idx)
                layers.append(TeacherForcedLayer(group, self.schedule, policy.window, tags.prompt_length, int4_keys))
        super().__init__(layers=layers)

    def _schedule(self, policy: RetentionPolicy, prefill_plan: torch.Tensor | None) -> ActionSchedule:
        check_retention_policy(policy)
        costs = GroupCosts.from_config(self.text_config, len(policy.costs.groups))
        if policy.costs != costs:
            raise ValueError(f"the policy was built for layer groups / head dimensions {policy.costs}, not {costs}")
        if policy.attention_statistics() is not None:
            raise ValueError(
                "a policy that decides from attention statistics cannot be replayed in one forward: generate with it"
            )
        return ActionSchedule(policy, costs, self.tags, prefill_plan)

    def with_schedule(
        self, policy: RetentionPolicy, prefill_plan: torch.Tensor | None = None, keep: int | None = None
    ) -> TeacherForcedCache:
        """A new replay under ``policy`` / ``prefill_plan`` from this cache's first ``keep`` tokens (default: the
        prompt), sharing their tensors (views, never copied, never written in place); this cache is not changed.

        Tokens past the prompt hold the K/V this cache's schedule produced. They are the new schedule's too when it
        changes no forward before the one of token ``keep`` (forward ``k`` reads the token at position
        ``P + k − 1``, so ``keep = P + k0 − 1`` for a schedule whose first changed forward is ``k0``): the caller
        states it, as `CaseReplay` does from `first_changed_forward`.

        Raises:
            ValueError: ``keep`` outside ``[P, tokens held]``, or past the prompt with sliding-window layers (they
                hold only their last window and cannot be cut back).
        """
        prompt, held = self.tags.prompt_length, self.get_seq_length()
        keep = prompt if keep is None else keep
        if held and not prompt <= keep <= held:
            raise ValueError(f"keep must be in [{prompt}, {held}] (the prompt .. the tokens held), got {keep}")
        if keep > prompt and not self.resumes_past_prompt:
            raise ValueError("a cache with sliding-window layers restarts from the prompt only: keep the default")
        fresh = copy.copy(self)
        fresh.schedule = self._schedule(policy, prefill_plan)
        fresh.layers = []
        for layer in self.layers:
            clone = copy.copy(layer)
            if isinstance(layer, TeacherForcedLayer):
                clone.schedule, clone.window = fresh.schedule, policy.window
                if held:
                    clone.keys, clone.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            elif held > prompt:
                raise ValueError("with_schedule starts from the prompt: this cache already holds generated tokens")
            fresh.layers.append(clone)
        if held:
            fresh.schedule.begin(self.layers[0].keys.shape[0], prompt)
        return fresh

    def nbytes(self) -> int:
        """Bytes of the K/V tensors this cache holds (views of another cache's counted as their own)."""
        held = [layer.keys for layer in self.layers] + [layer.values for layer in self.layers]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    @property
    def resumes_past_prompt(self) -> bool:
        """Whether `with_schedule` can keep tokens past the prompt (no sliding-window layer)."""
        return all(isinstance(layer, TeacherForcedLayer) for layer in self.layers)
