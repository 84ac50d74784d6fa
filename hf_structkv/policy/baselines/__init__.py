"""Decode-time retention baselines on PASK's mixed-precision cache, with the same ledger accounting (B.3): each is a
`RetentionPolicy` (``costs``, ``sink_tokens``, ``window``, ``controller(costs)``) whose controllers also plan the
prompt at its first commit; the attention-based ones ask the cache for attention statistics (`AttentionMass`,
torch reference only: a second, statistics-only pass over the same partitions after attention, so the attention
output is untouched). Every policy has ``expected_budget(lengths)`` (the knob arithmetic) and
``for_budget(model, target, lengths, **knobs)``, which picks its budget knob from development lengths.

Full KV is `PolicyTable.all_high`. Stretch rows of the PASK paper not implemented here, and why:
RocketKV (its decode stage is sparse attention that *reads* a selected subset per step while keeping everything
stored: a kernel change, not a retention decision), LazyEviction (delays eviction until
recurrence is observed: a decision that can be revisited, which this cache's commit-once rule forbids),
TriAxialKV (per-tag INT2 / INT4 allocation: the cache has no INT2 tier) and Transactional Attention (semantic anchors
and sponsorship vouchers: no reference implementation or specification precise enough to reproduce).
"""

from .criticalkv import CriticalKV
from .h2o import H2O
from .mikv import MiKV
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

__all__ = ["H2O", "CriticalKV", "MiKV", "SnapKV", "StreamingLLM"]
