"""PASK end to end on the embedded model: a BFCL-style question answered under the tools' JSON schema, with the
structured mixed-precision cache, printing the call, every generated token's structural tags and scheduled actions,
and the bytes saved.

    bash scripts/setup.sh && .venv/bin/python examples/structured_function_call.py

The policy is the hand-written *illustrative* table shipped for the embedded model (not calibrated: the calibrated
table is issue 4's output), so the bytes saved show the mechanism, not a tuned operating point.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_structkv.models import load_default_model
from hf_structkv.policy import illustrative_policy
from hf_structkv.structured_generation import generate_calls

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "dict",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
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
                "origin": {"type": "string", "description": "Departure city"},
                "destination": {"type": "string", "description": "Arrival city"},
                "date": {"type": "string", "description": "Date as YYYY-MM-DD"},
                "passengers": {"type": "integer", "description": "Number of passengers"},
            },
            "required": ["origin", "destination", "date"],
        },
    },
]
QUESTION = "Book a flight from Lisbon to Oslo on 2026-12-18 for two people, and tell me the weather in Oslo in celsius."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tokenizer = load_default_model()
    policy = illustrative_policy(model)
    start = time.perf_counter()
    result = generate_calls(model, tokenizer, args.question, TOOLS, policy, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    print(f"question: {args.question}\nanswer:   {result.texts[0]}")
    print("calls:", json.dumps(result.calls[0], indent=2) if result.calls[0] is not None else "(incomplete JSON)")
    print(f"\n{'token':>16}  {'actions':>7}  tags (class|role|state|next)")
    for row in result.token_report(0, tokenizer):
        tags = "stop" if row["tags"] is None else " / ".join(row["tags"]) or "(unresolved: full protection)"
        print(f"{row['text']!r:>16}  {row['actions'] or 'window':>7}  {tags}")
    report = result.bytes_report()
    print(
        f"\nprompt {result.prompt_length} tokens + {result.processor.num_tagged(0) + 1} generated, {seconds:.1f} s"
        f"\nscheduled payload {report['scheduled_payload_bytes']:,.0f} B"
        f" vs Full KV {report['full_payload_bytes']:,.0f} B"
        f" (B = {report['budget_ratio']:.3f}; prompt kept H)"
        f"\nstored tensors {report['nbytes']:,} B vs DynamicCache {report['full_nbytes']:,} B"
        " (the model's dtype; slot maps, INT4 scales and growth padding included)"
    )


if __name__ == "__main__":
    main()
