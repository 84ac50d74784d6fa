"""Cost of KV-Surgeon's greedy block elimination: in-place downdates (`KVSurgeon.eliminate`) against one copy of the
reduced matrices per block (a loop over `eliminate_block`, the per-block update the tests check against fresh solves).

The elimination works on the surrogate's ``B [m, d_v + 1]`` and ``G [m, m]`` only, so its cost depends on the pool
size ``m = c t`` and ``d_v``, not on the attention pattern: each head here is a seeded random problem of that size
(``T`` keys, ``N`` queries, peaked attention), solved once by `KVSurgeon.surrogate`; both paths then delete from the
same ``B, G`` down to ``t`` rows, one after the other, and must keep the same pool positions. Times are the best of
``--repeats`` on ``--threads`` threads; speed claims are ratios of the two paths measured side by side.

    python benchmarks/elimination_cost.py --kept 100 400 800 --out benchmarks/results/elimination_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_structkv.compaction.methods import HeadProblem, KVSurgeon, _complement, _top, eliminate_block, saliency


def per_block_copies(rule: KVSurgeon, coefficients: torch.Tensor, inverse: torch.Tensor, budget: int) -> torch.Tensor:
    """The greedy path of `KVSurgeon.eliminate`, reducing ``B, G`` to the remaining rows at every block."""
    kept = torch.arange(inverse.shape[0])
    while kept.numel() > budget:
        block = _top(saliency(coefficients, inverse), min(rule.block_size, kept.numel() - budget), largest=False)
        coefficients, inverse = eliminate_block(coefficients, inverse, block)
        kept = kept[_complement(kept.numel(), block)]
    return kept


def best_seconds(repeats: int, function, *args) -> tuple[float, torch.Tensor]:
    """``(best wall time of repeats calls function(*args), the last result)``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(*args)
        times.append(time.perf_counter() - start)
    return min(times), result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kept", type=int, nargs="+", default=[100, 400, 800], help="t, kept entries per head")
    parser.add_argument("--ratio", type=float, default=10.0, help="T = ratio * t")
    parser.add_argument("--queries", type=int, default=2048, help="N, calibration queries of the random head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/elimination_cost.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rule, rows = KVSurgeon(), []
    print(f"{'t':>6}{'pool m':>8}{'per-block copies s':>20}{'in place s':>12}{'speed-up':>10}{'same kept':>11}")
    for kept in args.kept:
        gen = torch.Generator().manual_seed(kept)
        length = round(args.ratio * kept)
        keys, values = (
            2 * torch.randn(length, args.head_dim, generator=gen),
            torch.randn(length, args.head_dim, generator=gen),
        )
        problem = HeadProblem.build(keys, values, 2 * torch.randn(args.queries, args.head_dim, generator=gen))
        pool = _top(problem.loo, round(rule.pool_factor * kept))
        coefficients, inverse = rule.surrogate(problem, pool)
        copies, by_copies = best_seconds(args.repeats, per_block_copies, rule, coefficients, inverse, kept)
        in_place, by_downdates = best_seconds(args.repeats, rule.eliminate, coefficients, inverse, kept)
        same = torch.equal(torch.sort(by_copies).values, torch.sort(by_downdates).values)
        rows.append(
            {
                "kept": kept,
                "pool": pool.numel(),
                "length": length,
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
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return payload


if __name__ == "__main__":
    main()
