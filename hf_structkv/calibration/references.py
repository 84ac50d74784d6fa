"""Reference trajectories: greedy generations of calibration / development cases under the all-high policy, with each
generated token's candidate tags, each prompt token's span labels and the AST checker's verdict; cached on disk.

One case is generated alone (batch 1): BFCL cases mostly carry their own tools, and one ``generate`` call serves one
grammar; batch 1 also makes the window shortcut of `task_sensitivity` exact (a batch's padding and shapes change the
floating-point results of the other rows).

The cache is one JSON file per (`generation_key`, case id), named by the hash of that key, in ``cache_dir``: a
re-run with the same model and settings reads the cases it has instead of generating them, also when the split grew
or shrank (the interventions' verdicts are kept beside them by `verdicts.VerdictStore`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..eval.bfcl import BfclEntry
from ..eval.bfcl_checker import check_calls
from ..persistence import model_fingerprint
from ..policy.table import PolicyTable
from ..structure.prompt_spans import label_prompt, token_labels
from ..structure.tags import StructuralTag, position_tag
from ..structured_generation import call_prompt, generate_calls, parse_calls
from ..version import __version__

__all__ = [
    "CaseRun",
    "case_run",
    "ReferenceTrajectory",
    "generation_key",
    "key_digest",
    "reference_trajectories",
    "run_case",
    "with_position_tags",
]

TokenTags = tuple[str, ...] | None
"""A generated token's candidate tag keys (``class|role|state|next``; ``()`` unresolved); ``None``: a stop token."""


@dataclass(frozen=True)
class CaseRun:
    """One generation of one case.

    Attributes:
        tokens: the generated ids up to and including the first stop token (``T`` tokens).
        tags: per generated token its candidate tag keys (`TokenTags`).
        valid: the AST checker's verdict.
        text: the generated text.
    """

    tokens: tuple[int, ...]
    tags: tuple[TokenTags, ...]
    valid: bool
    text: str

    def candidates(self, index: int) -> tuple[StructuralTag, ...] | None:
        """The candidate tags of generated token ``index`` as `StructuralTag` values (``None``: stop token)."""
        keys = self.tags[index]
        return None if keys is None else tuple(StructuralTag.from_key(key) for key in keys)


@dataclass(frozen=True)
class ReferenceTrajectory(CaseRun):
    """A `CaseRun` under the all-high policy, with what the distortion and prefill measurements need.

    Attributes:
        case_id, category: the BFCL case.
        prompt_ids: the prompt's ids (``P``).
        prompt_labels: per prompt token its span labels (`token_labels`).
        seconds: the generation's wall time.
    """

    _: KW_ONLY
    case_id: str
    category: str
    prompt_ids: tuple[int, ...]
    prompt_labels: tuple[tuple[str, ...], ...]
    seconds: float

    @property
    def num_decoded(self) -> int:
        """Non-stop generated tokens (the tokens the decode ledger charges)."""
        return sum(tags is not None for tags in self.tags)


def run_case(
    model,
    tokenizer,
    entry: BfclEntry,
    policy,
    max_new_tokens: int,
    prefill_plan: torch.Tensor | None = None,
) -> tuple[CaseRun, int, str]:
    """Generate one case with `generate_calls` (greedy, batch 1) under ``policy`` and score it.

    Args:
        prefill_plan: optional prompt actions ``[1, P, 3]``.

    Returns:
        ``(run, prompt_length, prompt_text)``.
    """
    result = generate_calls(
        model, tokenizer, list(entry.messages), entry.tools, policy, max_new_tokens, prefill_plan=prefill_plan
    )
    run = case_run(model, tokenizer, entry, result.sequences, result.prompt_length, result.processor)
    return run, result.prompt_length, call_prompt(tokenizer, list(entry.messages), entry.tools)


def case_run(model, tokenizer, entry: BfclEntry, sequences: torch.Tensor, prompt_length: int, processor) -> CaseRun:
    """Score one generation of ``entry``: ``sequences`` ``[1, prompt_length + n]`` from ``generate`` under
    ``processor`` (its `StructuralLogitsProcessor`), cut after the first stop token, tagged and checked."""
    generated = sequences[0, prompt_length:].tolist()
    stops = processor.adapter.stop_token_ids
    end = next((i + 1 for i, token in enumerate(generated) if token in stops), len(generated))
    if processor.num_tagged(0) < end:  # the last token was never fed back: let the processor tag it
        processor(sequences[:, : prompt_length + end], torch.zeros(1, model.config.vocab_size))
    tags = tuple(None if tags is None else tuple("|".join(tag) for tag in tags) for tags in processor.tags(0)[:end])
    text = tokenizer.decode(sequences[0, prompt_length:], skip_special_tokens=True)
    verdict = check_calls(entry.category, entry.tools, entry.ground_truth, parse_calls(text))
    return CaseRun(tokens=tuple(generated[:end]), tags=tags, valid=bool(verdict["valid"]), text=text)


def _reference(model, tokenizer, entry: BfclEntry, policy: PolicyTable, max_new_tokens: int) -> ReferenceTrajectory:
    start = time.perf_counter()
    run, prompt_length, prompt = run_case(model, tokenizer, entry, policy, max_new_tokens)
    seconds = time.perf_counter() - start
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(prompt_ids) != prompt_length:
        raise RuntimeError(
            f"case {entry.id}: the rebuilt prompt has {len(prompt_ids)} tokens, generation saw {prompt_length}"
        )
    labels = token_labels(tokenizer, prompt, label_prompt(prompt, entry.tools))
    return ReferenceTrajectory(
        **asdict(run),
        case_id=entry.id,
        category=entry.category,
        prompt_ids=tuple(prompt_ids),
        prompt_labels=tuple(tuple(token) for token in labels),
        seconds=seconds,
    )


def key_digest(key: Any) -> str:
    """The 20-hex-digit hash naming a cache file: SHA-256 of ``key`` as sorted JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def generation_key(model, tokenizer, policy: PolicyTable, max_new_tokens: int) -> dict[str, Any]:
    """What a calibration's generations depend on besides the case and the intervention: package version, model
    fingerprint, dtype, generation cap, and ``policy``'s window, sinks and tag view (the key of the on-disk caches)."""
    return {
        "hf_structkv_version": __version__,
        "fingerprint": model_fingerprint(model, tokenizer),
        "dtype": str(model.dtype),
        "max_new_tokens": max_new_tokens,
        "window": policy.window,
        "sink_tokens": policy.sink_tokens,
        **({} if policy.tag_view == "full" else {"tag_view": policy.tag_view}),  # full-view keys stay as before
    }


def reference_trajectories(
    model,
    tokenizer,
    entries: Sequence[BfclEntry],
    max_new_tokens: int,
    window: int,
    sink_tokens: int,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    desc: str = "reference",
    tag_view: str = "full",
) -> list[ReferenceTrajectory]:
    """All-high greedy trajectories of ``entries`` (in order), each read from / written to ``cache_dir`` when given
    (one file per case, written as soon as it is generated).

    Args:
        window, sink_tokens, tag_view: the all-high policy's recent window, sinks and tag view (the settings of the
            calibrated table; the recorded tags are of that view).
    """
    if not entries or not all(isinstance(entry, BfclEntry) for entry in entries):
        raise ValueError("entries must be a non-empty list of BfclEntry objects (bfcl_split)")
    policy = PolicyTable.all_high(model, window=window, sink_tokens=sink_tokens, tag_view=tag_view)
    common = generation_key(model, tokenizer, policy, max_new_tokens)
    keys = [{**common, "case": entry.id} for entry in entries]
    paths = [None if cache_dir is None else Path(cache_dir) / f"reference-{key_digest(key)}.json" for key in keys]
    trajectories = [_read_reference(path, key) for path, key in zip(paths, keys, strict=True)]
    missing = [i for i, trajectory in enumerate(trajectories) if trajectory is None]
    for i in tqdm(missing, desc=desc, unit="case", disable=not progress):
        trajectories[i] = _reference(model, tokenizer, entries[i], policy, max_new_tokens)
        if paths[i] is not None:
            _write_json(paths[i], {"key": keys[i], "trajectory": asdict(trajectories[i])})
    return trajectories


def _read_reference(path: Path | None, key: dict[str, Any]) -> ReferenceTrajectory | None:
    """The cached trajectory of ``key`` at ``path``, ``None`` when absent or of another key."""
    if path is None or not path.is_file():
        return None
    stored = json.loads(path.read_text(encoding="utf-8"))
    return _from_json(stored["trajectory"]) if stored.get("key") == key else None


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` through a temporary file of this process (processes sharing a cache folder may
    write the same case at once), so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(path)


def with_position_tags(reference: ReferenceTrajectory, position_bins: Sequence[int]) -> ReferenceTrajectory:
    """``reference`` as a processor of the ``"position_bins"`` view records it: the same tokens (the all-high policy
    ignores tags, so the trajectory does not depend on the view), each non-stop token tagged with its bin alone."""
    bins = tuple(position_bins)
    tags = tuple(
        None if keys is None else ("|".join(position_tag(i, bins, "function_calling")),)
        for i, keys in enumerate(reference.tags)
    )
    return replace(reference, tags=tags)


def _from_json(record: dict[str, Any]) -> ReferenceTrajectory:
    return ReferenceTrajectory(
        tokens=tuple(record["tokens"]),
        tags=tuple(None if tags is None else tuple(tags) for tags in record["tags"]),
        valid=record["valid"],
        text=record["text"],
        case_id=record["case_id"],
        category=record["category"],
        prompt_ids=tuple(record["prompt_ids"]),
        prompt_labels=tuple(tuple(labels) for labels in record["prompt_labels"]),
        seconds=record["seconds"],
    )
