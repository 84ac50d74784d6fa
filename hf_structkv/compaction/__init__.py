"""Offline compaction: per-head methods (`compact_head`) and the end-to-end `compact(...)` pipeline."""

from ..attention.recording import capture_queries
from .budget_sensitivity import compute_head_budgets
from .budgets import HeadBudgets, UniformBudgets, default_head_budgets
from .chunks import chunk_spans, context_documents
from .context_prefill import prefill_context
from .dataset import compact_dataset, compact_document
from .head_compaction import HEAD_METHODS, compact_head, compact_head_to_bytes, register_head_method, relative_loss
from .head_method import HeadMethod
from .head_statistics import CompactedHead
from .pipeline import compact, resolve_budgets
from .queries import Conversation, conversation_queries, repeat_pass_queries, subsample_queries
from .self_study import SelfStudy, self_study_conversations, self_study_queries
from .settings import METHODS, QUERY_TIERS, CompactionSettings

__all__ = [
    "HEAD_METHODS",
    "HeadBudgets",
    "METHODS",
    "QUERY_TIERS",
    "CompactedHead",
    "CompactionSettings",
    "Conversation",
    "HeadMethod",
    "SelfStudy",
    "UniformBudgets",
    "capture_queries",
    "chunk_spans",
    "compact",
    "compute_head_budgets",
    "default_head_budgets",
    "compact_dataset",
    "compact_document",
    "context_documents",
    "conversation_queries",
    "compact_head",
    "compact_head_to_bytes",
    "prefill_context",
    "register_head_method",
    "relative_loss",
    "repeat_pass_queries",
    "resolve_budgets",
    "self_study_conversations",
    "self_study_queries",
    "subsample_queries",
]
