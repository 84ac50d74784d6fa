"""How much of PASK's accuracy at a small budget its INT4 action costs, by key layout (issue 32): the attention error
of real BFCL prompts whose tokens outside the recent window are stored in INT4, with PASK's layout (one symmetric
FP16 scale per token row) against per-channel layouts (an FP16 scale and offset per channel and group of tokens,
`quantize_int4_channels`, as the compacted INT4 keys have), at the bytes each costs.

Protocol: the first ``--cases`` development cases of each category (BFCL v4, seed 0; never the test split), each
prompt as `generate_calls` builds it (`call_prompt`), run once with a cache; the queries of its last ``--window``
positions are recorded (`capture_queries`). Per layer and KV head, those queries attend causally over the prompt's
keys and values, with the tokens between the first ``--sinks`` and the window (the ones a prefill plan may quantise)
stored in each layout and the sinks and the window exact, against the same attention with every token exact. Values
are per-row INT4 in every layout (``keys exact`` isolates their share). Reported per layout: the bytes of one stored
token row of one KV head (codes, scales, offsets; K and V; the window excluded), and the relative error of the
attention output ``‖ô − o‖ / ‖o‖`` per (layer, query head, query): median, 90th percentile, mean.

    python benchmarks/int4_key_layouts.py --cases 8 --out benchmarks/results/int4_key_layouts.json
    python benchmarks/int4_key_layouts.py --tiny --cases 1 --out /tmp/int4_key_layouts.json   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_structkv.attention.recording import capture_queries
from hf_structkv.eval.bfcl import CATEGORIES, bfcl_split
from hf_structkv.quant.int4 import dequantize_int4, quantize_int4
from hf_structkv.quant.int4_centred import dequantize_int4_centred, key_centre, quantize_int4_centred
from hf_structkv.quant.int4_channels import dequantize_int4_channels, quantize_int4_channels
from hf_structkv.structured_generation import call_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_budget import load_model  # noqa: E402
from results_json import write_json  # noqa: E402

LAYOUTS = (
    "keys exact",
    "row",
    "row/smoothed",
    "row/centred",
    "row/centred+rotated",
    "row/centred/g128",
    "row/centred/g64",
    "row/centre/g128",
    "channel/g32",
    "channel/g128",
    "channel/prompt",
)
"""Key layouts: ``keys exact`` (only the values quantised), ``row`` (PASK's INT4 action: `quantize_int4` per token row),
``row/smoothed`` (each channel divided by its largest magnitude over the quantised tokens before the per-row
quantisation, multiplied back after: one FP16 vector per head and prompt; attention can fold it into the query),
``row/centred`` (the cache's ``int4_keys="centred"``, `hf_structkv.quant.int4_centred`: each channel centred by
its mean over the whole prompt and divided by its largest deviation there, as the cache fits them: a second vector;
its dot product with the query is one logit shift for all of them), ``row/centred+rotated`` (the same, then each
centred row rotated by an orthonormal Hadamard matrix before the per-row quantisation, rotated back after: the query
would be rotated instead; no stored bytes), ``row/centred/gN`` (centre and spread fitted to each group of N
consecutive quantised tokens instead of the whole prompt: two FP16 vectors per group), ``row/centre/gN`` (the centre
per group of N, one spread for all the quantised tokens: their largest deviation from their group's centre; attention
would scale the query once and add one logit shift per group), ``channel/gN``
(`quantize_int4_channels` over groups of N tokens), ``channel/prompt`` (one group of all the quantised tokens)."""


def hadamard(d: int) -> torch.Tensor:
    """``[d, d]`` the orthonormal Sylvester-Hadamard matrix (``d`` a power of two)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two size, got {d}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < d:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / d**0.5


def centred(keys: torch.Tensor, fitted_on: torch.Tensor, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """``keys [H_kv, n, d]`` served from the centred row layout with centre and spread fitted to ``fitted_on
    [H_kv, m, d]`` (FP32), each centred row multiplied by ``rotation [d, d]`` (orthonormal) before the quantisation
    and by its transpose after."""
    real = torch.ones(1, fitted_on.shape[-2], dtype=torch.bool, device=keys.device)
    centre, spread = key_centre(fitted_on[None], real)
    if rotation is None:
        codes, scales = quantize_int4_centred(keys[None], centre, spread)
        return dequantize_int4_centred(codes, scales, centre, spread, keys.shape[-1])[0]
    rows = (keys.float() - centre[0].float()) / spread[0].float() @ rotation
    codes, scales = quantize_int4(rows)
    return (dequantize_int4(codes, scales, keys.shape[-1]) @ rotation.T) * spread[0].float() + centre[0].float()


def stored_keys(keys: torch.Tensor, layout: str, prompt_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """``keys [H_kv, n, d]`` as served from ``layout`` (dequantised, FP32) and the bytes one token row of one head
    costs in it (codes, scales and offsets; a prompt-wide group's two rows are spread over the ``n`` rows).
    ``prompt_keys [H_kv, P, d]``: the whole prompt's keys, which ``row/centred`` is centred on (default ``keys``)."""
    n, d = keys.shape[-2:]
    if layout == "keys exact":
        return keys.float(), 2.0 * d
    if layout == "row":
        codes, scales = quantize_int4(keys)
        return dequantize_int4(codes, scales, d), d / 2 + 2
    if layout in ("row/centred", "row/centred+rotated"):
        rotation = hadamard(d).to(keys.device) if layout.endswith("rotated") else None
        return centred(keys, keys if prompt_keys is None else prompt_keys, rotation), d / 2 + 2 + 4.0 * d / n
    if layout.startswith("row/centre/g"):
        group = int(layout.removeprefix("row/centre/g"))
        rows = [keys[..., a : a + group, :].float() for a in range(0, n, group)]
        centre = torch.cat([r.mean(dim=-2, keepdim=True).half().float().expand_as(r) for r in rows], dim=-2)
        spread = (keys.float() - centre).abs().amax(dim=-2, keepdim=True).half().float().clamp_min(2**-14)
        codes, scales = quantize_int4((keys.float() - centre) / spread)
        return dequantize_int4(codes, scales, d) * spread + centre, d / 2 + 2 + 2.0 * d * (-(-n // group) + 1) / n
    if layout.startswith("row/centred/g"):
        group = int(layout.removeprefix("row/centred/g"))
        served = [centred(keys[..., a : a + group, :], keys[..., a : a + group, :]) for a in range(0, n, group)]
        return torch.cat(served, dim=-2), d / 2 + 2 + 4.0 * d * -(-n // group) / n
    if layout == "row/smoothed":
        keys = keys.float()
        spread = keys.abs().amax(dim=-2, keepdim=True).half().float().clamp_min(2**-14)
        codes, scales = quantize_int4(keys / spread)
        return dequantize_int4(codes, scales, d) * spread, d / 2 + 2 + 2.0 * d / n
    group = None if layout == "channel/prompt" else int(layout.removeprefix("channel/g"))
    codes, scales, offsets = quantize_int4_channels(keys, group)
    per_group_row = 4.0 * d  # an fp16 scale and offset per channel
    return dequantize_int4_channels(codes, scales, offsets, d, group), d / 2 + per_group_row / (group or n)


def attention_errors(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    served_keys: torch.Tensor,
    served_values: torch.Tensor,
    window: int,
    scaling: float,
    sinks: int = 0,
) -> list[float]:
    """``‖ô − o‖ / ‖o‖`` per query row: ``queries [H_kv, g·W, d]`` (the last ``W = window`` prompt positions, the
    ``g`` query heads of a KV head stacked head-major) over ``keys`` / ``values [H_kv, P, d]`` exact and over the
    first ``sinks`` exact, then ``served_keys`` / ``served_values [H_kv, P − sinks − W, d]`` (the stored tokens),
    then the exact window, causally."""
    total = keys.shape[-2]
    positions = torch.arange(total - window, total, device=keys.device).repeat(queries.shape[1] // window)
    visible = torch.arange(total, device=keys.device)[None, :] <= positions[:, None]  # [g·W, P]: causal

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (queries.float() @ k.transpose(-1, -2)) * scaling
        return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v

    exact = attend(keys.float(), values.float())
    stored = attend(
        torch.cat([keys[..., :sinks, :].float(), served_keys, keys[..., total - window :, :].float()], dim=-2),
        torch.cat([values[..., :sinks, :].float(), served_values, values[..., total - window :, :].float()], dim=-2),
    )
    return ((stored - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)).flatten().tolist()


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES[:4]), choices=CATEGORIES)
    parser.add_argument("--cases", type=int, default=8, help="development cases per category")
    parser.add_argument("--window", type=int, default=32, help="recent window kept exact (PASK's: 32)")
    parser.add_argument("--sinks", type=int, default=4, help="first tokens kept exact (PASK's sink tokens: 4)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="smoke test: random tiny model, byte tokenizer")
    parser.add_argument("--out", default="benchmarks/results/int4_key_layouts.json")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.window < 1 or args.sinks < 0:
        parser.error("--cases and --window must be at least 1, --sinks at least 0")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.tiny)
    entries = bfcl_split(args.categories, "development", limit=args.cases)
    errors: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    row_bytes: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    prompt_tokens = []
    for entry in entries:
        ids = tokenizer(call_prompt(tokenizer, list(entry.messages), entry.tools), add_special_tokens=False)
        input_ids = torch.tensor([ids["input_ids"]])
        if input_ids.shape[1] <= args.window + args.sinks:
            continue
        prompt_tokens.append(input_ids.shape[1])
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            queries = capture_queries(model, input_ids, slice(-args.window, None), cache=cache)
        for index, layer_queries in queries.items():
            keys, values = cache.layers[index].keys[0], cache.layers[index].values[0]  # [H_kv, P, d]
            head_dim = keys.shape[-1]
            stored = slice(args.sinks, input_ids.shape[1] - args.window)
            codes, scales = quantize_int4(values[..., stored, :])
            served_values = dequantize_int4(codes, scales, values.shape[-1])
            scaling = model.model.layers[index].self_attn.scaling
            for layout in LAYOUTS:
                served_keys, key_bytes = stored_keys(keys[..., stored, :], layout, keys)
                errors[layout] += attention_errors(
                    layer_queries, keys, values, served_keys, served_values, args.window, scaling, args.sinks
                )
                row_bytes[layout].append(key_bytes + values.shape[-1] / 2 + 2)
    if not prompt_tokens:
        parser.error(f"no prompt is longer than --window + --sinks ({args.window + args.sinks})")
    rows = []
    for layout in LAYOUTS:
        ordered = sorted(errors[layout])
        rows.append(
            {
                "layout": layout,
                "bytes_per_row": statistics.fmean(row_bytes[layout]),
                "median": statistics.median(ordered),
                "p90": ordered[int(0.9 * (len(ordered) - 1))],
                "mean": statistics.fmean(ordered),
                "query_rows": len(ordered),
            }
        )
    print(
        f"{len(prompt_tokens)} prompts ({statistics.fmean(prompt_tokens):.0f} tokens on average), window {args.window}"
    )
    print(f"{'layout':<22}{'bytes / row (K+V)':>18}{'median':>10}{'p90':>10}{'mean':>10}")
    for row in rows:
        print(
            f"{row['layout']:<22}{row['bytes_per_row']:>18.1f}{row['median']:>10.4f}{row['p90']:>10.4f}{row['mean']:>10.4f}"
        )
    payload = {
        "model": type(model).__name__ + (" (tiny, random)" if args.tiny else f" {model.config.name_or_path}"),
        "categories": args.categories,
        "split": "development",
        "cases_per_category": args.cases,
        "prompts": len(prompt_tokens),
        "mean_prompt_tokens": statistics.fmean(prompt_tokens),
        "window": args.window,
        "sinks": args.sinks,
        "bf16_bytes_per_row": 4 * head_dim,
        "rows": rows,
    }
    return write_json(args.out, payload, started=started)


if __name__ == "__main__":
    main()
