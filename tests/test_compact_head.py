"""Per-head compaction: KV-Surgeon formulas against brute force / closed forms, refit, methods, degenerate inputs."""

import itertools
import math

import pytest
import torch

from hf_structkv.compaction.head_compaction import HEAD_METHODS, compact_head, relative_loss
from hf_structkv.compaction.head_method import refit_head
from hf_structkv.compaction.head_statistics import CompactedHead, HeadProblem, loo_scores
from hf_structkv.compaction.kv_surgeon import KVSurgeon
from hf_structkv.compaction.refit import fit_multipliers, fit_values, least_squares
from hf_structkv.compaction.surrogate import downdate_, eliminate_block, ridge_solve, saliency

F64 = torch.float64


def random_head(seed, length=48, dim=8, queries=64, value_dim=6, temperature=2.0, dtype=F64):
    """``(K [T, D], V [T, D_v], Q [N, D], Q_heldout [N, D])`` with peaked attention (query scale ``temperature``)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, dim, generator=gen, dtype=F64)
    values = torch.randn(length, value_dim, generator=gen, dtype=F64)
    calib = temperature * torch.randn(queries, dim, generator=gen, dtype=F64)
    heldout = temperature * torch.randn(queries, dim, generator=gen, dtype=F64)
    return keys.to(dtype), values.to(dtype), calib.to(dtype), heldout.to(dtype)


def attention_stats(keys, values, queries):
    """``(P [N, T], O [N, D_v])`` of plain softmax attention with scale ``1/sqrt(D)``."""
    attention = torch.softmax(queries @ keys.T / math.sqrt(keys.shape[1]), dim=1)
    return attention, attention @ values


def surrogate_problem(seed, length=30, queries=40, value_dim=5):
    """``(P [N, T], Y [N, d_v + 1], λ)`` of the surrogate (9) on a random head, λ = 0.01 tr(PᵀP)/T."""
    keys, values, calib, _ = random_head(seed, length=length, queries=queries, value_dim=value_dim)
    attention, outputs = attention_stats(keys, values, calib)
    gamma = outputs.square().sum(1).mean().sqrt()
    targets = torch.cat([outputs, gamma * torch.ones(queries, 1, dtype=F64)], dim=1)
    return attention, targets, 0.01 * attention.square().sum().item() / length


def objective(attention, targets, ridge):
    """``F(S)`` of (9) by a fresh solve on the columns ``attention [N, |S|]``."""
    coefficients, _, _ = ridge_solve(attention, targets, ridge)
    return ((targets - attention @ coefficients).square().sum() + ridge * coefficients.square().sum()).item()


# --- the surrogate: (11), (14) ---------------------------------------------------------------------------------------


def test_block_update_equals_fresh_solve_on_reduced_support():
    attention, targets, ridge = surrogate_problem(0)
    coefficients, inverse, used = ridge_solve(attention, targets, ridge)
    assert used == ridge
    support = torch.arange(attention.shape[1])
    for block in ([3, 17, 5, 22], [0], [10, 11, 12, 1, 2, 20, 24]):  # positions within the current support
        block = torch.tensor(block)
        coefficients, inverse = eliminate_block(coefficients, inverse, block)
        keep = torch.ones(support.numel(), dtype=torch.bool)
        keep[block] = False
        support = support[keep]
        fresh_b, fresh_g, _ = ridge_solve(attention[:, support], targets, ridge)
        torch.testing.assert_close(coefficients, fresh_b, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(inverse, fresh_g, rtol=1e-8, atol=1e-8)


def test_in_place_downdate_equals_the_block_update_on_the_remaining_rows_and_zeroes_the_block():
    attention, targets, ridge = surrogate_problem(3)
    coefficients, inverse, _ = ridge_solve(attention, targets, ridge)
    block, rest = torch.tensor([4, 9, 0]), torch.tensor([j for j in range(attention.shape[1]) if j not in (4, 9, 0)])
    expected_b, expected_g = eliminate_block(coefficients, inverse, block)
    downdate_(coefficients, inverse, block)
    torch.testing.assert_close(coefficients[rest], expected_b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(inverse[rest][:, rest], expected_g, rtol=1e-10, atol=1e-12)
    assert inverse[block].abs().max() < 1e-10 * expected_g.abs().max()


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_greedy_elimination_equals_fresh_solves_at_every_block(block_size):
    """Brute force: at every step solve (9) afresh on the live support and delete the ``n_b`` lowest (11)."""
    attention, targets, ridge = surrogate_problem(4, length=40, queries=60)
    budget = 9
    support = torch.arange(attention.shape[1])
    while support.numel() > budget:
        fresh_b, fresh_g, _ = ridge_solve(attention[:, support], targets, ridge)
        block = torch.topk(saliency(fresh_b, fresh_g), min(block_size, support.numel() - budget), largest=False)
        keep = torch.ones(support.numel(), dtype=torch.bool)
        keep[block.indices] = False
        support = support[keep]
    coefficients, inverse, _ = ridge_solve(attention, targets, ridge)
    kept = KVSurgeon(block_size=block_size).eliminate(coefficients, inverse, budget)  # crosses the shrink step
    assert kept.tolist() == support.tolist()


def test_saliency_equals_objective_increase_of_single_deletion():
    attention, targets, ridge = surrogate_problem(1)
    coefficients, inverse, _ = ridge_solve(attention, targets, ridge)
    base = objective(attention, targets, ridge)
    columns = attention.shape[1]
    increase = torch.tensor(
        [objective(attention[:, [k for k in range(columns) if k != j]], targets, ridge) - base for j in range(columns)],
        dtype=F64,
    )
    torch.testing.assert_close(saliency(coefficients, inverse), increase, rtol=1e-6, atol=1e-10)


def test_loo_without_floor_is_exact_single_deletion_loss():
    keys, values, calib, _ = random_head(2, length=20, queries=30)
    attention, outputs = attention_stats(keys, values, calib)
    logits = calib @ keys.T / math.sqrt(keys.shape[1])
    exact = []
    for j in range(keys.shape[0]):
        masked = logits.clone()
        masked[:, j] = -math.inf
        exact.append((torch.softmax(masked, dim=1) @ values - outputs).square().sum())
    scores = loo_scores(attention, values, outputs, floor=0.0)
    torch.testing.assert_close(scores, torch.stack(exact), rtol=1e-9, atol=1e-12)


# --- the shared final refit ------------------------------------------------------------------------------------------


def refit_inputs(seed, kept=10):
    """``(E_S [N, t], s [N], O [N, D_v], Z_S [N, t])`` on a random support of ``kept`` entries of a random head."""
    keys, values, calib, _ = random_head(seed)
    logits = calib @ keys.T / math.sqrt(keys.shape[1])
    unnormalized = torch.exp(logits - logits.amax(1, keepdim=True))
    support = torch.randperm(keys.shape[0], generator=torch.Generator().manual_seed(seed))[:kept]
    outputs = torch.softmax(logits, 1) @ values
    return unnormalized[:, support], unnormalized.sum(1), outputs, logits[:, support]


@pytest.mark.parametrize("seed", range(4))
def test_multipliers_in_box_and_gradient_steps_do_not_increase_residual(seed):
    unnormalized, row_sums, _, _ = refit_inputs(seed)
    clamped = fit_multipliers(unnormalized, row_sums, bias_bound=3.0, steps=0)
    refined = fit_multipliers(unnormalized, row_sums, bias_bound=3.0)
    for weights in (clamped, refined):
        assert weights.min() >= math.exp(-3) - 1e-15 and weights.max() <= math.exp(3) + 1e-12
    residual_clamped, residual_refined = ((unnormalized @ w - row_sums).norm().item() for w in (clamped, refined))
    assert residual_refined <= residual_clamped + 1e-12


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (1, 7)])
def test_least_squares_matches_the_pseudo_inverse_and_the_nearest_solution_to_an_anchor(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    matrix = torch.randn(*shape, generator=generator, dtype=F64)
    rhs = torch.randn(shape[0], 3, generator=generator, dtype=F64)
    anchor = torch.randn(shape[1], 3, generator=generator, dtype=F64)
    pinv = torch.linalg.pinv(matrix)
    torch.testing.assert_close(least_squares(matrix, rhs), pinv @ rhs)
    # among the minimisers, the one nearest the anchor: anchor + pinv (rhs - A anchor) (closed form)
    torch.testing.assert_close(least_squares(matrix, rhs, anchor), anchor + pinv @ (rhs - matrix @ anchor))
    duplicated = torch.cat([matrix, matrix[:, :1]], 1)  # dependent columns: the pseudo-inverse path
    torch.testing.assert_close(least_squares(duplicated, rhs), torch.linalg.pinv(duplicated) @ rhs)


def test_keeping_every_entry_refits_to_the_full_cache_even_with_fewer_queries_than_entries():
    # more entries than queries: many multipliers and values fit exactly; the refit takes eviction's (1, V)
    keys, values, calib, _ = random_head(5, length=40, queries=12)
    logits = calib @ keys.T / math.sqrt(keys.shape[1])
    unnormalized = torch.exp(logits - logits.amax(1, keepdim=True))
    weights = fit_multipliers(unnormalized, unnormalized.sum(1))
    torch.testing.assert_close(weights, torch.ones_like(weights))
    attention = torch.softmax(logits, 1)
    torch.testing.assert_close(fit_values(attention, attention @ values, prior=values), values)
    assert (fit_values(attention, attention @ values) - values).abs().max() > 0.1  # the smallest solution is not


@pytest.mark.parametrize("seed", range(4))
def test_refit_values_satisfy_normal_equations(seed):
    unnormalized, row_sums, outputs, logits = refit_inputs(seed)
    weights = fit_multipliers(unnormalized, row_sums)
    attention = torch.softmax(logits + weights.log(), dim=1)
    # softmax(Z_S + log w) is diag(P_S w)^{-1} P_S diag(w)
    direct = unnormalized * weights / (unnormalized @ weights)[:, None]
    torch.testing.assert_close(attention, direct)
    values = fit_values(attention, outputs)
    gradient = attention.T @ (attention @ values - outputs)
    assert gradient.abs().max() <= 1e-10 * outputs.abs().max()


@pytest.mark.parametrize("seed", range(3))
def test_shrunk_values_satisfy_their_normal_equations_and_limits(seed):
    unnormalized, row_sums, outputs, logits = refit_inputs(seed)
    attention = torch.softmax(logits + fit_multipliers(unnormalized, row_sums).log(), dim=1)
    prior = torch.randn(attention.shape[1], outputs.shape[1], dtype=attention.dtype)
    gram = attention.T @ attention
    scale = gram.diagonal().mean()
    values = fit_values(attention, outputs, prior=prior, shrinkage=0.1)
    # gradient of ‖P V - O‖² + s ā ‖V - prior‖² vanishes
    gradient = attention.T @ (attention @ values - outputs) + 0.1 * scale * (values - prior)
    assert gradient.abs().max() <= 1e-10 * outputs.abs().max()
    torch.testing.assert_close(fit_values(attention, outputs, prior=prior, shrinkage=1e12), prior)
    with pytest.raises(ValueError, match="prior"):
        fit_values(attention, outputs, shrinkage=0.1)


def test_value_shrinkage_keeps_unconstrained_values_at_the_original_ones():
    keys, values, calib, _ = random_head(7)
    plain = compact_head(keys, values, calib, 8, method="loo")
    shrunk = compact_head(keys, values, calib, 8, method="loo", value_shrinkage=1e9)
    assert torch.equal(plain.indices, shrunk.indices)
    torch.testing.assert_close(shrunk.values, values[shrunk.indices].to(shrunk.values.dtype))
    with pytest.raises(ValueError, match="value_shrinkage"):
        compact_head(keys, values, calib, 8, method="loo", value_shrinkage=-1.0)


def test_compact_head_refit_is_optimal_for_its_support_and_biases():
    keys, values, calib, _ = random_head(5)
    head = compact_head(keys, values, calib, 8, method="loo")
    assert head.bias.abs().max() <= 3.0 + 1e-6
    attention = torch.softmax(calib @ keys[head.indices].T / math.sqrt(8) + head.bias.double(), dim=1)
    _, outputs = attention_stats(keys, values, calib)
    gradient = attention.T @ (attention @ head.values - outputs)
    assert gradient.abs().max() <= 1e-9
    assert head.train_loss == pytest.approx(relative_loss(head, keys, calib, values))


# --- methods end to end ----------------------------------------------------------------------------------------------


def heldout_losses(seed, budget=6):
    """Held-out relative losses of kv_surgeon, its plain eviction, random, loo with and without refit."""
    keys, values, calib, heldout = random_head(seed, length=64, queries=96)
    surgeon = compact_head(keys, values, calib, budget)
    evicted = CompactedHead(surgeon.indices, torch.zeros(budget), values[surgeon.indices])
    heads = {
        "kv_surgeon": surgeon,
        "eviction": evicted,
        "random": compact_head(keys, values, calib, budget, method="random", seed=seed),
        "loo": compact_head(keys, values, calib, budget, method="loo"),
        "loo_norefit": compact_head(keys, values, calib, budget, method="loo", refit=False),
    }
    return {name: relative_loss(head, keys, heldout, values) for name, head in heads.items()}


def test_kv_surgeon_beats_random_and_eviction_on_heldout_queries():
    losses = [heldout_losses(seed) for seed in range(10)]
    mean = {name: sum(row[name] for row in losses) / len(losses) for name in losses[0]}
    assert mean["kv_surgeon"] < mean["random"]
    assert mean["kv_surgeon"] < mean["eviction"]
    assert mean["loo"] <= mean["loo_norefit"]


def test_mild_compaction_fallback_keeps_top_loo_with_original_values():
    keys, values, calib, _ = random_head(6, length=40, dtype=torch.float32)
    head = compact_head(keys, values, calib, 13)  # 13 > 0.3 * 40
    attention, outputs = attention_stats(keys.double(), values.double(), calib.double())
    expected = torch.sort(torch.topk(loo_scores(attention, values.double(), outputs), 13).indices).values
    assert torch.equal(head.indices, expected)
    assert torch.equal(head.bias, torch.zeros(13))
    assert torch.equal(head.values, values[expected])


def test_kv_surgeon_below_threshold_refits():
    keys, values, calib, _ = random_head(6, length=40)
    head = compact_head(keys, values, calib, 12)  # 12 <= 0.3 * 40
    assert head.bias.abs().max() > 0


@pytest.mark.parametrize("method", sorted(HEAD_METHODS))
@pytest.mark.parametrize("budget", [1, 5, 13, 47, 48, 100])
def test_every_method_returns_sorted_distinct_indices(method, budget):
    keys, values, calib, _ = random_head(7, dtype=torch.float32)
    head = compact_head(keys, values, calib, budget, method=method)
    kept = min(budget, keys.shape[0])
    assert head.indices.dtype == torch.long and head.indices.shape == (kept,)
    assert torch.all(head.indices[1:] > head.indices[:-1])
    assert 0 <= head.indices.min() and head.indices.max() < keys.shape[0]
    assert head.bias.dtype == torch.float32 and head.bias.shape == (kept,)
    assert head.values.dtype == torch.float32 and head.values.shape == (kept, values.shape[1])
    assert torch.isfinite(head.bias).all() and torch.isfinite(head.values).all()
    if budget >= keys.shape[0]:
        assert torch.equal(head.bias, torch.zeros(kept)) and torch.equal(head.values, values)


def test_query_free_methods_accept_no_queries_and_random_is_seeded():
    keys, values, _, _ = random_head(8)
    head = compact_head(keys, values, None, 9, method="streaming_llm")
    assert head.indices.tolist() == [0, 1, 2, 3, 43, 44, 45, 46, 47] and head.train_loss is None
    norms = keys.norm(dim=1)
    kept_norms = norms[compact_head(keys, values, None, 9, method="key_norm").indices]
    assert kept_norms.max() <= torch.sort(norms).values[8]
    first, again = (compact_head(keys, values, None, 9, method="random", seed=3) for _ in range(2))
    assert torch.equal(first.indices, again.indices)


# --- degenerate inputs -----------------------------------------------------------------------------------------------


def degenerate_cases():
    """``(name, keys, values, queries, budget)`` triples that stress rank and size corner cases."""
    keys, values, calib, _ = random_head(9, length=40, queries=20)
    duplicated = keys.clone()
    duplicated[1::2] = duplicated[0::2]
    flat_values = values.clone()
    flat_values[::2] = flat_values[1::2]
    return [
        ("t=1", keys, values, calib, 1),
        ("duplicate keys", duplicated, values, calib, 8),
        ("all-equal keys", keys[:1].expand(40, -1).clone(), values, calib, 8),
        ("N < t", keys, values, calib[:3], 11),
        ("N = 1", keys, values, calib[:1], 6),
        ("rank-deficient values", keys, flat_values[:, :1].expand(40, 6).clone(), calib, 8),
        ("zero values", keys, torch.zeros_like(values), calib, 8),
        ("bf16", keys.bfloat16(), values.bfloat16(), calib.bfloat16(), 8),
        ("saturated attention", keys, values, 40 * calib, 8),
    ]


@pytest.mark.parametrize("method", sorted(HEAD_METHODS))
@pytest.mark.parametrize("case", degenerate_cases(), ids=lambda case: case[0])
def test_degenerate_inputs_give_finite_outputs(method, case):
    _, keys, values, queries, budget = case
    head = compact_head(keys, values, queries, budget, method=method)
    assert head.indices.shape == (budget,) and torch.unique(head.indices).numel() == budget
    assert head.values.shape == (budget, values.shape[1]) and head.values.dtype == values.dtype
    assert torch.isfinite(head.bias).all() and torch.isfinite(head.values).all()
    assert math.isfinite(head.train_loss)


# --- bad input -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"method": "nope"}, ValueError, "kv_surgeon"),
        ({"budget": 0}, ValueError, "budget"),
        ({"budget": 2.5}, TypeError, "budget"),
        ({"keys": torch.zeros(4, 8, 1)}, ValueError, "keys"),
        ({"values": torch.zeros(5, 6)}, ValueError, "values"),
        ({"queries": torch.zeros(3, 7)}, ValueError, "queries"),
        ({"queries": None}, ValueError, "queries"),
        ({"keys": torch.zeros(48, 8, dtype=torch.long)}, TypeError, "keys"),
        ({"values": torch.full((48, 6), math.nan)}, ValueError, "values"),
        ({"scaling": -1.0}, ValueError, "scaling"),
        ({"pool_factor": 0.5}, ValueError, "pool_factor"),
        ({"not_a_hyperparameter": 1}, TypeError, "not_a_hyperparameter"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, error, match):
    keys, values, calib, _ = random_head(10)
    arguments = {"keys": keys, "values": values, "queries": calib, "budget": 4} | kwargs
    with pytest.raises(error, match=match):
        compact_head(**arguments)


def test_problem_split_is_a_seeded_disjoint_partition_of_the_queries():
    from hf_structkv.compaction.head_statistics import HeadProblem

    keys, values, queries, _ = random_head(11, queries=25)
    problem = HeadProblem.build(keys, values, queries)
    fit, check = problem.split(0.2, seed=3)
    assert (fit.queries.shape[0], check.queries.shape[0]) == (20, 5)
    rows = {tuple(q.tolist()) for q in torch.cat([fit.queries, check.queries])}
    assert rows == {tuple(q.tolist()) for q in queries}
    assert torch.equal(check.queries, problem.split(0.2, seed=3)[1].queries)
    assert not torch.equal(check.queries, problem.split(0.2, seed=4)[1].queries)
    assert fit.keys is problem.keys and fit.values is problem.values
    with pytest.raises(ValueError, match="at least two calibration queries"):
        HeadProblem.build(keys, values, queries[:1]).split(0.2, seed=0)


def test_split_problems_carry_the_row_statistics_of_a_fresh_problem_over_their_queries():
    from hf_structkv.compaction.head_statistics import HeadProblem

    keys, values, queries, _ = random_head(12, queries=30)
    problem = HeadProblem.build(keys, values, queries)
    for part in problem.split(0.3, seed=1):
        fresh = HeadProblem.build(keys, values, part.queries)
        assert part.precomputed is not None
        for name in ("row_max", "row_sums", "outputs"):
            torch.testing.assert_close(getattr(part.statistics, name), getattr(fresh.statistics, name))


def test_attention_columns_are_the_softmax_over_every_entry():
    from hf_structkv.compaction.head_statistics import HeadProblem

    keys, values, queries, _ = random_head(13, queries=20)
    problem = HeadProblem.build(keys, values, queries)
    attention, outputs = attention_stats(keys, values, queries)
    columns = torch.tensor([5, 0, 31])
    torch.testing.assert_close(problem.attention_columns(columns), attention[:, columns])
    torch.testing.assert_close(problem.attention_columns(rows=slice(3, 9)), attention[3:9])
    torch.testing.assert_close(problem.outputs, outputs)
    expected_sums = torch.exp(queries @ keys.T / math.sqrt(keys.shape[1]) - problem.statistics.row_max[:, None]).sum(1)
    torch.testing.assert_close(problem.row_sums, expected_sums)


def test_surrogate_accumulated_over_query_blocks_is_the_ridge_solve_on_the_pool_columns(monkeypatch):
    from hf_structkv.compaction.head_statistics import HeadProblem

    keys, values, queries, _ = random_head(15, length=40, queries=24)
    monkeypatch.setattr(HeadProblem, "BLOCK_ELEMENTS", 50)  # 5 queries of the 10 pool columns per block
    problem = HeadProblem.build(keys, values, queries)
    pool = torch.tensor([3, 17, 0, 25, 8, 30, 11, 2, 39, 20])
    assert len(problem.query_blocks(pool.numel())) == 5
    coefficients, inverse = KVSurgeon().surrogate(problem, pool)
    attention, outputs = attention_stats(keys, values, queries)
    columns = attention[:, pool]
    targets = torch.cat([outputs, outputs.square().sum(1).mean().sqrt() * torch.ones(24, 1, dtype=F64)], dim=1)
    expected_b, expected_g, _ = ridge_solve(columns, targets, 0.01 * columns.square().sum().item() / pool.numel())
    torch.testing.assert_close(coefficients, expected_b)
    torch.testing.assert_close(inverse, expected_g)


@pytest.mark.parametrize("method", sorted(HEAD_METHODS))
def test_query_blocks_give_the_same_compaction_as_one_block(method, monkeypatch):
    """Statistics and scores folded over blocks of 1-2 queries (`BLOCK_ELEMENTS`) select and fit as one block."""
    from hf_structkv.compaction.head_statistics import HeadProblem

    keys, values, queries, _ = random_head(14, length=40, queries=24)
    whole = compact_head(keys, values, queries, 7, method=method)
    monkeypatch.setattr(HeadProblem, "BLOCK_ELEMENTS", 70)  # 1 query (40 logits) per block
    assert len(HeadProblem.build(keys, values, queries).query_blocks()) == 24
    blocked = compact_head(keys, values, queries, 7, method=method)
    assert torch.equal(blocked.indices, whole.indices)
    torch.testing.assert_close(blocked.bias, whole.bias)
    torch.testing.assert_close(blocked.values, whole.values)


def test_column_scores_over_query_blocks_equal_those_of_one_block(monkeypatch):
    from hf_structkv.compaction.head_statistics import HeadProblem

    keys, values, queries, _ = random_head(14, length=40, queries=24)
    one_block = HeadProblem.build(keys, values, queries)
    monkeypatch.setattr(HeadProblem, "BLOCK_ELEMENTS", 70)  # 1 query (40 logits) per block
    problem = HeadProblem.build(keys, values, queries)
    torch.testing.assert_close(problem.loo, one_block.loo, rtol=1e-10, atol=1e-14)
    sums = problem.reduce_columns(lambda block, rows: block.sum(0))
    torch.testing.assert_close(sums, one_block.attention_columns().sum(0))
    maxes = problem.reduce_columns(lambda block, rows: block.amax(0), torch.maximum)
    torch.testing.assert_close(maxes, one_block.attention_columns().amax(0))


@pytest.mark.parametrize("seed", range(6))
def test_refit_guard_returns_the_refit_or_the_eviction_that_wins_on_the_check_split(seed):
    from hf_structkv.compaction.head_method import evict, refit_head
    from hf_structkv.compaction.head_statistics import HeadProblem

    # Few queries (N = 12 < 16 kept entries): the value solve interpolates them and can overfit.
    keys, values, queries, _ = random_head(seed, length=40, queries=12)
    budget = 16
    guarded = compact_head(keys, values, queries, budget, method="loo", refit_guard=0.25, seed=seed)
    plain = compact_head(keys, values, queries, budget, method="loo", seed=seed)
    problem = HeadProblem.build(keys, values, queries)
    fit, check = problem.split(0.25, seed)
    refit_wins = check.relative_loss(refit_head(fit, plain.indices)) <= check.relative_loss(evict(check, plain.indices))
    assert torch.equal(guarded.indices, plain.indices)
    if refit_wins:
        assert torch.equal(guarded.bias, plain.bias) and torch.equal(guarded.values, plain.values)
    else:
        assert torch.equal(guarded.bias, torch.zeros_like(guarded.bias))
        assert torch.equal(guarded.values, values[plain.indices])


def test_refit_guard_keeps_whichever_of_refit_and_eviction_wins_on_its_held_back_queries():
    decisions = []
    for seed, (queries, budget) in itertools.product(range(4), [(3, 30), (10, 20), (120, 8)]):
        keys, values, calib, _ = random_head(seed, length=40, queries=queries)
        guarded = compact_head(keys, values, calib, budget, method="loo", refit_guard=0.3, seed=seed)
        plain = compact_head(keys, values, calib, budget, method="loo", seed=seed)
        # brute force: the seeded split, the refit on the rest, both losses on the held-back queries
        order = torch.randperm(queries, generator=torch.Generator().manual_seed(seed))
        held = max(1, round(0.3 * queries))
        fit, check = calib[order[held:]], calib[order[:held]]
        trial = refit_head(HeadProblem.build(keys, values, fit), plain.indices)
        evicted = CompactedHead(plain.indices, torch.zeros_like(plain.bias), values[plain.indices])
        keep_refit = relative_loss(trial, keys, check, values) <= relative_loss(evicted, keys, check, values)
        expected = plain if keep_refit else evicted
        torch.testing.assert_close(guarded.values, expected.values.to(guarded.values.dtype))
        torch.testing.assert_close(guarded.bias, expected.bias.to(guarded.bias.dtype))
        decisions.append(keep_refit)
    assert any(decisions) and not all(decisions)
    with pytest.raises(ValueError, match=r"refit_guard must be in \[0, 1\)"):
        compact_head(*random_head(0)[:3], 5, method="loo", refit_guard=1.0)


@pytest.mark.parametrize(
    ("budget", "error"), [(0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError), ("4", TypeError)]
)
def test_compact_head_rejects_a_bad_budget_naming_it(budget, error):
    keys, values, queries, _ = random_head(0)
    with pytest.raises(error, match=r"^budget must be an integer >= 1 \(kept entries\), got "):
        compact_head(keys, values, queries, budget)
