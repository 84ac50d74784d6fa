"""`InterventionStore`: one measurement per (case, reference tokens, bucket, action) in a `JsonLinesStore`, the
shared shape of the Runtime-V caches (`VerdictStore`: verdicts; `LikelihoodStore`: likelihood losses); `LayoutStores`:
the releases of a calibration with centred INT4 keys shared with the row-key store of the same key."""

from __future__ import annotations

from typing import Any

from ..policy.costs import Action
from .buckets import Bucket
from .jsonl_store import JsonLinesStore
from .references import KEY_LAYOUT_FIELD, ReferenceTrajectory, key_digest

__all__ = ["InterventionStore", "LayoutStores"]


class InterventionStore(JsonLinesStore):
    """Measurements of interventions ``(bucket, action)`` on calibration cases, one line each:
    ``{"case", "reference", "bucket", "action", FIELD}``, where ``reference`` is a hash of the case's reference
    tokens (a case whose reference changed is not matched). Subclasses name ``FIELD``, describe it (``EXPECTED``)
    and check it (`valid_value`)."""

    ID_FIELDS = ("case", "reference", "bucket", "action")
    FIELD = "value"
    EXPECTED = "a measurement"

    @classmethod
    def valid_value(cls, value: Any) -> bool:
        """Whether ``value`` is a well-formed measurement (read lines failing it are skipped, puts refused)."""
        raise NotImplementedError

    @classmethod
    def accepts(cls, fields: dict[str, Any]) -> bool:
        return cls.valid_value(fields.get(cls.FIELD))

    def get(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> Any:
        """The stored measurement of intervention ``(bucket, action)`` on ``reference``'s case, ``None`` when
        absent."""
        record = self.get_record(self._identity(reference, bucket, action))
        return None if record is None else record[self.FIELD]

    def put(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action, value: Any) -> None:
        """Store ``value`` of intervention ``(bucket, action)`` on ``reference``'s case (appended and flushed at once).

        Raises:
            TypeError: ``value`` is not a well-formed measurement (`valid_value`).
        """
        if not self.valid_value(value):
            raise TypeError(f"{self.FIELD} must be {self.EXPECTED}, got {value!r}")
        self.put_record(self._identity(reference, bucket, action), {self.FIELD: value})

    @staticmethod
    def _identity(reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> tuple[str, str, str, str]:
        if action not in (Action.L, Action.R):
            raise ValueError(f"an intervention applies R or L, got {action!r}")
        return reference.case_id, key_digest(list(reference.tokens)), str(bucket), action.name


class LayoutStores:
    """The Runtime-V store of a calibration whose ``L`` keeps INT4 keys in a layout other than per row: ``R``
    measurements are read from and written to ``release``, the store of the same key without the layout (a release
    keeps no INT4 token, so its measurement is the same in every layout and is shared with row-key runs), ``L``
    measurements to ``lower`` (the layout's own store). Same `get` / `put` as an `InterventionStore`."""

    def __init__(self, release: InterventionStore, lower: InterventionStore):
        if type(release) is not type(lower):
            raise TypeError(
                f"release and lower must be stores of one kind, got {type(release).__name__} and {type(lower).__name__}"
            )
        self.release, self.lower = release, lower

    @classmethod
    def open(cls, store: type[InterventionStore], cache_dir, key: dict[str, Any]):
        """``store.open(cache_dir, key)`` when ``key`` (a `generation_key` and more) names no key layout (row keys),
        else the pair of ``key`` without it (releases) and ``key`` (lowerings)."""
        if KEY_LAYOUT_FIELD not in key:
            return store.open(cache_dir, key)
        shared = {name: value for name, value in key.items() if name != KEY_LAYOUT_FIELD}
        return cls(store.open(cache_dir, shared), store.open(cache_dir, key))

    def _of(self, action: Action) -> InterventionStore:
        return self.release if action == Action.R else self.lower

    def get(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> Any:
        """The stored measurement of ``(bucket, action)`` on ``reference``'s case, ``None`` when absent."""
        return self._of(action).get(reference, bucket, action)

    def put(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action, value: Any) -> None:
        """Store ``value`` of ``(bucket, action)`` on ``reference``'s case, in the store of its action."""
        self._of(action).put(reference, bucket, action, value)
