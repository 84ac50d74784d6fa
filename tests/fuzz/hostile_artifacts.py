"""Small saved artifacts of every kind, hostile edits of their files, and the judges that decide whether what loaded
from an edited file is right.

`Artifacts.build(folder)` saves, with tiny models, one `CompactedCache`, `PolicyTable`, `PrefillPolicy` and
`HeadBudgets` (plus the shipped illustrative policies, whose entries vary), and a format 2 `CompactedCache` with INT4
heads (`INT4_CACHE`, beside `KINDS`); `Artifacts.copy(kind, into)` copies one into a fresh folder to edit. A judge
(`judge_cache`, `judge_json_artifact`) loads the edited folder: a refusal propagates (the caller classifies it), and a
load returns ``None`` when it is right or a complaint saying how it is silently wrong.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from test_compacted_int4_cache import int4_cache
from test_hub import TOKENIZER, compacted_cache, context_ids, tiny_llama

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.compaction.budgets import HeadBudgets
from hf_structkv.policy.prefill import PrefillPolicy, illustrative_prefill_policy
from hf_structkv.policy.table import PolicyTable, illustrative_policy

DATA_V0_1 = Path(__file__).resolve().parents[1] / "data" / "saved_v0_1"
KINDS = {
    "cache": (CompactedCache, "config.json"),
    "table": (PolicyTable, "policy_table.json"),
    "prefill": (PrefillPolicy, "prefill_policy.json"),
    "budgets": (HeadBudgets, "head_budgets.json"),
}
"""Artifact kind -> (its class, the JSON file an edit targets)."""
INT4_CACHE = "cache_int4"
"""The folder of the saved cache with INT4 heads (each compacted layer: KV head 0 in the model's dtype, KV head 1 in
INT4, key scales per group of `INT4_KEY_GROUP` kept entries)."""
INT4_KEY_GROUP = 8
SERVED_IDS = torch.tensor([[5, 6, 7]])


@dataclass
class Artifacts:
    """The saved originals under ``root`` (one folder per kind) and what they were made from."""

    root: Path
    model: Any = field(repr=False)
    cache: CompactedCache = field(repr=False)
    int4_cache: CompactedCache = field(repr=False)

    @classmethod
    def build(cls, root: Path) -> Artifacts:
        model = tiny_llama()
        cache = compacted_cache(model, TOKENIZER)
        cache.save_pretrained(root / "cache")
        int4_cache(model, context_ids(), key_group=INT4_KEY_GROUP)[0].save_pretrained(root / INT4_CACHE)
        int4 = CompactedCache.load(root / INT4_CACHE)  # as saved: metadata as the file holds it
        illustrative_policy().save_pretrained(root / "table")
        illustrative_prefill_policy().save_pretrained(root / "prefill")
        HeadBudgets.uniform(model).save_pretrained(root / "budgets")
        hf_structkv.enable(model)
        return cls(root, model, cache, int4)

    def copy(self, kind: str, into: Path) -> Path:
        """A fresh copy of the saved ``kind`` at ``into`` (replacing what was there)."""
        shutil.rmtree(into, ignore_errors=True)
        shutil.copytree(self.root / kind, into)
        return into

    def record(self, kind: str) -> dict[str, Any]:
        """The parsed JSON file of the saved ``kind``."""
        return json.loads((self.root / kind / KINDS[kind][1]).read_text())

    def served(self, cache: CompactedCache) -> torch.Tensor:
        """Logits of `SERVED_IDS` after ``cache``'s context (a copy: ``cache`` is not changed)."""
        with torch.no_grad():
            return self.model(SERVED_IDS, cache=cache.copy(), use_cache=True).logits


# ---------------------------------------------------------------------------------------------------- JSON edits
def json_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a parsed JSON value, the root excluded (lists: their first and last item)."""
    paths = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = [(i, value[i]) for i in sorted({0, len(value) - 1})] if value else []
    else:
        items = []
    for key, item in items:
        paths.append((*prefix, key))
        paths.extend(json_paths(item, (*prefix, key)))
    return paths


def edited(record: dict[str, Any], path: tuple, value: Any = None, *, delete: bool = False) -> dict[str, Any]:
    """A deep copy of ``record`` with the item at ``path`` set to ``value`` (or removed)."""
    record = copy.deepcopy(record)
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return record


def path_words(path: tuple) -> tuple[str, ...]:
    """The names a refusal of an edit at ``path`` may give: the object keys along it (``head_lengths``,
    ``fingerprint``, ...)."""
    return tuple(str(key) for key in path if isinstance(key, str))


def nested(depth: int) -> Any:
    """A JSON list nested ``depth`` deep."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def write_json(path: Path, record: Any) -> None:
    path.write_text(json.dumps(record))


def rehash(folder: Path) -> None:
    """Record the SHA-256 of the folder's (edited) ``cache.safetensors`` in its ``config.json``, so that a load goes
    past the content hash to the checks behind it."""
    config = json.loads((folder / "config.json").read_text())
    config["tensors_sha256"] = hashlib.sha256((folder / "cache.safetensors").read_bytes()).hexdigest()
    write_json(folder / "config.json", config)


def safetensors_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    """``(header, data)`` of a safetensors file."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def write_safetensors(path: Path, header: Any, data: bytes) -> None:
    """A safetensors file of ``header`` (any JSON) and ``data``, its header padded with spaces to 8 bytes."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


# ---------------------------------------------------------------------------------------------------- judges
def same_json(a: Any, b: Any) -> bool:
    """JSON equality that tells ``true`` from ``1`` and ``1`` from ``1.0``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def judge_cache(arts: Artifacts, folder: Path, *, same_tensors: bool = True, original: str = "cache") -> str | None:
    """Load the edited cache ``folder`` with and without the model and serve it; ``None`` when it is right.

    Right means: what loaded holds the config's metadata, serves finite logits, round-trips through a save, and
    (``same_tensors``: the edit left the tensors alone) holds the original tensors and context length and serves the
    original's logits exactly (the original: ``arts.cache``, or ``arts.int4_cache`` for ``original=INT4_CACHE``).
    """
    source = arts.int4_cache if original == INT4_CACHE else arts.cache
    CompactedCache.load(folder, model=arts.model)
    loaded = CompactedCache.load(folder)
    logits = arts.served(loaded)  # a structural difference from the serving model is refused here
    config = json.loads((folder / "config.json").read_text())
    if not torch.isfinite(logits).all():
        return "served logits hold NaN or inf"
    if any(not same_json(config[key], value) for key, value in loaded.metadata.items()):
        return "the loaded metadata differs from config.json"
    if same_tensors:
        if loaded.original_length != source.original_length or not _same_tensors(loaded, source):
            return f"loaded a different context (original_length {loaded.original_length})"
        if not torch.equal(logits, arts.served(source)):
            return "served logits differ from the original cache's"
    again = folder.with_name(folder.name + "-resaved")
    shutil.rmtree(again, ignore_errors=True)
    loaded.save_pretrained(again)
    reloaded = CompactedCache.load(again)
    if not _same_tensors(loaded, reloaded) or reloaded.metadata != loaded.metadata:
        return "did not round-trip through save_pretrained"
    return None


def _same_tensors(a: CompactedCache, b: CompactedCache) -> bool:
    pairs = [(x, y) for la, lb in zip(a.layers, b.layers) for x, y in zip(la.context_tensors(), lb.context_tensors())]
    return len(a.layers) == len(b.layers) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def judge_json_artifact(kind: str, folder: Path, record: dict[str, Any] | None = None) -> str | None:
    """Load the edited policy or budgets ``folder`` (whose file holds ``record``; ``None``: read it); ``None`` when
    what loaded is the file (no value coerced, dropped or defaulted wrongly) and round-trips through a save."""
    cls, name = KINDS[kind]
    loaded = cls.from_pretrained(folder)
    if record is None:
        try:
            record = json.loads((folder / name).read_text())
        except ValueError:
            return f"loaded although {name} is not JSON"
    if not same_json(_canonical(kind, _json_of(loaded)), _canonical(kind, record)):
        return "what loaded is not what the file holds"
    again = folder.with_name(folder.name + "-resaved")
    shutil.rmtree(again, ignore_errors=True)
    loaded.save_pretrained(again)
    if not same_json(_json_of(cls.from_pretrained(again)), _json_of(loaded)):
        return "did not round-trip through save_pretrained"
    return None


def _json_of(artifact: Any) -> dict[str, Any]:
    return artifact.to_config() if isinstance(artifact, HeadBudgets) else artifact.to_json_dict()


def _canonical(kind: str, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without the writer's version, with a table's optional fields filled in and head-budget shares
    normalised to sum 1 (what loading does to them)."""
    record = {key: value for key, value in record.items() if key != "hf_structkv_version"}
    if kind == "table":
        record = {"tag_view": "full", "position_bins": [], **record}
    if kind == "budgets":
        record = {"provenance": {}, **record}
        total = math.fsum(s for shares in record["weights"].values() for s in shares)
        record["weights"] = {k: [round(s / total, 12) for s in shares] for k, shares in record["weights"].items()}
    return record
