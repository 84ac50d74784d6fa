"""Cost of fitting one KV head with `compact_head`: wall time and peak memory of the whole fit, and KV-Surgeon's greedy
block elimination in place (`KVSurgeon.eliminate`) against one copy of the reduced matrices per block (a loop over
`eliminate_block`, the per-block update the tests check against fresh solves), side by side.

The costs depend on the sizes (``T`` keys, ``N`` queries, ``t`` kept, the pool ``m = c t``), not on the attention
pattern: each head is a seeded random problem of that size with peaked attention. Part 1 runs `compact_head` once per
``--kept`` (the default method and hyper-parameters, ``refit_guard`` as `compact()` sets it) and reports its wall time
and the growth of the process's peak resident memory (Linux ``ru_maxrss``; the first, largest fit sets the peak, so
list ``--kept`` in decreasing order). Part 2 solves the surrogate once per ``--kept`` and runs both elimination paths
from the same ``B, G`` down to ``t`` rows, one after the other, best of ``--repeats``; they must keep the same pool
positions. Speed claims are ratios of the two paths measured side by side.

    python benchmarks/head_fit_cost.py --length 8000 --queries 20000 --kept 800 400 100 \
        --out benchmarks/results/head_fit_cost.json
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

from hf_structkv.compaction.head_compaction import compact_head
from hf_structkv.compaction.head_statistics import HeadProblem
from hf_structkv.compaction.kv_surgeon import KVSurgeon
from hf_structkv.compaction.settings import DEFAULT_REFIT_GUARD
from hf_structkv.compaction.surrogate import eliminate_block, saliency

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402


def per_block_copies(rule: KVSurgeon, coefficients: torch.Tensor, inverse: torch.Tensor, budget: int) -> torch.Tensor:
    """The greedy path of `KVSurgeon.eliminate`, reducing ``B, G`` to the remaining rows at every block."""
    kept = torch.arange(inverse.shape[0])
    while kept.numel() > budget:
        count = min(rule.block_size, kept.numel() - budget)
        block = torch.topk(saliency(coefficients, inverse), count, largest=False).indices
        coefficients, inverse = eliminate_block(coefficients, inverse, block)
        remaining = torch.ones(kept.numel(), dtype=torch.bool)
        remaining[block] = False
        kept = kept[remaining]
    return kept


def best_seconds(repeats: int, function, *args) -> tuple[float, torch.Tensor]:
    """``(best wall time of repeats calls function(*args), the last result)``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(*args)
        times.append(time.perf_counter() - start)
    return min(times), result


def peak_gib() -> float:
    """The process's peak resident memory so far, GiB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def random_head(length: int, queries: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(K [T, D], V [T, D], Q [N, D])`` float32, seeded, queries and keys scaled by 2 (peaked attention)."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = 2 * torch.randn(length, head_dim, generator=gen), torch.randn(length, head_dim, generator=gen)
    return keys, values, 2 * torch.randn(queries, head_dim, generator=gen)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8000, help="T, keys of the head")
    parser.add_argument("--queries", type=int, default=20000, help="N, calibration queries")
    parser.add_argument("--kept", type=int, nargs="+", default=[800, 400, 100], help="t, kept entries per head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/head_fit_cost.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    keys, values, queries = random_head(args.length, args.queries, args.head_dim, seed=0)
    fits = []
    print(f"compact_head (kv_surgeon), T={args.length}, N={args.queries}, threads {args.threads}")
    print(f"{'t':>6}{'seconds':>10}{'peak GiB growth':>17}{'train loss':>12}")
    for kept in args.kept:
        before = peak_gib()
        start = time.perf_counter()
        head = compact_head(keys, values, queries, kept, refit_guard=DEFAULT_REFIT_GUARD)
        row = {"kept": kept, "seconds": time.perf_counter() - start, "peak_gib_growth": peak_gib() - before}
        fits.append({**row, "train_loss": head.train_loss})
        print(f"{kept:>6}{row['seconds']:>10.1f}{row['peak_gib_growth']:>17.2f}{head.train_loss:>12.5f}")
    rule, eliminations = KVSurgeon(), []
    print(f"{'t':>6}{'pool m':>8}{'per-block copies s':>20}{'in place s':>12}{'speed-up':>10}{'same kept':>11}")
    problem = HeadProblem.build(keys, values, queries)
    for kept in args.kept:
        pool = torch.topk(problem.loo, round(rule.pool_factor * kept)).indices
        coefficients, inverse = rule.surrogate(problem, pool)
        copies, by_copies = best_seconds(args.repeats, per_block_copies, rule, coefficients, inverse, kept)
        in_place, by_downdates = best_seconds(args.repeats, rule.eliminate, coefficients, inverse, kept)
        same = torch.equal(torch.sort(by_copies).values, torch.sort(by_downdates).values)
        eliminations.append(
            {
                "kept": kept,
                "pool": pool.numel(),
                "per_block_copies_seconds": copies,
                "in_place_seconds": in_place,
                "speedup": copies / in_place,
                "same_kept_positions": same,
            }
        )
        print(f"{kept:>6}{pool.numel():>8}{copies:>20.2f}{in_place:>12.2f}{copies / in_place:>10.1f}{str(same):>11}")
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__,
        "fits": fits,
        "eliminations": eliminations,
    }
    return write_json(args.out, payload, started=started)


if __name__ == "__main__":
    main()
