"""Long agent trajectories (issue 33, part 3): decode time per token and stored bytes of a DynamicCache against PASK
at B = 0.33, and against PASK after a compacted tool catalogue, side by side in one run, at batch 1 and 4.

- Trajectory (`trajectory`): a tool catalogue (the functions of the first ``--pool-cases`` BFCL test cases of
  ``simple_python`` / ``multiple`` whose function names are distinct) in the system turn, then turns drawn from those
  cases in a seeded order: the case's question (user), its first ground-truth answer as the JSON list of calls the
  grammar generates (assistant), and a synthetic JSON result of each call (``tool``: the call's name, arguments and a
  seeded value), until one more turn would pass ``--lengths`` tokens; a last question is answered. A batch of 4 holds
  four trajectories of the same target length (seeds ``seed .. seed + 3``), left-padded.
- Variants, each answering the same prompts greedily under the tools' JSON grammar (`StructuralLogitsProcessor`, the
  same masking and tagging for all): ``dynamic`` (a transformers ``DynamicCache`` of the whole prompt, model dtype),
  ``pask`` (`generate_calls` with the ``--pask-policy`` decode table and prefill policy at B_D = B_P = 0.33, whole
  prompt) and ``pask+catalogue`` (the same after the catalogue compacted by ``--catalogue-method`` at
  ``--catalogue-ratio`` with ``--catalogue-storage``, served as ``context=``; serving cost does not depend on which
  entries are kept, so the cheap query-free StreamingLLM selection is the default).
- Measured: the wall time between consecutive decode steps (a stopping criterion stamps each step: forward, masking,
  tagging, controller), its median and mean per token, the prefill time (to the first step), and the cache's stored
  bytes after the reply (`StructuredMixedPrecisionCache.nbytes`: catalogue + stores + recent region with scales and
  slot maps; a DynamicCache's keys and values). The crossover per batch size is the shortest history at which a
  variant decodes no slower than ``dynamic``.
- Resumable: each (variant, length, batch) measurement is appended to ``<out>.cases.jsonl`` (settings on its first
  line; a rerun with other settings is refused) and skipped when rerun.

On a GPU the Triton kernels change the attention part: the mixed-precision kernel reads the stores in place (INT4
dequantised in registers, split-KV over long histories). On this CPU a decode step reads the INT4 store from its
codes with the C kernel (`int4_rows_stats`, since commit 9824a39; before, the fused torch path dequantised every
stored INT4 entry at each step) and the high store, the recent region and a catalogue's entries in torch
(`attention/mixed_sdpa.py`); a layer with a compacted catalogue is served by that path on every device (the Triton
mixed kernel has no prefix partition, attention/backend.py).

Each prompt is prefilled in one forward, as ``generate`` does; the mixed-precision cache's torch paths serve the
prompt's query rows in blocks whose FP32 logits stay within ``SCORE_BLOCK_ELEMENTS`` (per partition in
`mixed_precision_attention`, over all partitions in `fused_mixed_precision_attention`), so its attention memory
grows as ``block x P``, not ``P^2``; what still grows as
``B P^2`` is transformers' boolean attention mask of a padded batch (``B P^2`` bytes: 4 GiB at 32K and batch 4). A
prompt may also be prefilled in chunks (``StructuredMixedPrecisionCache(..., prompt_length=P)`` with ``generate``'s
``prefill_chunk_size``; equal to one forward), which this benchmark does not use.

The run of issue 33 (embedded model, float32 on CPU, 1 thread):

    python benchmarks/long_trajectory.py --lengths 2048 8192 32768 --batches 1 4 --threads 1 \\
        --out benchmarks/results/long_trajectory.json

Smoke run: ``--lengths 1024 --pool-cases 2 --out /tmp/long_trajectory_smoke.json`` (512 tokens do not hold the
catalogue and one question).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from hf_structkv.compaction.catalogue import compact_catalogue
from hf_structkv.eval.bfcl import BfclEntry
from hf_structkv.models import load_default_model
from hf_structkv.policy.shipped import pair_name
from hf_structkv.structure import StructuralLogitsProcessor
from hf_structkv.structured_generation import call_prompt, generate_calls, left_padded_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_budget import is_prefill_source, load_pask, pask_at  # noqa: E402
from results_json import write_json  # noqa: E402
from tool_catalogue import CaseLog, pick_cases  # noqa: E402

LENGTHS = (2048, 8192, 32768)
BATCHES = (1, 4)
VARIANTS = ("dynamic", "pask", "pask+catalogue")
COMMITTED_PAIR = "calibrated-verdict-24"
"""The PASK pair of the committed runs (the default pair when they ran)."""
PASK_BUDGET = 0.33
CATEGORIES = ("simple_python", "multiple")


def ground_truth_calls(entry: BfclEntry) -> list[dict]:
    """The entry's first accepted answer as calls ``[{"name", "arguments"}]`` (each parameter's first accepted value;
    parameters whose first accepted value is ``""``, BFCL's mark of an omittable one, left out)."""
    calls = []
    for answer in entry.ground_truth:
        ((name, parameters),) = answer.items()
        arguments = {key: values[0] for key, values in parameters.items() if values and values[0] != ""}
        calls.append({"name": name, "arguments": arguments})
    return calls


def tool_result(call: dict, rng: random.Random) -> str:
    """A synthetic JSON result of ``call``: its name and arguments echoed and a seeded value."""
    result = {"status": "ok", "value": round(rng.uniform(0, 1000), 2), "request_id": rng.randrange(10**6)}
    return json.dumps({"name": call["name"], "arguments": call["arguments"], "result": result})


def trajectory(tokenizer, pool: list[BfclEntry], tools: list[dict], max_tokens: int, seed: int) -> list[dict]:
    """The chat of one trajectory (module docstring): turns of ``pool``'s cases in ``random.Random(seed)``'s order
    while the prompt (`call_prompt` with ``tools``) stays within ``max_tokens`` tokens, then a last question.

    Raises:
        ValueError: the catalogue and one question alone exceed ``max_tokens``.
    """
    rng = random.Random(f"long-trajectory/{seed}")

    def tokens(messages: list[dict]) -> int:
        return len(tokenizer(call_prompt(tokenizer, messages, tools), add_special_tokens=False)["input_ids"])

    def question() -> list[dict]:
        return [dict(m) for m in rng.choice(pool).messages]

    messages: list[dict] = []
    last = question()
    if tokens(last) > max_tokens:
        raise ValueError(f"the catalogue and one question take {tokens(last)} tokens, more than {max_tokens}")
    while True:
        entry = rng.choice(pool)
        calls = ground_truth_calls(entry)
        turn = [*(dict(m) for m in entry.messages), {"role": "assistant", "content": json.dumps(calls)}]
        turn += [{"role": "tool", "content": tool_result(call, rng)} for call in calls]
        if tokens(messages + turn + last) > max_tokens:
            return messages + last
        messages += turn


class StepClock(StoppingCriteria):
    """Stamps ``time.perf_counter()`` at every decode step (called once per generated token); never stops."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def measure(variant: str, model, tokenizer, chats, tools, pask, catalogue, max_new_tokens: int) -> dict:
    """One generation of ``variant`` over the batch ``chats``: step times, prefill time, stored bytes, texts."""
    table, prefill = pask
    clock = StepClock()
    start = time.perf_counter()
    if variant == "dynamic":
        prompts = [call_prompt(tokenizer, chat, tools) for chat in chats]
        batch = left_padded_batch(tokenizer, prompts, model.device)
        processor = StructuralLogitsProcessor(
            tokenizer, tools=tools, tag_view=table.tag_view, position_bins=table.position_bins
        )
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            sequences = model.generate(
                **batch,
                cache=cache,
                logits_processor=[processor],
                stopping_criteria=StoppingCriteriaList([clock]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        prompt_length = batch["input_ids"].shape[1]
        texts = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
        stored = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    else:
        context = catalogue if variant == "pask+catalogue" else None
        with torch.no_grad():
            result = generate_calls(
                model,
                tokenizer,
                chats,
                tools,
                table,
                max_new_tokens=max_new_tokens,
                prefill_policy=prefill,
                context=context,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        prompt_length, texts, stored = result.prompt_length, result.texts, result.cache.nbytes()
    steps = [later - earlier for earlier, later in zip(clock.stamps, clock.stamps[1:])]
    return {
        "prompt_tokens": prompt_length,
        "generated_steps": len(clock.stamps),
        "prefill_seconds": clock.stamps[0] - start,
        "decode_ms_median": 1000 * statistics.median(steps) if steps else None,
        "decode_ms_mean": 1000 * statistics.fmean(steps) if steps else None,
        "stored_bytes": stored,
        "texts": texts,
    }


def crossovers(records: list[dict], lengths, batches) -> dict:
    """Per batch size and PASK variant, the shortest target length at which its median decode step is no slower
    than ``dynamic``'s (None: never within ``lengths``)."""
    by_key = {(r["variant"], r["length"], r["batch"]): r for r in records}
    out = {}
    for batch in batches:
        for variant in VARIANTS[1:]:
            reached = [
                length
                for length in sorted(lengths)
                if (variant, length, batch) in by_key
                and (dynamic := by_key.get(("dynamic", length, batch))) is not None
                and by_key[(variant, length, batch)]["decode_ms_median"] <= dynamic["decode_ms_median"]
            ]
            out[f"{variant}@batch{batch}"] = reached[0] if reached else None
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="trajectory tokens (at most)")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--pool-cases", type=int, default=4, help="BFCL cases whose functions form the catalogue")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--catalogue-method", default="streaming_llm")
    parser.add_argument("--catalogue-ratio", type=float, default=4.0)
    parser.add_argument("--catalogue-storage", default="int4", choices=("bf16", "int4"))
    parser.add_argument(
        "--pask-policy",
        default=COMMITTED_PAIR,
        help="the PASK pair: a shipped pair's name ('calibrated': the default pair) or a folder, as bfcl_budget.py "
        f"takes it; default {COMMITTED_PAIR!r}, the pair of the committed runs (another pair needs its own --out)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/long_trajectory.json")
    args = parser.parse_args(argv)
    for name in ("pool_cases", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.lengths) < 1 or min(args.batches) < 1:
        parser.error("--lengths and --batches must be >= 1")
    if not is_prefill_source(args.pask_policy):
        parser.error(f"--pask-policy {args.pask_policy!r} is neither a shipped pair nor a folder with a prefill policy")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    pool = pick_cases(CATEGORIES, args.pool_cases, args.seed)
    tools = list({tool["name"]: tool for case in pool for tool in case.tools}.values())
    pask_policy = pair_name(args.pask_policy)
    settings = {
        "model": model.config.name_or_path,
        "pool": [case.id for case in pool],
        **{
            key: getattr(args, key)
            for key in ("max_new_tokens", "catalogue_method", "catalogue_ratio", "catalogue_storage", "seed")
        },
        # the committed logs, made before the option, hold the committed pair's runs: only another pair is recorded
        **({} if pask_policy == COMMITTED_PAIR else {"pask_policy": pask_policy}),
    }
    out = Path(args.out)
    try:
        log = CaseLog(out.with_suffix(".cases.jsonl"), settings)
    except ValueError as error:
        parser.error(str(error))
    table, prefill, provenance = load_pask(args.pask_policy, model)
    pask = pask_at(table, prefill, PASK_BUDGET)
    catalogue = None
    if any(("pask+catalogue", f"{n}/{b}") not in log.cases for n in args.lengths for b in args.batches):
        catalogue = compact_catalogue(
            model,
            tokenizer,
            tools,
            ratio=args.catalogue_ratio,
            method=args.catalogue_method,
            storage=args.catalogue_storage,
            seed=args.seed,
            progress=False,
        )
    print(f"{'length':>7} {'batch':>5} {'variant':<15} {'prompt':>7} {'ms/token':>9} {'prefill s':>9} {'MiB':>8}")
    records = []
    for length in sorted(args.lengths):
        for batch in sorted(args.batches):
            chats = [trajectory(tokenizer, pool, tools, length, args.seed + row) for row in range(batch)]
            for variant in VARIANTS:
                key = (variant, f"{length}/{batch}")
                if key not in log.cases:
                    measured = measure(variant, model, tokenizer, chats, tools, pask, catalogue, args.max_new_tokens)
                    log.add_case(
                        variant, {"id": key[1], "variant": variant, "length": length, "batch": batch, **measured}
                    )
                r = log.cases[key]
                records.append(r)
                print(
                    f"{length:>7} {batch:>5} {variant:<15} {r['prompt_tokens']:>7} {r['decode_ms_median']:>9.1f} "
                    f"{r['prefill_seconds']:>9.1f} {r['stored_bytes'] / 2**20:>8.2f}"
                )
    found = crossovers(records, args.lengths, args.batches)
    print("crossover (shortest length decoding no slower than dynamic):", found)
    payload = {
        "settings": settings,
        "catalogue": None if catalogue is None else {"tokens": catalogue.original_length, "nbytes": catalogue.nbytes()},
        "pask": {"provenance": provenance, "B_D": pask[0].budget, "B_P": pask[1].budget},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "crossover": found,
        "records": records,
    }
    payload = write_json(out, payload, started=started)
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
