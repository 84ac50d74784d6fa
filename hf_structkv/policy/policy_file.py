"""What PASK's saved policies (`PolicyTable`, `PrefillPolicy`) share: the checks of their records (provenance,
thresholds, calibration, fingerprint) and the persistence convention of every hf_structkv artifact."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from ..persistence import (
    CARD_NAME,
    SavedArtifact,
    check_fingerprint,
    check_same_model,
    check_same_tokenizer,
    model_fingerprint,
    read_json_object,
    write_text_file,
)
from ..validation import is_int, is_number
from .costs import GroupCosts
from .policy_json import json_object, json_text

__all__ = ["PROVENANCES", "PolicyFile", "shipped_policy"]

PROVENANCES = ("calibrated", "illustrative", "reference")

SavedPolicy = TypeVar("SavedPolicy", bound="PolicyFile")


class PolicyFile(SavedArtifact):
    """What `PolicyTable` and `PrefillPolicy` share as policies saved in one JSON file: the checks of their
    ``provenance``, ``description``, ``thresholds``, ``calibration`` and ``fingerprint`` fields (`_check_records`,
    run by their ``__post_init__`` after ``costs`` is checked and the mappings frozen), and the
    persistence convention.

    A subclass names its JSON file (``_FILE_NAME``), the files it saves (``SAVED_FILES``: that file and the card) and
    itself in messages (``_WHAT``), and implements
    ``to_json_dict``, ``from_json_dict`` and ``render_card(repo_id)``; this class gives it the persistence convention
    of every hf_structkv artifact (`from_pretrained`, `save_pretrained`, `push_to_hub`, a model card).
    """

    _FILE_NAME: ClassVar[str]
    _WHAT: ClassVar[str]

    def _check_cost_values(self) -> None:
        """``costs`` holds one integer >= 0 per layer group in ``elements``, ``rows`` and ``padding``."""
        for name in ("elements", "rows", "padding"):
            values = getattr(self.costs, name)
            if len(values) != len(self.costs.groups) or not all(is_int(v) and v >= 0 for v in values):
                raise ValueError(
                    f"{type(self).__name__}.costs.{name} (group_costs.{name} in the file) must hold one integer >= 0 "
                    f"per layer group, got {values}"
                )

    def _check_records(self) -> None:
        if self.provenance not in PROVENANCES:
            raise ValueError(f"provenance must be one of {PROVENANCES}, got {self.provenance!r}")
        if not isinstance(self.description, str):
            raise TypeError(f"description must be a str, got {type(self.description).__name__}")
        for name, value in self.thresholds.items():
            if not isinstance(name, str) or not is_number(value):
                raise ValueError(f"thresholds must map names to finite numbers, got {name!r}: {value!r}")
        try:
            calibration = json.loads(json.dumps(dict(self.calibration), allow_nan=False))
        except (TypeError, ValueError) as err:
            raise ValueError(f"calibration must be JSON-serialisable (no NaN): {err}") from None
        object.__setattr__(self, "calibration", MappingProxyType(calibration))
        if self.fingerprint is None:
            if self.provenance == "calibrated":
                raise ValueError(
                    f"a calibrated {self._WHAT} needs the fingerprint of its model: "
                    "fingerprint=model_fingerprint(model) (from hf_structkv.persistence import model_fingerprint)"
                )
            return
        if not isinstance(self.fingerprint, Mapping):
            raise TypeError(f"fingerprint must be a dict or None, got {type(self.fingerprint).__name__}")
        check_fingerprint(dict(self.fingerprint), "the fingerprint")  # sizes bounded before use
        layers = self.fingerprint["num_hidden_layers"]
        kv_heads, head_dim = self.fingerprint["num_key_value_heads"], self.fingerprint["head_dim"]
        groups = len(self.costs.groups)
        if GroupCosts.from_dims([kv_heads] * layers, [head_dim] * layers, groups) != self.costs:
            raise ValueError(
                f"costs do not match the fingerprint's model ({layers} layers, {kv_heads} KV heads, head_dim "
                f"{head_dim}): build them with GroupCosts.from_config(model.config, groups={groups}) (group_costs in "
                f"{self._FILE_NAME})"
            )
        object.__setattr__(self, "fingerprint", json.loads(json.dumps(dict(self.fingerprint), allow_nan=False)))

    def _records_to_json(self) -> dict[str, Any]:
        """The JSON fields of the checked records (`_check_records`), as both files write them."""
        return {
            "thresholds": dict(self.thresholds),
            "calibration": dict(self.calibration),
            "provenance": self.provenance,
            "description": self.description,
            "fingerprint": None if self.fingerprint is None else dict(self.fingerprint),
        }

    @classmethod
    def _records_from_json(cls, record: dict[str, Any]) -> dict[str, Any]:
        """The constructor keywords of the records in a parsed file (``thresholds`` and ``calibration`` must be JSON
        objects; the rest is checked by `_check_records`)."""
        for name, kind in (("provenance", str), ("description", str), ("fingerprint", (dict, type(None)))):
            if not isinstance(record[name], kind):
                expected = "a JSON object or null" if name == "fingerprint" else "a string"
                raise ValueError(f"{name} in {cls._FILE_NAME} must be {expected}, got {type(record[name]).__name__}")
        return {
            "thresholds": json_object(record["thresholds"], "thresholds", file_name=cls._FILE_NAME),
            "calibration": json_object(record["calibration"], "calibration", file_name=cls._FILE_NAME),
            "provenance": record["provenance"],
            "description": record["description"],
            "fingerprint": record["fingerprint"],
        }

    @classmethod
    def _from_folder(cls: type[SavedPolicy], source: Path, *, model: Any, tokenizer: Any) -> SavedPolicy:
        """Read the JSON record (in ``source``, or ``source`` itself), then check ``model`` (`check_model`) and
        ``tokenizer`` (its vocabulary hash must equal the fingerprint's; a policy without one cannot be checked and
        raises) when given.

        Raises:
            ValueError: a missing or invalid JSON file (see ``from_json_dict``), or a model / tokenizer the policy
                was not built for.
        """
        folder, name = (source.parent, source.name) if source.is_file() else (source, cls._FILE_NAME)
        policy = cls.from_json_dict(read_json_object(folder, name, cls._WHAT))
        if model is not None:
            policy.check_model(model)
        if tokenizer is not None:
            check_same_tokenizer(dict(policy.fingerprint or {}), tokenizer, what=cls._WHAT)
        return policy

    def check_model(self, model: Any) -> None:
        """Raise ``ValueError`` unless ``model`` has this policy's fingerprint (when recorded) and layer-group costs."""
        if self.fingerprint is not None:
            check_same_model(dict(self.fingerprint), model_fingerprint(model), what=self._WHAT)
        costs = GroupCosts.from_config(model.config, len(self.costs.groups))
        if costs != self.costs:
            raise ValueError(
                f"this {self._WHAT} was built for other layer dimensions: its group costs are {self.costs}, the "
                f"model's are {costs}"
            )

    def _write_folder(self, directory: Path, repo_id: str | None) -> None:
        """The JSON record and the card; the record (which makes the folder a policy) removed first and written
        last, so a crash never leaves a loadable mix of two policies."""
        text = json_text(self.to_json_dict()) + "\n"
        card = self.render_card(repo_id=repo_id)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / self._FILE_NAME).unlink(missing_ok=True)
        write_text_file(directory / CARD_NAME, card)
        write_text_file(directory / self._FILE_NAME, text)

    def _commit_message(self) -> str:
        return f"Upload {self.provenance} PASK {self._WHAT} with hf_structkv"


def shipped_policy(cls: type[SavedPolicy], name: str, model: Any) -> SavedPolicy:
    """Load the policy folder ``hf_structkv/data/policies/<name>`` shipped with the package with
    ``cls.from_pretrained`` (checked against ``model`` when given)."""
    resource = importlib.resources.files("hf_structkv") / "data" / "policies" / name
    with importlib.resources.as_file(resource) as folder:
        return cls.from_pretrained(folder, model=model)
