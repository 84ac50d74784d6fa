"""Shared test setup: offline Hugging Face, at most two CPU threads, the default model."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton decides interpreted vs compiled when triton.language is first imported (transformers imports it early),
# so the CPU tests of triton_ops need this before anything imports torch / transformers.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of the embedded default model in float32, loaded once per session."""
    from hf_structkv.models import load_default_model

    return load_default_model()
