"""`first_flip` against brute force: the first step at which greedy constrained generation under a schedule leaves
the all-high reference is the masked teacher-forced replay's first flip (float64, where the replay equals step-by-step
decoding), for decode interventions and prefill plans, on real BFCL cases."""

import copy

import pytest
import torch

from hf_structkv.attention.registry import enable
from hf_structkv.calibration.bfcl_task import BfclTask
from hf_structkv.calibration.buckets import Bucket
from hf_structkv.calibration.greedy_flips import first_flip, reference_masks
from hf_structkv.calibration.interventions import BucketIntervention
from hf_structkv.calibration.likelihood import CaseReplay
from hf_structkv.calibration.references import reference_trajectories, run_case
from hf_structkv.eval.bfcl import bfcl_split
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.table import PolicyTable

BFCL = BfclTask()
WINDOW, SINKS, MAX_NEW = 3, 4, 24


@pytest.fixture(scope="module")
def model64(model):
    model = copy.deepcopy(model).to(torch.float64)  # the replay equals step-by-step decoding (test_teacher_forced)
    enable(model)
    return model


def _divergence(generated: tuple[int, ...], reference: tuple[int, ...]) -> int | None:
    """The first index at which two greedy replies differ (None: the same reply)."""
    return next((i for i, (a, b) in enumerate(zip(generated, reference)) if a != b), None)


def test_first_flip_is_where_greedy_generation_leaves_the_reference(model64, tokenizer):
    cases = bfcl_split(["simple_python"], "calibration", limit=2)
    references = reference_trajectories(model64, tokenizer, BFCL, cases, MAX_NEW, WINDOW, SINKS)
    costs = GroupCosts.from_config(model64.config)
    all_high = PolicyTable.all_high(model64.config, window=WINDOW, sink_tokens=SINKS)
    seen = []
    for case, reference in zip(cases, references, strict=True):
        replay = CaseReplay(model64, reference, all_high)
        allowed = reference_masks(replay, BFCL.processor(tokenizer, case, all_high))  # one walk serves every schedule
        prompt = len(reference.prompt_ids)
        keys = sorted({key for tags in reference.tags if tags for key in tags})
        schedules = [(all_high, None)]
        schedules += [(BucketIntervention(costs, Bucket(key, 1), Action.R, SINKS, WINDOW), None) for key in keys[:3]]
        schedules += [(all_high, torch.full((1, prompt, 3), int(action))) for action in (Action.L, Action.R)]
        for policy, plan in schedules:
            run, _ = run_case(model64, tokenizer, BFCL, case, policy, MAX_NEW, prefill_plan=plan)
            want = _divergence(run.tokens, reference.tokens)
            assert len(run.tokens) == len(reference.tokens) or want is not None
            rows = replay.reply_logits(replay.prompt_cache.with_schedule(policy, plan))
            flip = first_flip(replay, rows, allowed)
            assert (None if flip is None else flip.index) == want
            if flip is not None:
                assert flip.chosen_token == run.tokens[want] and flip.reference_token == reference.tokens[want]
                assert flip.margin > 0
            seen.append(want)
    assert seen[0] is None and any(index is not None for index in seen)  # all-high keeps it; some schedule flips
