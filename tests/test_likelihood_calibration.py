"""Likelihood sensitivity (`calibration.likelihood`): the loss's closed form, the replay of a reference equals forced
step-by-step decoding on real BFCL references, skipped interventions are exactly 0 and never replayed, a resumed
calibration gives the identical table, and the calibrated table keeps the policy-table invariants."""

import copy
import dataclasses
import json
import math

import pytest
import torch

from hf_structkv.attention.registry import enable
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.calibration import likelihood
from hf_structkv.calibration.bfcl_task import BfclTask
from hf_structkv.calibration.buckets import Bucket
from hf_structkv.calibration.interventions import BucketIntervention
from hf_structkv.calibration.likelihood import (
    CaseReplay,
    DevelopmentReplay,
    DevelopmentReplayStore,
    LikelihoodStore,
    ReferenceTags,
    likelihood_loss,
    likelihood_measure,
)
from hf_structkv.calibration.references import reference_trajectories
from hf_structkv.calibration.resume import first_changed_forward
from hf_structkv.calibration.runner import calibrate
from hf_structkv.calibration.settings import CalibrationSettings
from hf_structkv.calibration.task_sensitivity import intervention_runs, needs_generation
from hf_structkv.eval.bfcl import bfcl_split
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.prefill import PrefillPolicy
from hf_structkv.policy.table import PolicyEntry, PolicyTable
from hf_structkv.structure.prompt_spans import PROMPT_LABELS

BFCL = BfclTask()
WINDOW, SINKS, MAX_NEW = 3, 4, 24
SETTINGS = CalibrationSettings(
    max_new_tokens=MAX_NEW, window=WINDOW, max_dev_candidates=2, sensitivity="likelihood", max_confirmations=2
)


@pytest.mark.parametrize(
    ("reference", "intervened", "first", "want"),
    [
        ([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], 0, 0.0),
        ([-1.0, -2.0, -3.0], [-9.0, -2.5, -3.5], 1, 1 - math.exp(-1.0)),
        ([-1.0, -2.0], [-1.0, -1.0], 1, -1.0),  # more likely: 1 - e^1 clipped at -1
        ([-1.0, -2.0], [-1.0, -2.1], 2, 0.0),  # nothing from token 2 on
        ([0.0], [-1000.0], 0, 1.0),
    ],
)
def test_likelihood_loss_closed_form(reference, intervened, first, want):
    got = likelihood_loss(torch.tensor(reference), torch.tensor(intervened), first)
    assert got == pytest.approx(want, abs=1e-12)


@pytest.fixture(scope="module")
def cases():
    return bfcl_split(["simple_python"], "calibration", limit=2), bfcl_split(["simple_python"], "development", limit=2)


@pytest.fixture(scope="module")
def references(model, tokenizer, cases, tmp_path_factory):
    enable(model)
    return reference_trajectories(
        model, tokenizer, BFCL, cases[0], MAX_NEW, WINDOW, SINKS, cache_dir=tmp_path_factory.mktemp("refs")
    )


def _forced_log_probs(model, reference, policy, plan=None) -> torch.Tensor:
    """Forced step-by-step decoding of the reference reply on a `StructuredMixedPrecisionCache`: ``[T]``."""
    tags = ReferenceTags(reference)
    cache = StructuredMixedPrecisionCache(model, policy, processor=tags, prefill_plan=plan)
    ids = torch.tensor([list(reference.prompt_ids) + list(reference.tokens)])
    prompt, rows = len(reference.prompt_ids), []
    with torch.no_grad():
        rows.append(model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[0, -1])
        for p in range(prompt, ids.shape[1] - 1):
            rows.append(model(input_ids=ids[:, p : p + 1], cache=cache, use_cache=True).logits[0, -1])
    log_probs = torch.log_softmax(torch.stack(rows).float(), -1)
    return log_probs.gather(-1, ids[0, prompt:].unsqueeze(-1)).squeeze(-1)


def test_replay_of_a_reference_equals_forced_decoding_for_every_action(model, references):
    model = copy.deepcopy(model).to(
        torch.float64
    )  # float64: no INT4 code flips from rounding noise (test_teacher_forced)
    reference = references[0]
    costs = GroupCosts.from_config(model.config)
    all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS)
    replay = CaseReplay(model, reference, all_high)
    torch.testing.assert_close(
        replay.reference_log_probs, _forced_log_probs(model, reference, all_high), atol=1e-4, rtol=0
    )
    key = next(key for tags in reference.tags if tags for key in tags)
    for action in (Action.L, Action.R):
        policy = BucketIntervention(costs, Bucket(key, 1), action, SINKS, WINDOW)
        forced = _forced_log_probs(model, reference, policy)
        torch.testing.assert_close(replay.log_probs(policy), forced, atol=1e-4, rtol=0)
    plan = torch.full((1, len(reference.prompt_ids), 3), int(Action.L))
    torch.testing.assert_close(
        replay.log_probs(all_high, plan), _forced_log_probs(model, reference, all_high, plan), atol=1e-4, rtol=0
    )


def test_skipped_interventions_are_exactly_zero_and_not_replayed(model, cases, references, tmp_path):
    costs = GroupCosts.from_config(model.config)
    all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS)
    keys = sorted({key for r in references for tags in r.tags if tags for key in tags})
    buckets = [Bucket(key, 2) for key in keys]
    measured = []
    inner = likelihood_measure(model, costs, "decode", all_high)

    def measure(case, reference, bucket, action):
        measured.append((reference.case_id, bucket))
        return inner(case, reference, bucket, action)

    def run(store):
        return intervention_runs(
            BFCL, cases[0], references, buckets, "decode", measure, SINKS, WINDOW, store=store, skipped=lambda r: 0.0
        )

    first = run(LikelihoodStore.open(tmp_path, {"k": 1}))
    for bucket in buckets:
        for i, reference in enumerate(references):
            needed = needs_generation(reference, bucket, "decode", SINKS, WINDOW)
            assert ((reference.case_id, bucket) in measured) == needed
            if not needed:
                assert first.values[bucket, Action.L][i] == 0.0 and first.values[bucket, Action.R][i] == 0.0
    assert any(v != 0.0 for values in first.values.values() for v in values)  # some intervention lowers the reply
    again = run(LikelihoodStore.open(tmp_path, {"k": 1}))
    assert again.values == first.values and again.reused == len(measured)
    assert len(measured) == sum(first.generated.values())  # one replay per needed (case, bucket, action)


def test_a_decode_intervention_changes_nothing_before_its_first_changed_forward(model, references):
    reference = references[0]
    all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS)
    replay = CaseReplay(model, reference, all_high)
    key = next(key for tags in reference.tags if tags for key in tags)
    first = first_changed_forward(reference, key, WINDOW)
    policy = BucketIntervention(GroupCosts.from_config(model.config), Bucket(key, 0), Action.R, SINKS, WINDOW)
    torch.testing.assert_close(replay.log_probs(policy)[:first], replay.reference_log_probs[:first], atol=1e-5, rtol=0)


def test_a_replay_restarted_at_the_first_changed_forward_equals_the_whole_replay(model, references):
    model = copy.deepcopy(model).to(torch.float64)  # as above: compare schedules, not INT4 rounding noise
    all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS)
    costs, compared = GroupCosts.from_config(model.config), 0
    for reference in references:
        replay = CaseReplay(model, reference, all_high)
        for key in sorted({key for tags in reference.tags if tags for key in tags}):
            first = first_changed_forward(reference, key, WINDOW)
            if first >= len(reference.tokens):
                continue
            for group, action in ((0, Action.R), (2, Action.L)):
                policy = BucketIntervention(costs, Bucket(key, group), action, SINKS, WINDOW)
                whole, restarted = replay.log_probs(policy), replay.log_probs(policy, first=first)
                torch.testing.assert_close(restarted, whole, atol=1e-5, rtol=0)  # FP32 log-softmax
                assert replay.loss(policy, first) == pytest.approx(
                    likelihood_loss(replay.reference_log_probs, whole, first), abs=1e-5
                )
                compared += not torch.allclose(whole, replay.reference_log_probs, atol=1e-6)
    assert compared >= 2  # some restarted replays do differ from the reference
    with pytest.raises(ValueError, match="first must be >= 1"):
        replay.log_probs(all_high, first=0)
    with pytest.raises(ValueError, match="keep must be in"):
        replay.prompt_cache.with_schedule(all_high, keep=len(reference.prompt_ids) + 1)


def test_likelihood_calibration_resumes_to_the_identical_table(model, tokenizer, cases, tmp_path):
    full = calibrate(model, tokenizer, *cases, SETTINGS, cache_dir=tmp_path, log=lambda _: None)
    replays = full.report["decode"]["runtime_v_generations"]
    assert full.report["decode"]["sensitivity"] == "likelihood" and replays > 0
    # interrupt: keep the store's first half only, then run again
    stores = sorted(tmp_path.glob("likelihood-*.jsonl"))
    assert stores and list(tmp_path.glob("development-replay-*.jsonl")) and list(tmp_path.glob("distortion-*.jsonl"))
    for path in stores:
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[: 1 + (len(lines) - 1) // 2]))
    resumed = calibrate(model, tokenizer, *cases, SETTINGS, cache_dir=tmp_path, log=lambda _: None)
    assert 0 < resumed.report["decode"]["runtime_v_reused"] < replays
    assert resumed.table.entries == full.table.entries and resumed.table.budget == full.table.budget
    assert resumed.table.reserve_by_state == full.table.reserve_by_state
    assert resumed.prefill_policy.entries == full.prefill_policy.entries
    for stage in ("decode", "prefill"):
        assert json.dumps(resumed.report[stage]["buckets"]) == json.dumps(full.report[stage]["buckets"])
    # the selection: by the error change the loss curve reads from the likelihood, then confirmed by verdicts
    decode = full.report["decode"]
    assert all("likelihood_loss" in row and "expected_error_change" in row for row in decode["development"])
    if decode["selected"] != "all-high fallback":
        assert decode["confirmations"][-1]["passed"]
        assert decode["selected"]["expected_error_change"] <= SETTINGS.alpha_decode + 1e-12
    else:
        assert all(not c["passed"] for c in decode["confirmations"])
    # the loss curve's pairs: calibration interventions with their replayed loss and generated verdict, the verdicts
    # stored, so the resumed run reads them back and fits the same curve
    for stage in ("decode", "prefill"):
        pairs = full.report[stage]["loss_curve"]["pairs"]
        assert 0 < len(pairs) <= SETTINGS.curve_pairs
        assert resumed.report[stage]["loss_curve"]["pairs"] == pairs
    assert list(tmp_path.glob("verdicts-*.jsonl"))
    # a run sampling one pair still fits on every stored verdict: the curve of the first run, nothing generated
    narrow = calibrate(
        model, tokenizer, *cases, dataclasses.replace(SETTINGS, curve_pairs=1), cache_dir=tmp_path, log=lambda _: None
    )
    for stage in ("decode", "prefill"):
        assert sorted(map(tuple, narrow.report[stage]["loss_curve"]["pairs"])) == sorted(
            map(tuple, full.report[stage]["loss_curve"]["pairs"])
        )


def test_runtime_v_shards_fill_the_store_that_a_full_run_reads_back(model, tokenizer, cases, tmp_path):
    settings = dataclasses.replace(SETTINGS, stages=("decode",))
    parts = [
        calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None, runtime_v_shard=(i, 2))
        for i in (0, 1)
    ]
    assert all(part.table is None and part.report["decode"]["reused"] == 0 for part in parts)
    full = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None)
    measured = sum(part.report["decode"]["measured"] for part in parts)
    assert measured == full.report["decode"]["runtime_v_generations"] == full.report["decode"]["runtime_v_reused"] > 0
    fresh = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path / "fresh", log=lambda _: None)
    assert fresh.table.entries == full.table.entries and fresh.table.budget == full.table.budget
    with pytest.raises(ValueError, match="runtime_v_shard must be"):
        calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, runtime_v_shard=(2, 2))
    with pytest.raises(ValueError, match="pass cache_dir"):
        calibrate(model, tokenizer, *cases, settings, runtime_v_shard=(0, 2))


def test_development_replays_are_stored_and_read_back(model, references, tmp_path):
    """A candidate's development replays land in the store as they are computed; a new run reads them back (the same
    result, every case reused) and replays only what another candidate needs."""
    costs = GroupCosts.from_config(model.config)
    all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS)
    low = PolicyEntry((Action.L,) * 3, (Action.L,) * 3, ((0.0, 0.0),) * 3)
    prefill = PrefillPolicy(
        costs=costs, entries=dict.fromkeys(PROMPT_LABELS, low), budget=0.5, provenance="illustrative"
    )
    plain = DevelopmentReplay(model, references, all_high)(all_high, prefill)
    key = {"test": "development replays"}
    first = DevelopmentReplay(model, references, all_high, DevelopmentReplayStore.open(tmp_path, key))(
        all_high, prefill
    )
    assert first == plain and plain.reused == 0 and plain.error_rate != 0 and plain.prefill_ratio < 1
    store = DevelopmentReplayStore.open(tmp_path, key)
    assert len(store) == len(references)
    again = DevelopmentReplay(model, references, all_high, store)
    assert again(all_high, prefill) == dataclasses.replace(plain, reused=len(references))
    assert again(all_high).reused == 0 and len(store) == 2 * len(references)


@pytest.mark.parametrize("max_prompt_bytes", [0, 1, 2**30])
def test_prompt_forwards_kept_across_candidates_change_nothing_and_run_once_per_case(
    model, references, max_prompt_bytes, monkeypatch
):
    """Kept prompt forwards (all, or none under a bound of 0 or 1 byte) give the results of fresh ones; with room for
    them all, each case's prompt is forwarded once for two candidates."""
    costs = GroupCosts.from_config(model.config)
    all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS)
    low = PolicyEntry((Action.L,) * 3, (Action.L,) * 3, ((0.0, 0.0),) * 3)
    prefill = PrefillPolicy(
        costs=costs, entries=dict.fromkeys(PROMPT_LABELS, low), budget=0.5, provenance="illustrative"
    )
    fresh = [DevelopmentReplay(model, references, all_high, max_prompt_bytes=0)(all_high, p) for p in (None, prefill)]
    prompts = []
    original = likelihood.CaseReplay.__init__
    monkeypatch.setattr(
        likelihood.CaseReplay, "__init__", lambda self, *a, **k: prompts.append(a[1].case_id) or original(self, *a, **k)
    )
    replay = DevelopmentReplay(model, references, all_high, max_prompt_bytes=max_prompt_bytes)
    assert [replay(all_high, p) for p in (None, prefill)] == fresh
    assert len(prompts) == (len(references) if max_prompt_bytes == 2**30 else 2 * len(references))
    with pytest.raises(ValueError, match="max_prompt_bytes must be"):
        DevelopmentReplay(model, references, all_high, max_prompt_bytes=-1)


def test_settings_refuse_an_unknown_sensitivity():
    with pytest.raises(ValueError, match="sensitivity must be one of"):
        dataclasses.replace(SETTINGS, sensitivity="bits")
    with pytest.raises(ValueError, match="max_confirmations"):
        dataclasses.replace(SETTINGS, max_confirmations=0)


def test_the_likelihood_of_L_is_measured_in_the_calibrations_key_layout(model, references):
    """An ``L`` loss replays the calibration's key layout (the all-high policy carries it); an ``R`` loss is the same
    in both layouts (a release keeps no INT4 token)."""
    costs = GroupCosts.from_config(model.config)
    reference = references[0]
    key = next(key for tags in reference.tags if tags for key in tags)
    first = first_changed_forward(reference, key, WINDOW)
    losses = {}
    for int4_keys in ("row", "centred"):
        all_high = PolicyTable.all_high(model.config, window=WINDOW, sink_tokens=SINKS, int4_keys=int4_keys)
        replay = CaseReplay(model, reference, all_high)
        for stage, bucket in (("decode", Bucket(key, 1)), ("prefill", Bucket("protected_content", 1))):
            measure = likelihood_measure(model, costs, stage, all_high)
            for action in (Action.L, Action.R):
                losses[int4_keys, stage, action] = measure(None, reference, bucket, action)
        policy = BucketIntervention(costs, Bucket(key, 1), Action.L, SINKS, WINDOW, int4_keys=int4_keys)
        assert losses[int4_keys, "decode", Action.L] == replay.loss(policy, first)
    for stage in ("decode", "prefill"):
        assert losses["row", stage, Action.R] == pytest.approx(losses["centred", stage, Action.R], abs=1e-6)
        assert losses["row", stage, Action.L] != pytest.approx(losses["centred", stage, Action.L], abs=1e-6)


def test_a_centred_calibration_records_its_layout_and_shares_only_releases_with_a_row_run(
    model, tokenizer, cases, tmp_path
):
    settings = dataclasses.replace(SETTINGS, max_dev_candidates=1, max_confirmations=1, curve_pairs=4)
    row = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None)
    references = sorted(tmp_path.glob("reference-*.json"))
    stores = {p.name: len(p.read_text().splitlines()) for p in tmp_path.glob("likelihood-*.jsonl")}
    centred = calibrate(
        model,
        tokenizer,
        *cases,
        dataclasses.replace(settings, int4_keys="centred"),
        cache_dir=tmp_path,
        log=lambda _: None,
    )
    assert sorted(tmp_path.glob("reference-*.json")) == references  # the all-high references are shared
    for stage in ("decode", "prefill"):  # every R read back from the row run's store, every L replayed
        measured, reused = row.report[stage]["runtime_v_generations"], centred.report[stage]["runtime_v_reused"]
        assert measured > 0 and reused == measured // 2
    after = {p.name: len(p.read_text().splitlines()) for p in tmp_path.glob("likelihood-*.jsonl")}
    assert {name: after[name] for name in stores} == stores and len(after) == 2 * len(stores)
    assert (row.table.int4_keys, row.prefill_policy.int4_keys) == ("row", "row")
    assert (centred.table.int4_keys, centred.prefill_policy.int4_keys) == ("centred", "centred")
    assert centred.report["settings"]["int4_keys"] == "centred"
    centred.save_pretrained(tmp_path / "out")
    assert PolicyTable.from_pretrained(tmp_path / "out" / "decode").int4_keys == "centred"
    assert PrefillPolicy.from_pretrained(tmp_path / "out" / "prefill").int4_keys == "centred"
    with pytest.raises(ValueError, match="int4_keys"):
        dataclasses.replace(settings, int4_keys="column")
