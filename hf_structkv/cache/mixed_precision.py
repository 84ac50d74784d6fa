"""`StructuredMixedPrecisionCache`: PASK's cache — each token's K/V kept high precision, packed INT4, or released per
layer group, decided by a frozen `PolicyTable` from the token's structural tag (PASK §3.5, B.2–B.7).

Its global-attention layers are `MixedPrecisionLayer` objects (`mixed_precision_layer`: the layout of the high, low
and recent stores, the commit point, the partitions merged in FP32 statistics, a compacted context's prefix served by
reference); its sliding-window layers keep transformers' own sliding layer, or serve a context's window
(`SharedContextSlidingLayer`, `composed_context`). The cache holds what the layers share: the policy, the
`ActionSchedule` (controllers, ledger, prefill plan), the processor and the optional context.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..attention.attention_mass import AttentionMass
from ..policy.costs import GroupCosts
from ..policy.retention import RetentionPolicy, check_retention_policy
from ..quant.int4_centred import check_int4_keys
from ..structure.tag_source import TagSource
from .action_schedule import ActionSchedule
from .compacted import CompactedCache
from .compacted_layers import ContextLayer
from .composed_context import context_layers
from .layer_types import SLIDING_TYPES, model_layer_types
from .mixed_precision_layer import MixedPrecisionLayer


class StructuredMixedPrecisionCache(Cache):
    """A transformers ``Cache`` for constrained decoding whose global layers keep each token's K/V in BF16 (the
    model's dtype), packed INT4 or nowhere, by layer group, as a frozen `PolicyTable` and its `PolicyController`
    decide from the structural tags of a `StructuralLogitsProcessor`.

    Use the same processor in ``generate``::

        proc = StructuralLogitsProcessor(tokenizer, tools=tools)
        cache = StructuredMixedPrecisionCache(model, policy, processor=proc)
        model.generate(**inputs, logits_processor=[proc], cache=cache)

    The model must run hf_structkv's attention (``hf_structkv.enable(model)``; the constructor does it when given
    a model). Sliding-window layers keep transformers' own sliding layer. One cache serves one ``generate`` call.

    Args:
        model: the model (or its config: then enable the model yourself).
        policy: a `RetentionPolicy` built for this model's layer and head dimensions: a `PolicyTable`, a baseline of
            `hf_structkv.policy.baselines`, ...
        processor: the `TagSource` of the same generation, i.e. its `StructuralLogitsProcessor` (``None``: every
            generated token is unresolved, i.e. fully protected by the policy); it must emit the policy's
            ``tag_view`` and ``position_bins``, else ``ValueError``.
        prefill_plan: optional actions for the prompt tokens, int ``[B, P, groups]`` with the policy's number of
            layer groups (see `ActionSchedule`); with a ``context``, for the ``P`` tokens after it.
        context: optional `CompactedCache` of a context read before every prompt (e.g. a compacted tool catalogue):
            its prefix is served, shared and never copied, before the PASK-managed tokens, which continue at its
            original length (`mixed_precision_layer`'s docstring). Feed ``generate`` with `generation_inputs`
            (placeholders for the context). Not with attention-statistics policies.
        prompt_length: optional, the prompt's length (``input_ids.shape[1]`` of the ``generate`` call, a context's
            placeholders included), needed to prefill the prompt in several forwards (``generate(...,
            prefill_chunk_size=k)``, or ``model(ids[:, :k], cache=c)`` then ``model(ids[:, k:], cache=c)``): no token
            is committed until the whole prompt is cached, so the chunks attend the prompt at full precision, as one
            forward does. Without it, a second forward before the processor's first call is refused. Not with
            attention-statistics policies.
        int4_keys: how the keys of the INT4 (``L``) tokens are stored: ``"row"`` (PASK B.5, per token row) or
            ``"centred"`` (per row after centring each channel by the prompt's mean and range,
            `hf_structkv.quant.int4_centred`: the same bytes per token, two FP16 vectors per row and KV head) or
            ``"centred-g128"`` (centred per group of 128 prompt tokens: two FP16 vectors per group);
            ``None`` (the default): the policy's ``int4_keys`` (what a calibrated table was calibrated or shipped
            with).

    A policy whose `RetentionPolicy.attention_statistics` returns an `AttentionMass` (the attention-based baselines)
    has it filled by the layers during attention (torch reference only), and its controllers plan the prompt at the
    first commit (`RetentionController.plan_prompt`).

    Raises:
        TypeError: ``model`` is not a model or config, ``policy`` not a `RetentionPolicy`, ``processor`` not a
            `TagSource`.
        ValueError: the policy was built for other layer dimensions, the processor emits another tag view, the
            context was compacted for another model or is combined with an attention-statistics policy,
            ``prompt_length`` is not an int past the context covering ``prefill_plan``, or ``int4_keys`` names no
            layout.
    """

    def __init__(
        self,
        model,
        policy: RetentionPolicy,
        processor: TagSource | None = None,
        prefill_plan: torch.Tensor | None = None,
        context: CompactedCache | None = None,
        prompt_length: int | None = None,
        int4_keys: str | None = None,
    ):
        from ..attention.registry import enable

        config = model if isinstance(model, PretrainedConfig) else getattr(model, "config", None)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"model must be a transformers model or its config, got {type(model).__name__}")
        check_retention_policy(policy)
        int4_keys = check_int4_keys(policy.int4_keys if int4_keys is None else int4_keys)
        if processor is not None and not isinstance(processor, TagSource):
            raise TypeError(
                "processor must be a TagSource: the StructuralLogitsProcessor passed to generate (it provides "
                "tag_view, position_bins, prompt_length, num_tagged(seq) and tag_at(seq, index)), got "
                f"{type(processor).__name__}"
            )
        if not isinstance(model, PretrainedConfig):
            enable(model)
        text_config = config.get_text_config()
        self.costs = GroupCosts.from_config(text_config, len(policy.costs.groups))
        if policy.costs != self.costs:
            raise ValueError(
                f"the policy was built for layer groups / head dimensions {policy.costs}, the model has {self.costs}: "
                "use a PolicyTable calibrated for this model (or PolicyTable.all_high(model.config))"
            )
        policy_view = policy.tag_view, tuple(policy.position_bins)
        processor_view = policy_view if processor is None else (processor.tag_view, tuple(processor.position_bins))
        if processor_view != policy_view:
            raise ValueError(
                f"the policy was calibrated on (tag_view, position_bins)={policy_view!r}, the processor emits "
                f"{processor_view!r}: build the processor with "
                "StructuralLogitsProcessor(..., tag_view=policy.tag_view, position_bins=policy.position_bins)"
            )
        layer_types = model_layer_types(text_config)
        contexts = [None] * len(layer_types) if context is None else context_layers(context, config, layer_types)
        self.policy = policy
        self.processor = processor
        self.context = context
        self.statistics: AttentionMass | None = policy.attention_statistics()
        if context is not None and self.statistics is not None:
            raise ValueError(
                "a policy that decides from attention statistics (H2O / SnapKV / MiKV / CriticalKV baselines) cannot "
                "serve a compacted context (its prefix has no slots to score): use a PolicyTable, or no context"
            )
        context_length = 0 if context is None else context.original_length
        self.schedule = ActionSchedule(
            policy, self.costs, processor, prefill_plan, self.statistics, context_length, prompt_length
        )
        layers = []
        for idx, (layer_type, layer_context) in enumerate(zip(layer_types, contexts, strict=True)):
            if layer_type in SLIDING_TYPES:
                sliding = DynamicSlidingWindowLayer(sliding_window=text_config.sliding_window)
                layers.append(sliding if layer_context is None else layer_context)
            else:
                group = self.costs.group_of_layer(idx)
                layers.append(
                    MixedPrecisionLayer(
                        group, self.schedule, policy.window, self.statistics, layer_context, int4_keys=int4_keys
                    )
                )
        super().__init__(layers=layers)

    def mixed_layers(self) -> list[MixedPrecisionLayer]:
        return [layer for layer in self.layers if isinstance(layer, MixedPrecisionLayer)]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: remove that many); restores controllers, ledger and
        pending actions of the removed tokens (the processor rewinds itself on its next call).

        Raises:
            NotImplementedError: the policy records attention statistics (mass already given to earlier slots by
                the removed queries cannot be taken back).
            ValueError: the crop would cut into the compacted context.
        """
        if self.statistics is not None:
            raise NotImplementedError(
                "crop is not supported with attention statistics (H2O / SnapKV / MiKV baselines): the attention mass "
                "of removed queries cannot be taken back; generate without speculative decoding"
            )
        seen = self.get_seq_length()
        length = seen + max_length if max_length < 0 else min(max_length, seen)
        if length < self.schedule.context_length:
            raise ValueError(
                f"cannot crop to {length} tokens: the compacted context of {self.schedule.context_length} tokens "
                "cannot be cut"
            )
        super().crop(max_length)
        self.schedule.crop(length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.schedule.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.schedule.select_rows(torch.arange(self.schedule.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.schedule.select_rows(torch.arange(self.schedule.batch_size)[indices.cpu()])

    def nbytes(self) -> int:
        """Physical bytes of every layer's tensors: stores (padding included), INT4 scales, slot maps, recent
        regions, and the sliding layers' tensors."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, (MixedPrecisionLayer, ContextLayer)):
                total += layer.nbytes()
            elif layer.is_initialized:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total

    def full_nbytes(self) -> int:
        """Bytes of the same tokens in a ``DynamicCache`` of the model's dtype (the mixed layers' share; sliding
        layers hold what they would hold anyway)."""
        sliding = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if not isinstance(layer, (MixedPrecisionLayer, ContextLayer)) and layer.is_initialized
            for t in (layer.keys, layer.values)
        )
        context_sliding = sum(layer.full_nbytes() for layer in self.layers if isinstance(layer, ContextLayer))
        return sliding + context_sliding + sum(layer.full_nbytes() for layer in self.mixed_layers())

    def scheduled_payload(self) -> float:
        """The ledger's scheduled payload of every cached token after the compacted context, in bytes (B.3 cost
        convention: ``m(H) = 16 n_c`` bits, ``m(L) = 4 n_c + 16 k_c``, ``m(R) = 0``), over all sequences."""
        return self.schedule.scheduled_bits(self.get_seq_length()) / 8

    def full_payload(self) -> float:
        """The Full-KV payload of the same tokens (after the compacted context) under the same convention
        (``C_full`` bits per token), in bytes."""
        suffix = self.get_seq_length() - self.schedule.context_length
        return self.schedule.batch_size * suffix * self.costs.full / 8
