"""`PolicyController` (Algorithm 2): hand-computed golden steps, a brute-force reference on random tables and on every
shipped decode table, floors never crossed over 10^5 random steps (and on every shipped table), the exact ledger
identity, stop tokens, and bit-for-bit rollback."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from fractions import Fraction
from itertools import islice, permutations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy_table import brute_lookup, entry, tables, tag

from hf_structkv.policy import Action, GroupCosts, PolicyController, PolicyTable, calibrated_policy, illustrative_policy
from hf_structkv.policy.shipped import SHIPPED_PAIRS
from hf_structkv.structure.tags import view_vocabulary

R, L, H = Action.R, Action.L, Action.H
# One KV head of dimension 4 per layer, 3 layers: m(H, c) = 16 * 8 = 128 bits, m(L, c) = 4 * 8 + 16 * 2 = 64 bits.
COSTS = GroupCosts.from_dims([1, 1, 1], [4, 4, 4])
SCAFFOLD = tag("pure_scaffold|scaffold_separator|boundary|no_lookahead")
VALUE = tag("schema_bearing|required|boundary|no_lookahead")
CRITICAL_VALUE = tag("schema_bearing|required|critical|no_lookahead")


def small_table(budget=0.5, **fields) -> PolicyTable:
    entries = {
        "pure_scaffold": entry("LLL", "RRR", r_to_l=(1.0, 3.0, 5.0), l_to_h=(0.5, 0.7, 0.9)),
        "schema_bearing|required": entry("HHH", "LLL", r_to_l=(2.0, 2.0, 2.0), l_to_h=(0.2, 0.6, 0.4)),
    }
    return PolicyTable("function_calling", COSTS, entries, budget, provenance="illustrative", **fields)


# ---------------------------------------------------------------------------------------------------- golden
def test_costs_of_the_golden_setup():
    assert [COSTS.cost(a, 0) for a in (R, L, H)] == [0, 64, 128] and COSTS.full == 384


def test_golden_demotion_promotion_and_ledger():
    controller = PolicyController(small_table(budget=0.5), COSTS)  # b = 192 bits, R_1 = 192
    assert controller.allowance == 192.0 and controller.balance == 192.0
    # A required value: HHH costs 384 > 192. Demote ascending by L->H score (0.2, 0.6, 0.4): lower (-> 320),
    # upper (-> 256), middle (-> 192 <= 192): LLL, exactly the budget.
    assert controller.step((VALUE,)) == (L, L, L)
    assert controller.balance == 192.0 and controller.scheduled_bits == 192
    # Scaffold: LLL = 192 fits; not critical, so no promotion.
    assert controller.step((SCAFFOLD,)) == (L, L, L)
    assert controller.balance == 192.0
    # A critical value with balance 192: demote to LLL as before, then promote descending by score: the L->H
    # steps (0.2, 0.6, 0.4) each cost 64 and 192 + 64 > 192: nothing fits.
    assert controller.step((CRITICAL_VALUE,)) == (L, L, L)
    # Stop token: free, no allowance.
    assert controller.step(None) is None
    assert controller.balance == 192.0 and controller.scheduled_bits == 576 and controller.num_steps == 4


def test_golden_savings_buy_promotions():
    controller = PolicyController(small_table(budget=1.0), COSTS)  # b = 384
    # Critical value, budget 384: HHH = 384 fits, no demotion; promotions impossible (already H).
    assert controller.step((CRITICAL_VALUE,)) == (H, H, H) and controller.balance == 384.0
    # Scaffold: LLL = 192 <= 384, not critical: stays LLL and saves 192 bits.
    assert controller.step((SCAFFOLD,)) == (L, L, L) and controller.balance == 576.0
    # A critical scaffold-class token, budget 576: LLL (192) promoted by descending L->H score, upper (0.9),
    # middle (0.7), lower (0.5), 64 bits each: all fit.
    assert controller.step((tag("pure_scaffold|required|critical|no_lookahead"),)) == (H, H, H)
    assert controller.balance == 576.0


def test_golden_promotion_order_and_stop_at_first_misfit():
    # Critical scaffold-class token: base LLL (192), floors RRR. Budget b = 0.75 * 384 = 288: promotions in
    # descending L->H score (0.9 upper, 0.7 middle, 0.5 lower), each +64: upper (256) fits, middle (320) does not,
    # and the first step that does not fit ends the promotions.
    controller = PolicyController(small_table(budget=0.75), COSTS)
    assert controller.step((tag("pure_scaffold|required|critical|no_lookahead"),)) == (L, L, H)
    assert controller.balance == 288.0 - 256.0 + 288.0


def test_golden_demotion_goes_below_base_but_never_below_floor():
    # B_D = 0: no allowance, every token is demoted to its floor; debt carries.
    controller = PolicyController(small_table(budget=0.0), COSTS)
    assert controller.step((SCAFFOLD,)) == (R, R, R)
    assert controller.step((VALUE,)) == (L, L, L)  # floors LLL: 192 bits of debt
    assert controller.balance == -192.0
    assert controller.step(()) == (H, H, H)  # unresolved: full protection regardless of the budget
    assert controller.balance == -192.0 - 384.0


def test_reserve_uses_the_most_demanding_candidate_state():
    # Γ(boundary) = 0, Γ(critical) = 128. Two candidates on the same class entry (pure_scaffold: LLL / RRR),
    # one boundary, one critical: B_t = [192 - 128]_+ = 64 -> demote in ascending R->L score (lower 1.0, middle
    # 3.0, upper 5.0): LLL -> RLL (128) -> RRL (64).
    table = small_table(budget=0.5, reserve_by_state={"boundary": 0.0, "critical": 128.0})
    boundary = tag("pure_scaffold|optional|boundary|no_lookahead")
    critical_other = tag("pure_scaffold|optional|critical|no_lookahead")
    assert PolicyController(table, COSTS).step((boundary,)) == (L, L, L)
    # critical_other also protects (critical state), but promotion needs budget beyond 64: none.
    assert PolicyController(table, COSTS).step((boundary, critical_other)) == (R, R, L)


def test_all_high_policy_keeps_everything_high_and_the_balance_at_one_allowance():
    controller = PolicyController(PolicyTable.all_high(COSTS), COSTS)
    for candidates in [(SCAFFOLD,), (), (VALUE, SCAFFOLD), None, (CRITICAL_VALUE,)]:
        assert controller.step(candidates) in (None, (H, H, H))
        assert controller.balance == COSTS.full


def test_illustrative_policy_protects_dispatch_keys():
    table = illustrative_policy()
    controller = PolicyController(table, table.costs)
    key = tag("schema_bearing|dispatch_key|critical|no_lookahead")
    scaffold = tag("pure_scaffold|scaffold_separator|boundary|no_lookahead")
    assert controller.step((key,)) == (H, H, H)  # floors H: charged in full, debt carries
    assert controller.balance < controller.allowance
    assert max(controller.step((scaffold,))) <= L


def test_mismatched_inputs():
    with pytest.raises(ValueError, match="built for other layer dimensions"):
        PolicyController(small_table(), GroupCosts.from_dims([2, 1, 1], [4, 4, 4]))
    with pytest.raises(TypeError, match="table must be a PolicyTable"):
        PolicyController("table", COSTS)
    with pytest.raises(TypeError, match="costs must be a GroupCosts"):
        PolicyController(small_table(), None)
    controller = PolicyController(small_table(), COSTS)
    controller.step((SCAFFOLD,))
    for bad, error in ((2, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"num_steps must be an integer in \[0, 1\] \(steps taken\)"):
            controller.rollback(bad)


# ---------------------------------------------------------------------------------------------------- reference
def _linear_extensions(chains: list[list[tuple]]) -> list[list[tuple]]:
    """Every order of the steps that keeps each chain's own order."""
    steps = [s for chain in chains for s in chain]
    position = {s: (i, j) for i, chain in enumerate(chains) for j, s in enumerate(chain)}
    return [
        list(order)
        for order in permutations(steps)
        if all(
            position[a][1] < position[b][1]
            for k, a in enumerate(order)
            for b in order[k + 1 :]
            if position[a][0] == position[b][0]
        )
    ]


def reference_step(table: PolicyTable, candidates, balance: Fraction) -> tuple[Action, ...]:
    """Algorithm 2 by enumeration: demotion follows the lexicographically smallest (score, group) order of all chain-
    respecting demotion sequences and stops at the first prefix that fits; promotion the largest, while it fits."""
    costs = table.costs
    base, floor, priorities = brute_lookup(table, candidates)
    actions = [max(a, f) for a, f in zip(base, floor)]
    reserve = max((Fraction(table.reserve(t.state)) for t in candidates), default=Fraction(table.reserve(None)))
    budget = max(balance - reserve, Fraction(0))

    def total(vector):
        return sum(costs.cost(Action(a), c) for c, a in enumerate(vector))

    def chain(c, levels):  # steps (group, from, to) while each has a score
        steps = []
        for frm, to in levels:
            score = priorities[c][min(frm, to)]
            if score is None:
                break
            steps.append((score, c, frm, to))
        return steps

    down = [chain(c, [(a, a - 1) for a in range(actions[c], floor[c], -1)]) for c in range(len(actions))]
    orders = _linear_extensions([s for s in down if s])
    best = min(orders, key=lambda order: [(s[0], s[1]) for s in order]) if orders else []
    for _, c, _, to in best:
        if total(actions) <= budget:
            break
        actions[c] = to
    if any(t.protects for t in candidates):
        up = [chain(c, [(a, a + 1) for a in range(actions[c], int(H))]) for c in range(len(actions))]
        orders = _linear_extensions([s for s in up if s])
        best = max(orders, key=lambda order: [(s[0], s[1]) for s in order]) if orders else []
        for _, c, _, to in best:
            trial = list(actions)
            trial[c] = to
            if total(trial) > budget:
                break
            actions = trial
    return tuple(Action(a) for a in actions)


def random_candidates(table: PolicyTable, seed: int) -> Iterator:
    """Endless tokens' candidates: ``None`` (stop) 5%, empty (unresolved) 5%, else one to three tags of the table's
    vocabulary under its tag view, each half the time one that resolves to an entry (when the table has one)."""
    rng = random.Random(seed)
    tags = view_vocabulary(table.family, table.tag_view, table.position_bins)
    resolved = [t for t in tags if table.entry_key(t) is not None] or tags
    while True:
        draw = rng.random()
        if draw < 0.05:
            yield None
        elif draw < 0.10:
            yield ()
        else:
            yield tuple(
                rng.choice(resolved if rng.random() < 0.5 else tags) for _ in range(rng.choice((1, 1, 1, 2, 3)))
            )


def check_reference(table: PolicyTable, seed: int, steps: int) -> list:
    """``steps`` random tokens: every decision equals `reference_step` at the exact balance. Returns the decisions."""
    controller = PolicyController(table, table.costs)
    allowance = Fraction(table.budget) * table.costs.full
    balance, decisions = allowance, []
    for candidates in islice(random_candidates(table, seed), steps):
        actions = controller.step(candidates)
        decisions.append(actions)
        if candidates is None:
            assert actions is None
            continue
        assert actions == reference_step(table, candidates, balance)
        balance += allowance - table.costs.total(actions)
    return decisions


def check_floors_and_ledger(table: PolicyTable, seed: int, steps: int) -> None:
    """``steps`` random tokens: floors never crossed (Proposition 1), ``R_t = t·b − Σ M(a_i)`` exactly."""
    controller = PolicyController(table, table.costs)
    allowance = Fraction(table.budget) * table.costs.full
    tokens, charged = 0, 0
    for candidates in islice(random_candidates(table, seed), steps):
        actions = controller.step(candidates)
        if candidates is None:
            assert actions is None
        else:
            floor = brute_lookup(table, candidates).floor
            assert all(a >= f for a, f in zip(actions, floor)), (candidates, actions, floor)
            tokens += 1
            charged += table.costs.total(actions)
        assert controller.scheduled_bits == charged
        assert controller.balance == float((tokens + 1) * allowance - charged)  # R_{t+1}, exactly rounded
    assert controller.num_steps == steps


@settings(max_examples=150, deadline=None)
@given(tables(), st.integers(0, 2**32 - 1))
def test_controller_equals_the_brute_force_reference(table, seed):
    check_reference(table, seed, 40)


@settings(max_examples=100, deadline=None)
@given(tables(), st.integers(0, 2**32 - 1))
def test_floors_and_ledger_over_1000_steps_per_table(table, seed):
    """100 tables x 1000 steps = 10^5 controller steps."""
    check_floors_and_ledger(table, seed, 1000)


@pytest.mark.parametrize("name", sorted(SHIPPED_PAIRS))
def test_every_shipped_decode_table_equals_the_reference_keeps_its_floors_and_an_exact_ledger(name):
    """Every shipped pair's decode table (a newly shipped pair is covered by being in `SHIPPED_PAIRS`): 10 x 100 steps
    against the brute-force reference, 10 x 1000 steps of floors and ledger; the steps exercise its entries (some
    decision below H)."""
    table = calibrated_policy(name=name)
    decisions = [d for seed in range(10) for d in check_reference(table, seed, 100)]
    assert any(d is not None and min(d) < H for d in decisions)
    for seed in range(10):
        check_floors_and_ledger(table, seed, 1000)


@settings(max_examples=60, deadline=None)
@given(tables(), st.integers(0, 2**32 - 1), st.integers(0, 60), st.integers(0, 60))
def test_rollback_restores_the_state_bit_for_bit(table, seed, total, back):
    stream = list(islice(random_candidates(table, seed), total + 20))
    back = min(back, total)
    controller = PolicyController(table, table.costs)
    states, decisions = [], []
    for candidates in stream[:total]:
        states.append((controller.num_steps, controller.balance.hex(), controller.scheduled_bits))
        decisions.append(controller.step(candidates))
    states.append((controller.num_steps, controller.balance.hex(), controller.scheduled_bits))
    clone = copy.deepcopy(controller)
    controller.rollback(total - back)
    assert (controller.num_steps, controller.balance.hex(), controller.scheduled_bits) == states[total - back]
    # Replaying the same tokens reproduces the same decisions and states; new tokens continue like a fresh run.
    fresh = PolicyController(table, table.costs)
    replay = [fresh.step(c) for c in stream[: total - back]]
    assert replay == decisions[: total - back]
    for candidates in stream[total - back :]:
        assert controller.step(candidates) == fresh.step(candidates)
        assert (controller.balance.hex(), controller.scheduled_bits) == (fresh.balance.hex(), fresh.scheduled_bits)
    assert clone.num_steps == total  # a deep copy is independent of the rolled-back original


def test_stop_tokens_are_free_and_add_no_allowance():
    controller = PolicyController(small_table(), COSTS)
    controller.step((SCAFFOLD,))
    before = (controller.balance, controller.scheduled_bits)
    for _ in range(5):
        assert controller.step(None) is None
    assert (controller.balance, controller.scheduled_bits) == before and controller.num_steps == 6


def test_exact_ledger_with_a_non_dyadic_budget():
    # B_D = 0.1 is not a binary fraction: float(0.1) * 384 is inexact, the ledger is not.
    table = small_table(budget=0.1)
    controller = PolicyController(table, COSTS)
    allowance = Fraction(0.1) * 384
    charged = 0
    for i in range(1, 2001):
        charged += COSTS.total(controller.step((SCAFFOLD,)))
        assert controller.balance == float((i + 1) * allowance - charged)


def test_policy_table_is_a_retention_policy_whose_controller_is_algorithm_2():
    from hf_structkv.policy import RetentionController, RetentionPolicy

    table = PolicyTable.all_high(COSTS)
    assert isinstance(table, RetentionPolicy)
    controller = table.controller(table.costs)
    assert isinstance(controller, PolicyController) and isinstance(controller, RetentionController)


def test_retention_interface_defaults():
    """A table records no attention statistics and its controller plans no prompt (the declared defaults); the
    interface is abstract: a policy without ``controller`` cannot be made."""
    from hf_structkv.policy import RetentionPolicy

    table = PolicyTable.all_high(COSTS)
    assert table.attention_statistics() is None
    with pytest.raises(NotImplementedError, match="PolicyController does not plan the prompt"):
        table.controller(COSTS).plan_prompt(torch.ones(3, 4), torch.ones(4, dtype=torch.bool))

    class NoController(RetentionPolicy):
        costs, sink_tokens, window = COSTS, 0, 1

    with pytest.raises(TypeError, match="abstract"):
        NoController()

    class Minimal(NoController):
        def controller(self, costs):
            return PolicyController(table, costs)

    minimal = Minimal()
    assert (minimal.tag_view, minimal.position_bins, minimal.attention_statistics()) == ("full", (), None)
