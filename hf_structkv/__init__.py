"""hf_structkv: smaller KV caches for HuggingFace transformers.

- `CompactedCache`: a long reusable context read once, compacted offline per KV head (kept keys, refit values,
  per-entry logit biases), saved and reused with ``model.generate(cache=...)`` (or the older ``past_key_values=``).
- `StructuredMixedPrecisionCache` (PASK): during constrained decoding, each generated token's K/V is kept BF16,
  packed INT4 or released per layer group, as a frozen `PolicyTable` decides from the structural tag that the
  `StructuralLogitsProcessor` (lm-format-enforcer) resolves; `generate_calls` wires them into one call, `generate_sql`
  does the same for text-to-SQL under one database's SQL grammar (xgrammar).
- `calibrate` (PASK Algorithm 1): calibrates a `PolicyTable` and a `PrefillPolicy` from interventions and attention
  distortion on the model's own BFCL trajectories (``hf-structkv calibrate``).
- `enable(model)`: switches a model to hf_structkv's registered attention (no patching at import).
"""

from .attention.registry import ATTENTION_NAME, enable, is_enabled
from .cache.compacted import CompactedCache
from .cache.mixed_precision import StructuredMixedPrecisionCache
from .calibration import calibrate
from .compaction.pipeline import compact
from .policy import PolicyController, PolicyTable, illustrative_policy
from .sql_generation import generate_sql
from .structure import StructuralLogitsProcessor
from .structured_generation import generate_calls
from .version import __version__

__all__ = [
    "__version__",
    "ATTENTION_NAME",
    "CompactedCache",
    "PolicyController",
    "PolicyTable",
    "StructuralLogitsProcessor",
    "StructuredMixedPrecisionCache",
    "calibrate",
    "compact",
    "enable",
    "generate_calls",
    "generate_sql",
    "illustrative_policy",
    "is_enabled",
]
