"""Per-token cost of PASK's online control — structural tagging + the policy controller — against the number of
tokens generated before (history 128, 2K, 8K, 32K), with lm-format-enforcer's masking time beside it.

The output is a JSON list of function calls (the embedded model's tokenizer, the illustrative policy): the history
is a run of ``get_weather`` / ``book_flight`` calls, the measured window the ``--window`` tokens that follow it.
Tagging is `GrammarSequence.advance`
(our character-level parser walk); the controller is `PolicyController.step` (Algorithm 2), timed in a walk without
masking; lm-format-enforcer's masking (`allowed_token_mask`) is timed in a second walk that masks every token, as
generation does, up to the longest ``--mask-histories`` entry (default 8K: the engine keys its states by the whole
token prefix, so its time per token grows with the history and its memory quadratically).
Target (issue 3): tagging + controller flat, i.e. the 32K / 128 ratio <= 1.1.

    .venv/bin/python benchmarks/controller_overhead.py --out benchmarks/results/controller_overhead.json
"""

from __future__ import annotations

import argparse
import json
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


def walk(tokenizer, length: int, window_starts: list[int], window: int, mask: bool) -> dict[int, dict[str, list]]:
    """Walk ``length`` tokens of the call list, timing tagging, the controller and (with ``mask``) lm-format-
    enforcer's masking for the ``window`` tokens after each of ``window_starts``.

    A token is the tokenizer's own token for the next characters when the grammar accepts it, else the next single
    character; with ``mask`` lm-format-enforcer decides acceptance, without it our own parser does (a token it cannot
    tag is replaced by the single character)."""
    text = call_list_text(length // 20 + 10)  # ~27 tokens per call
    schema = function_call_schema(TOOLS)
    schema["maxItems"] = length  # lm-format-enforcer caps lists without maxItems at 20 items
    policy = illustrative_policy()
    sequence = JsonSchemaAdapter(tokenizer, schema).new_sequence()
    controller = PolicyController(policy, policy.costs)
    vocab, cursor = len(tokenizer), 0
    times = {h: {"tagging": [], "controller": [], "masking": []} for h in window_starts}
    for position in range(length):
        masking, allowed = None, None
        if mask:
            start = time.perf_counter()
            allowed = sequence.allowed_token_mask(vocab)
            masking = time.perf_counter() - start
        natural = tokenizer(text[cursor : cursor + 32], add_special_tokens=False).input_ids[0]
        single = tokenizer(text[cursor], add_special_tokens=False).input_ids[0]
        token = natural if allowed is None or bool(allowed[natural]) else single
        start = time.perf_counter()
        tags = sequence.advance(token)
        tagging = time.perf_counter() - start
        if not tags and token != single:  # without masking: our parser rejected the natural token
            sequence.rollback(1)
            token = single
            start = time.perf_counter()
            tags = sequence.advance(token)
            tagging = time.perf_counter() - start
        if not tags or (allowed is not None and not bool(allowed[token])):
            raise RuntimeError(f"the grammar forbids {text[cursor]!r} at character {cursor}")
        cursor += len(tokenizer.decode([token]))
        start = time.perf_counter()
        controller.step(tags)
        stepping = time.perf_counter() - start
        for h in window_starts:
            if h <= position < h + window:
                times[h]["tagging"].append(tagging)
                times[h]["controller"].append(stepping)
                if masking is not None:
                    times[h]["masking"].append(masking)
    return times


def measure(tokenizer, histories: list[int], window: int, mask_histories: list[int]) -> list[dict]:
    """Two walks: tagging + controller alone at every history (what PASK adds), and, up to the longest of
    ``mask_histories``, lm-format-enforcer's masking at every token as in generation (its parser states are keyed
    by the whole token prefix: time per token grows with the history and memory quadratically — a walk masking up
    to 32K was stopped at 8.8 GB resident)."""
    control = walk(tokenizer, max(histories) + window, histories, window, mask=False)
    masked = walk(tokenizer, max(mask_histories) + window, mask_histories, window, mask=True) if mask_histories else {}
    result = []
    for h in histories:
        both = [a + b for a, b in zip(control[h]["tagging"], control[h]["controller"])]
        result.append(
            {
                "history": h,
                "tokens_timed": len(both),
                "tagging_plus_controller_us": 1e6 * statistics.median(both),
                "tagging_us": 1e6 * statistics.median(control[h]["tagging"]),
                "controller_us": 1e6 * statistics.median(control[h]["controller"]),
                "masking_ms": 1e3 * statistics.median(masked[h]["masking"]) if h in masked else None,
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--histories", type=int, nargs="+", default=[128, 2048, 8192, 32768])
    parser.add_argument("--window", type=int, default=200, help="tokens timed after each history")
    parser.add_argument(
        "--mask-histories",
        type=int,
        nargs="*",
        default=[128, 2048, 8192],
        help="histories at which lm-format-enforcer's masking is timed too (it masks every token up to the longest)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_snapshot())
    start = time.perf_counter()
    rows = measure(tokenizer, sorted(args.histories), args.window, args.mask_histories)
    seconds = time.perf_counter() - start
    base = rows[0]["tagging_plus_controller_us"]
    print(f"{'history':>8} {'tag+ctrl µs':>12} {'tag µs':>8} {'ctrl µs':>8} {'ratio':>6} {'LMFE mask ms':>13}")
    for row in rows:
        row["ratio_to_shortest"] = row["tagging_plus_controller_us"] / base
        mask = "-" if row["masking_ms"] is None else f"{row['masking_ms']:.2f}"
        print(
            f"{row['history']:>8} {row['tagging_plus_controller_us']:>12.1f} {row['tagging_us']:>8.1f} "
            f"{row['controller_us']:>8.1f} {row['ratio_to_shortest']:>6.2f} {mask:>13}"
        )
    flat = max(row["ratio_to_shortest"] for row in rows) <= 1.1
    print(f"target: tagging + controller flat (ratio <= 1.1): {'met' if flat else 'NOT met'}; {seconds:.0f} s")
    if args.out:
        record = {
            "command": f"benchmarks/controller_overhead.py --histories {' '.join(map(str, args.histories))} "
            f"--window {args.window} --mask-histories {' '.join(map(str, args.mask_histories))}",
            "medians_over_window": rows,
            "flat_target_met": flat,
            "seconds": seconds,
            "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
        }
        write_json(args.out, record, started=started)


if __name__ == "__main__":
    main()
