"""Replayed verdicts (`calibration.replayed_verdicts`) against brute force, in float64 where the teacher-forced replay
equals step-by-step decoding: an intervention the `FlipGate` passes writes the reference reply token for token, every
gated verdict is the generated one (decode and prefill interventions on real BFCL cases, scored so that verdicts
change with the reply), and a calibration by
replayed verdicts gives the table a calibration by generated verdicts gives."""

import copy
import dataclasses
import zlib

import pytest
import torch

from hf_structkv.attention.registry import enable
from hf_structkv.calibration import likelihood
from hf_structkv.calibration.bfcl_task import BfclTask
from hf_structkv.calibration.buckets import Bucket
from hf_structkv.calibration.interventions import prefill_positions
from hf_structkv.calibration.likelihood import PromptReplays
from hf_structkv.calibration.references import reference_trajectories
from hf_structkv.calibration.replayed_verdicts import FlipGate, GatedVerdicts, ReplayedDevelopment
from hf_structkv.calibration.runner import calibrate
from hf_structkv.calibration.selection import evaluate_controller
from hf_structkv.calibration.settings import CalibrationSettings
from hf_structkv.calibration.task_sensitivity import ACTIONS, decode_generator, needs_generation, prefill_generator
from hf_structkv.eval.bfcl import bfcl_split
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.prefill import PrefillPolicy
from hf_structkv.policy.table import PolicyEntry, PolicyTable
from hf_structkv.structure.prompt_spans import PROMPT_LABELS

WINDOW, SINKS, MAX_NEW = 3, 4, 24


class ParityTask(BfclTask):
    """BFCL cases scored by the parity of the reply's CRC-32: a random tiny model never writes a valid call, and this
    verdict changes with the reply (for half the replies), so that the calibrations below have sensitivities to agree
    on."""

    cache_key = {"score": "crc32 parity"}

    def score(self, case, text: str, stopped: bool) -> bool:
        return zlib.crc32(text.encode()) % 2 == 0


TASK = ParityTask()


@pytest.fixture(scope="module")
def model64(model):
    model = copy.deepcopy(model).to(torch.float64)
    enable(model)
    return model


@pytest.fixture(scope="module")
def cases():
    return bfcl_split(["simple_python"], "calibration", limit=2), bfcl_split(["simple_python"], "development", limit=2)


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_gated_verdicts_are_the_generated_ones_and_unflipped_replies_are_the_reference(
    model64, tokenizer, cases, stage
):
    # decode: a case the tiny model answers at length (most of its replies end before a decode intervention can
    # reach them); prefill: the first case
    calibration = bfcl_split(["simple_python"], "calibration", limit=6)[5:] if stage == "decode" else cases[0][:1]
    refs = reference_trajectories(model64, tokenizer, TASK, calibration, MAX_NEW, WINDOW, SINKS)
    costs = GroupCosts.from_config(model64.config)
    all_high = PolicyTable.all_high(model64.config, window=WINDOW, sink_tokens=SINKS)
    if stage == "decode":
        keys = sorted({key for r in refs for tags in r.tags if tags for key in tags})
        generate = decode_generator(model64, tokenizer, TASK, costs, MAX_NEW, SINKS, WINDOW)
    else:
        keys = [label for label in PROMPT_LABELS if any(prefill_positions(r, label, SINKS, WINDOW) for r in refs)]
        generate = prefill_generator(model64, tokenizer, TASK, all_high, MAX_NEW)
    buckets = [Bucket(key, 1) for key in keys]  # the middle layer group
    gate = FlipGate(model64, tokenizer, TASK, costs, stage, all_high)
    measure = GatedVerdicts(gate, generate)
    verdicts = set()
    for case, reference in zip(calibration, refs, strict=True):
        for bucket in buckets:
            if not needs_generation(reference, bucket, stage, SINKS, WINDOW):
                continue
            for action in ACTIONS:
                run = generate(case, reference, bucket, action)
                if not gate(case, reference, bucket, action):
                    assert run.tokens == reference.tokens  # no flip: the greedy reply is the reference's
                assert measure(case, reference, bucket, action) == run.valid
                verdicts.add(run.valid)
    assert gate.noisy == 0  # float64: the all-high replay reproduces every reference
    assert len(verdicts) == 2  # the generated verdicts differ between interventions
    assert 0 < gate.flipped < gate.checked  # some interventions change the reply, and many are never generated


def test_a_calibration_by_replayed_verdicts_gives_the_verdict_calibrations_table(model64, tokenizer, cases, tmp_path):
    # the prefill stage on one calibration and one development case: its interventions change replies (the test
    # above), the decode stage's on these short replies would not
    split = cases[0][:1], cases[1][:1]
    settings = CalibrationSettings(max_new_tokens=MAX_NEW, window=WINDOW, max_dev_candidates=2, stages=("prefill",))
    run = {"log": lambda _: None, "task": TASK}
    by_generation = calibrate(model64, tokenizer, *split, settings, cache_dir=tmp_path / "v", **run)
    replayed = dataclasses.replace(settings, sensitivity="replayed_verdict")
    by_replay = calibrate(model64, tokenizer, *split, replayed, cache_dir=tmp_path / "r", **run)
    assert by_replay.prefill_policy.entries == by_generation.prefill_policy.entries
    assert by_replay.prefill_policy.budget == by_generation.prefill_policy.budget
    assert by_replay.report["prefill"]["sensitivity"] == "replayed_verdict"
    counts = by_replay.report["prefill"]["runtime_v_replayed"]  # every needed intervention replayed, few generated
    assert counts["replayed"] == by_replay.report["prefill"]["runtime_v_generations"] > counts["generated"] > 0
    buckets = by_replay.report["prefill"]["buckets"]
    assert buckets == by_generation.report["prefill"]["buckets"]
    assert any(row["V"]["L"] or row["V"]["R"] for row in buckets.values())  # some intervention changes a verdict
    assert list((tmp_path / "r").glob("replayed-verdicts-*.jsonl"))
    assert not list((tmp_path / "r").glob("verdicts-*.jsonl"))


def test_replayed_development_gives_the_generated_development_result(model64, tokenizer, cases, monkeypatch):
    development = cases[1]
    refs = reference_trajectories(model64, tokenizer, TASK, development, MAX_NEW, WINDOW, SINKS)
    costs = GroupCosts.from_config(model64.config)
    all_high = PolicyTable.all_high(model64.config, window=WINDOW, sink_tokens=SINKS)
    prompts = []
    original = likelihood.CaseReplay.__init__
    monkeypatch.setattr(
        likelihood.CaseReplay, "__init__", lambda self, *a, **k: prompts.append(a[1].case_id) or original(self, *a, **k)
    )
    replayed = ReplayedDevelopment(tokenizer, TASK, refs, PromptReplays(model64, all_high))
    prefills = [None]  # all-high: every reply is the reference's, answered by replay
    for action in (Action.L, Action.R):  # the upper layer group lowered: these replies change, and are generated
        actions = (Action.H, Action.H, action)
        entry = PolicyEntry(actions, actions, ((0.0, 0.0),) * 3)
        prefills.append(PrefillPolicy(costs, dict.fromkeys(PROMPT_LABELS, entry), 0.5, provenance="illustrative"))
    run = (model64, tokenizer, TASK, development, all_high, MAX_NEW)
    for prefill in prefills:
        generated = evaluate_controller(*run, prefill_policy=prefill)
        gated = evaluate_controller(*run, prefill_policy=prefill, replayed=replayed)
        assert gated.valid == generated.valid and gated.error_rate == generated.error_rate
        assert gated.prefill_ratio == pytest.approx(generated.prefill_ratio, rel=1e-9)
        assert gated.decode_ratio == pytest.approx(generated.decode_ratio, rel=1e-9)
    assert replayed.replayed > 0 and replayed.passed > 0
    assert replayed.replayed + replayed.passed == len(development) * len(prefills)
    assert sorted(prompts) == sorted(r.case_id for r in refs)  # each prompt forwarded once for every candidate


def test_the_all_high_flip_check_is_the_replay_that_restarts_interventions(model64, tokenizer, monkeypatch):
    calibration = bfcl_split(["simple_python"], "calibration", limit=6)[5:]  # a reply long enough to restart in
    (reference,) = reference_trajectories(model64, tokenizer, TASK, calibration, MAX_NEW, WINDOW, SINKS)
    assert len(reference.tokens) >= 4
    all_high = PolicyTable.all_high(model64.config, window=WINDOW, sink_tokens=SINKS)
    fresh = likelihood.CaseReplay(model64, reference, all_high)
    expected_rows, expected = fresh.schedule_logits(all_high), fresh.log_probs(all_high, first=3)
    replay = likelihood.CaseReplay(model64, reference, all_high)
    forwards = []
    original = likelihood.CaseReplay.reply_logits
    monkeypatch.setattr(
        likelihood.CaseReplay, "reply_logits", lambda self, *a: forwards.append(a[1:]) or original(self, *a)
    )
    assert torch.equal(replay.all_high_logits(), expected_rows)
    assert torch.equal(replay.reference_log_probs, fresh.reference_log_probs)
    assert torch.equal(replay.log_probs(all_high, first=3), expected)
    assert len(forwards) == 2  # the flip check's forward, then the restart: no second all-high replay
    assert forwards[1] == (len(reference.prompt_ids) + 2,)
    assert torch.equal(replay.all_high_logits(), expected_rows)  # once kept, the all-high rows are forwarded again
