"""Record the post-RoPE queries each global attention layer receives, grouped per KV head.

`capture_queries` runs one forward with a recording attention function, registered with transformers'
``AttentionInterface`` under ``RECORD_NAME`` at call time (never at import). It records ``query`` and delegates to
the attention the model ran before (so an hf_structkv-enabled model keeps serving its `CompactedCache`); the model's
attention implementation is restored afterwards, also when the forward raises. `recording` is the same as a context
manager around any forwards (block replay, attention-distortion measurements).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..validation import is_int

__all__ = ["RECORD_NAME", "Positions", "capture_queries", "recording", "recording_attention"]

RECORD_NAME = "hf_structkv_record"

Positions = slice | torch.Tensor | None


@dataclass
class _Recorder:
    """Where the recording attention puts the queries of the forward in progress; with ``layers`` set, only those
    layers are recorded and the forward stops once the last of them is."""

    delegate: Callable
    positions: slice | torch.Tensor
    layers: frozenset[int] | None = None
    queries: dict[int, torch.Tensor] = field(default_factory=dict)


class _CaptureComplete(Exception):
    """Raised by the recording attention when every requested layer is recorded: the rest of the forward is not
    needed (caught by `capture_queries`)."""


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("hf_structkv_query_recorder", default=None)


def _group_by_kv_head(query: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``[H_q, n, D]`` -> ``[H_kv, g * n, D]``: KV head ``h`` stacks query heads ``h*g .. (h+1)*g - 1``, head-major."""
    n_q_heads, n, dim = query.shape
    return query.reshape(n_kv_heads, (n_q_heads // n_kv_heads) * n, dim)


def recording_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention registered as ``RECORD_NAME``: records the query of a global layer, then runs the delegate; once
    the recorder's ``layers`` are all recorded it raises `_CaptureComplete` after the delegate (the cache layer just
    updated has then been served, so a compacted cache can be continued by a next forward).

    Args:
        query: ``[1, H_q, q, D]``, post-RoPE (and post q-norm where the model has one); key / value:
            ``[1, H_kv, n, D]``. Layers with a ``sliding_window`` are not recorded.

    Returns:
        Whatever the delegate (the model's previous attention function) returns.
    """
    recorder = _ACTIVE.get()
    if recorder is None:
        raise RuntimeError(f"{RECORD_NAME!r} attention runs only inside hf_structkv's capture_queries")
    wanted = recorder.layers is None or module.layer_idx in recorder.layers
    if kwargs.get("sliding_window") is None and wanted:
        if query.shape[0] != 1:
            raise ValueError(f"capture_queries records a single sequence, got a batch of {query.shape[0]}")
        selected = query[0][:, recorder.positions].detach()
        recorder.queries[module.layer_idx] = _group_by_kv_head(selected, key.shape[1])
    output = recorder.delegate(module, query, key, value, attention_mask, **kwargs)
    if recorder.layers is not None and recorder.layers.issubset(recorder.queries):
        raise _CaptureComplete  # after the delegate, so the cache layer it updated was also served
    return output


def _register_recording(previous: str) -> Callable:
    """Register ``RECORD_NAME`` with ``previous``'s mask function; returns ``previous``'s attention function."""
    if previous not in ALL_ATTENTION_FUNCTIONS or previous not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"cannot record queries under attention implementation {previous!r}: it needs both an attention and a "
            "mask function registered with transformers (e.g. 'sdpa' or hf_structkv's); switch the model first"
        )
    AttentionInterface.register(RECORD_NAME, recording_attention)
    AttentionMaskInterface.register(RECORD_NAME, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return ALL_ATTENTION_FUNCTIONS[previous]


def _check_positions(positions: Positions) -> slice | torch.Tensor:
    """``None`` -> every position; a tensor must be 1-D integer indices into the new tokens."""
    if positions is None:
        return slice(None)
    if isinstance(positions, torch.Tensor) and (positions.dim() != 1 or positions.is_floating_point()):
        raise ValueError(f"positions must be a 1-D integer tensor, got shape {tuple(positions.shape)}")
    if not isinstance(positions, (slice, torch.Tensor)):
        raise TypeError(f"positions must be a slice, a 1-D integer tensor or None, got {type(positions).__name__}")
    return positions


def _check_layers(layers) -> frozenset[int] | None:
    """``None`` (every global layer) or a non-empty collection of layer indices -> a frozenset."""
    if layers is None:
        return None
    try:
        chosen = frozenset(layers)
    except TypeError:
        raise TypeError(f"layers must be a collection of layer indices or None, got {type(layers).__name__}") from None
    if not chosen or any(not is_int(i) or i < 0 for i in chosen):
        raise ValueError(f"layers must be non-empty layer indices >= 0, got {sorted(chosen, key=str)!r}")
    return chosen


def capture_queries(
    model: PreTrainedModel, input_ids: torch.Tensor, positions: Positions = None, cache=None, layers=None
) -> dict[int, torch.Tensor]:
    """Run ``model`` once on ``input_ids [1, L]`` and return the queries of every global attention layer.

    Args:
        positions: which of the ``L`` new tokens to keep (a slice or 1-D indices); ``None`` keeps all.
        cache: a prefilled cache to continue (updated in place), e.g. from `prefill_context` or a `CompactedCache`.
        layers: record only these global layers (indices) and stop the forward as soon as the last of them is
            recorded (on-policy calibration needs one layer per pass). The layers after it then never run: a given
            ``cache`` holds the new tokens only up to that layer, so pass a copy (`context_copy`). ``None``: every
            global layer, the whole forward.

    Returns:
        ``{layer_idx: [H_kv, g * P, D]}`` for each non-sliding layer (of ``layers``), ``g = H_q / H_kv`` and ``P``
        selected positions: the queries exactly as the attention function receives them (post-RoPE, post
        q/k-norm), the ``g`` query heads of a KV head stacked head-major (rows ``j*P .. (j+1)*P - 1`` are query
        head ``h*g + j``).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, L], got shape {tuple(input_ids.shape)}")
    with recording(model, positions, layers) as recorder:
        model(input_ids.to(model.device), cache=cache, use_cache=cache is not None, logits_to_keep=1)
    return recorder.queries


@contextlib.contextmanager
def recording(model: PreTrainedModel, positions: Positions = None, layers=None) -> Iterator[_Recorder]:
    """Run the body with ``model``'s attention recording queries (`capture_queries` runs one forward in it).

    Yields the recorder, whose ``queries`` (``{layer_idx: [H_kv, g * P, D]}``) fill as attention runs; with
    ``layers``, the forward in the body ends quietly once the last of them is recorded. On exit the attention
    implementation is restored (also when the body raises), grad mode too.

    Raises:
        ValueError: some of ``layers`` were not recorded (not global attention layers, or never run).
    """
    chosen = _check_layers(layers)
    previous = model.config._attn_implementation
    recorder = _Recorder(delegate=_register_recording(previous), positions=_check_positions(positions), layers=chosen)
    token = _ACTIVE.set(recorder)
    try:
        model.set_attn_implementation(RECORD_NAME)
        with torch.no_grad():
            yield recorder
    except _CaptureComplete:
        pass
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)
    if chosen is not None and not chosen.issubset(recorder.queries):
        missing = sorted(chosen - recorder.queries.keys())
        raise ValueError(f"layers {missing} are not global attention layers of this model; nothing was recorded there")
