"""Ported baselines (AM-HAK, AM-OMP, H2O, OBCache, KVzip, KVMerger, Q-Filters) against brute force / closed forms."""

import math

import pytest
import torch

from hf_structkv.compaction.attention_matching import omp_select
from hf_structkv.compaction.head_compaction import HEAD_METHODS, compact_head, relative_loss
from hf_structkv.compaction.head_statistics import HeadProblem, loo_scores
from hf_structkv.compaction.score_eviction import obcache_scores

F64 = torch.float64
CALIBRATED = ["am_hak", "am_omp", "h2o", "obcache", "kvzip", "kvmerger"]
BASELINES = [*CALIBRATED, "q_filters"]


def random_head(seed, length=24, dim=8, queries=32, value_dim=5, temperature=2.0):
    """``(K [T, D], V [T, D_v], Q [N, D], Q_heldout [N, D])`` in float64 with peaked attention."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, dim, generator=gen, dtype=F64)
    values = torch.randn(length, value_dim, generator=gen, dtype=F64)
    calib = temperature * torch.randn(queries, dim, generator=gen, dtype=F64)
    heldout = temperature * torch.randn(queries, dim, generator=gen, dtype=F64)
    return keys, values, calib, heldout


def problem_of(seed, **kwargs):
    keys, values, calib, _ = random_head(seed, **kwargs)
    return HeadProblem.build(keys, values, calib)


def plain_attention(keys, queries):
    """``P [N, T]`` recomputed independently of `HeadProblem`."""
    return torch.softmax(queries @ keys.T / math.sqrt(keys.shape[1]), dim=1)


def top_set(scores, count):
    """The ``count`` largest scores' positions as a Python set (the random scores have no ties)."""
    return set(sorted(range(len(scores)), key=lambda j: -float(scores[j]))[:count])


def selected(method, problem, budget, **hparams):
    return set(HEAD_METHODS[method](**hparams).select(problem, budget, 0).tolist())


# --- one-pass scores -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_am_hak_h2o_kvzip_pick_the_top_rms_sum_and_max_attention(seed):
    keys, values, calib, _ = random_head(seed)
    problem = HeadProblem.build(keys, values, calib)
    attention = plain_attention(keys, calib).tolist()
    columns = list(zip(*attention))
    rms = [math.sqrt(sum(p * p for p in column) / len(column)) for column in columns]
    accumulated = [sum(column) for column in columns]
    peak = [max(column) for column in columns]
    for budget in (1, 5, 11):
        assert selected("am_hak", problem, budget) == top_set(rms, budget)
        assert selected("h2o", problem, budget) == top_set(accumulated, budget)
        assert selected("kvzip", problem, budget) == top_set(peak, budget)


def test_h2o_recent_window_keeps_the_last_positions_and_top_older_ones():
    keys, values, calib, _ = random_head(3)
    problem = HeadProblem.build(keys, values, calib)
    accumulated = plain_attention(keys, calib).sum(0).tolist()
    length = keys.shape[0]
    kept = selected("h2o", problem, 8, recent_tokens=3)
    assert kept == top_set(accumulated[: length - 3], 5) | {length - 3, length - 2, length - 1}
    assert selected("h2o", problem, 4, recent_tokens=10) == set(range(length - 4, length))


def test_obcache_score_is_the_second_order_truncation_of_the_deletion_loss():
    keys, values, calib, _ = random_head(4)
    attention = plain_attention(keys, calib)
    outputs = attention @ values
    brute = torch.tensor(
        [
            sum(attention[i, j] ** 2 * (values[j] - outputs[i]).square().sum() for i in range(calib.shape[0]))
            for j in range(keys.shape[0])
        ],
        dtype=F64,
    )
    scores = obcache_scores(attention, values, outputs)
    torch.testing.assert_close(scores, brute, rtol=1e-10, atol=1e-12)
    # equals the exact single-deletion loss (13) up to the factor (1 - P)^-2 >= 1
    assert torch.all(scores <= loo_scores(attention, values, outputs, floor=0.0) * (1 + 1e-10))
    problem = HeadProblem.build(keys, values, calib)
    assert selected("obcache", problem, 7) == top_set(brute.tolist(), 7)


# --- AM-OMP ----------------------------------------------------------------------------------------------------------


def brute_force_omp(columns, target, count, per_step=1):
    """Greedy OMP with a fresh least-squares solve on the selected columns after every step."""
    chosen, residual = [], target.clone()
    norms = columns.norm(dim=0)
    while len(chosen) < count:
        score = [
            -math.inf if j in chosen else float(columns[:, j] @ residual / norms[j]) for j in range(columns.shape[1])
        ]
        chosen += sorted(range(len(score)), key=lambda j: -score[j])[: min(per_step, count - len(chosen))]
        support = columns[:, chosen]
        coefficients = torch.linalg.lstsq(support, target[:, None]).solution
        residual = target - (support @ coefficients).squeeze(1)
    return chosen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_step", [1, 3])
def test_omp_matches_brute_force_greedy_least_squares(seed, per_step):
    problem = problem_of(seed, length=20, queries=30)
    columns = problem.unnormalized(torch.arange(problem.length))
    for count in (1, 4, 9):
        expected = brute_force_omp(columns, problem.row_sums, count, per_step)
        assert omp_select(columns, problem.row_sums, count, per_step).tolist() == expected
        method = HEAD_METHODS["am_omp"](keys_per_step=per_step)
        assert method.select(problem, count, 0).tolist() == expected


def test_omp_reconstructs_the_mass_better_with_more_columns_and_exactly_at_full_rank():
    problem = problem_of(5, length=30, queries=12)
    columns, target = problem.unnormalized(torch.arange(30)), problem.row_sums
    residuals = []
    for count in (1, 3, 6, 12):
        support = columns[:, omp_select(columns, target, count)]
        solution = torch.linalg.lstsq(support, target[:, None]).solution.squeeze(1)
        residuals.append((support @ solution - target).norm().item())
    assert all(later <= earlier + 1e-12 for earlier, later in zip(residuals, residuals[1:]))
    assert residuals[-1] <= 1e-8 * target.norm().item()  # 12 generic columns span R^12


def test_omp_skips_columns_already_in_the_span():
    columns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64)  # column 1 duplicates column 0
    chosen = omp_select(columns, torch.tensor([2.0, 1.0], dtype=F64), 3)
    assert chosen.tolist()[0] == 0 and sorted(chosen.tolist()) == [0, 1, 2]


# --- KVMerger --------------------------------------------------------------------------------------------------------


def brute_force_adjacent_merge(keys, count):
    """Greedy agglomeration: repeatedly merge the two neighbouring groups whose boundary keys are most similar."""
    groups = [[j] for j in range(keys.shape[0])]
    while len(groups) > count:
        similarity = [
            float(torch.nn.functional.cosine_similarity(keys[a[-1]], keys[b[0]], dim=0))
            for a, b in zip(groups, groups[1:])
        ]
        best = max(range(len(similarity)), key=lambda g: similarity[g])
        groups[best : best + 2] = [groups[best] + groups[best + 1]]
    return groups


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [1, 4, 9, 23])
def test_kvmerger_groups_pivots_and_merged_values(seed, budget):
    keys, values, calib, _ = random_head(seed)
    problem = HeadProblem.build(keys, values, calib)
    method = HEAD_METHODS["kvmerger"]()
    group = method.groups(problem, budget)
    assert group[0] == 0 and group[-1] == budget - 1
    assert torch.all((group[1:] - group[:-1] >= 0) & (group[1:] - group[:-1] <= 1))  # contiguous groups
    expected_groups = brute_force_adjacent_merge(keys, budget)
    assert [torch.nonzero(group == g).squeeze(1).tolist() for g in range(budget)] == expected_groups

    accumulated = plain_attention(keys, calib).sum(0)
    pivots, merged = method.merge(problem, budget)
    assert pivots.numel() == budget and torch.all(pivots[1:] > pivots[:-1])
    for g, members in enumerate(expected_groups):
        assert pivots[g].item() == max(members, key=lambda j: float(accumulated[j]))
        weights = accumulated[members]
        torch.testing.assert_close(merged[g], weights @ values[members] / weights.sum())

    evicted = compact_head(keys, values, calib, budget, method="kvmerger", refit=False)
    assert torch.equal(evicted.indices, pivots) and torch.equal(evicted.bias, torch.zeros(budget))
    torch.testing.assert_close(evicted.values, merged)
    refit = compact_head(keys, values, calib, budget, method="kvmerger")
    assert torch.equal(refit.indices, pivots)


def test_kvmerger_duplicate_runs_collapse_into_one_group():
    keys, values, calib, _ = random_head(6, length=12)
    keys = keys[torch.tensor([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4, 5])]  # 6 distinct keys in contiguous runs
    group = HEAD_METHODS["kvmerger"]().groups(HeadProblem.build(keys, values, calib), 6)
    assert group.tolist() == [0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4, 5]


# --- Q-Filters -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_q_filters_projects_keys_on_the_signed_principal_query_direction(seed):
    keys, values, calib, _ = random_head(seed, dim=6)
    gen = torch.Generator().manual_seed(100 + seed)
    axis = torch.nn.functional.normalize(torch.randn(6, generator=gen, dtype=F64), dim=0)
    queries = calib + 6.0 * axis  # anisotropic: a shared direction dominates the queries
    problem = HeadProblem.build(keys, values, queries)
    method = HEAD_METHODS["q_filters"]()
    direction = method.direction(problem)
    top_singular = torch.linalg.svd(queries, full_matrices=False).Vh[0]
    assert abs(float(direction @ top_singular)) == pytest.approx(1.0, abs=1e-10)
    assert float((queries @ direction).sum()) > 0 and float(direction @ axis) > 0.9
    projection = (keys @ direction).tolist()
    assert selected("q_filters", problem, 6) == top_set(projection, 6)
    head = compact_head(keys, values, queries, 6, method="q_filters")
    assert torch.equal(head.bias, torch.zeros(6)) and torch.equal(head.values, values[head.indices])


def test_q_filters_needs_queries():
    keys, values, _, _ = random_head(0)
    with pytest.raises(ValueError, match="queries"):
        compact_head(keys, values, None, 4, method="q_filters")


# --- refit vs eviction, degenerate inputs, hyperparameters ----------------------------------------------------------


@pytest.mark.parametrize("method", CALIBRATED)
def test_refit_beats_eviction_on_heldout_queries_on_average(method):
    refit, evicted = [], []
    for seed in range(8):
        keys, values, calib, heldout = random_head(seed, length=48, queries=96)
        for rows, flag in ((refit, True), (evicted, False)):
            head = compact_head(keys, values, calib, 6, method=method, refit=flag)
            rows.append(relative_loss(head, keys, heldout, values))
    assert sum(refit) < sum(evicted)


def degenerate_cases():
    keys, values, calib, _ = random_head(9, length=20, queries=16)
    duplicated = keys.clone()
    duplicated[1::2] = duplicated[0::2]
    zero_keys = keys.clone()
    zero_keys[3:9] = 0
    return [
        ("t=1", keys, values, calib, 1),
        ("t=T-1", keys, values, calib, 19),
        ("t=T", keys, values, calib, 20),
        ("t>T", keys, values, calib, 50),
        ("duplicate keys", duplicated, values, calib, 7),
        ("all-equal keys", keys[:1].expand(20, -1).clone(), values, calib, 7),
        ("zero keys", zero_keys, values, calib, 7),
        ("N=1", keys, values, calib[:1], 5),
        ("N<t", keys, values, calib[:3], 9),
        ("saturated attention", keys, values, 60 * calib, 7),
    ]


@pytest.mark.parametrize(
    ("method", "hparams"),
    [(name, {}) for name in BASELINES]
    + [("am_omp", {"keys_per_step": 4}), ("h2o", {"recent_tokens": 3}), ("kvmerger", {"refit": False})],
    ids=str,
)
@pytest.mark.parametrize("case", degenerate_cases(), ids=lambda case: case[0])
def test_degenerate_inputs_give_finite_outputs(method, hparams, case):
    _, keys, values, queries, budget = case
    head = compact_head(keys, values, queries, budget, method=method, **hparams)
    kept = min(budget, keys.shape[0])
    assert head.indices.shape == (kept,) and torch.all(head.indices[1:] > head.indices[:-1])
    assert 0 <= head.indices.min() and head.indices.max() < keys.shape[0]
    assert head.values.shape == (kept, values.shape[1])
    assert torch.isfinite(head.bias).all() and torch.isfinite(head.values).all()
    assert math.isfinite(head.train_loss)


@pytest.mark.parametrize(
    ("method", "hparams", "error", "match"),
    [
        ("am_omp", {"keys_per_step": 0}, ValueError, "keys_per_step must be an integer >= 1, got 0"),
        ("am_omp", {"keys_per_step": 1.5}, TypeError, "keys_per_step must be an integer >= 1, got 1.5"),
        ("h2o", {"recent_tokens": -1}, ValueError, "recent_tokens must be an integer >= 0, got -1"),
        ("kvzip", {"bias_bound": 0.0}, ValueError, "bias_bound"),
    ],
)
def test_bad_hyperparameters_raise_naming_them(method, hparams, error, match):
    keys, values, calib, _ = random_head(0)
    with pytest.raises(error, match=match):
        compact_head(keys, values, calib, 4, method=method, **hparams)
