"""Decode attention kernels and end-to-end decode time per token (TPOT) on a GPU, side by side in one run.

Part 1, kernels (one decode query per sequence, random data): time and effective bandwidth against history length
and batch, for

* ``sdpa``: BF16 ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``; the flash backend where it
  accepts the inputs, else torch's default choice: the row records which) on a full cache ``[B, H_kv, T, D]``;
* ``compacted``: ``hf_structkv.attention.kernels.biased_attention.triton_compacted_attention`` on a compacted cache
  keeping ``T / 10`` and ``T / 50`` entries per KV head on average (ragged: head ``h`` of ``H`` keeps
  ``T / ratio * (0.5 + h / (H-1))``, from half to 1.5x the mean), FP32 biases, shared by the batch as in
  ``CompactedCache``, plus ``APPENDED_TOKENS`` appended tokens per sequence (the question and the answer so far,
  the current token last); each ratio with the prefix stored in BF16 (variant ``10x``) and in INT4 (``10x int4``,
  `COMPACTED_STORAGES`): every head as ``compact(storage="int4")`` stores it, packed key codes with FP16 per-channel
  scales and offsets (one row per head, ``INT4_KEY_GROUP``) and packed value codes with FP16 row scales, built
  through ``CompactedCache.from_selection`` and served as its layer serves it (`int4_prefix`); the kernel reads the
  codes natively. Rows record ``storage``;
* ``mixed``: ``hf_structkv.attention.kernels.mixed_attention.triton_mixed_precision_attention`` on the three
  partitions of a ``StructuredMixedPrecisionCache`` layer at payload ratio B = 0.33 and 0.5: the newest ``window``
  tokens BF16 (recent region), of the older ones ``RELEASED_FRACTION`` released and the rest split between BF16 and
  packed INT4 (FP16 row scales) so that the payload (B.3 costs, ``hf_structkv.policy.costs``) is B x the Full-KV
  payload;
  every entry visible.

for two shapes: the embedded model's (14 query heads, 2 KV heads, head_dim 64) and 32 / 8 / 128.

Bytes-read model: the fewest bytes a decode step must move through device memory, each tensor the kernel reads
counted once and the output written once: query, keys, values (BF16, packed INT4 codes, FP16 scales and key
offsets), FP32 biases and head offsets, the mixed kernel's bool visibility rows, and the output. The compacted
prefix is shared by the batch, so it counts once whatever the batch (the kernel reads it once per sequence; repeats
can come from L2). Split-KV statistics (written and re-read when a head's keys are split) are not counted. Effective
bandwidth = bytes read / median time; % of peak is against the H200's 4.8 TB/s HBM datasheet figure (the run also
measures a device-to-device copy, bytes read + written, as the reachable ceiling). Timing: CUDA events around each
call, an L2-sized buffer overwritten before each, ``--warmup`` untimed calls, median of ``--reps``. Each call
includes its Python launch overhead, so small cases are launch-bound. Before timing, each kernel's output on the
smallest history / batch is compared with its torch reference (relative L2 error, FP32 reference).

Part 2, end to end: TPOT of the embedded model's architecture (Qwen2.5-Coder-0.5B-Instruct: 24 layers, 14 / 2
heads, head_dim 64) in BF16 on CUDA over a 32K-token context (32,704 random token ids: 32K minus room for the
decoded tokens inside the model's 32,768 positions), greedy decoding from one token, median over timed steps (each
to a device synchronise) after warm-up steps, with

* ``DynamicCache`` and transformers' stock ``sdpa`` attention (the baseline);
* ``CompactedCache`` at 10x built with ``CompactedCache.from_selection`` from **random** kept positions per KV head
  (ragged lengths as above, biases 0) of the prefilled cache: serving cost does not depend on which entries are
  kept, and calibrated compaction (KV-Surgeon) of 32K tokens takes far longer than the benchmark;
* ``StructuredMixedPrecisionCache`` with the all-high reference ``PolicyTable`` (generated tokens stay BF16: they
  are under 0.2% of the cache here) and a ``prefill_plan`` giving the prompt tokens the same R / L / H mix as the
  kernel benchmark at B = 0.5 (each layer group its own random permutation); the measured payload ratio is
  recorded.

The three share one model (kernels: ``HF_STRUCTKV_ATTENTION_BACKEND=triton``). A batch above 1 repeats the
prefilled rows (the compacted context is shared by the batch). ``--weights embedded`` loads the real weights
(``load_default_model(dtype=torch.bfloat16, device=...)``); ``--weights random`` builds the same architecture with
random weights (``EMBEDDED_MODEL_CONFIG``), which decodes at the same speed and is what a device machine can run:
the weights (a 491 MB GGUF) do not fit in what travels to it.

Device command (an H200 lent by the ``device`` tool; about 5 minutes). Here, once, in the repository root, fetch
the wheels the machine lacks (its transformers is older than the tested 5.24; lm-format-enforcer and pydantic are
missing)::

    mkdir -p .git/info && echo /.whl/ >> .git/info/exclude && python3 -m pip download --no-deps \\
      --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \\
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 \\
      lm-format-enforcer==0.11.3 interegular==0.3.3 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \\
      typing-inspection==0.4.5 typing-extensions==4.16.0

then ``run`` with ``carry=[".whl"]``, ``timeout_s=480``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; nvidia-smi; set -o pipefail; \\
      PYTHONUNBUFFERED=1 python3 benchmarks/attention_kernels.py --weights random \\
      --out $OUT/attention_kernels.json 2>&1 | tee $OUT/attention_kernels.log

CPU smoke run (the same code paths, tiny sizes, kernels under the Triton interpreter; what CI runs)::

    TRITON_INTERPRET=1 python benchmarks/attention_kernels.py --smoke --out /tmp/attention_kernels_smoke.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.attention.backend import BACKEND_ENV
from hf_structkv.attention.compacted_inputs import AppendedTokens, CompactedPrefix
from hf_structkv.attention.compacted_reference import compacted_attention
from hf_structkv.attention.kernels.biased_attention import triton_compacted_attention
from hf_structkv.attention.kernels.mixed_attention import triton_mixed_precision_attention
from hf_structkv.attention.kernels.runtime import interpreter_ready
from hf_structkv.attention.mixed_reference import DensePartition, Int4Partition, mixed_precision_attention
from hf_structkv.cache.compacted_layers import Int4Head
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.models import load_default_model
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.table import DEFAULT_WINDOW, PolicyTable
from hf_structkv.quant.int4 import quantize_int4
from hf_structkv.quant.int4_channels import quantize_int4_channels

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402

H200_PEAK_HBM_BYTES_PER_S = 4.8e12
"""NVIDIA's datasheet HBM3e bandwidth of the H200 (141 GB)."""
L2_FLUSH_BYTES = 256 * 1024**2
"""Overwritten before each timed call so that no input is served from the H200's 60 MB L2."""
COMPACTION_RATIOS = (10, 50)
COMPACTED_STORAGES = ("bf16", "int4")
"""How the compacted prefix of every ``COMPACTION_RATIOS`` case is stored (`int4_prefix` for ``"int4"``)."""
INT4_KEY_GROUP = None
"""Kept entries per row of INT4 key scales and offsets: None, one row per head (the package default)."""
PAYLOAD_RATIOS = (0.33, 0.5)
RELEASED_FRACTION = 0.2
"""Share of the tokens older than the recent window that the mixed cache releases (the rest are BF16 or INT4)."""
APPENDED_TOKENS = 32
"""Tokens appended after a compacted context per sequence in the kernel benchmark (question + answer so far)."""
E2E_COMPACTION_RATIO = 10
E2E_PAYLOAD_RATIO = 0.5
REFERENCE_TOLERANCE = 2e-2
"""Largest relative L2 error of a BF16 kernel against its FP32 torch reference that passes the check."""

EMBEDDED_MODEL_CONFIG = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
)
"""The architecture of the embedded Qwen2.5-Coder-0.5B-Instruct (tests check it against the loaded model)."""


@dataclass(frozen=True)
class AttentionShape:
    """Query heads, KV heads and head dim of one attention layer (GQA group ``q_heads / kv_heads``)."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


SHAPES = (AttentionShape("14q/2kv/64", 14, 2, 64), AttentionShape("32q/8kv/128", 32, 8, 128))


@dataclass(frozen=True)
class Settings:
    """Sizes of one run.

    Attributes:
        lengths / batches: the kernel grid (history tokens x sequences, for every shape in ``SHAPES``).
        window: the mixed cache's recent window (BF16 newest tokens), in the kernel grid and end to end.
        warmup / reps: untimed and timed calls per kernel case (and for the copy bandwidth of ``copy_bytes``).
        model_overrides: replace fields of ``EMBEDDED_MODEL_CONFIG`` (the smoke run's smaller model).
        e2e_context / e2e_batches / e2e_warmup_steps / e2e_steps: the end-to-end decode.
    """

    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    window: int
    warmup: int
    reps: int
    copy_bytes: int
    model_overrides: dict
    e2e_context: int
    e2e_batches: tuple[int, ...]
    e2e_warmup_steps: int
    e2e_steps: int


FULL = Settings(
    lengths=(4096, 8192, 16384, 32768, 65536, 131072),
    batches=(1, 4, 16, 32),
    window=DEFAULT_WINDOW,
    warmup=3,
    reps=20,
    copy_bytes=4 * 1024**3,
    model_overrides={},
    e2e_context=32768 - 64,
    e2e_batches=(1, 16),
    e2e_warmup_steps=4,
    e2e_steps=32,
)
SMOKE = Settings(
    lengths=(160,),
    batches=(2,),
    window=8,
    warmup=1,
    reps=1,
    copy_bytes=1024**2,
    model_overrides=dict(num_hidden_layers=3, intermediate_size=128, vocab_size=512),
    e2e_context=96,
    e2e_batches=(2,),
    e2e_warmup_steps=1,
    e2e_steps=2,
)


# --------------------------------------------------------------------------------------------- measuring


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median time of one ``fn()`` call over ``reps`` calls after ``warmup`` untimed ones.

    On CUDA: events around each call, with an ``L2_FLUSH_BYTES`` buffer overwritten before it; elsewhere the host
    clock (CPU work is synchronous).
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def copy_bytes_per_s(device: torch.device, nbytes: int, settings: Settings) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second) of an ``nbytes`` buffer."""
    source = torch.randint(0, 127, (nbytes,), dtype=torch.int8, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, settings.warmup, settings.reps)
    return 2 * nbytes / seconds


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in FP32 (NaN if ``out`` holds a NaN)."""
    out, ref = out.float(), ref.float()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


# --------------------------------------------------------------------------------------------- cache contents


def ragged_head_lengths(mean: float, kv_heads: int) -> list[int]:
    """Kept entries per KV head: from ``0.5 * mean`` (head 0) to ``1.5 * mean`` (last head) in equal steps, at
    least 1 each; one head keeps ``mean``."""
    if kv_heads < 1 or mean <= 0:
        raise ValueError(f"kv_heads must be >= 1 and mean > 0, got kv_heads={kv_heads}, mean={mean}")
    if kv_heads == 1:
        return [max(1, round(mean))]
    return [max(1, round(mean * (0.5 + h / (kv_heads - 1)))) for h in range(kv_heads)]


@dataclass(frozen=True)
class EntryCounts:
    """Where a mixed-precision layer holds the ``history`` tokens of one sequence."""

    high: int
    low: int
    recent: int
    released: int

    def payload_ratio(self, costs: GroupCosts) -> float:
        """Scheduled payload over the Full-KV payload of the same tokens (B.3 costs of layer group 0)."""
        full = costs.cost(Action.H, 0)
        kept = (self.high + self.recent) * full + self.low * costs.cost(Action.L, 0)
        return kept / ((self.high + self.low + self.recent + self.released) * full)


def mixed_entry_counts(history: int, payload_ratio: float, window: int, head_dim: int) -> EntryCounts:
    """Split ``history`` tokens into recent (the newest ``window``, BF16), released (``RELEASED_FRACTION`` of the
    older ones), BF16 and INT4 so that the payload ratio (B.3) is ``payload_ratio`` to within one token's cost.

    Raises:
        ValueError: no such split exists (``payload_ratio`` too low or too high for this release share and window).
    """
    costs = GroupCosts.from_dims([1], [head_dim])
    low_cost = costs.cost(Action.L, 0) / costs.cost(Action.H, 0)
    recent = min(window, history)
    older = history - recent
    released = round(RELEASED_FRACTION * older)
    kept = older - released
    # recent + high + low_cost * (kept - high) = payload_ratio * history
    high = round((payload_ratio * history - recent - low_cost * kept) / (1 - low_cost))
    if not 0 <= high <= kept:
        lowest = (recent + low_cost * kept) / history
        highest = (recent + kept) / history
        raise ValueError(
            f"payload_ratio {payload_ratio} is outside [{lowest:.3f}, {highest:.3f}], the ratios reachable over "
            f"{history} tokens with window {window} and {RELEASED_FRACTION:.0%} of the older tokens released"
        )
    return EntryCounts(high=high, low=kept - high, recent=recent, released=released)


def prefill_plan(counts: EntryCounts, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Actions ``[batch, history, 3]`` for the prompt: per layer group a random permutation of ``counts`` over the
    older tokens (the newest ``counts.recent`` get ``H``: they leave the window as BF16)."""
    older = torch.tensor(
        [int(Action.H)] * counts.high + [int(Action.L)] * counts.low + [int(Action.R)] * counts.released
    )
    recent = torch.full((counts.recent,), int(Action.H))
    groups = [torch.cat([older[torch.randperm(older.numel(), generator=generator)], recent]) for _ in range(3)]
    return torch.stack(groups, dim=-1).unsqueeze(0).expand(batch, -1, -1).contiguous()


# --------------------------------------------------------------------------------------------- kernel cases


@dataclass
class KernelCase:
    """One decode attention call ready to time: ``run()`` and, for our kernels, the torch ``reference()``."""

    kernel: str
    variant: str
    run: Callable[[], torch.Tensor]
    reference: Callable[[], torch.Tensor] | None
    bytes_read: int
    details: dict


def sdpa_case(shape: AttentionShape, batch: int, history: int, device: torch.device) -> KernelCase:
    """BF16 SDPA over a full cache; the flash backend where it accepts the call, torch's choice otherwise."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    query = torch.randn(batch, shape.q_heads, 1, shape.head_dim, **bf16)
    keys = torch.randn(batch, shape.kv_heads, history, shape.head_dim, **bf16)
    values = torch.randn_like(keys)

    def default() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return default()

    try:
        flash()
        run, backend = flash, "flash"
    except RuntimeError:
        run, backend = default, "default"
    return KernelCase(
        "sdpa",
        f"full bf16 ({backend})",
        run,
        None,
        tensor_bytes(query, keys, values) + tensor_bytes(query),  # the output has the query's size
        {"entries_per_head": history},
    )


def int4_prefix(prefix: CompactedPrefix, key_group: int | None = INT4_KEY_GROUP) -> CompactedPrefix:
    """``prefix`` with every KV head stored in INT4 as ``compact(storage="int4")`` stores one: keys quantised per
    channel (`quantize_int4_channels`, a row of FP16 scales and offsets per ``key_group`` entries), values per row
    (`quantize_int4`), the biases kept; built by ``CompactedCache.from_selection(..., int4=...)`` from a one-layer
    context cache holding head ``h``'s entries at positions ``0 .. L_h - 1``, and returned as that layer serves it (a
    `QuantizedPrefix`: the codes and scales, no rows in ``keys`` / ``values``)."""
    heads = [prefix.head(h) for h in range(prefix.num_kv_heads)]  # (keys [L_h, D], values [L_h, D_v], bias [L_h])
    int4 = [Int4Head(*quantize_int4_channels(keys, key_group), *quantize_int4(values)) for keys, values, _ in heads]
    longest = max(keys.shape[0] for keys, _, _ in heads)
    context_keys = prefix.keys.new_zeros(1, len(heads), longest, prefix.keys.shape[-1])
    context_values = prefix.values.new_zeros(1, len(heads), longest, prefix.values.shape[-1])
    for h, (keys, values, _) in enumerate(heads):
        context_keys[0, h, : keys.shape[0]] = keys
        context_values[0, h, : values.shape[0]] = values
    source = DynamicCache()
    source.update(context_keys, context_values, 0)
    cache = CompactedCache.from_selection(
        source,
        [[torch.arange(keys.shape[0], device=keys.device) for keys, _, _ in heads]],
        [[bias for _, _, bias in heads]],
        int4=[int4],
        key_group=key_group,
    )
    return cache.layers[0].served_prefix(None)


def compacted_case(
    shape: AttentionShape, batch: int, history: int, ratio: int, storage: str, device: torch.device
) -> KernelCase:
    """Our biased varlen kernel over a context compacted ``ratio`` x (ragged per head, shared by the batch), its
    prefix stored in ``storage`` (`COMPACTED_STORAGES`)."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    lengths = ragged_head_lengths(history / ratio, shape.kv_heads)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    prefix_keys = torch.randn(offsets[-1], shape.head_dim, **bf16)
    prefix_values = torch.randn_like(prefix_keys)
    prefix_bias = torch.randn(offsets[-1], dtype=torch.float32, device=device)
    prefix = CompactedPrefix(prefix_keys, prefix_values, prefix_bias, offsets)
    if storage == "int4":
        prefix = int4_prefix(prefix)
    appended_keys = torch.randn(batch, shape.kv_heads, APPENDED_TOKENS, shape.head_dim, **bf16)
    appended_values = torch.randn_like(appended_keys)
    query = torch.randn(batch, shape.q_heads, 1, shape.head_dim, **bf16)
    args = (query, prefix, AppendedTokens(appended_keys, appended_values))
    scaling = shape.head_dim**-0.5
    quantized = [] if prefix.quantized is None else prefix.quantized.tensors()
    return KernelCase(
        "compacted",
        f"{ratio}x" if storage == "bf16" else f"{ratio}x {storage}",
        lambda: triton_compacted_attention(*args, scaling),
        lambda: compacted_attention(*args, scaling),
        tensor_bytes(query, prefix.keys, prefix.values, prefix.bias, *quantized, appended_keys, appended_values)
        + 8 * len(offsets)  # int64 head offsets
        + tensor_bytes(query),  # the output has the query's size
        {"entries_per_head": lengths, "appended_tokens": APPENDED_TOKENS, "storage": storage},
    )


def mixed_case(
    shape: AttentionShape, batch: int, history: int, payload_ratio: float, window: int, device: torch.device
) -> KernelCase:
    """Our mixed-precision kernel over the BF16 / INT4 / recent partitions of one layer at ``payload_ratio``."""
    counts = mixed_entry_counts(history, payload_ratio, window, shape.head_dim)
    bf16 = dict(dtype=torch.bfloat16, device=device)

    def dense(n: int) -> DensePartition:
        keys = torch.randn(batch, shape.kv_heads, n, shape.head_dim, **bf16)
        visible = torch.ones(batch, 1, n, dtype=torch.bool, device=device)
        return DensePartition(keys, torch.randn_like(keys), visible)

    key_codes, key_scales = quantize_int4(torch.randn(batch, shape.kv_heads, counts.low, shape.head_dim, **bf16))
    value_codes, value_scales = quantize_int4(torch.randn(batch, shape.kv_heads, counts.low, shape.head_dim, **bf16))
    low = Int4Partition(
        key_codes,
        key_scales,
        value_codes,
        value_scales,
        shape.head_dim,
        shape.head_dim,
        torch.ones(batch, 1, counts.low, dtype=torch.bool, device=device),
    )
    partitions = [dense(counts.high), low, dense(counts.recent)]
    query = torch.randn(batch, shape.q_heads, 1, shape.head_dim, **bf16)
    scaling = shape.head_dim**-0.5
    stored = [query, query]  # the query read, the output (of the query's size) written
    for part in partitions:
        if isinstance(part, DensePartition):
            stored += [part.keys, part.values, part.visible]
        else:
            stored += [part.key_codes, part.key_scales, part.value_codes, part.value_scales, part.visible]
    return KernelCase(
        "mixed",
        f"B={payload_ratio}",
        lambda: triton_mixed_precision_attention(query, partitions, scaling),
        lambda: mixed_precision_attention(query, partitions, scaling),
        tensor_bytes(*stored),
        {
            "entries": vars(counts),
            "payload_ratio": counts.payload_ratio(GroupCosts.from_dims([1], [shape.head_dim])),
        },
    )


def kernel_cases(shape: AttentionShape, batch: int, history: int, settings: Settings, device: torch.device):
    """The decode attention calls compared at one point of the grid (built one at a time)."""
    yield lambda: sdpa_case(shape, batch, history, device)
    for ratio in COMPACTION_RATIOS:
        for storage in COMPACTED_STORAGES:
            yield lambda ratio=ratio, storage=storage: compacted_case(shape, batch, history, ratio, storage, device)
    for payload_ratio in PAYLOAD_RATIOS:
        yield lambda b=payload_ratio: mixed_case(shape, batch, history, b, settings.window, device)


def benchmark_kernels(settings: Settings, device: torch.device) -> list[dict]:
    """Time every kernel case of the grid; check our kernels against their references at the first grid point."""
    rows = []
    for shape in SHAPES:
        for history in settings.lengths:
            for batch in settings.batches:
                check = history == settings.lengths[0] and batch == settings.batches[0]
                for build in kernel_cases(shape, batch, history, settings, device):
                    case = build()
                    seconds = median_seconds(case.run, device, settings.warmup, settings.reps)
                    if case.kernel == "sdpa":
                        baseline = seconds
                    row = {
                        "kernel": case.kernel,
                        "variant": case.variant,
                        "shape": shape.name,
                        "q_heads": shape.q_heads,
                        "kv_heads": shape.kv_heads,
                        "head_dim": shape.head_dim,
                        "batch": batch,
                        "history": history,
                        "bytes_read": case.bytes_read,
                        "seconds": seconds,
                        "bytes_per_s": case.bytes_read / seconds,
                        "fraction_of_peak": case.bytes_read / seconds / H200_PEAK_HBM_BYTES_PER_S,
                        "speedup_vs_sdpa": baseline / seconds,
                        **case.details,
                    }
                    if check and case.reference is not None:
                        row["reference_rel_error"] = relative_error(case.run(), case.reference())
                    rows.append(row)
                    del case
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------- end to end


def build_model(weights: str, settings: Settings, device: torch.device) -> transformers.PreTrainedModel:
    """The embedded model in BF16 on ``device``: its real weights, or its architecture with random weights."""
    if weights == "embedded":
        model, _ = load_default_model(dtype=torch.bfloat16, device=device)
        return model
    config = Qwen2Config(**{**EMBEDDED_MODEL_CONFIG, **settings.model_overrides})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def decode_seconds_per_token(model, cache, first_tokens: torch.Tensor, settings: Settings) -> dict:
    """Greedy decode from ``first_tokens`` ``[B, 1]``: median and mean seconds of the timed steps (each step ends
    with a device synchronise) after ``e2e_warmup_steps`` untimed ones."""
    device = first_tokens.device
    tokens = first_tokens
    times = []
    with torch.no_grad():
        for step in range(settings.e2e_warmup_steps + settings.e2e_steps):
            start = time.perf_counter()
            logits = model(input_ids=tokens, cache=cache, use_cache=True, logits_to_keep=1).logits
            tokens = logits[:, -1:].argmax(-1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= settings.e2e_warmup_steps:
                times.append(time.perf_counter() - start)
    return {"tpot_s": statistics.median(times), "mean_step_s": statistics.fmean(times)}


def prefill(model, cache, prompt: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)


def random_selection(cache: DynamicCache, ratio: int, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Random kept positions per layer and KV head, ragged lengths (`ragged_head_lengths`), sorted."""
    length = cache.get_seq_length()
    selection = []
    for layer in cache.layers:
        heads = ragged_head_lengths(length / ratio, layer.keys.shape[1])
        selection.append(
            [torch.randperm(length, generator=generator)[:n].sort().values.to(layer.keys.device) for n in heads]
        )
    return selection


def benchmark_end_to_end(weights: str, settings: Settings, device: torch.device) -> dict:
    """TPOT with DynamicCache / SDPA, a 10x CompactedCache and a B≈0.5 StructuredMixedPrecisionCache, per batch."""
    os.environ[BACKEND_ENV] = "triton"
    model = build_model(weights, settings, device)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, settings.e2e_context), generator=generator).to(device)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    counts = mixed_entry_counts(settings.e2e_context, E2E_PAYLOAD_RATIO, settings.window, head_dim)
    policy = PolicyTable.all_high(model.config, window=settings.window)
    rows = []
    for batch in settings.e2e_batches:
        first_tokens = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)

        model.set_attn_implementation("sdpa")
        full = DynamicCache(config=model.config)
        prefill(model, full, prompt)
        compacted = CompactedCache.from_selection(full, random_selection(full, E2E_COMPACTION_RATIO, generator))
        full.batch_repeat_interleave(batch)
        full_bytes = sum(tensor_bytes(layer.keys, layer.values) for layer in full.layers)
        rows.append(
            {
                "cache": "DynamicCache (sdpa)",
                "batch": batch,
                "stored_bytes": full_bytes,
                **decode_seconds_per_token(model, full, first_tokens, settings),
            }
        )
        del full

        hf_structkv.enable(model)
        rows.append(
            {
                "cache": f"CompactedCache {E2E_COMPACTION_RATIO}x (random selection)",
                "batch": batch,
                "stored_bytes": compacted.nbytes(),
                **decode_seconds_per_token(model, compacted, first_tokens, settings),
            }
        )
        del compacted

        mixed = StructuredMixedPrecisionCache(model, policy, prefill_plan=prefill_plan(counts, 1, generator))
        prefill(model, mixed, prompt)
        mixed.batch_repeat_interleave(batch)
        timing = decode_seconds_per_token(model, mixed, first_tokens, settings)
        rows.append(
            {
                "cache": f"StructuredMixedPrecisionCache B={E2E_PAYLOAD_RATIO}",
                "batch": batch,
                "stored_bytes": mixed.nbytes(),
                "payload_ratio": mixed.scheduled_payload() / mixed.full_payload(),
                **timing,
            }
        )
        del mixed
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        baseline = next(r for r in rows if r["batch"] == row["batch"])
        row["speedup_vs_dynamic"] = baseline["tpot_s"] / row["tpot_s"]
    return {
        "weights": weights,
        "layers": model.config.num_hidden_layers,
        "context_tokens": settings.e2e_context,
        "warmup_steps": settings.e2e_warmup_steps,
        "timed_steps": settings.e2e_steps,
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------- report


def print_kernel_table(rows: list[dict]) -> None:
    print(
        f"{'kernel':<10}{'variant':<18}{'shape':<13}{'batch':>6}{'history':>9}{'MB read':>10}{'us':>10}"
        f"{'GB/s':>9}{'% peak':>8}{'vs sdpa':>9}{'ref err':>10}"
    )
    for row in rows:
        error = row.get("reference_rel_error")
        print(
            f"{row['kernel']:<10}{row['variant']:<18}{row['shape']:<13}{row['batch']:>6}{row['history']:>9}"
            f"{row['bytes_read'] / 1e6:>10.2f}{row['seconds'] * 1e6:>10.1f}{row['bytes_per_s'] / 1e9:>9.1f}"
            f"{row['fraction_of_peak'] * 100:>8.1f}{row['speedup_vs_sdpa']:>9.2f}"
            f"{'' if error is None else f'{error:.1e}':>10}"
        )


def print_reference_failures(rows: list[dict]) -> None:
    """Warn about every kernel whose reference check exceeded ``REFERENCE_TOLERANCE`` (its timings are suspect)."""
    for row in rows:
        error = row.get("reference_rel_error")
        if error is not None and not error < REFERENCE_TOLERANCE:
            print(
                f"WARNING: {row['kernel']} {row['variant']} {row['shape']} differs from its torch reference by "
                f"{error:.2e} (tolerance {REFERENCE_TOLERANCE:.0e})"
            )


def print_end_to_end_table(result: dict) -> None:
    print(
        f"end to end: {result['weights']} weights, {result['layers']} layers, {result['context_tokens']} context "
        f"tokens, median of {result['timed_steps']} steps after {result['warmup_steps']}"
    )
    print(f"{'cache':<46}{'batch':>6}{'stored MB':>11}{'ms/token':>10}{'speed x':>9}{'payload':>9}")
    for row in result["rows"]:
        payload = row.get("payload_ratio")
        print(
            f"{row['cache']:<46}{row['batch']:>6}{row['stored_bytes'] / 1e6:>11.1f}{row['tpot_s'] * 1e3:>10.2f}"
            f"{row['speedup_vs_dynamic']:>9.2f}{'' if payload is None else f'{payload:.3f}':>9}"
        )


def environment(device: torch.device) -> dict:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, kernels under TRITON_INTERPRET=1")
    parser.add_argument("--weights", choices=("embedded", "random"), default="embedded")
    parser.add_argument("--parts", nargs="+", choices=("kernels", "e2e"), default=["kernels", "e2e"])
    parser.add_argument("--lengths", type=int, nargs="+", help="history lengths of the kernel grid")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes of the kernel grid")
    parser.add_argument("--out", default="benchmarks/results/attention_kernels.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    settings = SMOKE if args.smoke else FULL
    settings = replace(
        settings,
        lengths=tuple(args.lengths or settings.lengths),
        batches=tuple(args.batches or settings.batches),
    )
    if args.smoke:
        if not interpreter_ready():
            parser.error("--smoke runs the kernels on CPU: set TRITON_INTERPRET=1 in the environment")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("no CUDA device: this benchmark needs a GPU (or --smoke for the CPU check)")
    torch.manual_seed(0)

    result = {
        "smoke": args.smoke,
        **environment(device),
        "peak_hbm_bytes_per_s": H200_PEAK_HBM_BYTES_PER_S,
        "copy_bytes_per_s": copy_bytes_per_s(device, settings.copy_bytes, settings),
        "warmup": settings.warmup,
        "reps": settings.reps,
    }
    print(
        f"{result['device']}: torch {result['torch']}, triton {result['triton']}, transformers "
        f"{result['transformers']}; device-to-device copy {result['copy_bytes_per_s'] / 1e9:.0f} GB/s"
    )
    if "kernels" in args.parts:
        result["kernels"] = benchmark_kernels(settings, device)
        print_kernel_table(result["kernels"])
        print_reference_failures(result["kernels"])
    if "e2e" in args.parts:
        result["end_to_end"] = benchmark_end_to_end("random" if args.smoke else args.weights, settings, device)
        print_end_to_end_table(result["end_to_end"])
    write_json(args.out, result, started=started)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
