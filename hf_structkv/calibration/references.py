"""Reference trajectories: greedy generations of calibration / development cases under the all-high policy, with each
generated token's candidate tags, each prompt token's span labels and the task's verdict; cached on disk.

What a case is, how it is generated and scored is the `CalibrationTask`'s (`BfclTask`, `SpiderTask`). One case is
generated alone (batch 1): BFCL cases mostly carry their own tools, Spider cases their database, and one ``generate``
call serves one grammar; batch 1 also makes the window shortcut of `task_sensitivity` exact (a batch's padding and
shapes change the floating-point results of the other rows).

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

from ..persistence import model_fingerprint
from ..policy.table import PolicyTable
from ..structure.tags import StructuralTag, position_tag
from ..version import __version__
from .task import CalibrationTask

__all__ = [
    "CaseRun",
    "case_run",
    "ReferenceTrajectory",
    "KEY_LAYOUT_FIELD",
    "generation_key",
    "key_digest",
    "reference_trajectories",
    "run_case",
    "stop_index",
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
        valid: the task's verdict (`CalibrationTask.score`).
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
        case_id, category: the case (`CalibrationTask.case_id`, `CalibrationTask.category`).
        prompt_ids: the prompt's ids (``P``).
        prompt_labels: per prompt token its span labels (`CalibrationTask.prompt_labels`; ``()`` each for a task
            without them).
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
    task: CalibrationTask,
    case,
    policy,
    max_new_tokens: int,
    prefill_plan: torch.Tensor | None = None,
) -> tuple[CaseRun, tuple[int, ...]]:
    """Generate one case with `CalibrationTask.generate` (greedy, batch 1) under ``policy`` and score it.

    Args:
        prefill_plan: optional prompt actions ``[1, P, 3]``.

    Returns:
        ``(run, prompt_ids)``: the scored run and the prompt's ``P`` ids.
    """
    result = task.generate(model, tokenizer, case, policy, max_new_tokens, prefill_plan=prefill_plan)
    run = case_run(model, tokenizer, task, case, result.sequences, result.prompt_length, result.processor)
    return run, tuple(result.sequences[0, : result.prompt_length].tolist())


def stop_index(generated: list[int], stop_token_ids) -> int | None:
    """The index of the first stop token among the ``generated`` ids, ``None`` when there is none."""
    return next((i for i, token in enumerate(generated) if token in stop_token_ids), None)


def case_run(
    model, tokenizer, task: CalibrationTask, case, sequences: torch.Tensor, prompt_length: int, processor
) -> CaseRun:
    """Score one generation of ``case``: ``sequences`` ``[1, prompt_length + n]`` from ``generate`` under
    ``processor`` (its `StructuralLogitsProcessor`), cut after the first stop token, tagged and scored."""
    generated = sequences[0, prompt_length:].tolist()
    stop = stop_index(generated, processor.adapter.stop_token_ids)
    end = len(generated) if stop is None else stop + 1
    if processor.num_tagged(0) < end:  # the last token was never fed back: let the processor tag it
        processor(sequences[:, : prompt_length + end], torch.zeros(1, model.config.vocab_size))
    tags = tuple(None if tags is None else tuple("|".join(tag) for tag in tags) for tags in processor.tags(0)[:end])
    text = tokenizer.decode(sequences[0, prompt_length:], skip_special_tokens=True)
    valid = task.score(case, text, stopped=stop is not None)
    return CaseRun(tokens=tuple(generated[:end]), tags=tags, valid=valid, text=text)


def _reference(model, tokenizer, task: CalibrationTask, case, policy: PolicyTable, max_new_tokens: int):
    """The `ReferenceTrajectory` of ``case`` under the all-high ``policy``."""
    start = time.perf_counter()
    run, prompt_ids = run_case(model, tokenizer, task, case, policy, max_new_tokens)
    seconds = time.perf_counter() - start
    labels = task.prompt_labels(tokenizer, case) if task.labels_prompts else [()] * len(prompt_ids)
    if len(labels) != len(prompt_ids):
        raise RuntimeError(
            f"case {task.case_id(case)}: the rebuilt prompt has {len(labels)} tokens, generation saw {len(prompt_ids)}"
        )
    return ReferenceTrajectory(
        **asdict(run),
        case_id=task.case_id(case),
        category=task.category(case),
        prompt_ids=prompt_ids,
        prompt_labels=tuple(tuple(token) for token in labels),
        seconds=seconds,
    )


def key_digest(key: Any) -> str:
    """The 20-hex-digit hash naming a cache file: SHA-256 of ``key`` as sorted JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


KEY_LAYOUT_FIELD = "int4_keys"
"""The field of `generation_key` naming a non-row INT4 key layout (absent for row keys)."""


def generation_key(model, tokenizer, task: CalibrationTask, policy: PolicyTable, max_new_tokens: int) -> dict[str, Any]:
    """What a calibration's generations depend on besides the case and the intervention: package version, model
    fingerprint, dtype, generation cap, ``policy``'s window, sinks, tag view and INT4 key layout, and the task's
    `cache_key` (the key of the on-disk caches)."""
    return {
        **task.cache_key,  # BFCL: nothing, its keys stay as before
        "hf_structkv_version": __version__,
        "fingerprint": model_fingerprint(model, tokenizer),
        "dtype": str(model.dtype),
        "max_new_tokens": max_new_tokens,
        "window": policy.window,
        "sink_tokens": policy.sink_tokens,
        **({} if policy.tag_view == "full" else {"tag_view": policy.tag_view}),  # full-view keys stay as before
        **({} if policy.int4_keys == "row" else {KEY_LAYOUT_FIELD: policy.int4_keys}),  # row-key keys stay as before
    }


def reference_trajectories(
    model,
    tokenizer,
    task: CalibrationTask,
    cases: Sequence,
    max_new_tokens: int,
    window: int,
    sink_tokens: int,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    desc: str = "reference",
    tag_view: str = "full",
) -> list[ReferenceTrajectory]:
    """All-high greedy trajectories of ``cases`` (in order), each read from / written to ``cache_dir`` when given
    (one file per case, written as soon as it is generated).

    Args:
        task: what the cases are (`BfclTask`, `SpiderTask`).
        window, sink_tokens, tag_view: the all-high policy's recent window, sinks and tag view (the settings of the
            calibrated table; the recorded tags are of that view).
    """
    task.check_cases(cases, "cases")
    policy = PolicyTable.all_high(model, family=task.family, window=window, sink_tokens=sink_tokens, tag_view=tag_view)
    common = generation_key(model, tokenizer, task, policy, max_new_tokens)
    keys = [{**common, "case": task.case_id(case)} for case in cases]
    paths = [None if cache_dir is None else Path(cache_dir) / f"reference-{key_digest(key)}.json" for key in keys]
    trajectories = [_read_reference(path, key) for path, key in zip(paths, keys, strict=True)]
    missing = [i for i, trajectory in enumerate(trajectories) if trajectory is None]
    for i in tqdm(missing, desc=desc, unit="case", disable=not progress):
        trajectories[i] = _reference(model, tokenizer, task, cases[i], policy, max_new_tokens)
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


def with_position_tags(
    reference: ReferenceTrajectory, position_bins: Sequence[int], family: str
) -> ReferenceTrajectory:
    """``reference`` as a processor of the ``"position_bins"`` view of ``family``'s grammar records it: the same
    tokens (the all-high policy ignores tags, so the trajectory does not depend on the view), each non-stop token
    tagged with its bin alone."""
    bins = tuple(position_bins)
    tags = tuple(
        None if keys is None else ("|".join(position_tag(i, bins, family)),) for i, keys in enumerate(reference.tags)
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
