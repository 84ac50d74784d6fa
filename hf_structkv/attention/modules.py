"""Finding a model's attention modules: the modules transformers' attention classes build, recognised by an int
``layer_idx`` and a float ``scaling`` (the softmax scale they pass to the attention function)."""

from __future__ import annotations

import torch

__all__ = ["attention_modules", "attention_scalings"]


def attention_modules(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The attention modules under ``module`` (itself included), by layer index, in module order."""
    found = {}
    for child in module.modules():
        index, scaling = getattr(child, "layer_idx", None), getattr(child, "scaling", None)
        if isinstance(index, int) and not isinstance(index, bool) and isinstance(scaling, float):
            found.setdefault(index, child)
    return found


def attention_scalings(model: torch.nn.Module) -> dict[int, float]:
    """The softmax scaling of each attention layer, as its module applies it (``1/sqrt(d)`` or the model's own)."""
    return {index: float(child.scaling) for index, child in attention_modules(model).items()}
