"""Algorithm 1 end to end: reference trajectories, Runtime-V, Runtime-D, priorities, greedy paths, budgets, reserve
and development selection, for the decode table and then the prefill companion (decode held all-high).

`calibrate` returns a `CalibrationResult`: the selected `PolicyTable` (provenance ``"calibrated"``, card fields
``thresholds`` and ``calibration`` filled; ``None`` when the decode stage is not run), the selected `PrefillPolicy`
(``None`` when the prefill stage is not run) and a JSON report of every measurement (``V``, ``D``, ``N̄``, ``ρ``,
floors, paths, development results). The benchmark is a `CalibrationTask` (BFCL by default, `SpiderTask` for
text-to-SQL); each stage runs as `stages.run_stage`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..persistence import model_fingerprint, write_text_file
from ..policy.costs import Action, GroupCosts
from ..policy.prefill import PrefillPolicy
from ..policy.table import PolicyEntry, PolicyTable
from ..structure.prompt_spans import PROMPT_LABELS
from ..structure.tags import position_bin_starts
from ..version import __version__
from .bfcl_task import BfclTask
from .candidates import all_high_candidate
from .development_store import DevelopmentStore
from .distortion import DistortionStore
from .intervention_store import LayoutStores
from .likelihood import DevelopmentReplay, DevelopmentReplayStore, LikelihoodStore
from .references import generation_key, reference_trajectories, with_position_tags
from .replayed_verdicts import ReplayedVerdictStore
from .settings import CalibrationSettings, settings_json
from .stages import StageInputs, decode_stage, prefill_stage, replayed_counts, run_stage, stage_runtime_v
from .task import CalibrationTask
from .task_sensitivity import ACTIONS, needs_generation
from .verdicts import VerdictStore

RUNTIME_V_STORES = {"verdict": VerdictStore, "likelihood": LikelihoodStore, "replayed_verdict": ReplayedVerdictStore}
"""The Runtime-V store of each sensitivity (`SENSITIVITIES`)."""

__all__ = ["REPORT_NAME", "CalibrationResult", "calibrate"]

REPORT_NAME = "calibration_report.json"
DECODE_FOLDER, PREFILL_FOLDER = "decode", "prefill"  # where a two-stage result puts its two policies
_DEFAULT_SETTINGS = CalibrationSettings()


@dataclass
class CalibrationResult:
    """The selected decode table (``None`` without the decode stage), the selected prefill policy (``None`` without
    the prefill stage), the report."""

    table: PolicyTable | None
    prefill_policy: PrefillPolicy | None
    report: dict[str, Any] = field(default_factory=dict)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the report (``calibration_report.json``) and each selected policy as a loadable folder with its card.

        One stage: the policy is written into ``directory`` itself (``policy_table.json`` or ``prefill_policy.json``,
        and ``README.md``). Both stages: the table into ``directory / "decode"`` and the prefill policy into
        ``directory / "prefill"``, so each keeps its own card (``README.md`` is never shared by two artifacts).
        """
        directory = Path(directory)
        both = self.table is not None and self.prefill_policy is not None
        if self.table is not None:
            self.table.save_pretrained(directory / DECODE_FOLDER if both else directory)
        if self.prefill_policy is not None:
            self.prefill_policy.save_pretrained(directory / PREFILL_FOLDER if both else directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_text_file(directory / REPORT_NAME, json.dumps(self.report, indent=1) + "\n")


def calibrate(
    model,
    tokenizer,
    calibration: Sequence,
    development: Sequence,
    settings: CalibrationSettings = _DEFAULT_SETTINGS,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    data: dict[str, Any] | None = None,
    task: CalibrationTask | None = None,
    runtime_v_shard: tuple[int, int] | None = None,
) -> CalibrationResult:
    """Run Algorithm 1 on ``calibration`` (fits) and ``development`` (selection) cases.

    Args:
        calibration, development: cases of ``task`` (`bfcl_split` partitions for BFCL).
        cache_dir: where reference trajectories, Runtime-V verdicts and the development cases of evaluated candidates
            are cached (``None``: not cached); a stopped run started again with the same model and settings resumes
            from what it had generated.
        log: receives progress lines (the time estimate after the reference pass).
        data: a description of the data recorded in the card (benchmark, categories, split seed).
        task: the benchmark (`CalibrationTask`); ``None``: `BfclTask`.
        runtime_v_shard: ``(i, n)``: only fill ``cache_dir``'s Runtime-V store with the interventions on every
            ``n``-th calibration case from the ``i``-th (the buckets are those of all cases), then return a result
            without policies whose report counts what was measured: ``n`` processes sharing ``cache_dir`` split
            Runtime-V, and a full run afterwards reads it back.

    Raises:
        ValueError: empty case lists, overlapping calibration and development cases, invalid settings, the prefill
            stage for a task without prompt labels.
    """
    task = BfclTask() if task is None else task
    if not isinstance(task, CalibrationTask):
        raise TypeError(f"task must be a CalibrationTask (BfclTask, SpiderTask), got {type(task).__name__}")
    task.check_cases(calibration, "calibration")
    task.check_cases(development, "development")
    overlap = {task.case_id(c) for c in calibration} & {task.case_id(c) for c in development}
    if overlap:
        raise ValueError(f"calibration and development cases overlap: {sorted(overlap)[:5]}; use disjoint splits")
    if "prefill" in settings.stages and not task.labels_prompts:
        raise ValueError(
            f"the {task.name} task has no prompt span labels, which the prefill stage calibrates: pass "
            "stages=('decode',) (CLI: --decode-only)"
        )
    if runtime_v_shard is not None:
        index, count = runtime_v_shard if isinstance(runtime_v_shard, tuple) and len(runtime_v_shard) == 2 else (0, 0)
        if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
            raise ValueError(f"runtime_v_shard must be a tuple (i, n) with 0 <= i < n, got {runtime_v_shard!r}")
        if cache_dir is None:
            raise ValueError("runtime_v_shard fills the Runtime-V store of cache_dir: pass cache_dir")
    torch.manual_seed(settings.seed)
    start = time.perf_counter()
    costs = GroupCosts.from_config(model.config, settings.layer_groups)
    fingerprint = model_fingerprint(model)
    by_position = settings.tag_view == "position_bins"
    common = dict(
        max_new_tokens=settings.max_new_tokens,
        window=settings.window,
        sink_tokens=settings.sink_tokens,
        tag_view="full" if by_position else settings.tag_view,
    )
    refs = reference_trajectories(
        model, tokenizer, task, calibration, **common, cache_dir=cache_dir, progress=progress, desc="reference (cal)"
    )
    dev_refs = reference_trajectories(
        model, tokenizer, task, development, **common, cache_dir=cache_dir, progress=progress, desc="reference (dev)"
    )
    view = {"tag_view": settings.tag_view, "position_bins": (), "int4_keys": settings.int4_keys}
    if by_position:  # C.5: bins from the Full-KV calibration completion lengths, per category
        lengths: dict[str, list[int]] = {}
        for r in refs:
            lengths.setdefault(r.category, []).append(r.num_decoded)
        view["position_bins"] = position_bin_starts(lengths)
        refs = [with_position_tags(r, view["position_bins"], task.family) for r in refs]
        dev_refs = [with_position_tags(r, view["position_bins"], task.family) for r in dev_refs]
    reference = PolicyTable.all_high(
        model, family=task.family, window=settings.window, sink_tokens=settings.sink_tokens, **view
    )
    reference_error = sum(not r.valid for r in dev_refs) / len(dev_refs)
    report: dict[str, Any] = {
        "hf_structkv_version": __version__,
        "settings": settings_json(settings),
        "data": dict(data or {}),
        "position_bins": list(view["position_bins"]),
        "calibration_cases": [r.case_id for r in refs],
        "development_cases": [r.case_id for r in dev_refs],
        "reference": {
            "calibration_accuracy": sum(r.valid for r in refs) / len(refs),
            "development_accuracy": 1 - reference_error,
        },
    }
    store_key = {
        **generation_key(model, tokenizer, task, reference, settings.max_new_tokens),
        "layer_groups": settings.layer_groups,
        "position_bins": view["position_bins"],
    }
    replay_store = None if cache_dir is None else DevelopmentReplayStore.open(cache_dir, store_key)
    dev_replay = DevelopmentReplay(model, dev_refs, reference, replay_store)  # likelihood sensitivity only; on use
    inputs = StageInputs(model, tokenizer, task, development, dev_replay, refs, reference, costs, settings, fingerprint)
    stages = []
    if "decode" in settings.stages:
        stages.append(decode_stage(inputs, view))
    if "prefill" in settings.stages:
        stages.append(prefill_stage(inputs))
    stores = {
        stage.name: (None, None, None, None)
        if cache_dir is None
        else (
            LayoutStores.open(RUNTIME_V_STORES[settings.sensitivity], cache_dir, {**store_key, "stage": stage.name}),
            DevelopmentStore.open(cache_dir, {**store_key, "stage": stage.name}),
            DistortionStore.open(cache_dir, {**store_key, "stage": stage.name}),
            LayoutStores.open(VerdictStore, cache_dir, {**store_key, "stage": stage.name})
            if stage.by_likelihood
            else None,
        )
        for stage in stages
    }
    _log_estimate(log, settings, refs, dev_refs, stages, stores)
    if runtime_v_shard is not None:
        return _runtime_v_shard(runtime_v_shard, stages, stores, task, calibration, refs, settings, progress, start)
    selected = {}
    for stage in stages:
        selected[stage.name], report[stage.name] = run_stage(
            stage, task, calibration, refs, reference_error, settings, model, costs, progress, log, *stores[stage.name]
        )
    report["seconds"] = round(time.perf_counter() - start, 1)
    table = prefill = None
    if "decode" in selected:
        table = _final_table(selected["decode"], report, settings, costs, fingerprint, view, task)
    if "prefill" in selected:
        prefill = _final_prefill(selected["prefill"], report, settings, costs, fingerprint)
    return CalibrationResult(table=table, prefill_policy=prefill, report=report)


def _runtime_v_shard(shard, stages, stores, task, calibration, refs, settings, progress, start) -> CalibrationResult:
    """Runtime-V of every stage on the shard's calibration cases into the stores (`calibrate`'s
    ``runtime_v_shard``)."""
    index, count = shard
    report: dict[str, Any] = {"runtime_v_shard": [index, count]}
    for stage in stages:
        runs = stage_runtime_v(
            stage, task, calibration[index::count], refs[index::count], settings, progress, stores[stage.name][0]
        )
        report[stage.name] = {"measured": sum(runs.generated.values()), "reused": runs.reused, **replayed_counts(stage)}
    report["seconds"] = round(time.perf_counter() - start, 1)
    return CalibrationResult(table=None, prefill_policy=None, report=report)


# ------------------------------------------------------------------------------------------------ outputs
def _final_table(selected, report, settings, costs, fingerprint, view, task: CalibrationTask) -> PolicyTable:
    chosen = report["decode"]["selected"]
    card = _card(report, settings, "decode")
    if selected is None:
        return all_high_candidate(
            costs,
            task.family,
            sink_tokens=settings.sink_tokens,
            window=settings.window,
            fingerprint=fingerprint,
            thresholds={"alpha_D": settings.alpha_decode},
            **view,
            calibration={**card, "decode_budget": 1.0, "selected": chosen},
            description="PASK Algorithm 1 found no candidate within alpha_D: the all-high fallback (B_D = 1).",
        )
    return dataclasses.replace(
        selected,
        thresholds={**selected.thresholds, "alpha_D": settings.alpha_decode},
        calibration={**card, "decode_budget": selected.budget, "selected": chosen},
        description=(
            f"PASK Algorithm 1 (offline calibration) on {len(report['calibration_cases'])} calibration and "
            f"{len(report['development_cases'])} development {task.name} cases; unobserved tags resolve to H."
        ),
    )


def _final_prefill(selected, report, settings, costs, fingerprint) -> PrefillPolicy:
    chosen = report["prefill"]["selected"]
    card = {**_card(report, settings, "prefill"), "selected": chosen}
    if selected is None:
        high = PolicyEntry((Action.H,) * 3, (Action.H,) * 3, ((0.0, 0.0),) * 3)
        return PrefillPolicy(
            costs=costs,
            entries=dict.fromkeys(PROMPT_LABELS, high),
            budget=1.0,
            thresholds={"alpha_P": settings.alpha_prefill},
            calibration={**card, "prefill_budget": 1.0},
            fingerprint=fingerprint,
            int4_keys=settings.int4_keys,
            description="PASK prefill calibration found no candidate within alpha_P: all prompt tokens H (B_P = 1).",
        )
    return dataclasses.replace(
        selected,
        thresholds={**selected.thresholds, "alpha_P": settings.alpha_prefill},
        calibration={**card, "prefill_budget": selected.budget},
        description="PASK prefill companion calibrated with Algorithm 1's machinery (decode held all-high).",
    )


def _card(report, settings, stage) -> dict[str, Any]:
    return {
        "algorithm": f"PASK Algorithm 1 ({stage})",
        "data": report["data"],
        "calibration_cases": len(report["calibration_cases"]),
        "development_cases": len(report["development_cases"]),
        "settings": settings_json(settings),
        "reference_development_accuracy": report["reference"]["development_accuracy"],
        "runtime_v_generations": report[stage]["runtime_v_generations"],
        "seconds": report["seconds"],
    }


def _log_estimate(log, settings, refs, dev_refs, stages, stores) -> None:
    """Print the work ahead. Verdicts: the number of generations and their time at the reference pass's mean seconds
    per case: Runtime-V exactly (the needed interventions whose verdicts the cache does not hold), development
    evaluations at most (every candidate the selection may evaluate, less the cases the cache holds for none of them:
    not counted). Likelihood: the number of Runtime-V and development replays (one forward each) and at most
    ``max_confirmations`` development generations per case."""
    per_case = sum(r.seconds for r in (*refs, *dev_refs)) / (len(refs) + len(dev_refs))
    runtime_v = cached = evaluations = 0
    for stage in stages:
        measured = stores[stage.name][0]
        for bucket in stage.buckets:
            for r in refs:
                if needs_generation(r, bucket, stage.name, settings.sink_tokens, settings.window):
                    for action in ACTIONS:
                        if measured is not None and measured.get(r, bucket, action) is not None:
                            cached += 1
                        else:
                            runtime_v += 1
        path_length = 1 + 2 * len(stage.buckets)
        candidates = min(path_length, settings.max_dev_candidates or path_length) * len(settings.thresholds)
        evaluations += candidates * len(dev_refs)
    head = f"reference pass: {len(refs)} calibration + {len(dev_refs)} development cases, {per_case:.1f} s per case; "
    if settings.sensitivity == "likelihood":
        confirmations = settings.max_confirmations * len(dev_refs) * len(stages)
        log(
            head + f"ahead: {runtime_v} Runtime-V replays ({cached} more read from the cache), at most {evaluations} "
            f"development replays and at most {confirmations} development generations (about "
            f"{confirmations * per_case / 60:.0f} min) to confirm the selection"
        )
        return
    if settings.sensitivity == "replayed_verdict":
        log(
            head + f"ahead: {runtime_v} Runtime-V replays, each generated only where its greedy reply leaves the "
            f"reference ({cached} more read from the cache), and at most {evaluations} development generations"
        )
        return
    generations = runtime_v + evaluations
    log(
        head + f"ahead: {runtime_v} Runtime-V generations ({cached} more read from the cache) and at most "
        f"{evaluations} development generations (fewer when the selection stops early or the cache holds them), at "
        f"most about {generations * per_case / 60:.0f} min"
    )
