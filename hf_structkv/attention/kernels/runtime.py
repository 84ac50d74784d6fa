"""Where the Triton kernels can run: CUDA tensors, or any tensors under the Triton interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...validation import check_int

INTERPRETED: tl.constexpr = tl.constexpr(bool(triton.knobs.runtime.interpret))
"""Whether the kernels are built for the Triton interpreter: Triton reads ``TRITON_INTERPRET`` when a kernel is
decorated, i.e. when the kernel modules are imported."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_ready() -> bool:
    """Whether kernels can run under the interpreter: ``TRITON_INTERPRET=1`` was set before ``triton.language`` was
    first imported (its own functions, ``tl.zeros``, ``tl.max``, ... are decorated then) and before the kernels."""
    from triton.runtime.interpreter import InterpretedFunction

    return INTERPRETED.value and isinstance(tl.zeros, InterpretedFunction)


def check_runs_on(device: torch.device) -> None:
    """Raise a ValueError unless kernels can run on ``device``: CUDA, or anything under the interpreter."""
    if device.type != "cuda" and not interpreter_ready():
        raise ValueError(
            f"tensors on {device} run the Triton kernels only under the interpreter: set TRITON_INTERPRET=1 in the "
            "environment before triton is first imported (transformers and torch import it early), or use the "
            "torch reference (HF_STRUCTKV_ATTENTION_BACKEND=torch)"
        )


def check_tensor(name: str, t: object, ndim: int, dtypes=SUPPORTED_DTYPES) -> torch.Tensor:
    """``t`` itself if it is a ``ndim``-D tensor of one of ``dtypes``; TypeError / ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {t.dtype}")
    return t


def check_num_splits(num_splits: int | None) -> None:
    """``num_splits``: None (automatic) or a positive int."""
    check_int("num_splits", num_splits, 1, none_ok=True)
