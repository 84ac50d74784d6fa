"""PASK offline calibration (Algorithm 1, §3.4, §3.6, A.4, B.4, B.6): from task interventions and attention
distortion on a model's own reference trajectories to a frozen `PolicyTable` and `PrefillPolicy`.

Modules, one job each: `task` (what calibration needs of a benchmark: `CalibrationTask`) with `bfcl_task` (BFCL
function calling) and `spider_task` (Spider text-to-SQL, decode only), `buckets` (what an intervention acts on),
`references` (cached all-high trajectories),
`interventions` (single-bucket policies and the exact window shortcut), `task_sensitivity` (Runtime-V), `floors`
(envelope, eq. 5-6), `distortion` (Runtime-D, eq. 7), `path` (priorities eq. 8, greedy nested path), `reserve`
(eqs. 10, 16), `candidates` (tables and nominal budgets), `selection` (eq. 9), `jsonl_store` (the on-disk record
files), `verdicts` (Runtime-V verdicts on disk) and `development_store` (development cases on disk: a stopped
calibration resumes), `settings` (`CalibrationSettings`), `stages` (one stage of Algorithm 1: decode or prefill),
`runner` (`calibrate`), `cli` (``hf-structkv calibrate``).
"""

from .bfcl_task import BfclTask
from .buckets import Bucket
from .development_store import DevCase, DevelopmentStore, candidate_digest
from .floors import DEFAULT_THRESHOLDS, envelope, protection_floor, protection_floors
from .interventions import BucketIntervention, prefill_intervention_plan, reaches_generation
from .path import greedy_path, upgrade_priorities
from .references import ReferenceTrajectory, reference_trajectories
from .reserve import left_quantile, reserve_statistics, reserve_table
from .runner import CalibrationResult, calibrate
from .selection import search_path, select_cheapest
from .settings import CalibrationSettings
from .spider_task import SpiderTask
from .task import CalibrationTask
from .verdicts import VerdictStore

__all__ = [
    "DEFAULT_THRESHOLDS",
    "BfclTask",
    "Bucket",
    "BucketIntervention",
    "CalibrationResult",
    "CalibrationSettings",
    "CalibrationTask",
    "DevCase",
    "DevelopmentStore",
    "ReferenceTrajectory",
    "SpiderTask",
    "VerdictStore",
    "calibrate",
    "candidate_digest",
    "envelope",
    "greedy_path",
    "left_quantile",
    "prefill_intervention_plan",
    "protection_floor",
    "protection_floors",
    "reaches_generation",
    "reference_trajectories",
    "reserve_statistics",
    "reserve_table",
    "search_path",
    "select_cheapest",
    "upgrade_priorities",
]
