"""The C kernel of `int4_decode_attention` on the CPU (``int4_decode.c`` beside this file), and of the softmax
statistics at a decode step of a mixed-precision cache's INT4 store (`native_int4_rows_stats`) and of a compacted
prefix's INT4 heads (`native_int4_prefix_stats`): compiled once per machine with the system's C compiler, cached,
loaded with ``ctypes``.

At a decode step over INT4 compacted heads, torch unpacks each head's codes into float32 matrices before its two
matrix products and merges the appended tokens in a dozen small operations per head; the kernel reads the packed
codes and FP16 scales directly (``int4_decode.c`` says how) and does a layer's heads in one call, so that an INT4
head costs less time than the bytes it saves. It is an optimisation only: where no compiler is found, compilation
fails, the tensors are not on the CPU or a dimension is above `MAX_DIM` or odd, `int4_decode_attention` runs its
torch path (`int4_head_stats` per head), with the same result up to rounding. ``HF_STRUCTKV_NATIVE=0`` turns the
kernel off.

The library is built with ``$CC`` (else ``cc``) at ``-O3 -march=native`` into ``$HF_STRUCTKV_CACHE/native`` (default
``~/.cache/hf_structkv/native``), under a name that hashes the source, the compiler, the flags and the CPU, written
to a temporary file and renamed into place (concurrent first uses each build and one rename wins); where that folder
cannot be written, into a private temporary folder, once per process. Only this
package's own source is compiled; nothing from a saved artifact is.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .compacted_inputs import CompactedPrefix
from .partitions import PartitionStats

SOURCE = Path(__file__).with_name("int4_decode.c")
NATIVE_ENV = "HF_STRUCTKV_NATIVE"
CACHE_ENV = "HF_STRUCTKV_CACHE"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
MAX_DIM = 256  # as in int4_decode.c
LANES = 16  # the score workspace's rows are padded to a multiple of it, as in int4_decode.c
BUILD_TIMEOUT_S = 120


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags where Linux lists them."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep))) or platform.processor()


def cache_dir() -> Path:
    """Where built libraries are kept: ``$HF_STRUCTKV_CACHE/native``, default ``~/.cache/hf_structkv/native``."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_structkv"
    return Path(root) / "native"


def _build(compiler: str) -> Path:
    """The shared library built from `SOURCE` (built now unless cached; where the cache folder cannot be written, into
    a private temporary folder for this process). Raises OSError or CalledProcessError."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu_identity().encode()]))
    name = f"int4_decode-{key.hexdigest()[:20]}.so"
    if (cache_dir() / name).exists():
        return cache_dir() / name
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=cache_dir())
        target = cache_dir() / name
    except OSError:  # a read-only home: a folder only this process knows
        folder = Path(tempfile.mkdtemp(prefix="hf_structkv-native-"))
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        target = folder / name
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it is turned off (``HF_STRUCTKV_NATIVE=0``) or cannot be built (a
    warning says why, once per process)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or "cc"
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(
            f"hf_structkv: the INT4 CPU kernel could not be built with {compiler!r} ({error}; "
            f"{detail.decode(errors='replace')[-400:]}); INT4 heads are read by the torch path instead "
            f"(set {NATIVE_ENV}=0 to silence this)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    library.int4_decode_attention.argtypes = [size] * 8 + [pointer] * 2 + [real] + [pointer] * 15
    library.int4_decode_attention.restype = ctypes.c_int
    library.int4_rows_stats.argtypes = [size] * 4 + [pointer] + [size] * 2 + [pointer] * 2 + [real] + [pointer] * 11
    library.int4_rows_stats.restype = ctypes.c_int
    library.int4_prefix_stats.argtypes = [size] * 6 + [pointer] * 2 + [real] + [pointer] * 14
    library.int4_prefix_stats.restype = ctypes.c_int
    return library


def _loaded_library() -> ctypes.CDLL:
    """`native_library`, or a RuntimeError where it is turned off or cannot be built."""
    library = native_library()
    if library is None:
        raise RuntimeError(f"the INT4 CPU kernel is not available ({NATIVE_ENV}=0 or no compiler)")
    return library


def _check_status(status: int, dim: int, value_dim: int) -> None:
    """A kernel call's status: 0, else the RuntimeError for dimensions it refused."""
    if status:
        raise RuntimeError(f"the INT4 CPU kernel refused dimensions {dim} / {value_dim} (at most {MAX_DIM}, even)")


def _padded(length: int) -> int:
    """``length`` rounded up to whole `LANES`: the row stride of the kernel's score workspace."""
    return -(-length // LANES) * LANES


def runs_natively(device: torch.device, dim: int, value_dim: int) -> bool:
    """Whether `native_int4_decode` serves heads of these dimensions on ``device`` (builds the library on first
    use)."""
    sizes_fit = 0 < dim <= MAX_DIM and 0 < value_dim <= MAX_DIM and dim % 2 == 0 and value_dim % 2 == 0
    return device.type == "cpu" and sizes_fit and native_library() is not None


def native_int4_decode(
    query: torch.Tensor,
    scaling: float,
    heads: list[int],
    prefix: CompactedPrefix,
    appended_keys: torch.Tensor,
    appended_values: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """A decode step of the INT4 KV heads ``heads`` of ``prefix``: each head's prefix read from its codes (its
    statistics as `int4_head_stats` defines them, scales and offsets read in fp16 as stored) merged with its appended
    tokens, normalised, written to ``out`` at the head's query heads; the other query heads of ``out`` are left as
    they are.

    Args:
        query: ``[B, H_q, 1, D]`` float32 queries (``g = H_q / H_kv`` query heads per KV head).
        scaling: logit scale.
        heads: KV heads, each read from codes (`int4_head_stats.reads_codes`).
        prefix: the layer's compacted prefix (a `QuantizedPrefix`).
        appended_keys: ``[B, H_kv, n, D]`` and appended_values: ``[B, H_kv, n, D_v]`` float32, the appended tokens.
        mask: ``[B | 1, n]`` float32 additive mask over the appended tokens.
        out: ``[B, H_q, D_v]`` float32 contiguous; a row that sees no key gets zeros.

    Raises:
        RuntimeError: the library is not available or refused the dimensions.
    """
    library = _loaded_library()
    named = {"query": query, "appended_keys": appended_keys, "appended_values": appended_values, "mask": mask}
    for name, tensor in {**named, "bias": prefix.bias, "out": out}.items():
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: the kernel writes it in place")
    batch, query_heads, _, dim = query.shape
    kv_heads, appended, value_dim = appended_keys.shape[1], appended_keys.shape[2], out.shape[-1]
    stored, longest = _prefix_arguments(prefix, heads)
    rows = batch * (query_heads // kv_heads)
    workspace = torch.empty(rows * (3 + dim + value_dim + _padded(longest)) + longest + appended, dtype=torch.float32)
    query, keys, values, mask = (t.contiguous() for t in (query, appended_keys, appended_values, mask))
    status = library.int4_decode_attention(
        batch, query_heads, kv_heads, dim, value_dim, appended, mask.shape[0], len(heads), _int64s(heads),
        query.data_ptr(), scaling, *_pointers(stored), keys.data_ptr(), values.data_ptr(),
        mask.data_ptr(), workspace.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    _check_status(status, dim, value_dim)


def _int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _pointers(arguments: list) -> list:
    """``arguments`` with each tensor replaced by its data pointer (the caller keeps the list, so the tensors, alive
    through the call)."""
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in arguments]


def _prefix_arguments(prefix: CompactedPrefix, heads: list[int]) -> tuple[list, int]:
    """The kernel's arguments from ``key_scales`` to ``bias_starts`` for INT4 heads ``heads`` of ``prefix`` (the stored
    tensors, made contiguous, `_pointers` turns them into pointers; the heads' rows, lengths and bias offsets), and
    the longest of those heads' lengths (the kernel's workspace is sized by it)."""
    quantized = prefix.quantized
    tensors = [quantized.key_scales, quantized.key_offsets, quantized.key_codes, quantized.value_codes]
    key_scales, key_offsets, key_codes, value_codes, value_scales, bias = (
        t.contiguous() for t in [*tensors, quantized.value_scales, prefix.bias]
    )
    lengths = [prefix.offsets[h + 1] - prefix.offsets[h] for h in heads]
    arguments = [
        key_scales, key_offsets, _int64s([quantized.group_starts[h] for h in heads]), key_codes, value_codes,
        value_scales, _int64s([quantized.row_starts[h] for h in heads]), _int64s(lengths), bias,
        _int64s([prefix.offsets[h] for h in heads]),
    ]  # fmt: skip
    return arguments, max(lengths)


def native_int4_prefix_stats(
    query: torch.Tensor, scaling: float, heads: list[int], prefix: CompactedPrefix
) -> list[PartitionStats]:
    """Softmax statistics of the INT4 KV heads ``heads`` of ``prefix`` at a decode step, read from their codes (as
    `int4_head_stats` defines them: scales and offsets in fp16 as stored, every entry visible).

    Args:
        query: ``[B, H_q, 1, D]`` float32 queries (``g = H_q / H_kv`` query heads per KV head).
        scaling: logit scale.
        heads: KV heads, each read from codes (`int4_head_stats.reads_codes`).
        prefix: the layer's compacted prefix (a `QuantizedPrefix`).

    Returns:
        per head, `PartitionStats` of shapes ``[B, g]`` and ``[B, g, D_v]``.

    Raises:
        RuntimeError: the library is not available or refused the dimensions.
    """
    library = _loaded_library()
    for name, tensor in {"query": query, "bias": prefix.bias}.items():
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}")
    batch, query_heads, _, dim = query.shape
    group, value_dim = query_heads // prefix.num_kv_heads, prefix.values.shape[-1]
    stored, longest = _prefix_arguments(prefix, heads)
    workspace = torch.empty(batch * group * (dim + 1 + _padded(longest)) + longest, dtype=torch.float32)
    row_max = torch.empty(len(heads), batch, group, dtype=torch.float32)
    exp_sum = torch.empty_like(row_max)
    value_sum = torch.empty(len(heads), batch, group, value_dim, dtype=torch.float32)
    query = query.contiguous()
    status = library.int4_prefix_stats(
        batch, query_heads, prefix.num_kv_heads, dim, value_dim, len(heads), _int64s(heads), query.data_ptr(),
        scaling, *_pointers(stored), workspace.data_ptr(), row_max.data_ptr(), exp_sum.data_ptr(),
        value_sum.data_ptr(),
    )  # fmt: skip
    _check_status(status, dim, value_dim)
    return [PartitionStats(*(t[i] for t in (row_max, exp_sum, value_sum))) for i in range(len(heads))]


def _entry_strides(rows: torch.Tensor) -> tuple[int, int] | None:
    """``(batch, head)`` strides counted in entries of ``rows [B, H, n, w]`` whose entries are contiguous rows of
    ``w`` one entry apart (a store's view), else None."""
    width = rows.shape[-1]
    if rows.stride(-1) != 1 or rows.stride(2) != width or rows.stride(0) % width or rows.stride(1) % width:
        return None
    return rows.stride(0) // width, rows.stride(1) // width


def native_int4_rows_stats(
    queries: torch.Tensor,
    stores: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    scaling: float,
    offsets: torch.Tensor | None = None,
) -> list[PartitionStats]:
    """Softmax statistics of INT4 stores with one FP16 scale per entry row (`quantize_int4`'s layout, a mixed-precision
    cache's INT4 stores) at a decode step, read from the codes, all in one call: in store ``i``, entry ``j`` of batch
    row ``b`` and KV head ``h`` scores ``(q_i · code_j · key_scale_j + offset_i) · scaling`` where ``visible[b, j]``,
    its value is ``code · value_scale_j``.

    Args:
        queries: ``[S, B, H_kv, g, D]`` float32, store ``i``'s query heads of each KV head (centred keys: the query
            scaled by the store's spread).
        stores: ``S`` tuples ``(key_codes, key_scales, value_codes, value_scales, visible)``: uint8
            ``[B, H_kv, n_i, D / 2]``, fp16 ``[B, H_kv, n_i, 1]``, the same for ``D_v``, bool ``[B, n_i]``. Any
            strides over the first two dimensions (a store's views).
        scaling: logit scale.
        offsets: ``[S, B, H_kv, g]`` float32 logit offsets added before scaling (centred keys: ``q · centre``), or
            ``None``.

    Returns:
        per store, `PartitionStats` of shapes ``[B, H_kv, g, 1]`` and ``[B, H_kv, g, 1, D_v]`` (a row that sees no
        entry: ``-inf``, 0, 0).

    Raises:
        RuntimeError: the library is not available or refused the dimensions (at most `MAX_DIM`, even).
    """
    library = _loaded_library()
    if queries.dtype != torch.float32 or (offsets is not None and offsets.dtype != torch.float32):
        raise TypeError(f"queries and offsets must be float32, got {queries.dtype}")
    count, batch, kv_heads, group, dim = queries.shape
    value_dim = stores[0][2].shape[-1] * 2
    held, lengths, strides = [], [], []
    for key_codes, key_scales, value_codes, value_scales, visible in stores:
        fields = [key_codes, key_scales, value_codes, value_scales]
        found = {_entry_strides(t) for t in fields}
        if len(found) != 1 or None in found:
            fields = [t.contiguous() for t in fields]
            found = {_entry_strides(fields[0])}
        held.append([*fields, visible.to(torch.uint8).contiguous()])
        lengths.append(key_codes.shape[2])
        strides.append(found.pop())
    queries = queries.contiguous()
    offsets = None if offsets is None else offsets.contiguous()
    longest = max(lengths)
    workspace = torch.empty(3 * longest + group + group * _padded(longest), dtype=torch.float32)
    row_max = torch.empty(count, batch, kv_heads, group, 1, dtype=torch.float32)
    exp_sum = torch.empty_like(row_max)
    value_sum = torch.empty(count, batch, kv_heads, group, 1, value_dim, dtype=torch.float32)
    pointers = [(ctypes.c_void_p * count)(*(fields[k].data_ptr() for fields in held)) for k in range(5)]
    status = library.int4_rows_stats(
        count, batch, kv_heads, group, _int64s(lengths), dim, value_dim, queries.data_ptr(),
        None if offsets is None else offsets.data_ptr(), scaling, *pointers[:4],
        _int64s([b for b, _ in strides]), _int64s([h for _, h in strides]), pointers[4], workspace.data_ptr(),
        row_max.data_ptr(), exp_sum.data_ptr(), value_sum.data_ptr(),
    )  # fmt: skip
    _check_status(status, dim, value_dim)
    return [PartitionStats(row_max[i], exp_sum[i], value_sum[i]) for i in range(count)]
