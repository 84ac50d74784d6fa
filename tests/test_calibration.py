"""PASK offline calibration (Algorithm 1): closed forms, brute-force references, the exact window shortcut, and an
end-to-end `calibrate` on a tiny model with the real tokenizer."""

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch

from hf_structkv.calibration import (
    BfclTask,
    Bucket,
    BucketIntervention,
    CalibrationSettings,
    DevCase,
    DevelopmentStore,
    VerdictStore,
    calibrate,
    candidate_digest,
    envelope,
    greedy_path,
    left_quantile,
    protection_floor,
    protection_floors,
    reaches_generation,
    reserve_statistics,
    reserve_table,
    search_path,
    select_cheapest,
    task_sensitivity,
    upgrade_priorities,
)
from hf_structkv.calibration.buckets import parse_bucket
from hf_structkv.calibration.distortion import DistortionStore, attention_distortion, capture_reference_states
from hf_structkv.calibration.interventions import prefill_intervention_plan, prefill_positions
from hf_structkv.calibration.references import (
    ReferenceTrajectory,
    generation_key,
    key_digest,
    reference_trajectories,
    run_case,
    with_position_tags,
)
from hf_structkv.calibration.resume import ReferenceKV, first_changed_forward, resumed_case_run
from hf_structkv.calibration.selection import evaluate_controller
from hf_structkv.calibration.task_sensitivity import decode_generator, intervention_runs, prefill_generator
from hf_structkv.eval.bfcl import bfcl_split
from hf_structkv.policy import Action, GroupCosts, PolicyTable, PrefillPolicy
from hf_structkv.policy.prefill import illustrative_prefill_policy
from hf_structkv.quant.int4 import dequantize_int4, quantize_int4
from hf_structkv.quant.int4_centred import dequantize_int4_centred, key_centre, quantize_int4_centred
from hf_structkv.structure.prompt_spans import PROMPT_LABELS
from hf_structkv.structure.tags import StructuralTag, position_bin_starts, view_tags
from hf_structkv.structured_generation import generate_calls

R, L, H = Action.R, Action.L, Action.H
BFCL = BfclTask()
COSTS = GroupCosts.from_dims([2] * 6, [16] * 6)


# ---------------------------------------------------------------------------------------------- envelope, floors
@pytest.mark.parametrize(
    ("v_low", "v_release", "want"),
    [(-0.1, -0.2, (0.0, 0.0)), (0.02, 0.01, (0.02, 0.02)), (0.0, 0.03, (0.0, 0.03)), (0.01, 0.05, (0.01, 0.05))],
)
def test_envelope_closed_form(v_low, v_release, want):
    assert envelope(v_low, v_release) == want


def test_floors_closed_form():
    tau_low, tau_high = 0.005, 0.01
    assert protection_floor(0.02, 0.0, tau_low, tau_high) == H  # V̄(L) > τ_high (and V̄(R) >= V̄(L))
    assert protection_floor(0.0, 0.004, tau_low, tau_high) == R  # V̄(R) <= τ_low
    assert protection_floor(-0.5, 0.005, tau_low, tau_high) == R  # boundary: <= τ_low
    assert protection_floor(0.0, 0.006, tau_low, tau_high) == L
    assert protection_floor(0.01, 0.5, tau_low, tau_high) == L  # boundary: not > τ_high
    assert protection_floor(0.006, -1.0, tau_low, tau_high) == L  # the envelope lifts V̄(R) to V̄(L)
    floors = protection_floors({Bucket("a", 0): {L: 0.5, R: 0.5}, Bucket("a", 1): {L: 0, R: 0}}, (0.005, 0.01))
    assert floors == {Bucket("a", 0): H, Bucket("a", 1): R}
    with pytest.raises(ValueError, match="tau_low <= tau_high"):
        protection_floors({}, (0.02, 0.01))


def test_bucket_text_round_trip_and_errors():
    bucket = Bucket("pure_scaffold|scaffold_separator|boundary|no_lookahead", 2)
    assert str(bucket).endswith("::upper") and parse_bucket(str(bucket)) == bucket
    tied = Bucket("pure_scaffold|scaffold_separator|boundary|no_lookahead", 0, 1)
    assert str(tied).endswith("::all") and parse_bucket(str(tied)) == tied and tied != Bucket(tied.key, 0)
    with pytest.raises(ValueError, match="key::lower"):
        parse_bucket("no-group")


# ---------------------------------------------------------------------------------------------- priorities, path
def test_priorities_formula():
    a, b = Bucket("a", 0), Bucket("b", 2)
    distortion = {a: {R: 9.0, L: 4.0}, b: {R: 1.0, L: 3.0}}
    counts = {a: 2.0, b: 0.5}
    got = upgrade_priorities(distortion, counts, COSTS)
    for bucket in (a, b):
        c = bucket.group
        rl = COSTS.cost(L, c) - COSTS.cost(R, c)
        lh = COSTS.cost(H, c) - COSTS.cost(L, c)
        d = distortion[bucket]
        want = (max(d[R] - d[L], 0) / (counts[bucket] * rl), max(d[L] - 0, 0) / (counts[bucket] * lh))
        assert got[bucket] == pytest.approx(want)
    assert got[b][0] == 0.0  # D(R) < D(L): a clipped, zero-score upgrade
    with pytest.raises(ValueError, match="positive mean count"):
        upgrade_priorities(distortion, {a: 1.0}, COSTS)


def _brute_force_path(floors, priorities):
    """Scan every eligible upgrade each step: the largest score, ties by serialized (key, group) order."""
    current = dict(floors)
    path = [dict(current)]
    while any(a < H for a in current.values()):
        eligible = [(b, current[b]) for b in sorted(current) if current[b] < H]
        bucket, action = max(eligible, key=lambda item: priorities[item[0]][item[1]])  # first maximum: tie order
        current[bucket] = Action(action + 1)
        path.append(dict(current))
    return path


def test_greedy_path_is_nested_ends_all_high_and_equals_brute_force():
    rng = random.Random(3)
    buckets = [Bucket(key, c) for key in ("k1", "k2", "k3") for c in range(3)]
    for _ in range(20):
        floors = {b: Action(rng.randrange(3)) for b in buckets}
        scores = [0.0, 0.5, 1.0, 2.0]  # repeated values exercise the tie order
        priorities = {b: (rng.choice(scores), rng.choice(scores)) for b in buckets}
        path = greedy_path(floors, priorities)
        assert path == _brute_force_path(floors, priorities)
        assert path[0] == floors and all(a == H for a in path[-1].values())
        assert len(path) == 1 + sum(H - a for a in floors.values())
        for before, after in itertools.pairwise(path):
            assert all(after[b] >= before[b] for b in buckets)
            assert sum(after[b] - before[b] for b in buckets) == 1


# ---------------------------------------------------------------------------------------------- reserve
def _brute_force_statistic(costs, u, allowance, horizon):
    options = [sum(costs[u + 1 : u + 1 + h]) - h * allowance for h in range(0, min(horizon, len(costs) - 1 - u) + 1)]
    return max(max(options), 0.0)


def test_reserve_statistic_and_left_quantile_equal_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        costs = [rng.choice([0.0, 40.0, 100.0, 160.0]) for _ in range(rng.randrange(1, 15))]
        allowance, horizon = rng.choice([50.0, 80.0]), rng.choice([0, 1, 3, 8])
        got = reserve_statistics(costs, allowance, horizon)
        assert got == [pytest.approx(_brute_force_statistic(costs, u, allowance, horizon)) for u in range(len(costs))]
    for n in range(1, 12):
        values = [rng.choice(range(6)) for _ in range(n)]
        for beta in (0.1, 0.5, 0.8, 1.0):
            # inf{x : F(x) >= β} over the sample points
            want = min(x for x in values if sum(v <= x for v in values) / n >= beta)
            assert left_quantile(values, beta) == want
    assert left_quantile([5, 1, 4, 2, 3], 0.8) == 4  # rank ⌈0.8 · 5⌉ = 4
    with pytest.raises(ValueError, match="beta"):
        left_quantile([1.0], 0.0)


def test_reserve_table_by_state_and_pooled():
    floor_costs = [[100.0, 0.0, 100.0, 100.0], [0.0, 100.0]]
    states = [[frozenset({"boundary"}), frozenset({"critical"}), frozenset({"boundary", "critical"}), frozenset()]]
    states.append([frozenset({"critical"}), frozenset({"boundary"})])
    by_state, pooled = reserve_table(floor_costs, states, allowance=50.0, horizon=2, beta=0.8)
    stats = [reserve_statistics(c, 50.0, 2) for c in floor_costs]
    flat = [(s, st) for per, sts in zip(stats, states) for s, st in zip(per, sts)]
    assert pooled == left_quantile([s for s, _ in flat], 0.8)
    for state in ("boundary", "critical"):
        assert by_state[state] == left_quantile([s for s, st in flat if state in st], 0.8)


# ---------------------------------------------------------------------------------------------- selection
def test_selection_picks_cheapest_within_alpha_and_falls_back():
    costs, errors = [0.2, 0.3, 0.5, 0.1], [0.5, 0.45, 0.4, 0.9]
    assert select_cheapest(costs, errors, reference_error=0.4, alpha=0.05) == 1
    assert select_cheapest(costs, errors, reference_error=0.4, alpha=0.1) == 0
    assert select_cheapest(costs, errors, reference_error=0.2, alpha=0.05) is None
    assert select_cheapest([0.3, 0.3], [0.0, 0.0], 0.0, 0.05) == 0  # ties: the first
    with pytest.raises(ValueError, match="one value per candidate"):
        select_cheapest([0.1], [], 0.0, 0.05)


def _search(length, budget, threshold):
    """`search_path` on a path whose candidates pass from ``threshold`` on: (indices evaluated, cheapest passing)."""
    order = search_path(length, budget, lambda index: index >= threshold)
    passing = [i for i in order if i >= threshold]
    return order, min(passing) if passing else None


@pytest.mark.parametrize("length", [1, 2, 3, 7, 16, 103])
def test_search_path_bisects_to_the_cheapest_passing_candidate(length):
    for threshold in range(length + 1):  # length: nothing passes, not even the end
        order, found = _search(length, None, threshold)
        assert order == list(range(length))
        for budget in range(1, 9):
            order, found = _search(length, budget, threshold)
            assert len(order) == len(set(order)) <= budget and order[0] == 0
            if threshold == 0:
                assert order == [0] and found == 0
                continue
            # brute force: the evaluations leave the cheapest passing candidate in an interval of at most
            # ceil((length - 1) / 2^(budget - 1)) candidates, and never miss it once the budget suffices
            failing = max(i for i in order if i < threshold)
            upper = found if found is not None else length - 1
            assert upper - failing <= max(1, -(-(length - 1) // 2 ** (budget - 1)))
            if budget >= 1 + math.ceil(math.log2(max(length - 1, 1))) and threshold < length:
                assert found == threshold or (threshold == length - 1 and found is None)
    with pytest.raises(ValueError, match="max_candidates"):
        search_path(3, 0, lambda index: True)


def test_settings_errors_are_named():
    with pytest.raises(ValueError, match="tau_low <= tau_high"):
        CalibrationSettings(thresholds=((0.1, 0.05),))
    with pytest.raises(ValueError, match="stages must be one of"):
        CalibrationSettings(stages=("prefill", "decode"))
    with pytest.raises(ValueError, match="stages must be one of"):
        CalibrationSettings(stages=())
    assert CalibrationSettings(stages=["prefill"]).stages == ("prefill",)
    with pytest.raises(ValueError, match="prefill-only run"):
        CalibrationSettings(stages=("prefill",), tag_view="no_role")
    with pytest.raises(ValueError, match="max_dev_candidates"):
        CalibrationSettings(max_dev_candidates=0)
    with pytest.raises(ValueError, match="R or L"):
        BucketIntervention(COSTS, Bucket("pure_scaffold|scaffold_separator|boundary|no_lookahead", 0), H, 4, 8)
    one_group = GroupCosts.from_dims([2] * 6, [16] * 6, groups=1)
    with pytest.raises(ValueError, match=r"Bucket\(key, group, groups=1\)"):
        BucketIntervention(one_group, Bucket("pure_scaffold|scaffold_separator|boundary|no_lookahead", 0), L, 4, 8)
    with pytest.raises(ValueError, match="layer_groups must be 3"):
        CalibrationSettings(layer_groups=2)
    with pytest.raises(ValueError, match=r"decode table only: pass stages=\('decode',\)"):
        CalibrationSettings(layer_groups=1)


# ---------------------------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def cases():
    return bfcl_split(["simple_python"], "calibration", limit=2), bfcl_split(["simple_python"], "development", limit=2)


WINDOW = 3
MAX_NEW = 24


@pytest.fixture(scope="module")
def references(model, tokenizer, cases, tmp_path_factory):
    return reference_trajectories(
        model, tokenizer, BFCL, cases[0], MAX_NEW, WINDOW, 4, cache_dir=tmp_path_factory.mktemp("refs")
    )


def test_window_shortcut_equals_a_real_intervened_generation(model, tokenizer, cases, references):
    """Every skipped (bucket, action, case) generates exactly the reference; the all-high reference does not depend
    on the window, so one reference serves several windows."""
    costs = GroupCosts.from_config(model.config)
    checked = {True: 0, False: 0}
    for window in (WINDOW, 12, 17):
        for entry, reference in zip(cases[0], references):
            for key in sorted({key for tags in reference.tags if tags for key in tags}):
                reaches = reaches_generation(reference, key, window)
                checked[reaches] += 1
                if reaches:
                    continue
                for group, action in ((0, R), (2, L)):
                    policy = BucketIntervention(costs, Bucket(key, group), action, 4, window)
                    run = run_case(model, tokenizer, BFCL, entry, policy, MAX_NEW)[0]
                    assert run.tokens == reference.tokens and run.valid == reference.valid
    assert checked[True] and checked[False]


def test_a_resumed_intervention_is_the_fresh_intervened_generation(model, tokenizer, cases):
    """Every decode intervention that reaches generation, resumed at its first changed forward from the recorded
    reference K/V, gives the fresh generation's tokens, tags, text and verdict (two windows, both actions)."""
    costs = GroupCosts.from_config(model.config)
    entries = cases[0] + bfcl_split(["parallel"], "calibration", limit=1)  # a longer, multi-call reply too
    compared = 0
    for window in (WINDOW, 8):
        references = reference_trajectories(model, tokenizer, BFCL, entries, 40, window, 4)
        for entry, reference in zip(entries, references, strict=True):
            all_high = PolicyTable.all_high(model, window=window, sink_tokens=4)
            recorded = ReferenceKV.record(model, tokenizer, BFCL, entry, reference, all_high, 40)
            assert recorded is not None and recorded.keys[0].shape[-2] >= len(reference.prompt_ids) + 1
            for key in sorted({key for tags in reference.tags if tags for key in tags}):
                if not reaches_generation(reference, key, window):
                    continue
                forward = first_changed_forward(reference, key, window)
                for group, action in ((0, R), (2, L)):
                    policy = BucketIntervention(costs, Bucket(key, group), action, 4, window)
                    fresh = run_case(model, tokenizer, BFCL, entry, policy, 40)[0]
                    assert resumed_case_run(model, tokenizer, BFCL, entry, policy, 40, recorded, forward) == fresh
                    compared += 1
    assert compared >= 20


def test_a_resumed_prefill_intervention_is_the_fresh_generation(model, tokenizer, cases):
    """Every prefill intervention (label x group x action that lowers a prompt token), resumed after the shared prompt
    forward, gives the fresh generation; so does prefill_generator with and without resume."""
    compared = 0
    for window in (WINDOW, 8):
        references = reference_trajectories(model, tokenizer, BFCL, cases[0], MAX_NEW, window, 4)
        all_high = PolicyTable.all_high(model, window=window, sink_tokens=4)
        for entry, reference in zip(cases[0], references, strict=True):
            recorded = ReferenceKV.record(model, tokenizer, BFCL, entry, reference, all_high, MAX_NEW)
            for label in PROMPT_LABELS:
                if not prefill_positions(reference, label, 4, window):
                    continue
                for group, action in ((0, R), (1, L), (2, R)):
                    plan = prefill_intervention_plan(reference, Bucket(label, group), action, 4, window)
                    fresh = run_case(model, tokenizer, BFCL, entry, all_high, MAX_NEW, prefill_plan=plan)[0]
                    resumed = resumed_case_run(model, tokenizer, BFCL, entry, all_high, MAX_NEW, recorded, 1, plan)
                    assert resumed == fresh
                    compared += 1
    assert compared >= 12
    bucket = Bucket(next(label for label in PROMPT_LABELS if prefill_positions(reference, label, 4, 8)), 1)
    generators = [prefill_generator(model, tokenizer, BFCL, all_high, MAX_NEW, resume=flag) for flag in (True, False)]
    assert generators[0](entry, reference, bucket, R) == generators[1](entry, reference, bucket, R)


def test_resume_refuses_what_it_cannot_replay(model, tokenizer, cases, references, monkeypatch):
    entry, reference = cases[0][0], references[0]
    all_high = PolicyTable.all_high(model, window=WINDOW, sink_tokens=4)
    other = dataclasses.replace(reference, tokens=reference.tokens[:-1] + (reference.tokens[-1] + 1,))
    assert ReferenceKV.record(model, tokenizer, BFCL, entry, other, all_high, MAX_NEW) is None  # not reproduced
    recorded = ReferenceKV.record(model, tokenizer, BFCL, entry, reference, all_high, MAX_NEW)
    with pytest.raises(ValueError, match="forward must be in"):
        recorded.fill(None, 0)
    with pytest.raises(ValueError, match="does not occur"):
        first_changed_forward(reference, "pure_scaffold|dispatch_key|stable|no_lookahead", WINDOW)
    assert first_changed_forward(reference, reference.tags[0][0], WINDOW) == WINDOW + 2
    generate = decode_generator(model, tokenizer, BFCL, GroupCosts.from_config(model.config), MAX_NEW, 4, WINDOW)
    fresh = decode_generator(
        model, tokenizer, BFCL, GroupCosts.from_config(model.config), MAX_NEW, 4, WINDOW, resume=False
    )
    bucket = Bucket(reference.tags[0][0], 1)
    assert generate(entry, reference, bucket, R) == fresh(entry, reference, bucket, R)
    assert generate(entry, other, bucket, R) == fresh(entry, other, bucket, R)  # not the recorded run: generated
    # centred INT4 keys: the interventions store L in that layout, and a resumed run fits the same prompt centre
    served, run = [], task_sensitivity.run_case
    monkeypatch.setattr(task_sensitivity, "run_case", lambda *args: served.append(args[4].int4_keys) or run(*args))
    generate, fresh = (
        decode_generator(
            model,
            tokenizer,
            BFCL,
            GroupCosts.from_config(model.config),
            MAX_NEW,
            4,
            WINDOW,
            resume=resume,
            int4_keys="centred",
        )
        for resume in (True, False)
    )
    assert generate(entry, reference, bucket, L) == fresh(entry, reference, bucket, L) and served == ["centred"]


def test_intervention_controller_lowers_only_occurrences():
    key = "schema_bearing|required|critical|no_lookahead"
    other = "pure_scaffold|scaffold_separator|boundary|no_lookahead"
    controller = BucketIntervention(COSTS, Bucket(key, 1), L, 4, 8).controller(COSTS)
    tags = [StructuralTag.from_key(k) for k in (key, other)]
    assert controller.step([tags[0]]) == (H, L, H)
    assert controller.step(tags) == (H, L, H)  # several candidates: an occurrence of each
    assert controller.step([tags[1]]) == (H, H, H)
    assert controller.step(()) == (H, H, H) and controller.step(None) is None
    assert controller.scheduled_bits == 2 * COSTS.total((H, L, H)) + 2 * COSTS.full  # stop tokens are free
    controller.rollback(1)
    assert controller.num_steps == 1 and controller.scheduled_bits == COSTS.total((H, L, H))
    one_group = GroupCosts.from_dims([2] * 6, [16] * 6, groups=1)
    tied = BucketIntervention(one_group, Bucket(key, 0, 1), R, 4, 8).controller(one_group)
    assert tied.step([tags[0]]) == (R,) and tied.step([tags[1]]) == (H,)  # every layer at once
    assert tied.scheduled_bits == COSTS.full


def test_generation_key_and_its_digest(model, tokenizer):
    table = PolicyTable.all_high(model, window=WINDOW)
    key = generation_key(model, tokenizer, BFCL, table, MAX_NEW)
    assert key["max_new_tokens"] == MAX_NEW and key["window"] == WINDOW and "tag_view" not in key  # full: as before
    assert generation_key(model, tokenizer, BFCL, PolicyTable.all_high(model, tag_view="no_role"), MAX_NEW)["tag_view"]
    assert generation_key(model, tokenizer, BFCL, table, MAX_NEW + 1) != key
    assert key_digest({"a": 1, "b": [2]}) == key_digest({"b": [2], "a": 1}) != key_digest({"a": 2, "b": [2]})
    assert len(key_digest(key)) == 20 and int(key_digest(key), 16) >= 0


def test_reference_cache_is_reused_and_keyed(model, tokenizer, cases, tmp_path):
    first = reference_trajectories(model, tokenizer, BFCL, cases[0][:1], MAX_NEW, WINDOW, 4, cache_dir=tmp_path)
    (path,) = tmp_path.glob("reference-*.json")
    record = json.loads(path.read_text())
    record["trajectory"]["text"] = "from the cache"
    path.write_text(json.dumps(record))
    again = reference_trajectories(model, tokenizer, BFCL, cases[0][:1], MAX_NEW, WINDOW, 4, cache_dir=tmp_path)
    assert again[0].text == "from the cache" and again[0].tokens == first[0].tokens
    other = reference_trajectories(model, tokenizer, BFCL, cases[0][:1], MAX_NEW, WINDOW + 1, 4, cache_dir=tmp_path)
    assert other[0].text == first[0].text and len(list(tmp_path.glob("reference-*.json"))) == 2
    with pytest.raises(ValueError, match="non-empty list"):
        reference_trajectories(model, tokenizer, BFCL, [], MAX_NEW, WINDOW, 4)


def test_a_grown_split_generates_only_its_new_cases(model, tokenizer, cases, references, tmp_path):
    """References are cached per case: a split grown from one case to two reads the first and generates the second
    (equal to a fresh generation of both)."""
    reference_trajectories(model, tokenizer, BFCL, cases[0][:1], MAX_NEW, WINDOW, 4, cache_dir=tmp_path)
    (path,) = tmp_path.glob("reference-*.json")
    record = json.loads(path.read_text())
    record["trajectory"]["text"] = "from the cache"
    path.write_text(json.dumps(record))
    grown = reference_trajectories(model, tokenizer, BFCL, cases[0][:2], MAX_NEW, WINDOW, 4, cache_dir=tmp_path)
    assert [r.case_id for r in grown] == [e.id for e in cases[0][:2]] and grown[0].text == "from the cache"
    assert dataclasses.replace(grown[1], seconds=0.0) == dataclasses.replace(references[1], seconds=0.0)
    assert len(list(tmp_path.glob("reference-*.json"))) == 2


# ---------------------------------------------------------------------------------------------- verdict store
def _verdict_reference(case_id="toy", tokens=(5, 6, 7)):
    return ReferenceTrajectory(
        tokens=tuple(tokens),
        tags=(None,) * len(tokens),
        valid=True,
        text="",
        case_id=case_id,
        category="simple_python",
        prompt_ids=(1, 2),
        prompt_labels=((), ()),
        seconds=0.0,
    )


BUCKET = Bucket("pure_scaffold|scaffold_separator|boundary|no_lookahead", 1)


def test_verdict_store_round_trips_and_keys_by_case_reference_bucket_and_action(tmp_path):
    key = {"model": "m", "window": 3}
    store = VerdictStore.open(tmp_path, key)
    ref = _verdict_reference()
    assert store.get(ref, BUCKET, L) is None and not store.path.exists()
    store.put(ref, BUCKET, L, False)
    store.put(ref, BUCKET, R, True)
    again = VerdictStore.open(tmp_path, key)
    assert len(again) == 2 and again.get(ref, BUCKET, L) is False and again.get(ref, BUCKET, R) is True
    assert again.get(_verdict_reference(tokens=(5, 6, 8)), BUCKET, L) is None  # the reference changed
    assert again.get(_verdict_reference(case_id="other"), BUCKET, L) is None
    assert again.get(ref, Bucket(BUCKET.key, 2), L) is None
    other = VerdictStore.open(tmp_path, {"model": "m", "window": 4})
    assert other.path != store.path and len(other) == 0
    with pytest.raises(ValueError, match="R or L"):
        store.get(ref, BUCKET, H)
    with pytest.raises(TypeError, match="valid must be a bool"):
        store.put(ref, BUCKET, L, 1)


def test_verdict_store_skips_a_cut_line_and_restarts_a_file_of_another_key(tmp_path):
    key = {"model": "m"}
    store = VerdictStore.open(tmp_path, key)
    ref = _verdict_reference()
    store.put(ref, BUCKET, L, True)
    with store.path.open("a", encoding="utf-8") as file:
        file.write('{"case": "toy", "refer')  # a crash in the middle of a line
    resumed = VerdictStore.open(tmp_path, key)
    assert len(resumed) == 1
    resumed.put(ref, BUCKET, R, False)
    assert len(VerdictStore.open(tmp_path, key)) == 2  # the new line was not glued to the cut one
    store.path.write_text(json.dumps({"key": {"model": "another"}}) + "\n", encoding="utf-8")
    collided = VerdictStore(store.path, key)
    assert len(collided) == 0
    collided.put(ref, BUCKET, L, True)
    lines = store.path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == {"key": key} and len(lines) == 2


def test_two_stores_sharing_a_new_file_keep_both_verdicts_and_one_key_line(tmp_path):
    """Two processes calibrating different cases into one cache folder: both open the store before it exists."""
    key = {"model": "m"}
    first, second = VerdictStore.open(tmp_path, key), VerdictStore.open(tmp_path, key)
    first.put(_verdict_reference("a"), BUCKET, L, True)
    second.put(_verdict_reference("b"), BUCKET, R, False)  # the file exists now: appended, not started anew
    first.put(_verdict_reference("a"), BUCKET, R, True)
    lines = first.path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) == {"key": key} for line in lines] == [True, False, False, False]
    merged = VerdictStore.open(tmp_path, key)
    assert len(merged) == 3 and merged.get(_verdict_reference("b"), BUCKET, R) is False
    assert len(second) == 2  # it read the first store's line when it found the file
    assert second.get(_verdict_reference("a"), BUCKET, R) is True  # a missing verdict: the file's new lines are read
    assert len(second) == 3
    with first.path.open("a", encoding="utf-8") as file:
        file.write('{"case": "c", "refer')  # another process in the middle of a line
    assert second.get(_verdict_reference("c"), BUCKET, L) is None and len(second) == 3
    second.put(_verdict_reference("c"), BUCKET, L, True)  # ends the cut line first: both lines stay readable
    assert len(VerdictStore.open(tmp_path, key)) == 4


def test_development_store_round_trips_cases_by_case_and_candidate_and_skips_malformed_lines(tmp_path):
    key = {"model": "m", "stage": "decode"}
    store = DevelopmentStore.open(tmp_path, key)
    case = DevCase(valid=True, prompt_bits=12.5, prompt_tokens=3, decode_bits=4.0, decode_tokens=2, full_bits=8.0)
    assert store.get("a", "c1") is None and not store.path.exists()
    assert store.path.name.startswith("development-")
    store.put("a", "c1", case)
    store.put("a", "c2", dataclasses.replace(case, valid=False))
    with store.path.open("a", encoding="utf-8") as file:  # well-formed JSON, malformed records: skipped on reading
        file.write(
            json.dumps({"case": "b", "candidate": "c1", **dataclasses.asdict(case), "prompt_tokens": 1.5}) + "\n"
        )
        file.write(json.dumps({"case": "b", "candidate": "c2", "valid": "yes"}) + "\n")
        file.write('{"case": "b", "cand')  # a crash in the middle of a line
    again = DevelopmentStore.open(tmp_path, key)
    assert len(again) == 2 and again.get("a", "c1") == case and again.get("a", "c2").valid is False
    assert again.get("b", "c1") is None and again.get("a", "c3") is None
    assert len(DevelopmentStore.open(tmp_path, {"model": "m", "stage": "prefill"})) == 0
    with pytest.raises(TypeError, match="case must be a DevCase"):
        store.put("a", "c1", dataclasses.asdict(case))
    with pytest.raises(ValueError, match="integer token counts"):
        store.put("a", "c1", dataclasses.replace(case, prompt_tokens=2.5))
    with pytest.raises(ValueError, match="identity must be 2 strings"):
        store.put_record(("a",), {})


def test_candidate_digest_names_what_serving_reads_and_ignores_card_fields(model):
    table = PolicyTable.all_high(model, window=WINDOW, sink_tokens=4)
    carded = dataclasses.replace(table, description="another card", thresholds={"tau_low": 0.1}, provenance="reference")
    assert candidate_digest(carded) == candidate_digest(table)
    assert candidate_digest(dataclasses.replace(table, window=WINDOW + 1)) != candidate_digest(table)
    assert candidate_digest(dataclasses.replace(table, budget=0.5)) != candidate_digest(table)
    prefill = illustrative_prefill_policy()
    assert candidate_digest(table, prefill) != candidate_digest(table)
    assert candidate_digest(table, dataclasses.replace(prefill, budget=0.5)) != candidate_digest(table, prefill)


def test_intervention_runs_generate_each_needed_case_once_with_a_store(tmp_path):
    refs = [_verdict_reference("a", tuple(range(12))), _verdict_reference("b", tuple(range(12)))]
    refs = [dataclasses.replace(r, tags=((BUCKET.key,),) * 11 + (None,)) for r in refs]
    entries = [type("Entry", (), {"id": r.case_id})() for r in refs]
    calls = []

    def measure(entry, reference, bucket, action):
        calls.append((entry.id, action))
        return entry.id == "a" and action == L

    first = intervention_runs(
        BFCL, entries, refs, [BUCKET], "decode", measure, 4, 3, store=VerdictStore.open(tmp_path, {})
    )
    assert len(calls) == 4 and first.reused == 0
    second = intervention_runs(
        BFCL, entries, refs, [BUCKET], "decode", measure, 4, 3, store=VerdictStore.open(tmp_path, {})
    )
    assert len(calls) == 4 and second.reused == 4
    assert second.values == first.values == {(BUCKET, L): [True, False], (BUCKET, R): [False, False]}
    assert second.generated == first.generated == {(BUCKET, L): 2, (BUCKET, R): 2}


# ---------------------------------------------------------------------------------------------- Runtime-D
def _toy_reference(tags, prompt_labels):
    return ReferenceTrajectory(
        tokens=tuple(range(len(tags))),
        tags=tuple(tags),
        valid=True,
        text="",
        case_id="toy",
        category="simple_python",
        prompt_ids=tuple(range(len(prompt_labels))),
        prompt_labels=tuple(prompt_labels),
        seconds=0.0,
    )


def _brute_force_distortion(reference, states, key, stage, action, sink, window, costs, group, int4_keys="row"):
    """Per query and layer: rebuild the keys / values the query sees, attention head by head, max over heads (a
    lowered key rounded on its own, per row or centred by its head's prompt keys' `key_centre`)."""
    prompt, tokens = len(reference.prompt_ids), len(reference.tokens)
    total = 0.0
    for layer, (queries, keys, values, scaling) in states.items():
        if costs.group_of_layer(layer) != group:
            continue
        centre, spread = key_centre(keys[None, :, :prompt], torch.ones(1, prompt, dtype=torch.bool))
        groups = queries.shape[0] // keys.shape[0]
        for j in range(tokens - 1):
            worst = 0.0
            for h in range(queries.shape[0]):
                kv = h // groups
                q = queries[h, j]
                ref_k, ref_v = keys[kv, : prompt + j + 1], values[kv, : prompt + j + 1]
                new_k, new_v, keep = [], [], []
                for n in range(prompt + j + 1):
                    if stage == "decode":
                        i = n - prompt
                        hit = i >= 0 and n >= sink and key in (reference.tags[i] or ()) and j >= i + window + 1
                    else:
                        hit = sink <= n < prompt - window and key in reference.prompt_labels[n]
                    k, v = keys[kv, n], values[kv, n]
                    if hit and action == L and int4_keys == "row":
                        k = dequantize_int4(*quantize_int4(k[None]), k.shape[-1])[0]
                    elif hit and action == L:
                        mu, s = centre[0, kv], spread[0, kv]  # [1, D]
                        k = dequantize_int4_centred(*quantize_int4_centred(k[None], mu, s), mu, s, k.shape[-1])[0]
                    if hit and action == L:
                        v = dequantize_int4(*quantize_int4(v[None]), v.shape[-1])[0]
                    new_k.append(k)
                    new_v.append(v)
                    keep.append(not (hit and action == R))
                ref_out = torch.softmax(ref_k @ q * scaling, -1) @ ref_v
                kept = torch.tensor(keep)
                new_k, new_v = torch.stack(new_k)[kept], torch.stack(new_v)[kept]
                out = torch.softmax(new_k @ q * scaling, -1) @ new_v
                worst = max(worst, float((ref_out - out).square().sum()))
            total += worst
    return total


def _random_states(generator, tokens: int, total: int) -> dict:
    """`ReferenceStates` of 3 layers: 4 query heads over ``tokens - 1`` queries, 2 KV heads over ``total`` positions,
    head dim 8."""
    return {
        layer: (
            torch.randn(4, tokens - 1, 8, generator=generator),
            torch.randn(2, total, 8, generator=generator),
            torch.randn(2, total, 8, generator=generator),
            8**-0.5,
        )
        for layer in range(3)
    }


@pytest.mark.parametrize("int4_keys", ["row", "centred"])
def test_distortion_equals_brute_force_on_random_states(int4_keys):
    costs = GroupCosts.from_dims([2] * 3, [8] * 3)
    a, b = "schema_bearing|required|critical|no_lookahead", "pure_scaffold|scaffold_separator|boundary|no_lookahead"
    tags = [(a,), (b,), (a, b), (a,), (), (b,), (a,), (a,), None]
    labels = (
        [("protected_content",)] * 3
        + [("function_name",), ("function_name", "schema_scaffold")] * 2
        + [("protected_content",)]
    )
    reference = _toy_reference(tags, labels)
    generator = torch.Generator().manual_seed(0)
    total = len(labels) + len(tags)
    states = _random_states(generator, len(tags), total)
    sink, window = 2, 2
    for stage, keys in (("decode", (a, b)), ("prefill", ("function_name", "schema_scaffold", "protected_content"))):
        buckets = [Bucket(key, c) for key in keys for c in range(3)]
        got = attention_distortion([reference], buckets, stage, costs, sink, window, lambda r: states, None, int4_keys)
        for bucket in buckets:
            for action in (R, L):
                want = _brute_force_distortion(
                    reference, states, bucket.key, stage, action, sink, window, costs, bucket.group, int4_keys
                )
                assert got[bucket][action] == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert any(got[bucket][R] > 0 for bucket in buckets)
        if int4_keys == "centred":  # the layout is used: L differs from the row layout's round trip
            row = attention_distortion([reference], buckets, stage, costs, sink, window, lambda r: states)
            assert any(got[b][L] != pytest.approx(row[b][L], rel=1e-3) for b in buckets if row[b][L] > 0)


def test_distortion_store_resumes_without_capturing_the_stored_references(tmp_path):
    """A second run reads every reference's distortions from the store (no capture, the same values); a reference
    whose lines were lost is captured again, alone."""
    costs = GroupCosts.from_dims([2] * 3, [8] * 3)
    a, b = "schema_bearing|required|critical|no_lookahead", "pure_scaffold|scaffold_separator|boundary|no_lookahead"
    generator = torch.Generator().manual_seed(1)
    references, states = [], {}
    for case, tags in enumerate(([(a,), (b,), (a, b), (a,), (), (b,), (a,), None], [(b,), (a,), (a,), (b,), None])):
        reference = dataclasses.replace(_toy_reference(tags, [("protected_content",)] * 4), case_id=f"toy_{case}")
        total = 4 + len(tags)
        states[reference.case_id] = _random_states(generator, len(tags), total)
        references.append(reference)
    buckets = [Bucket(key, c) for key in (a, b) for c in range(3)]
    captured = []

    def states_of(reference):
        captured.append(reference.case_id)
        return states[reference.case_id]

    plain = attention_distortion(references, buckets, "decode", costs, 1, 1, states_of)
    key = {"model": "toy", "stage": "decode"}
    first = attention_distortion(
        references, buckets, "decode", costs, 1, 1, states_of, DistortionStore.open(tmp_path, key)
    )
    assert first == plain and captured == ["toy_0", "toy_1", "toy_0", "toy_1"]
    captured.clear()
    again = attention_distortion(
        references, buckets, "decode", costs, 1, 1, states_of, DistortionStore.open(tmp_path, key)
    )
    assert again == plain and captured == []
    path = DistortionStore.open(tmp_path, key).path
    lines = path.read_text().splitlines()
    path.write_text("\n".join(line for line in lines if '"toy_1"' not in line) + "\n")
    resumed = attention_distortion(
        references, buckets, "decode", costs, 1, 1, states_of, DistortionStore.open(tmp_path, key)
    )
    assert resumed == plain and captured == ["toy_1"]
    with pytest.raises(TypeError, match="error must be a finite float >= 0"):
        DistortionStore.open(tmp_path, key).put(references[0], buckets[0], R, -1.0)


def test_reference_states_reproduce_the_model_attention(model, references):
    """The captured queries / keys / values give back the layer's attention output of a plain forward."""
    states = capture_reference_states(model, references[0])
    assert sorted(states) == [0, 1, 2]
    queries, keys, values, scaling = states[0]
    tokens, prompt = len(references[0].tokens), len(references[0].prompt_ids)
    assert queries.shape == (4, tokens - 1, 16) and keys.shape == (2, prompt + tokens, 16)
    assert scaling == pytest.approx(16**-0.5)


# ---------------------------------------------------------------------------------------------- end to end
SETTINGS = CalibrationSettings(max_new_tokens=MAX_NEW, window=WINDOW, max_dev_candidates=2)


def test_evaluate_controller_scores_the_all_high_policy_as_its_references_with_full_ratios(
    model, tokenizer, cases, capsys
):
    development = cases[1]
    refs = reference_trajectories(model, tokenizer, BFCL, development, MAX_NEW, WINDOW, 4)
    all_high = PolicyTable.all_high(model, window=WINDOW, sink_tokens=4)
    result = evaluate_controller(model, tokenizer, BFCL, development, all_high, MAX_NEW, progress=True)
    assert result.valid == tuple(r.valid for r in refs)
    assert result.error_rate == sum(not r.valid for r in refs) / len(refs)
    assert result.decode_ratio == pytest.approx(1.0) and result.prefill_ratio == pytest.approx(1.0)
    assert "development" in capsys.readouterr().err  # the progress bar over the cases


def test_evaluate_controller_with_a_store_generates_each_case_once(model, tokenizer, cases, tmp_path):
    """The second evaluation reads every case back: it gives the same result without touching the model."""
    development = cases[1]
    all_high = PolicyTable.all_high(model, window=WINDOW, sink_tokens=4)
    first = evaluate_controller(
        model, tokenizer, BFCL, development, all_high, MAX_NEW, store=DevelopmentStore.open(tmp_path, {"m": 1})
    )
    assert first.reused == 0
    second = evaluate_controller(
        None, None, BFCL, development, all_high, MAX_NEW, store=DevelopmentStore.open(tmp_path, {"m": 1})
    )
    assert second == dataclasses.replace(first, reused=len(development))
    plain = evaluate_controller(model, tokenizer, BFCL, development[:1], all_high, MAX_NEW)
    assert plain.valid == first.valid[:1] and plain.reused == 0
    with pytest.raises(ValueError, match="non-empty list of BfclEntry"):
        evaluate_controller(model, tokenizer, BFCL, [], all_high, MAX_NEW)


@pytest.fixture(scope="module")
def calibration_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def calibrated(model, tokenizer, cases, calibration_cache):
    return calibrate(model, tokenizer, *cases, SETTINGS, cache_dir=calibration_cache, log=lambda _: None)


def test_calibrate_end_to_end_gives_loadable_tables_that_generate_calls_accepts(
    model, tokenizer, cases, calibrated, tmp_path
):
    calibrated.save_pretrained(tmp_path)
    table = PolicyTable.from_pretrained(tmp_path / "decode", model=model)
    prefill = PrefillPolicy.from_pretrained(tmp_path / "prefill", model=model)
    assert table == calibrated.table and prefill == calibrated.prefill_policy
    assert table.provenance == "calibrated" and table.window == WINDOW
    card = dict(table.calibration)
    assert card["calibration_cases"] == 2 and card["development_cases"] == 2
    assert card["decode_budget"] == table.budget and "alpha_D" in table.thresholds
    report = json.loads((tmp_path / "calibration_report.json").read_text())
    decode = report["decode"]
    for path in decode["paths"]:
        budgets = path["nominal_budgets"]
        assert budgets == sorted(budgets) and budgets[-1] == pytest.approx(1.0)  # Prop. 2, ends all-high
        assert path["evaluated"] and path["evaluated"] == sorted(path["evaluated"])
    # the selected candidate is the cheapest evaluated one within alpha of all-high on development
    reference = report["reference"]["development_accuracy"]
    passing = [r for r in decode["development"] if reference - r["accuracy"] <= SETTINGS.alpha_decode + 1e-12]
    if passing:
        cheapest = min(passing, key=lambda r: r["measured_ratio"])
        assert decode["selected"]["measured_ratio"] == cheapest["measured_ratio"]
    else:
        assert decode["selected"] == "all-high fallback" and table.budget == 1.0
    entry = cases[1][0]
    result = generate_calls(
        model, tokenizer, list(entry.messages), entry.tools, table, max_new_tokens=8, prefill_policy=prefill
    )
    assert result.sequences.shape[0] == 1 and 0 < result.bytes_report()["budget_ratio"] <= 1


def test_calibrate_is_deterministic(model, tokenizer, cases, calibrated, tmp_path):
    again = calibrate(model, tokenizer, *cases, SETTINGS, cache_dir=tmp_path, log=lambda _: None)
    for result in (again, calibrated):
        result.report["decode"].pop("runtime_v_seconds")  # wall times differ, nothing else may
    assert again.table.entries == calibrated.table.entries and again.table.budget == calibrated.table.budget
    assert again.table.reserve_by_state == calibrated.table.reserve_by_state
    assert again.prefill_policy.entries == calibrated.prefill_policy.entries
    assert json.dumps(again.report["decode"]) == json.dumps(calibrated.report["decode"])


def test_a_second_calibration_reads_its_runtime_v_verdicts_back(model, tokenizer, cases, calibrated, calibration_cache):
    """Same model, cases, settings and cache folder: Runtime-V reads each verdict instead of generating it, and the
    table is the same."""
    assert calibrated.report["decode"]["runtime_v_reused"] == 0
    lines = []
    again = calibrate(model, tokenizer, *cases, SETTINGS, cache_dir=calibration_cache, log=lines.append)
    generations = calibrated.report["decode"]["runtime_v_generations"]
    both = generations + calibrated.report["prefill"]["runtime_v_generations"]
    assert f"ahead: 0 Runtime-V generations ({both} more read from the cache)" in lines[0]  # the time estimate
    assert generations > 0 and again.report["decode"]["runtime_v_generations"] == generations
    assert again.report["decode"]["runtime_v_reused"] == generations
    assert again.report["prefill"]["runtime_v_reused"] == calibrated.report["prefill"]["runtime_v_generations"]
    for stage in ("decode", "prefill"):  # every development case of every evaluated candidate read back too
        rows, first_rows = (
            [dict(r) for r in result.report[stage]["development"]] for result in (again, calibrated)
        )  # copies: the fixture's report is shared
        assert [r.pop("cases_from_cache") for r in first_rows] == [0] * len(first_rows)
        assert [r.pop("cases_from_cache") for r in rows] == [len(cases[1])] * len(rows)
        assert rows == first_rows
    assert again.table.entries == calibrated.table.entries and again.table.budget == calibrated.table.budget
    assert again.prefill_policy.entries == calibrated.prefill_policy.entries


def test_calibrate_with_a_tag_view_runs_on_viewed_tags_and_records_the_view(model, tokenizer, cases, tmp_path):
    settings = dataclasses.replace(SETTINGS, tag_view="no_role", stages=("decode",))
    result = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None)
    assert result.table.tag_view == "no_role" and result.report["settings"]["tag_view"] == "no_role"
    refs = reference_trajectories(
        model, tokenizer, BFCL, cases[0], MAX_NEW, WINDOW, 4, cache_dir=tmp_path, tag_view="no_role"
    )
    full_refs = reference_trajectories(model, tokenizer, BFCL, cases[0], MAX_NEW, WINDOW, 4, cache_dir=tmp_path)
    n_cases = len(cases[0]) + len(cases[1]) + len(cases[0])  # per case: cal + dev of the view, cal of the full view
    assert len(list(tmp_path.glob("reference-*.json"))) == n_cases
    for full, viewed in zip(full_refs, refs, strict=True):
        assert full.tokens == viewed.tokens  # all-high: the same tokens
        want = [
            None
            if t is None
            else tuple(
                "|".join(v) for v in view_tags(tuple(map(StructuralTag.from_key, t)), "no_role", "function_calling")
            )
            for t in full.tags
        ]
        assert list(viewed.tags) == want
    for key in result.table.entries:
        parts = key.split("|")
        assert len(parts) < 2 or parts[1] == "scaffold_separator"
    entry = cases[1][0]
    generated = generate_calls(model, tokenizer, list(entry.messages), entry.tools, result.table, max_new_tokens=8)
    assert generated.processor.tag_view == "no_role"
    with pytest.raises(ValueError, match="tag_view must be one of"):
        CalibrationSettings(tag_view="positions")


def test_calibrate_without_layer_groups_ties_every_bucket_across_depth(model, tokenizer, cases, calibrated, tmp_path):
    """The no-layer-groups ablation: one bucket per tag (``::all``), one action per token for every layer; the
    references (all-high) are the full calibration's, so the same tags are bucketed."""
    settings = dataclasses.replace(SETTINGS, layer_groups=1, stages=("decode",))
    result = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None)
    table = result.table
    assert table.costs == GroupCosts.from_config(model.config, groups=1) and table.layer_groups == (range(0, 3),)
    assert all(len(e.action) == len(e.floor) == len(e.priorities) == 1 for e in table.entries.values())
    assert result.report["settings"]["layer_groups"] == 1 and result.prefill_policy is None
    tied_keys = {b.rpartition("::")[0] for b in result.report["decode"]["buckets"]}
    assert all(b.endswith("::all") for b in result.report["decode"]["buckets"])
    assert tied_keys == {b.rpartition("::")[0] for b in calibrated.report["decode"]["buckets"]}
    result.save_pretrained(tmp_path / "tied")
    assert PolicyTable.from_pretrained(tmp_path / "tied", model=model) == table
    entry = cases[1][0]
    generated = generate_calls(model, tokenizer, list(entry.messages), entry.tools, table, max_new_tokens=8)
    decided = [actions for actions in generated.cache.schedule.decided[0] if actions is not None]
    assert decided and all(len(actions) == 1 for actions in decided)


def test_calibrate_on_position_bins_replaces_the_parser_tags_by_bins(model, tokenizer, cases, references, tmp_path):
    """No parser transitions (C.5): bins from the Full-KV calibration lengths, references re-tagged exactly as a
    position-view processor tags the same all-high generation, table keys over bin tags only."""
    lengths = {}
    for r in references:
        lengths.setdefault(r.category, []).append(r.num_decoded)
    bins = position_bin_starts(lengths)
    assert bins and max(bins) < max(r.num_decoded for r in references)
    table = PolicyTable.all_high(model, window=WINDOW, sink_tokens=4, tag_view="position_bins", position_bins=bins)
    for entry, reference in zip(cases[0], references, strict=True):
        run = run_case(model, tokenizer, BFCL, entry, table, MAX_NEW)[0]
        relabelled = with_position_tags(reference, bins, "function_calling")
        assert run.tokens == relabelled.tokens and run.tags == relabelled.tags and run.valid == relabelled.valid
    settings = dataclasses.replace(SETTINGS, tag_view="position_bins", stages=("decode",))
    result = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None)
    assert result.table.tag_view == "position_bins" and result.table.position_bins == bins
    assert result.report["position_bins"] == list(bins)
    assert result.table.entries and all(key.startswith("position") for key in result.table.entries)
    assert all(b.startswith("position|bin_") for b in result.report["decode"]["buckets"])
    result.save_pretrained(tmp_path / "bins")
    assert PolicyTable.from_pretrained(tmp_path / "bins", model=model) == result.table
    entry = cases[1][0]
    generated = generate_calls(model, tokenizer, list(entry.messages), entry.tools, result.table, max_new_tokens=8)
    assert generated.processor.position_bins == bins
    emitted = [tags for tags in generated.processor.tags(0) if tags is not None]
    assert emitted and all(len(tags) == 1 and tags[0].tag_class == "position" for tags in emitted)


def test_prefill_only_calibration_equals_the_prefill_stage_of_a_full_run(model, tokenizer, cases, calibrated, tmp_path):
    """The prefill stage holds decode all-high, so calibrating it alone gives the full run's prefill policy and
    prefill report; no decode table is made or saved."""
    settings = dataclasses.replace(SETTINGS, stages=("prefill",))
    result = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path / "refs", log=lambda _: None)
    assert result.table is None and "decode" not in result.report
    assert result.prefill_policy.entries == calibrated.prefill_policy.entries
    assert result.prefill_policy.budget == calibrated.prefill_policy.budget
    ours, full = (dict(r.report["prefill"]) for r in (result, calibrated))
    ours.pop("runtime_v_seconds"), full.pop("runtime_v_seconds")
    assert json.dumps(ours) == json.dumps(full)
    result.save_pretrained(tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["README.md", "calibration_report.json", "prefill_policy.json"]
    assert PrefillPolicy.from_pretrained(tmp_path / "out", model=model) == result.prefill_policy


def test_a_two_stage_result_saves_each_policy_in_its_own_folder_with_its_own_card(model, calibrated, tmp_path):
    calibrated.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration_report.json", "decode", "prefill"]
    assert PolicyTable.from_pretrained(tmp_path / "decode", model=model) == calibrated.table
    assert PrefillPolicy.from_pretrained(tmp_path / "prefill", model=model) == calibrated.prefill_policy
    assert "PASK policy table" in (tmp_path / "decode" / "README.md").read_text()
    assert "PASK prefill policy" in (tmp_path / "prefill" / "README.md").read_text()
    assert json.loads((tmp_path / "calibration_report.json").read_text()) == json.loads(json.dumps(calibrated.report))


def test_a_prefill_stage_without_a_passing_candidate_gives_the_all_high_prefill_policy(
    model, tokenizer, cases, tmp_path, monkeypatch
):
    """Development selection's fallback (no candidate within alpha_P) is a policy, not a missing one: every label
    ``H`` in every group, ``B_P = 1``."""
    from hf_structkv.calibration import runner

    def no_candidate_passes(stage, *args):
        return None, {"selected": "all-high fallback", "runtime_v_generations": 0}

    monkeypatch.setattr(runner, "run_stage", no_candidate_passes)
    settings = dataclasses.replace(SETTINGS, stages=("prefill",))
    result = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None)
    policy = result.prefill_policy
    assert result.table is None and policy is not None and policy.budget == 1.0
    assert set(policy.entries) == set(PROMPT_LABELS)
    assert all(e.action == e.floor == (Action.H,) * 3 for e in policy.entries.values())
    assert dict(policy.calibration)["selected"] == "all-high fallback"


def test_calibrate_errors_are_named(model, tokenizer, cases):
    with pytest.raises(ValueError, match="disjoint"):
        calibrate(model, tokenizer, cases[0], cases[0], SETTINGS)
    with pytest.raises(ValueError, match="calibration must be a non-empty list of BfclEntry"):
        calibrate(model, tokenizer, [], cases[1], SETTINGS)


def test_run_calibrate_threads_the_ablation_flags_into_the_saved_table(model, tokenizer, tmp_path):
    from hf_structkv.calibration.cli import run_calibrate
    from hf_structkv.cli import build_parser

    argv = ["calibrate", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "refs"), "--categories"]
    argv += ["simple_python", "--calibration-cases", "1", "--dev-cases", "1", "--max-new-tokens", str(MAX_NEW)]
    argv += ["--window", str(WINDOW), "--max-dev-candidates", "1", "--tag-view", "position_bins", "--layer-groups"]
    argv += ["1", "--decode-only"]
    assert run_calibrate(build_parser().parse_args(argv), lambda name: (model, tokenizer)) == 0
    table = PolicyTable.from_pretrained(tmp_path / "out", model=model)
    assert table.tag_view == "position_bins" and len(table.layer_groups) == 1 and table.provenance == "calibrated"
    report = json.loads((tmp_path / "out" / "calibration_report.json").read_text())
    assert report["settings"]["layer_groups"] == 1 and report["position_bins"] == list(table.position_bins)
    with pytest.raises(ValueError, match="decode table only"):
        run_calibrate(build_parser().parse_args(argv[:-1]), lambda name: (model, tokenizer))


def test_run_calibrate_prefill_only_writes_the_prefill_policy(model, tokenizer, tmp_path, capsys):
    from hf_structkv.calibration.cli import run_calibrate
    from hf_structkv.cli import build_parser

    argv = ["calibrate", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "refs"), "--categories"]
    argv += ["simple_python", "--calibration-cases", "1", "--dev-cases", "1", "--max-new-tokens", str(MAX_NEW)]
    argv += ["--window", str(WINDOW), "--max-dev-candidates", "1", "--prefill-only"]
    assert run_calibrate(build_parser().parse_args(argv), lambda name: (model, tokenizer)) == 0
    assert "prefill_budget" in capsys.readouterr().out and not (tmp_path / "out" / "policy_table.json").exists()
    policy = PrefillPolicy.from_pretrained(tmp_path / "out", model=model)
    report = json.loads((tmp_path / "out" / "calibration_report.json").read_text())
    assert report["settings"]["stages"] == ["prefill"] and report["prefill"]["selected"]
    assert dict(policy.calibration)["algorithm"] == "PASK Algorithm 1 (prefill)"
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv + ["--decode-only"])


def test_cli_calibrate_options():
    from hf_structkv.cli import build_parser

    args = build_parser().parse_args(
        ["calibrate", "--out", "x", "--calibration-cases", "2", "--tau", "0.01,0.02", "--tau", "0,0", "--paper-sizes"]
    )
    assert args.func.__name__ == "cmd_calibrate" and args.tau == [(0.01, 0.02), (0.0, 0.0)] and args.paper_sizes
    assert args.tag_view == "full"
    assert build_parser().parse_args(["calibrate", "--out", "x", "--tag-view", "no_role"]).tag_view == "no_role"
    assert args.layer_groups == 3
    assert build_parser().parse_args(["calibrate", "--out", "x", "--layer-groups", "1"]).layer_groups == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--out", "x", "--layer-groups", "2"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--out", "x", "--tau", "0.01"])
