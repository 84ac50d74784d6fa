"""Per-token cost of constrained decoding with PASK's online control — masking + structural tagging + the policy
controller — against the number of tokens generated before (history 128, 2K, 8K, 32K), for each grammar engine.

The output is a JSON list of function calls (the embedded model's tokenizer, the illustrative policy): the history
is a run of ``get_weather`` / ``book_flight`` calls, the measured window the ``--window`` tokens that follow it. One
walk per engine (``--engine``) masks every token as generation does (`GrammarSequence.allowed_token_mask`), tags it
(`GrammarSequence.advance`: our character-level parser walk, the same for both engines) and steps the controller
(`PolicyController.step`, Algorithm 2). The process's resident memory (Linux ``/proc/self/statm``) is read once the
engine's tables are built and before each window: its growth is what the walk has kept for the history.

lm-format-enforcer keys its states by the whole token prefix, so its masking time grows with the history and its
memory quadratically (a walk to 32K was stopped at 8.8 GB resident): it is walked only up to the longest
``--lmfe-histories`` entry (default 8K). xgrammar keeps one matcher state and a rollback history, and our tagging
walk one parser per token (for ``crop()``): ``--max-rollback-tokens k`` builds the xgrammar engine with that bound
(`XgrammarJsonAdapter(max_rollback_tokens=k)`), which keeps the last ``k`` tokens' states only. The list schema
bounds its length (``maxItems``) for lm-format-enforcer only, which caps unbounded lists at 20 items.
Targets (issue 33): with xgrammar <= 1 ms per token (median over the window) and flat (the 32K / 128 ratio <= 1.1),
memory flat.

    .venv/bin/python benchmarks/controller_overhead.py --out benchmarks/results/controller_overhead.json
    .venv/bin/python benchmarks/controller_overhead.py --engine xgrammar --max-rollback-tokens 64 \
        --out benchmarks/results/controller_overhead_rollback64.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hf_structkv.models import ensure_default_snapshot
from hf_structkv.policy import PolicyController, illustrative_policy
from hf_structkv.structure.function_calls import function_call_schema
from hf_structkv.structure.lmfe import JsonSchemaAdapter
from hf_structkv.structure.xgrammar_json import XgrammarJsonAdapter

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "dict",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    {
        "name": "book_flight",
        "description": "Book a one-way flight.",
        "parameters": {
            "type": "dict",
            "properties": {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "passengers": {"type": "integer"},
            },
            "required": ["origin", "destination"],
        },
    },
]
ENGINES = {"lmfe": JsonSchemaAdapter, "xgrammar": XgrammarJsonAdapter}
TARGET_MS, TARGET_RATIO = 1.0, 1.1
CITIES = ["Oslo", "Lisbon", "Kyoto", "Nairobi", "Lima", "Tallinn", "Hanoi", "Perth"]


def call_list_text(count: int) -> str:
    """A JSON list of ``count`` calls alternating ``book_flight`` / ``get_weather`` (ASCII)."""
    calls = []
    for i in range(count):
        if i % 2:
            calls.append({"name": "get_weather", "arguments": {"city": CITIES[i % 8], "unit": "celsius"}})
        else:
            args = {"origin": CITIES[i % 8], "destination": CITIES[(i + 3) % 8], "passengers": i % 5 + 1}
            calls.append({"name": "book_flight", "arguments": args})
    return json.dumps(calls)


def resident_mib() -> float | None:
    """The process's resident memory now, MiB (Linux ``/proc/self/statm``); ``None`` elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def walk(
    tokenizer, engine: str, window_starts: list[int], window: int, max_rollback_tokens: int | None = None
) -> dict[int, dict[str, list]]:
    """Walk the call list under ``engine``'s masks up to the last window, timing masking, tagging and the controller
    for the ``window`` tokens after each of ``window_starts`` and reading the resident memory before each window
    (``"rss_mib"``: ``[at the walk's start, before the window]``).

    A token is the tokenizer's own token for the next characters when the mask allows it, else the next single
    character."""
    length = max(window_starts) + window
    text = call_list_text(length // 20 + 10)  # ~27 tokens per call
    schema = function_call_schema(TOOLS)
    if engine == "lmfe":  # lm-format-enforcer caps lists without maxItems at 20 items; xgrammar needs no bound, and
        schema["maxItems"] = length  # a bound of ~32K items makes it keep about 1 KiB a token more (not our use)
    policy = illustrative_policy()
    bound = {} if max_rollback_tokens is None else {"max_rollback_tokens": max_rollback_tokens}
    sequence = ENGINES[engine](tokenizer, schema, **bound).new_sequence()
    start_rss = resident_mib()  # after the engine's tables are built: what follows is kept for the history
    controller = PolicyController(policy, policy.costs)
    vocab, cursor = len(tokenizer), 0
    times = {h: {"masking": [], "tagging": [], "controller": [], "rss_mib": []} for h in window_starts}
    for position in range(length):
        for h in window_starts:
            if position == h:
                times[h]["rss_mib"] = [start_rss, resident_mib()]
        start = time.perf_counter()
        allowed = sequence.allowed_token_mask(vocab)
        masking = time.perf_counter() - start
        natural = tokenizer(text[cursor : cursor + 32], add_special_tokens=False).input_ids[0]
        single = tokenizer(text[cursor], add_special_tokens=False).input_ids[0]
        token = natural if bool(allowed[natural]) else single
        if not bool(allowed[token]):
            raise RuntimeError(f"{engine} forbids {text[cursor]!r} at character {cursor}")
        start = time.perf_counter()
        tags = sequence.advance(token)
        tagging = time.perf_counter() - start
        if not tags:
            raise RuntimeError(f"our parser walk cannot tag {tokenizer.decode([token])!r} at character {cursor}")
        cursor += len(tokenizer.decode([token]))
        start = time.perf_counter()
        controller.step(tags)
        stepping = time.perf_counter() - start
        for h in window_starts:
            if h <= position < h + window:
                times[h]["masking"].append(masking)
                times[h]["tagging"].append(tagging)
                times[h]["controller"].append(stepping)
    return times


def measure(
    tokenizer, engine: str, histories: list[int], window: int, max_rollback_tokens: int | None = None
) -> list[dict]:
    """One walk under ``engine`` to the longest of ``histories``; per history the medians over its window (the
    per-token total is the median of the per-token sums) and the resident memory the history added."""
    times = walk(tokenizer, engine, histories, window, max_rollback_tokens)
    rows = []
    for h in histories:
        per_token = [sum(parts) for parts in zip(times[h]["masking"], times[h]["tagging"], times[h]["controller"])]
        start_rss, rss = times[h]["rss_mib"]
        rows.append(
            {
                "history": h,
                "tokens_timed": len(per_token),
                "per_token_ms": 1e3 * statistics.median(per_token),
                "masking_ms": 1e3 * statistics.median(times[h]["masking"]),
                "tagging_us": 1e6 * statistics.median(times[h]["tagging"]),
                "controller_us": 1e6 * statistics.median(times[h]["controller"]),
                "rss_growth_mib": None if rss is None else rss - start_rss,
            }
        )
    for row in rows:
        row["ratio_to_shortest"] = row["per_token_ms"] / rows[0]["per_token_ms"]
    return rows


def summary(rows: list[dict]) -> dict:
    """The issue's targets on one engine's rows: the largest median per token, the largest ratio to the shortest
    history, the resident memory added per 1K tokens of history (between the shortest and longest history)."""
    first, last = rows[0], rows[-1]
    growth = None
    if last["rss_growth_mib"] is not None and last["history"] > first["history"]:
        growth = 1024 * (last["rss_growth_mib"] - first["rss_growth_mib"]) / (last["history"] - first["history"])
    worst_ms = max(row["per_token_ms"] for row in rows)
    worst_ratio = max(row["ratio_to_shortest"] for row in rows)
    return {
        "max_per_token_ms": worst_ms,
        "max_ratio_to_shortest": worst_ratio,
        "rss_mib_per_1k_tokens": growth,
        "time_target_met": worst_ms <= TARGET_MS and worst_ratio <= TARGET_RATIO,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", nargs="+", choices=sorted(ENGINES), default=["xgrammar", "lmfe"])
    parser.add_argument("--histories", type=int, nargs="+", default=[128, 2048, 8192, 32768])
    parser.add_argument(
        "--lmfe-histories",
        type=int,
        nargs="+",
        default=[128, 2048, 8192],
        help="the histories of the lm-format-enforcer walk (its memory grows quadratically: 32K exhausts it)",
    )
    parser.add_argument("--window", type=int, default=200, help="tokens timed after each history")
    parser.add_argument(
        "--max-rollback-tokens",
        type=int,
        help="xgrammar only: the engine keeps the states of this many tokens only (default: every token's)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_rollback_tokens is not None and (args.max_rollback_tokens < 0 or "lmfe" in args.engine):
        parser.error(
            "--max-rollback-tokens takes an integer >= 0 and bounds the xgrammar engine: pass --engine xgrammar"
        )
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_snapshot())
    record = {"engines": {}, "targets": {"per_token_ms": TARGET_MS, "ratio_to_shortest": TARGET_RATIO}}
    columns = ("engine", 8), ("history", 8), ("ms/token", 9), ("mask ms", 8), ("tag µs", 7), ("ctrl µs", 8)
    print(" ".join(f"{name:>{width}}" for name, width in (*columns, ("ratio", 6), ("+RSS MiB", 9))))
    for engine in dict.fromkeys(args.engine):
        histories = sorted(set(args.lmfe_histories if engine == "lmfe" else args.histories))
        start = time.perf_counter()
        rows = measure(tokenizer, engine, histories, args.window, args.max_rollback_tokens)
        record["engines"][engine] = {"rows": rows, **summary(rows), "seconds": time.perf_counter() - start}
        for row in rows:
            rss = "-" if row["rss_growth_mib"] is None else f"{row['rss_growth_mib']:.1f}"
            print(
                f"{engine:>8} {row['history']:>8} {row['per_token_ms']:>9.3f} {row['masking_ms']:>8.3f} "
                f"{row['tagging_us']:>7.1f} {row['controller_us']:>8.1f} {row['ratio_to_shortest']:>6.2f} {rss:>9}"
            )
        met = record["engines"][engine]["time_target_met"]
        print(f"{engine}: <= {TARGET_MS} ms per token and ratio <= {TARGET_RATIO}: {'met' if met else 'NOT met'}")
    record.update(
        command="benchmarks/controller_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
        window=args.window,
        max_rollback_tokens=args.max_rollback_tokens,
        threads=torch.get_num_threads(),
        machine=platform.processor() or platform.machine(),
    )
    if args.out:
        record = write_json(args.out, record, started=started)
    return record


if __name__ == "__main__":
    main()
