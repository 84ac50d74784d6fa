"""Shared test setup: offline Hugging Face, at most two CPU threads (one per xdist worker), the default model, the
embedded tokenizer and a tiny model over it, a mocked Hub, a spy on kernel entry points, a switch refusing torch
dequantisation of INT4 heads."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton decides interpreted vs compiled when triton.language is first imported (transformers imports it early),
# so the CPU tests of the Triton kernels (hf_structkv/attention/kernels) need this before anything imports torch or
# transformers.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores: one torch thread in each of the two pytest-xdist workers of the suite's command, two in a single process.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of the embedded default model in float32, loaded once per session."""
    from hf_structkv.models import load_default_model

    return load_default_model()


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (from its cached snapshot), once per test module; a module that needs another
    tokenizer defines its own ``tokenizer`` fixture."""
    from transformers import AutoTokenizer

    from hf_structkv.models import ensure_default_snapshot

    return AutoTokenizer.from_pretrained(ensure_default_snapshot(), local_files_only=True)


@pytest.fixture(scope="module")
def model(tokenizer):
    """A 3-layer random Qwen2 over ``tokenizer``'s vocabulary, fresh for each test module (tests enable it and switch
    its attention); a module that needs another model defines its own ``model`` fixture."""
    from hf_structkv.models import tiny_model

    return tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_hidden_layers=3)


@pytest.fixture
def kernel_calls(monkeypatch):
    """A factory of call spies: ``kernel_calls(module, name)`` replaces ``module.name`` (an attention entry point
    taking the query first, e.g. a Triton kernel's) for the test by a wrapper that calls it and records its query's
    shape ``[B, H_q, q, D]``, and returns the list it records into."""

    def spy(module, name: str) -> list[torch.Size]:
        function, calls = getattr(module, name), []

        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls

    return spy


@pytest.fixture
def refuse_int4_dequantisation(monkeypatch):
    """A switch: once called, torch dequantisation of INT4 heads of a compacted prefix raises for the rest of the
    test. ``switch()`` refuses it for every INT4 head (`CompactedPrefix.dense`, `QuantizedHeads.served`), so whatever
    still serves them reads their codes (the Triton kernel); ``switch(read_from_codes=True)`` only for the heads that
    the torch path reads from their codes at a decode step (`CompactedPrefix.head` of a head that
    `int4_head_stats.reads_codes`), the others may still be dequantised: switch it on for calls of one query per
    row (at several, the torch path dequantises every INT4 head)."""

    def switch(read_from_codes: bool = False) -> None:
        from hf_structkv.attention.compacted_inputs import CompactedPrefix, QuantizedHeads
        from hf_structkv.attention.int4_head_stats import reads_codes

        def refuse(*_, **__):
            raise AssertionError("INT4 heads were dequantised in torch, not read as codes")

        if not read_from_codes:
            monkeypatch.setattr(CompactedPrefix, "dense", refuse)
            monkeypatch.setattr(QuantizedHeads, "served", refuse)
            return
        head = CompactedPrefix.head

        def head_unless_read_from_codes(prefix, h):
            return refuse() if reads_codes(prefix, h) else head(prefix, h)

        monkeypatch.setattr(CompactedPrefix, "head", head_unless_read_from_codes)

    return switch


@pytest.fixture
def fake_hub(monkeypatch):
    """A factory of mocked Hubs (no network). ``fake_hub(served=folder, load=Cls.load)`` makes
    ``huggingface_hub.snapshot_download`` return ``folder`` and ``HfApi.create_repo`` / ``create_branch`` /
    ``upload_folder`` record their arguments (an upload returns commit ``abc123``), and returns the dict they record
    into: ``downloads`` (each ``(repo_id, kwargs)``), ``create_repo`` / ``create_branch`` (``(repo_id, kwargs)``),
    ``token`` (the ``HfApi``'s), ``upload_folder`` (its kwargs) and, of the uploaded folder, ``files`` (names),
    ``readme`` (text) and ``loaded`` (``load(folder)``, read before the folder is gone)."""
    import huggingface_hub
    from huggingface_hub import CommitInfo, HfApi

    def make(served: Path | None = None, load=None) -> dict:
        calls: dict = {"downloads": []}

        def snapshot_download(repo_id, **kwargs):
            calls["downloads"].append((repo_id, kwargs))
            return str(served)

        def create_repo(self, repo_id, **kwargs):
            calls.update(token=self.token, create_repo=(repo_id, kwargs))

        def create_branch(self, repo_id, **kwargs):
            calls["create_branch"] = (repo_id, kwargs)

        def upload_folder(self, **kwargs):
            folder = Path(kwargs["folder_path"])
            calls.update(upload_folder=kwargs, files={p.name for p in folder.iterdir()})
            calls.update(readme=(folder / "README.md").read_text(), loaded=None if load is None else load(folder))
            url = f"https://huggingface.co/{kwargs['repo_id']}/commit/abc123"
            return CommitInfo(commit_url=url, commit_message="m", commit_description="", oid="abc123")

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        return calls

    return make
