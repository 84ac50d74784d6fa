"""``hf-structkv generate-calls`` and ``hf-structkv compact --tools``: function calls under the tools' JSON schema on
a PASK cache, optionally after a compacted tool catalogue. Every option is checked before the model loads."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .policy.shipped import CALIBRATED, SHIPPED_PAIRS
from .quant.int4_centred import INT4_KEY_LAYOUTS
from .validation import int_option, is_hub_id

POLICIES = (CALIBRATED, *SHIPPED_PAIRS, "illustrative", "all-high")


def read_tools(name: str) -> list[dict]:
    """The tool definitions of the JSON file ``name`` (``--tools``): a list of BFCL- or OpenAI-style definitions,
    checked by `function_call_schema`.

    Raises:
        ValueError: naming ``--tools``: not a file, not JSON, or not valid tool definitions.
    """
    from .structure.function_calls import function_call_schema

    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--tools {name!r} is not a file; pass a JSON file holding a list of tool definitions")
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--tools {name!r} is not JSON text: {err}") from None
    if isinstance(tools, dict) and "function" not in tools and "name" not in tools:
        raise ValueError(f"--tools {name!r} holds a JSON object; pass a list of tool definitions")
    tools = [tools] if isinstance(tools, dict) else tools
    try:
        function_call_schema(tools)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--tools {name!r}: {err}") from None
    return tools


def policy_name(text: str) -> str:
    """``--policy``: a shipped table's name (`POLICIES`) or the folder of a saved `PolicyTable`."""
    if text in POLICIES or Path(text).is_dir():
        return text
    raise argparse.ArgumentTypeError(f"takes {', '.join(POLICIES)} or a saved policy folder, got {text!r}")


def catalogue_source(text: str) -> str:
    """``--catalogue``: a saved compacted catalogue's folder or a Hub repository id."""
    if Path(text).is_dir() or (not Path(text).exists() and is_hub_id(text)):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a folder nor a Hub repository id of a compacted catalogue")


def load_policy(name: str, model):
    """The `PolicyTable` ``--policy`` names, checked against ``model``."""
    from .policy import PolicyTable, calibrated_policy, illustrative_policy

    if name == CALIBRATED or name in SHIPPED_PAIRS:
        return calibrated_policy(model, name)
    if name == "illustrative":
        return illustrative_policy(model)
    if name == "all-high":
        return PolicyTable.all_high(model)
    return PolicyTable.from_pretrained(name, model=model)


def run_generate_calls(args, load_model) -> int:
    """Answer each ``--prompt`` with calls to ``--tools``; print the calls and the cache's bytes."""
    from .cache.compacted import CompactedCache
    from .structured_generation import generate_calls

    tools = read_tools(args.tools)
    model, tokenizer = load_model(args.model)
    policy = load_policy(args.policy, model)
    context = None
    if args.catalogue is not None:
        context = CompactedCache.from_pretrained(args.catalogue, model=model, tokenizer=tokenizer)
    for prompt in args.prompt:
        start = time.perf_counter()
        with torch.no_grad():
            result = generate_calls(
                model,
                tokenizer,
                prompt,
                tools,
                policy,
                max_new_tokens=args.max_new_tokens,
                context=context,
                int4_keys=args.int4_keys,
            )
        report = result.bytes_report()
        print(f"Q: {prompt!r}  ({time.perf_counter() - start:.1f} s)")
        print(json.dumps(result.calls[0]) if result.calls[0] is not None else f"(not complete JSON) {result.texts[0]}")
        context_bytes = sum(layer.context_nbytes() for layer in result.cache.mixed_layers())
        print(
            f"cache {report['nbytes']:,} bytes ({context_bytes:,} of them the compacted catalogue), full "
            f"{report['full_nbytes']:,}; scheduled payload / full KV {report['budget_ratio']:.3f}"
        )
    return 0


def compact_tools(args, load_model, compact_kwargs: dict) -> int:
    """``compact --tools``: compact the catalogue of the tools and save it to ``--out``."""
    from .compaction.catalogue import compact_catalogue

    tools = read_tools(args.tools)
    if compact_kwargs.pop("keep_template", False):
        raise ValueError("--keep-template applies to a document; a tool catalogue is compacted as it is rendered")
    model, tokenizer = load_model(args.model)
    start = time.perf_counter()
    cache = compact_catalogue(model, tokenizer, tools, progress=True, **compact_kwargs)
    seconds = time.perf_counter() - start
    cache.save_pretrained(args.out)
    print(f"compacted the catalogue of {len(tools)} tools ({cache.original_length} tokens) in {seconds:.1f} s")
    print(f"stored {cache.nbytes():,} bytes vs {cache.full_nbytes():,} full -> {args.out}")
    return 0


def add_generate_calls_parser(sub, model_options, request) -> argparse.ArgumentParser:
    """The ``generate-calls`` subcommand's parser (``model_options`` adds --model / --dtype, ``request`` is the
    ``type`` of --prompt); `run_generate_calls` runs it."""
    parser = sub.add_parser(
        "generate-calls",
        help="answer prompts with function calls to tools on a PASK cache (optionally after a "
        "compacted tool catalogue)",
    )
    model_options(parser)
    parser.add_argument("--tools", required=True, help="JSON file holding a list of tool definitions")
    parser.add_argument(
        "--prompt", action="append", required=True, type=request, help="the user's request (repeatable)"
    )
    parser.add_argument(
        "--policy",
        default="calibrated",
        type=policy_name,
        help="decode policy table: 'calibrated' (default, shipped for the embedded model), an earlier shipped pair "
        f"by name ({', '.join(SHIPPED_PAIRS)}), 'illustrative', 'all-high', or a saved policy folder",
    )
    parser.add_argument(
        "--catalogue",
        type=catalogue_source,
        help="folder or Hub id of the tools' compacted catalogue (hf-structkv compact --tools): served before each "
        "prompt instead of the catalogue's tokens",
    )
    parser.add_argument(
        "--int4-keys",
        choices=INT4_KEY_LAYOUTS,
        default=None,
        help="how the cache stores the keys of INT4 tokens: row (PASK's per-row scales) or centred (by the prompt's "
        "per-channel centre and spread); default: the policy's",
    )
    parser.add_argument("--max-new-tokens", type=int_option(1), default=128)
    return parser
