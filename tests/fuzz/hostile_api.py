"""The fixed catalogue of hostile API arguments: every argument of `compact_head`, `compact`,
`CompactedCache.from_selection`, `generation_inputs`, `quantize_int4`, the `PolicyTable`, `PrefillPolicy`,
`PolicyEntry` and `HeadBudgets` constructors, `HeadBudgets.token_budgets` and `StructuredMixedPrecisionCache`,
replaced one at a time by a wrong type, sign, size or a non-finite or unservable number. A call that returns is
judged: finite results that keep the function's promise, artifacts that round-trip through a save."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hostile_artifacts import Artifacts
from hostile_outcomes import Case
from test_cli import ChatCharTokenizer
from test_hub import CONTEXT_LEN, context_ids
from transformers import DynamicCache

from hf_structkv import CompactedCache, StructuredMixedPrecisionCache
from hf_structkv.compaction import compact, compact_head
from hf_structkv.compaction.budgets import CAP_FRACTION, HeadBudgets, default_head_budgets
from hf_structkv.generation import generation_inputs
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.prefill import PrefillPolicy, illustrative_prefill_policy
from hf_structkv.policy.table import PolicyEntry, PolicyTable, illustrative_policy
from hf_structkv.quant.int4 import dequantize_int4, quantize_int4

NAN, INF = float("nan"), float("inf")
BAD_COUNTS = (0, -1, True, 1.5, "4", None, 10**30)
FOLDERS = itertools.count()
"""Numbers the folders judged saves go to (unique within a run)."""
BAD_REALS = (0.0, -1.0, NAN, INF, -INF, True, "4", None, 1e308, 1e-300)


def api_cases(arts: Artifacts, work: Path) -> list[Case]:
    return [
        *_compact_head_cases(),
        *_compact_cases(arts, work),
        *_from_selection_cases(arts, work),
        *_generation_inputs_cases(arts),
        *_quantize_cases(),
        *_policy_cases(work),
        *_head_budget_cases(arts, work),
        *_mixed_precision_cases(arts),
    ]


def _variants(
    target: str, call: Callable[..., Any], base: dict[str, Any], hostile: dict[str, tuple], judge: Callable
) -> list[Case]:
    """One case per hostile value of each argument: ``call(**base)`` with that one argument replaced, its result
    judged by ``judge(result, kwargs)``; a refusal must name the argument."""
    cases = []
    for name, values in hostile.items():
        for n, value in enumerate(values):

            def run(name=name, value=value):
                kwargs = {**base, name: value}
                kwargs = {key: v.make() if isinstance(v, Built) else v for key, v in kwargs.items()}
                return judge(call(**kwargs), kwargs)

            label = value.label if isinstance(value, Built) else f"{value!r:.60}"
            cases.append(Case("api", target, f"{name}={label} #{n}", run, (name,)))
    return cases


@dataclasses.dataclass(frozen=True)
class Built:
    """An argument built when its case runs (fresh tensors and caches), shown as ``label``."""

    label: str
    make: Callable[[], Any]


def labelled(label: str, make: Callable[[], Any]) -> Built:
    return Built(label, make)


def _finite(*tensors: torch.Tensor) -> bool:
    return all(torch.isfinite(t.float()).all() for t in tensors)


# ---------------------------------------------------------------------------------------------------- compaction
def _head_problem() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "keys": torch.randn(24, 16, generator=gen),
        "values": torch.randn(24, 16, generator=gen),
        "queries": torch.randn(40, 16, generator=gen),
        "budget": 6,
    }


def judge_head(head, kwargs) -> str | None:
    if not _finite(head.bias, head.values):
        return "the compacted head holds NaN or inf"
    kept = head.indices.numel()
    if kept > min(kwargs["budget"], kwargs["keys"].shape[0]) or head.values.shape[0] != kept:
        return f"kept {kept} entries for budget {kwargs['budget']}"
    return None


def _compact_head_cases() -> list[Case]:
    base = _head_problem()
    t = base["keys"]
    hostile = {
        "keys": (
            None,
            t.tolist(),
            labelled("int tensor", lambda: t.long()),
            labelled("[24] (1-D)", lambda: t[:, 0]),
            labelled("[24, 16, 1]", lambda: t[..., None]),
            labelled("[0, 16] (empty)", lambda: t[:0]),
            labelled("a NaN", lambda: _with(t, NAN)),
            labelled("an inf", lambda: _with(t, INF)),
            labelled("1e30", lambda: t * 1e30),
            labelled("[24, 8] (other D than the queries)", lambda: t[:, :8]),
            labelled("[23, 16] (other T than the values)", lambda: t[:23]),
            labelled("float16", lambda: t.half()),
        ),
        "values": (
            None,
            labelled("[23, 16]", lambda: base["values"][:23]),
            labelled("a NaN", lambda: _with(base["values"], NAN)),
            labelled("1e30", lambda: base["values"] * 1e30),
            labelled("int tensor", lambda: base["values"].long()),
        ),
        "queries": (
            None,
            labelled("[0, 16] (none)", lambda: base["queries"][:0]),
            labelled("[40, 8]", lambda: base["queries"][:, :8]),
            labelled("a NaN", lambda: _with(base["queries"], NAN)),
            labelled("1e30", lambda: base["queries"] * 1e30),
        ),
        "budget": (*BAD_COUNTS, 24, 25),
        "method": ("nope", "", None, 5),
        "scaling": (0.0, -1.0, NAN, INF, 1e30, "x", True),
        "seed": ("x", 1.5, None),
        "storage": ("fp8", None, "INT4"),
        "key_group": (0, -1, 4),
    }
    return _variants("compact_head", compact_head, base, hostile, judge_head)


def _with(tensor: torch.Tensor, value: float) -> torch.Tensor:
    changed = tensor.clone()
    changed.view(-1)[3] = value
    return changed


def _compact_cases(arts: Artifacts, work: Path) -> list[Case]:
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    base = {"model": arts.model, "tokenizer": ChatCharTokenizer(), "context": ids, "ratio": 4.0, "budgets": "uniform"}
    base |= {"progress": False, "on_policy": False, "query_cap": 64}
    hostile = {
        "context": (
            "",
            labelled("[1, 0]", lambda: ids[:, :0]),
            labelled("[40] (1-D)", lambda: ids[0]),
            labelled("[2, 40]", lambda: ids.repeat(2, 1)),
            labelled("float ids", lambda: ids.float()),
            labelled("ids >= the vocabulary", lambda: ids + 1000),
            labelled("negative ids", lambda: -ids),
            [],
            [""],
            None,
        ),
        "ratio": (*BAD_REALS, 0.5, 10**400),
        "method": ("nope", None),
        "queries": ("nope", None),
        "budgets": ("nope", 5, None),
        "chunk_tokens": (*BAD_COUNTS[:-2], 10**30),
        "seed": ("x", 1.5),
        "query_cap": (0, -1, True, "x"),
        "heldout_fraction": (-0.1, 1.0, NAN, "x"),
        "prefill_chunk_tokens": (0, -5, "x"),
        "block_replay": ("yes", 1),
        "prefix": ("", labelled("[1, 0]", lambda: ids[:, :0])),
    }
    cases = _variants("compact", compact, base, hostile, lambda cache, kw: judge_built_cache(arts, work, cache))

    def other_models_budgets():
        compact(**{**base, "budgets": default_head_budgets()})
        return "compacted with the head budgets of another model"

    cases.append(Case("api", "compact", "budgets=another model's HeadBudgets", other_models_budgets, ("budgets",)))
    for name, value in (("nope", 1), ("pool_factor", 0), ("refit", "yes")):

        def run(name=name, value=value):
            return judge_built_cache(arts, work, compact(**base, **{name: value}))

        cases.append(Case("api", "compact", f"{name}={value!r} (method hyper-parameter)", run, (name,)))
    return cases


def judge_built_cache(arts: Artifacts, work: Path, cache: CompactedCache) -> str | None:
    """A cache an API call built serves finite logits and round-trips through a save."""
    if not torch.isfinite(arts.served(cache)).all():
        return "the cache serves NaN or inf"
    folder = work / f"built-{next(FOLDERS)}"
    cache.save_pretrained(folder)
    loaded = CompactedCache.load(folder)
    pairs = [
        (a, b)
        for la, lb in zip(cache.layers, loaded.layers)
        for a, b in zip(la.context_tensors(), lb.context_tensors())
    ]
    if not all(torch.equal(a.cpu(), b) for a, b in pairs):
        return "did not round-trip through save_pretrained"
    return None


def _prefilled(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context_ids(), cache=cache)
    return cache


def _from_selection_cases(arts: Artifacts, work: Path) -> list[Case]:
    lengths = (5, 9)

    def indices(make=lambda n: torch.arange(n)):
        return [[make(n) for n in lengths] for _ in range(2)]

    def per_head(make):
        return [[make(n) for n in lengths] for _ in range(2)]

    base = {
        "cache": labelled("prefilled", lambda: _prefilled(arts.model)),
        "indices": labelled("valid", indices),
        "biases": None,
        "values": None,
        "metadata": {"fingerprint": model_fingerprint(arts.model)},
    }
    hostile = {
        "cache": (
            None,
            "x",
            labelled("empty DynamicCache", lambda: DynamicCache()),
            labelled("batch 2", _batch_two(arts)),
        ),
        "indices": (
            None,
            [],
            labelled("one layer", lambda: indices()[:1]),
            labelled("one head", lambda: [[torch.arange(5)]] * 2),
            labelled("float", lambda: indices(lambda n: torch.arange(n).float())),
            labelled("2-D", lambda: indices(lambda n: torch.arange(n)[None])),
            labelled("position T", lambda: indices(lambda n: torch.arange(n) + CONTEXT_LEN - n + 1)),
            labelled("position -1", lambda: indices(lambda n: torch.arange(n) - 1)),
            labelled("a position twice", lambda: indices(lambda n: torch.zeros(n, dtype=torch.long))),
            labelled("lists of ints", lambda: indices(lambda n: list(range(n)))),
        ),
        "biases": (
            labelled("NaN", lambda: per_head(lambda n: torch.full((n,), NAN))),
            labelled("inf", lambda: per_head(lambda n: torch.full((n,), INF))),
            labelled("1e30", lambda: per_head(lambda n: torch.full((n,), 1e30))),
            labelled("89 (e^89 overflows float32)", lambda: per_head(lambda n: torch.full((n,), 89.0))),
            labelled("-1e30", lambda: per_head(lambda n: torch.full((n,), -1e30))),
            labelled("wrong length", lambda: per_head(lambda n: torch.zeros(n + 1))),
            labelled("lists", lambda: per_head(lambda n: [0.0] * n)),
        ),
        "values": (
            labelled("NaN", lambda: per_head(lambda n: torch.full((n, 16), NAN))),
            labelled("1e30", lambda: per_head(lambda n: torch.full((n, 16), 1e30))),
            labelled("3e38", lambda: per_head(lambda n: torch.full((n, 16), 3e38))),
            labelled("[t, 8]", lambda: per_head(lambda n: torch.zeros(n, 8))),
            labelled("float16", lambda: per_head(lambda n: torch.zeros(n, 16, dtype=torch.float16))),
        ),
        "metadata": (
            "x",
            {"fingerprint": "x"},
            {"format_version": 2},
            labelled("a tensor", lambda: {"t": torch.ones(1)}),
        ),
    }
    return _variants(
        "CompactedCache.from_selection",
        CompactedCache.from_selection,
        base,
        hostile,
        lambda cache, kw: judge_built_cache(arts, work, cache),
    )


def _batch_two(arts: Artifacts) -> Callable[[], DynamicCache]:
    def make():
        cache = DynamicCache(config=arts.model.config)
        with torch.no_grad():
            arts.model(context_ids().repeat(2, 1), cache=cache)
        return cache

    return make


# ---------------------------------------------------------------------------------------------------- serving
def _generation_inputs_cases(arts: Artifacts) -> list[Case]:
    question = torch.tensor([[5, 6, 7]])

    def used():
        cache = arts.cache.copy()
        with torch.no_grad():
            arts.model(question, cache=cache, use_cache=True)
        return cache

    base = {
        "cache": labelled("a fresh copy", lambda: arts.cache.copy()),
        "question_ids": question,
        "attention_mask": None,
    }
    hostile = {
        "cache": (None, "x", labelled("empty DynamicCache", lambda: DynamicCache()), labelled("a used cache", used)),
        "question_ids": (
            None,
            [[5, 6, 7]],
            question[0],
            question[None],
            question.float(),
            question[:, :0],
            labelled("numpy", lambda: question.numpy()),
        ),
        "attention_mask": (
            [[1, 1, 1]],
            torch.ones(1, 4, dtype=torch.long),
            torch.ones(3),
            labelled("float", lambda: torch.ones(1, 3)),
            labelled("bool", lambda: torch.ones(1, 3, dtype=torch.bool)),
            labelled("2s", lambda: torch.full((1, 3), 2)),
        ),
    }
    return _variants("generation_inputs", generation_inputs, base, hostile, judge_generation_inputs)


def _quantize_cases() -> list[Case]:
    row = torch.linspace(-1, 1, 16)

    values = (NAN, INF, -INF, 1e38, 3.4e38, -3.4e38, 7 * 65504 + 1.0, 1e-45, 65504.0, -0.0)
    hostile = {
        "x": (
            None,
            [1.0, 2.0],
            torch.ones(4, dtype=torch.long),
            torch.tensor(1.0),
            torch.ones(3, 0),
            *(labelled(f"a row holding {v}", lambda v=v: _with(row, v)) for v in values),
            labelled("bfloat16 1e38", lambda: torch.full((2, 4), 1e38, dtype=torch.bfloat16)),
            labelled("float16 65504", lambda: torch.full((2, 4), 65504.0, dtype=torch.float16)),
            labelled("float64 1e300", lambda: torch.full((2, 4), 1e300, dtype=torch.float64)),
            labelled("one element", lambda: torch.ones(1, 1)),
        )
    }
    return _variants("quantize_int4", quantize_int4, {"x": row}, hostile, judge_quantized)


# ---------------------------------------------------------------------------------------------------- policies
def _policy_cases(work: Path) -> list[Case]:
    table, prefill = illustrative_policy(), illustrative_prefill_policy()
    entry = next(iter(table.entries.values()))
    fingerprint = dict(table.fingerprint)
    bad_fingerprints = (
        "x",
        [],
        {},
        {**fingerprint, "num_hidden_layers": 10**8},
        {**fingerprint, "num_key_value_heads": 0},
        {**fingerprint, "head_dim": 1.5},
        {**fingerprint, "layer_types": ["full_attention"]},
        {**fingerprint, "rope_parameters": "x"},
    )
    records = {
        "provenance": ("guessed", None, 5),
        "description": (None, 5),
        "thresholds": ("x", {"tau": NAN}, {"tau": "low"}, {5: 1.0}),
        "calibration": ("x", {"x": NAN}, labelled("a tensor", lambda: {"t": torch.ones(1)}), {"x": {1, 2}}),
        "fingerprint": bad_fingerprints,
    }
    table_hostile = {
        "family": ("sql ", None, 5, "SQL"),
        "costs": (
            None,
            "x",
            labelled("the tiny model's costs", lambda: GroupCosts.from_config(tiny_model("llama").config)),
        ),
        "entries": ("x", {"nope": entry}, {"literal": "H"}, labelled("2-group entry", lambda: {"literal": _entry(2)})),
        "budget": BAD_REALS + (1.5, -0.1),
        "reserve_by_state": ("x", {"nope": 1.0}, {"in_string": -1.0}, {"in_string": NAN}),
        "reserve_pooled": (-1.0, NAN, INF, "x", True),
        "sink_tokens": (-1, True, 1.5, "4", None),
        "window": (0, -1, True, 1.5, None),
        "tag_view": ("nope", None, 5),
        "position_bins": ([5, 1], "x", [-1], [1.5]),
        **records,
    }
    prefill_hostile = {
        "costs": (None, "x", GroupCosts.from_dims([2] * 24, [64] * 24, 1)),
        "entries": ("x", {"nope": entry}, {"system": "H"}, labelled("2-group entry", lambda: {"system": _entry(2)})),
        "budget": BAD_REALS + (1.5,),
        **records,
    }
    entry_hostile = {
        "action": (("H", "H", "H"), [Action.H] * 3, None, (Action.H,)),
        "floor": (("R",) * 3, None),
        "priorities": (((NAN, 0.0),) * 3, ((-1.0, 0.0),) * 3, ((0.0,),) * 3, None, ((INF, 0.0),) * 3),
    }
    return [
        *_variants("PolicyTable", PolicyTable, init_fields(table), table_hostile, round_trip(work)),
        *_variants("PrefillPolicy", PrefillPolicy, init_fields(prefill), prefill_hostile, round_trip(work)),
        *_variants("PolicyEntry", PolicyEntry, init_fields(entry), entry_hostile, lambda e, kw: None),
    ]


def init_fields(instance) -> dict[str, Any]:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init}


def _entry(groups: int) -> PolicyEntry:
    return PolicyEntry((Action.H,) * groups, (Action.H,) * groups, ((0.0, 0.0),) * groups)


def _head_budget_cases(arts: Artifacts, work: Path) -> list[Case]:
    budgets = HeadBudgets.uniform(arts.model)
    fingerprint = budgets.fingerprint

    hostile = {
        "weights": (
            {},
            "x",
            {0: [1.0, 1.0]},
            {0: [1.0], 1: [1.0]},
            {0: [-1.0, 1.0], 1: [1.0, 1.0]},
            {0: [NAN, 1.0], 1: [1.0, 1.0]},
            {0: [1e308, 1e308], 1: [1e308, 1e308]},
            {0: [0.0, 0.0], 1: [0.0, 0.0]},
            {0: ["1", 1.0], 1: [1.0, 1.0]},
            {"0": [1.0, 1.0], "1": [1.0, 1.0]},
            {0: [True, 1.0], 1: [1.0, 1.0]},
        ),
        "fingerprint": (None, "x", {**fingerprint, "num_hidden_layers": 10**8}, {**fingerprint, "layer_types": "x"}),
        "provenance": ("x", None, labelled("a tensor", lambda: {"t": torch.ones(1)}), {"x": NAN}),
    }
    ratio_hostile = {
        "ratio": (*BAD_REALS, 10**400, 1.0, 1000.0),
        "length": (*BAD_COUNTS, 1, 2**63, 10**18),
    }
    return [
        *_variants("HeadBudgets", HeadBudgets, init_fields(budgets), hostile, round_trip(work)),
        *_variants(
            "HeadBudgets.token_budgets",
            budgets.token_budgets,
            {"ratio": 4.0, "length": 1000},
            ratio_hostile,
            judge_token_budgets,
        ),
    ]


def _mixed_precision_cases(arts: Artifacts) -> list[Case]:
    base = {"model": arts.model, "policy": PolicyTable.all_high(arts.model), "processor": None, "prefill_plan": None}
    hostile = {
        "model": (None, "x", labelled("a qwen3 model", lambda: tiny_model("qwen3"))),
        "policy": (None, {}, "all_high", labelled("a policy for another model", lambda: illustrative_policy())),
        "processor": ("x", 5),
        "prefill_plan": (
            torch.zeros(1, 4, 2, dtype=torch.long),
            torch.full((1, 4, 3), 5),
            torch.full((1, 4, 3), -1),
            torch.zeros(1, 4, 3),
            [[[2, 2, 2]]],
            torch.full((2, 4, 3), 2),
        ),
    }
    return _variants("StructuredMixedPrecisionCache", StructuredMixedPrecisionCache, base, hostile, serves_finite(arts))


# ---------------------------------------------------------------------------------------------------- judges
def judge_generation_inputs(inputs, kwargs) -> str | None:
    q = kwargs["question_ids"]
    expected = (q.shape[0], CONTEXT_LEN + q.shape[1])
    if tuple(inputs["input_ids"].shape) != expected or tuple(inputs["attention_mask"].shape) != expected:
        return f"inputs of shape {tuple(inputs['input_ids'].shape)}, expected {expected}"
    if not torch.equal(inputs["input_ids"][:, CONTEXT_LEN:], q):
        return "the question ids are not at the end"
    return None


def judge_quantized(result, kwargs) -> str | None:
    x = kwargs["x"]
    codes, scales = result
    restored = dequantize_int4(codes, scales, x.shape[-1])
    if not _finite(scales, restored):
        return "dequantised values hold NaN or inf"
    within = x.float().abs() <= 7 * scales.float()
    error = (restored - x.float()).abs()
    if (error > scales.float() / 2 * 1.0001)[within].any():
        return "an element is further than scale / 2 from its input"
    return None


def judge_token_budgets(result, kwargs) -> str | None:
    ratio, length = kwargs["ratio"], kwargs["length"]
    flat = [n for per_head in result.values() for n in per_head]
    cap = math.floor(CAP_FRACTION * length)
    if sum(flat) != round(len(flat) * length / ratio) or not all(1 <= n <= cap for n in flat):
        return f"kept-entry counts {flat} do not sum to round(n_heads * length / ratio) within [1, {cap}]"
    return None


def round_trip(work: Path) -> Callable[[Any, dict], str | None]:
    """A judge: the artifact (policy or head budgets) saved into a fresh folder under ``work`` loads equal."""

    def judge(artifact, kwargs) -> str | None:
        folder = work / f"saved-{next(FOLDERS)}"
        artifact.save_pretrained(folder)
        return None if type(artifact).from_pretrained(folder) == artifact else "did not round-trip through a save"

    return judge


def serves_finite(arts: Artifacts) -> Callable[[Any, dict], str | None]:
    """A judge: the cache serves four tokens through the tiny model with finite logits."""

    def judge(cache, kwargs) -> str | None:
        with torch.no_grad():
            logits = arts.model(torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True).logits
        return None if torch.isfinite(logits).all() else "served NaN or inf"

    return judge
