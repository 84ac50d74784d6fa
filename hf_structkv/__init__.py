"""hf_structkv: smaller KV caches for HuggingFace transformers.

- `CompactedCache`: a long reusable context read once, compacted offline per KV head (kept keys, refit values,
  per-entry logit biases), saved and reused with ``model.generate(past_key_values=...)``.
- `enable(model)`: switches a model to hf_structkv's registered attention (no patching at import).
"""

from .attention.registry import ATTENTION_NAME, enable, is_enabled
from .cache.compacted import CompactedCache

__all__ = ["ATTENTION_NAME", "CompactedCache", "enable", "is_enabled"]
__version__ = "0.1.0"
