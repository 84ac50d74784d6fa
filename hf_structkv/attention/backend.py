"""Which implementation serves attention over a compacted or mixed-precision cache: Triton kernels, torch SDPA or the
torch references.

``HF_STRUCTKV_ATTENTION_BACKEND`` = ``auto`` (default: Triton for CUDA tensors when triton imports, torch otherwise),
``torch``, ``reference`` or ``triton`` (CPU tensors then need the Triton interpreter: ``TRITON_INTERPRET=1`` set
before triton is first imported). The kernels (`kernels/`) are imported only when used, never at ``import
hf_structkv``. With ``torch``, compacted and mixed-precision attention run through SDPA (`fused_compacted_attention`,
`fused_mixed_precision_attention`; the references where SDPA has no form for a call, such as soft-capping);
``reference`` runs both references (`compacted_attention`, `mixed_precision_attention`), which define what every path
computes.

A mixed-precision layer that serves a compacted context (a composed cache: ``StructuredMixedPrecisionCache(...,
context=)``, a `PrefixPartition` among its partitions) is served by the fused SDPA path under ``triton`` too (and by
the reference under ``reference``): the Triton mixed kernel reads slot stores only, not a ragged prefix with biases
(``mixed_precision_attention_for(..., with_prefix=True)``; tests/test_composed_cache.py checks it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from .compacted_reference import compacted_attention
from .compacted_sdpa import fused_compacted_attention
from .mixed_reference import mixed_precision_attention
from .mixed_sdpa import fused_mixed_precision_attention

BACKEND_ENV = "HF_STRUCTKV_ATTENTION_BACKEND"
BACKENDS = ("auto", "torch", "reference", "triton")


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(tensor: torch.Tensor) -> str:
    """``"triton"``, ``"torch"`` or ``"reference"`` for attention over ``tensor``'s device, following
    ``HF_STRUCTKV_ATTENTION_BACKEND`` (``auto``: triton for CUDA tensors when triton imports, else torch).

    Raises:
        ValueError: the variable holds another name, or ``triton`` is forced for CPU tensors without
            ``TRITON_INTERPRET=1``.
        ImportError: ``triton`` is forced but cannot be imported.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    setting = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if setting not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={setting!r} is not one of {', '.join(BACKENDS)}")
    if setting in ("torch", "reference"):
        return setting
    if setting == "auto":
        return "triton" if tensor.is_cuda and _triton_imports() else "torch"
    if not _triton_imports():
        raise ImportError(
            f"{BACKEND_ENV}=triton but triton cannot be imported: pip install 'hf-structkv[triton]', or unset it"
        )
    if not tensor.is_cuda:
        from .kernels.runtime import interpreter_ready

        if not interpreter_ready():
            raise ValueError(
                f"{BACKEND_ENV}=triton with {tensor.device} tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton is first imported (or choose torch / auto)"
            )
    return "triton"


def compacted_attention_for(tensor: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The compacted attention function for ``tensor`` (``choose_backend``): the Triton kernel wrapper
    ``kernels.biased_attention.triton_compacted_attention``, torch's ``fused_compacted_attention`` or the reference
    ``compacted_attention``; all take the same arguments (query, `CompactedPrefix`, `AppendedTokens`, scaling,
    softcap)."""
    chosen = choose_backend(tensor)
    if chosen == "reference":
        return compacted_attention
    if chosen == "torch":
        return fused_compacted_attention
    from .kernels.biased_attention import triton_compacted_attention

    return triton_compacted_attention


def mixed_precision_attention_for(tensor: torch.Tensor, with_prefix: bool = False) -> Callable[..., torch.Tensor]:
    """The mixed-precision attention function for ``tensor`` (``choose_backend``): torch's
    ``fused_mixed_precision_attention``, the reference ``mixed_precision_attention`` or the Triton kernel wrapper
    ``kernels.mixed_attention.triton_mixed_precision_attention``; all take the same arguments.

    Args:
        with_prefix: the partitions hold a compacted prefix (`PrefixPartition`): under ``triton`` the fused torch path
            serves it (the kernel reads slot stores only).
    """
    chosen = choose_backend(tensor)
    if chosen == "reference":
        return mixed_precision_attention
    if chosen == "torch" or with_prefix:
        return fused_mixed_precision_attention
    from .kernels.mixed_attention import triton_mixed_precision_attention

    return triton_mixed_precision_attention
