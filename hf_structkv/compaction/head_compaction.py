"""Per-KV-head compaction by name: ``compact_head(K, V, Q, t, method=..., storage=...)`` -> `CompactedHead` (positions,
biases, values) or, stored in INT4, `QuantizedHead` (`quantized_refit`).

Every method is one small class behind the `HeadMethod` interface (`head_method.py`), in the module of its family
(``design/ALGORITHMS.md`` §1): `kv_surgeon` (KV-Surgeon and its no-compensation ablation), `score_eviction` (LOO,
H2O, OBCache, KVzip), `attention_matching` (AM-HAK, AM-OMP), `kv_merger` (KVMerger) and `query_free` (StreamingLLM,
key norm, random, Q-Filters). `HEAD_METHODS` maps each method's name to its class; `register_head_method` adds one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..validation import check_int
from .attention_matching import AttentionMatchingHAK, AttentionMatchingOMP
from .head_method import HeadMethod
from .head_statistics import CompactedHead, HeadProblem
from .head_storage import STORAGE_CHOICES, StorageLayout, check_storage
from .kv_merger import KVMerger
from .kv_surgeon import KVSurgeon, KVSurgeonNoCompensation
from .quantized_refit import compact_int4, dtype_head
from .query_free import KeyNorm, QFilters, RandomSelection, StreamingLLMCompaction
from .score_eviction import H2OCompaction, KVzip, LeaveOneOut, OBCache

HEAD_METHODS: dict[str, type[HeadMethod]] = {
    method.name: method
    for method in (
        LeaveOneOut,
        KVSurgeon,
        KVSurgeonNoCompensation,
        RandomSelection,
        StreamingLLMCompaction,
        KeyNorm,
        AttentionMatchingHAK,
        AttentionMatchingOMP,
        H2OCompaction,
        OBCache,
        KVzip,
        KVMerger,
        QFilters,
    )
}


def register_head_method(cls: type[HeadMethod]) -> type[HeadMethod]:
    """Class decorator adding a method to `HEAD_METHODS` under its ``name``."""
    HEAD_METHODS[cls.name] = cls
    return cls


def compact_head(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    budget: int,
    method: str = "kv_surgeon",
    scaling: float | None = None,
    seed: int = 0,
    storage: str = "bf16",
    key_group: int | None = None,
    **hparams: object,
) -> CompactedHead:
    """Compact one KV head to ``min(budget, T)`` entries, stored in the values' dtype or in INT4.

    Args:
        keys: ``[T, D]`` post-RoPE keys of the head.
        values: ``[T, D_v]``.
        queries: ``[N, D]`` post-RoPE calibration queries (for GQA the stacked queries of the group); may be None
            for query-free methods (then ``train_loss`` is None).
        budget: kept entries ``t >= 1``; ``t >= T`` keeps everything (bias 0, values unchanged).
        method: a key of `HEAD_METHODS`.
        scaling: logit scale, default ``1/sqrt(D)``.
        seed: for randomised methods.
        storage: ``"bf16"``: keys and values in the values' dtype; ``"int4"``: packed INT4 codes, keys with FP16
            scales and offsets per channel, values per row, the method's refit redone with the quantized keys and the
            value rounding compensated (`quantized_refit`); where the same method in the values' dtype at the same
            bytes serves the calibration queries better (or a held-back quarter of them, refit without), that head
            is stored instead, marked ``storage_fallback``. (``"auto"``, a choice within a byte budget, is
            `compact_head_to_bytes`'s.)
        key_group: ``"int4"`` only: kept entries per row of key scales and offsets (None: one row per head).
        **hparams: the method's hyperparameters (fields of its class, e.g. ``pool_factor=4`` or ``refit=False``).

    Returns:
        `CompactedHead` with float32 bias and values in ``values.dtype``, on the inputs' device; with
        ``storage="int4"`` a `QuantizedHead` (float32 served keys and values, the stored codes and scales) unless it
        fell back.
    """
    budget = check_int("budget", budget, 1, counts="kept entries")
    if storage == "auto":
        raise ValueError("storage='auto' chooses within a byte budget: call compact_head_to_bytes(..., nbytes)")
    rule, problem = _rule_and_problem(keys, values, queries, method, scaling, storage, key_group, hparams)
    if storage == "int4":
        head = compact_int4(problem, rule, budget, seed, values.dtype, key_group)
    else:
        head = dtype_head(problem, rule, budget, seed, values.dtype)
    return _with_train_loss(head, problem)


def compact_head_to_bytes(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    nbytes: int,
    method: str = "kv_surgeon",
    scaling: float | None = None,
    seed: int = 0,
    storage: str = "auto",
    key_group: int | None = None,
    **hparams: object,
) -> CompactedHead:
    """Compact one KV head to the most entries whose stored bytes (`StorageLayout`: keys, values, FP32 biases, the
    head's row offset) fit in ``nbytes``, at least one (at most ``T``).

    Args (``method``, ``scaling``, ``seed`` and ``hparams`` as `compact_head`'s):
        keys: ``[T, D]`` post-RoPE keys of the head.
        values: ``[T, D_v]``, in the dtype a ``"bf16"`` head is stored in (its element size prices those entries).
        queries: ``[N, D]`` post-RoPE calibration queries (for GQA the stacked queries of the group), or None for a
            query-free method with ``"bf16"`` / ``"int4"``.
        nbytes: the head's byte budget, ``>= 1``.
        storage: ``"bf16"`` (the values' dtype), ``"int4"`` (`compact_head`'s INT4 head and its fallback at the INT4
            head's bytes) or ``"auto"``: the two candidates at this byte budget, the dtype head on the most entries
            ``nbytes`` buys and the INT4 head on the most INT4 entries it buys (with ``key_group``), and the one
            with the lower calibration loss is kept; the INT4 head must also pass the held-back-queries guard
            against the dtype head (`compact_int4` with ``fallback_entries``), else the dtype head is kept, marked
            ``storage_fallback``. Needs calibration queries.

    Returns:
        as `compact_head`: a `CompactedHead` (``indices [t]``, float32 ``bias [t]``, ``values [t, D_v]`` in
        ``values.dtype``) or a `QuantizedHead` (float32 served ``keys [t, D]`` and ``values [t, D_v]`` and the stored
        codes and scales); ``head.nbytes(D)`` is at most ``nbytes`` unless one entry alone costs more.
    """
    nbytes = check_int("nbytes", nbytes, 1, counts="bytes")
    if storage == "auto" and queries is None:
        raise ValueError("storage='auto' chooses by the calibration loss and needs queries; got queries=None")
    rule, problem = _rule_and_problem(keys, values, queries, method, scaling, storage, key_group, hparams)
    dim, value_dim = keys.shape[1], values.shape[1]
    in_dtype_entries = max(1, StorageLayout("bf16", dim, value_dim, values.element_size()).entries_for(nbytes))
    int4_entries = max(1, StorageLayout("int4", dim, value_dim, key_group=key_group).entries_for(nbytes))
    if storage == "bf16":
        head = dtype_head(problem, rule, in_dtype_entries, seed, values.dtype)
    else:
        fallback = {"fallback_entries": in_dtype_entries} if storage == "auto" else {}
        head = compact_int4(problem, rule, int4_entries, seed, values.dtype, key_group, **fallback)
    return _with_train_loss(head, problem)


def _rule_and_problem(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    method: str,
    scaling: float | None,
    storage: str,
    key_group: int | None,
    hparams: dict,
) -> tuple[HeadMethod, HeadProblem]:
    """The method's instance and the head's `HeadProblem`, every argument checked (errors name it)."""
    if method not in HEAD_METHODS:
        raise ValueError(f"method must be one of {sorted(HEAD_METHODS)}, got {method!r}")
    rule = HEAD_METHODS[method](**hparams)
    if queries is None and rule.needs_queries:
        raise ValueError(f"method {method!r} needs calibration queries, got queries=None")
    check_storage(storage, STORAGE_CHOICES)
    if storage == "bf16" and key_group is not None:
        raise ValueError(f"key_group is for storage='int4' or 'auto' only, got key_group={key_group!r} with 'bf16'")
    check_int("key_group", key_group, 1, counts="kept entries per row of key scales", none_ok=True)
    return rule, HeadProblem.build(keys, values, queries, scaling)


def _with_train_loss(head: CompactedHead, problem: HeadProblem) -> CompactedHead:
    return replace(head, train_loss=None if problem.queries is None else problem.relative_loss(head))


def relative_loss(
    head: CompactedHead,
    keys: torch.Tensor,
    queries: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
) -> float:
    """``L(S, w, V̂) / ‖O‖_F²`` (4) of ``head`` on ``queries [N, D]`` (e.g. held out), against the full ``keys [T, D]``
    and ``values [T, D_v]`` the head was compacted from."""
    if not isinstance(head, CompactedHead):
        raise TypeError(f"head must be a CompactedHead, got {type(head).__name__}")
    return HeadProblem.build(keys, values, queries, scaling).relative_loss(head)
