"""One call for PASK generation: function calls under the tools' JSON schema with a structured mixed-precision cache.

`generate_calls` wires the three pieces that must agree — the `StructuralLogitsProcessor` (grammar + tags), the
`StructuredMixedPrecisionCache` (storage) and the `PolicyTable` (actions) — into one ``model.generate`` call and
returns the parsed calls with the cache's measured bytes.

A tool catalogue can be read once and compacted (`catalogue_text` is what to compact): ``generate_calls(...,
context=compacted_catalogue)`` then feeds only each prompt's text after the catalogue (`conversation_text`), and the
cache serves the catalogue's compacted prefix before it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import BatchEncoding, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from .cache.compacted import CompactedCache
from .cache.mixed_precision import StructuredMixedPrecisionCache
from .generation import generation_inputs
from .policy.costs import Action
from .policy.prefill import PrefillPolicy, batch_prefill_plan
from .policy.retention import RetentionPolicy, check_retention_policy
from .quant.int4_centred import INT4_KEY_LAYOUTS, check_int4_keys
from .structure.processor import StructuralLogitsProcessor, resolve_engine

CALL_INSTRUCTION = (
    "You can call the tools listed below. Answer with a JSON list of calls, each "
    '{"name": <tool name>, "arguments": {<parameter>: <value>, ...}}, and nothing else.'
)


@dataclass
class StructuredOutput:
    """What a constrained generation on a mixed-precision cache produced (`generate_structured`).

    Attributes:
        sequences: ``[B, P + n]`` prompt and generated ids, as ``generate`` returns them.
        texts: the generated text of each sequence (special tokens removed).
        cache: the `StructuredMixedPrecisionCache` after generation (`nbytes`, `scheduled_payload`, ...).
        processor: the `StructuralLogitsProcessor` (per-token tags: ``tag_at(seq, i)``).
        prompt_length: ``P``.
    """

    sequences: torch.Tensor
    texts: list[str]
    cache: StructuredMixedPrecisionCache
    processor: StructuralLogitsProcessor
    prompt_length: int

    def token_report(self, seq: int = 0, tokenizer: PreTrainedTokenizerBase | None = None) -> list[dict[str, Any]]:
        """Per generated token of ``seq``: its id (and text with ``tokenizer``), candidate tags and the scheduled
        action per layer group (``None`` for tokens still waiting in the recent window, ``"stop"`` for stop tokens)."""
        decided = self.cache.schedule.decided[seq] if self.cache.schedule.controllers else []
        rows = []
        for index in range(self.processor.num_tagged(seq)):
            token = int(self.sequences[seq, self.prompt_length + index])
            tags = self.processor.tag_at(seq, index)
            if index < len(decided):
                actions = "stop" if decided[index] is None else "".join(Action(a).name for a in decided[index])
            else:
                actions = None
            rows.append(
                {
                    "token": token,
                    "text": None if tokenizer is None else tokenizer.decode([token]),
                    "tags": None if tags is None else ["|".join(tag) for tag in tags],
                    "actions": actions,
                }
            )
        return rows

    def bytes_report(self) -> dict[str, float]:
        """Physical bytes and the Full-KV bytes of the same tokens; the scheduled payload (B.3 convention) against
        Full KV overall (``budget_ratio``, the paper's ``B``) and per stage (``prefill_ratio`` = ``B_P`` over the
        prompt tokens, ``decode_ratio`` over the generated tokens scheduled so far, Table 17 style), with each
        stage's scheduled and Full-KV payload bytes so that ratios can be pooled over several generations."""
        cache = self.cache
        prompt_bits, decode_bits, prompt_length = cache.schedule.scheduled_bits_by_stage(cache.get_seq_length())
        rows, full = cache.schedule.batch_size, cache.costs.full
        decoded = sum(len(decisions) for decisions in cache.schedule.decided)
        payload, full_payload = (prompt_bits + decode_bits) / 8, cache.full_payload()
        prompt_full, decode_full = rows * prompt_length * full / 8, decoded * full / 8
        return {
            "nbytes": cache.nbytes(),
            "full_nbytes": cache.full_nbytes(),
            "scheduled_payload_bytes": payload,
            "full_payload_bytes": full_payload,
            "budget_ratio": payload / full_payload if full_payload else 1.0,
            "prefill_payload_bytes": prompt_bits / 8,
            "prefill_full_bytes": prompt_full,
            "prefill_ratio": prompt_bits / 8 / prompt_full if prompt_full else 1.0,
            "decode_payload_bytes": decode_bits / 8,
            "decode_full_bytes": decode_full,
            "decode_ratio": decode_bits / 8 / decode_full if decode_full else 1.0,
        }


@dataclass
class StructuredGeneration(StructuredOutput):
    """What `generate_calls` produced: a `StructuredOutput` plus ``calls``, per sequence the parsed list of calls,
    or ``None`` when the text is not complete JSON (generation hit ``max_new_tokens``)."""

    calls: list[list[dict] | None]


def _chat(question: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """The chat of one question: the call instruction as system message (prepended to the question's own system
    message, if any), then the user text or the given messages."""
    if isinstance(question, str) and question:
        return [{"role": "system", "content": CALL_INSTRUCTION}, {"role": "user", "content": question}]
    if (
        isinstance(question, Sequence)
        and not isinstance(question, str)
        and question
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in question)
    ):
        messages = [dict(m) for m in question]
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{CALL_INSTRUCTION}\n\n{messages[0]['content']}"
            return messages
        return [{"role": "system", "content": CALL_INSTRUCTION}, *messages]
    raise ValueError(
        "each question must be a non-empty string or a non-empty list of chat messages {'role': ..., 'content': ...}, "
        f"got {question!r}"
    )


def call_prompt(tokenizer: PreTrainedTokenizerBase, question, tools: Sequence[Mapping[str, Any]]) -> str:
    """The exact prompt text `generate_calls` builds for one question (a text or a list of chat messages): the
    tokenizer's chat template with the call instruction and ``tools``, ending with the generation prompt."""
    return tokenizer.apply_chat_template(_chat(question), tools=list(tools), add_generation_prompt=True, tokenize=False)


def _common_prefix_length(first: str, second: str) -> int:
    """The length of the longest common prefix of ``first`` and ``second``, by bisection over slice comparisons (a
    catalogue's prompts run to tens of thousands of characters: no Python loop over them)."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if first[:middle] == second[:middle] else (low, middle - 1)
    return low


def catalogue_text(tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool catalogue as the chat template renders it: every prompt of `call_prompt` for ``tools`` starts with
    this text (the system turn with the call instruction and the tools, in the template's tool format), which ends
    at the end of a special token, so that the catalogue's tokens followed by a conversation's tokens are the full
    prompt's tokens (`conversation_text` checks it). Compact it once (``compact(model, tokenizer, catalogue_text(...))``
    or ``hf-structkv compact --tools``) and pass the cache as ``generate_calls(..., context=)``.

    Raises:
        ValueError: the template renders no common, special-token-ended opening for two different questions (then
            the catalogue cannot be split from the conversation token-exactly).
    """
    first, second = (call_prompt(tokenizer, probe, tools) for probe in ("a", "b"))
    common = _common_prefix_length(first, second)
    found = ((first.rfind(token, 0, common), token) for token in tokenizer.get_added_vocab() if token)
    end = max((at + len(token) for at, token in found if at >= 0), default=0)  # added tokens are never merged
    if not first[:end].strip():
        raise ValueError(
            "the tokenizer's chat template renders no opening shared by every question that ends at a special "
            "token: its tool catalogue cannot be compacted apart from the conversation"
        )
    catalogue = first[:end]
    conversation_text(tokenizer, first, catalogue)
    return catalogue


def catalogue_metadata(tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a compacted catalogue records about itself (``metadata["catalogue"]``): the SHA-256 of `catalogue_text`,
    its token count and tool count, so that ``generate_calls(..., context=)`` can check it serves the same tools."""
    text = catalogue_text(tokenizer, tools)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": tokens, "tools": len(tools)}


def conversation_text(tokenizer: PreTrainedTokenizerBase, prompt: str, catalogue: str) -> str:
    """``prompt``'s text after the ``catalogue`` (`catalogue_text`).

    Raises:
        ValueError: ``prompt`` does not start with ``catalogue`` (e.g. a question with its own system message), or
            the catalogue's tokens followed by the conversation's are not the prompt's tokens.
    """
    if not prompt.startswith(catalogue):
        raise ValueError(
            "the prompt does not start with the tool catalogue's text (a question with its own system message?): "
            "answer it without context="
        )
    rest = prompt[len(catalogue) :]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (prompt, catalogue, rest)]
    if ids[0] != ids[1] + ids[2]:
        raise ValueError("the prompt's tokens are not the catalogue's tokens followed by the conversation's")
    return rest


def check_catalogue(
    tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]], context: CompactedCache
) -> str:
    """`catalogue_text` of ``tools`` after checking that ``context`` is its compacted cache: its length is the
    catalogue's token count and, when its metadata records the catalogue (`catalogue_metadata`), the same text.

    Raises:
        TypeError: ``context`` is not a `CompactedCache`.
        ValueError: ``context`` was compacted from another text.
    """
    if not isinstance(context, CompactedCache):
        raise TypeError(
            "context must be the CompactedCache of the tools' catalogue (hf-structkv compact --tools), got "
            f"{type(context).__name__}"
        )
    expected = catalogue_metadata(tokenizer, tools)
    recorded = context.metadata.get("catalogue")
    if context.original_length != expected["tokens"] or (
        isinstance(recorded, dict) and recorded.get("sha256") != expected["sha256"]
    ):
        raise ValueError(
            f"context holds a {context.original_length}-token context, not the catalogue of these {len(tools)} tools "
            f"({expected['tokens']} tokens, sha256 {expected['sha256'][:12]}): compact catalogue_text(tokenizer, "
            "tools) (hf-structkv compact --tools) and pass that cache"
        )
    return catalogue_text(tokenizer, tools)


def parse_calls(text: str) -> list[dict] | None:
    """The calls of a generated reply: the JSON list it holds, ``None`` when it is not one (cut, malformed)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return calls if isinstance(calls, list) else None


def generate_calls(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: str | Sequence[str],
    tools: Sequence[Mapping[str, Any]],
    policy: RetentionPolicy,
    max_new_tokens: int = 128,
    prefill_plan: torch.Tensor | None = None,
    prefill_policy: PrefillPolicy | None = None,
    engine: str = "auto",
    context: CompactedCache | None = None,
    int4_keys: str | None = None,
    **generate_kwargs,
) -> StructuredGeneration:
    """Answer each question with function calls to ``tools`` under their JSON schema, on a mixed-precision cache.

    The prompt is the tokenizer's chat template with ``tools=`` (a system instruction asks for the JSON list of
    calls); a batch of questions is left-padded. Greedy unless ``generate_kwargs`` say otherwise.

    Args:
        questions: one question or a list of them (batch); a question is the user's text or a list of chat
            messages (``{"role", "content"}``, e.g. BFCL's prompts that open with a system message).
        tools: BFCL- or OpenAI-style tool definitions (`function_call_schema`).
        policy: the `PolicyTable` for this model (e.g. ``illustrative_policy()`` for the embedded model, or
            ``PolicyTable.all_high(model.config)``), or any `RetentionPolicy`; the processor emits the policy's
            ``tag_view`` and ``position_bins``.
        prefill_plan: optional prompt actions for the cache (``[B, P, groups]``, the policy's layer groups).
        prefill_policy: alternatively, a `PrefillPolicy` from which the plan of the built prompts is made
            (`batch_prefill_plan`, with ``policy``'s sink tokens and window).
        engine: the grammar engine that masks (`StructuralLogitsProcessor`'s ``engine``): ``"auto"`` (xgrammar when
            installed), ``"xgrammar"`` or ``"lmfe"``; the tags are the same either way.
        context: optional `CompactedCache` of ``tools``' catalogue (`catalogue_text`, e.g. loaded with
            ``CompactedCache.from_pretrained(folder_or_repo, model=model)``): the prompts then hold only the text after
            the catalogue (placeholders stand for it, `generation_inputs`) and the cache serves the compacted
            catalogue before them, shared; ``sequences`` start with those placeholders, and a prefill plan covers
            the conversation tokens only.
        int4_keys: the cache's INT4 key layout (`StructuredMixedPrecisionCache`): ``"row"``, ``"centred"`` or
            ``"centred-g128"``; ``None``: ``policy``'s, which a ``prefill_policy`` must share (else ``ValueError``:
            pass it explicitly to serve a pair calibrated under different layouts).
        generate_kwargs: passed to ``model.generate`` (not ``logits_processor`` / ``past_key_values``: this call
            owns them).
    """
    check_retention_policy(policy)
    if int4_keys is None and prefill_policy is not None and prefill_policy.int4_keys != policy.int4_keys:
        raise ValueError(
            f"the decode policy stores INT4 keys {policy.int4_keys!r}, the prefill policy "
            f"{prefill_policy.int4_keys!r}: one cache has one layout; pass int4_keys (one of {INT4_KEY_LAYOUTS})"
        )
    int4_keys = check_int4_keys(policy.int4_keys if int4_keys is None else int4_keys)
    resolve_engine(engine)
    if isinstance(questions, str) or (
        isinstance(questions, Sequence) and questions and all(isinstance(m, Mapping) for m in questions)
    ):
        questions = [questions]  # one question: a text, or one chat (a list of messages)
    if not questions or isinstance(questions, Mapping):
        raise ValueError("questions must be a non-empty string or a non-empty list of questions")
    prompts = [call_prompt(tokenizer, question, tools) for question in questions]
    if context is not None:
        catalogue = check_catalogue(tokenizer, tools, context)
        prompts = [conversation_text(tokenizer, prompt, catalogue) for prompt in prompts]
    batch = left_padded_batch(tokenizer, prompts, model.device)
    if prefill_policy is not None:
        if prefill_plan is not None:
            raise ValueError("pass prefill_plan or prefill_policy, not both")
        prefill_plan = batch_prefill_plan(
            tokenizer, prompts, tools, prefill_policy, policy, batch["input_ids"], batch["attention_mask"]
        )
    processor = StructuralLogitsProcessor(
        tokenizer, tools=tools, tag_view=policy.tag_view, position_bins=policy.position_bins, engine=engine
    )
    if context is None:
        output = generate_structured(
            model,
            tokenizer,
            batch,
            processor,
            policy,
            max_new_tokens,
            prefill_plan=prefill_plan,
            int4_keys=int4_keys,
            **generate_kwargs,
        )
    else:
        prompt_length = context.get_seq_length() + batch["input_ids"].shape[1]  # placeholders + conversation
        cache = StructuredMixedPrecisionCache(
            model, policy, processor, prefill_plan, context=context, prompt_length=prompt_length, int4_keys=int4_keys
        )
        batch = generation_inputs(cache, batch["input_ids"], batch["attention_mask"])
        output = generate_structured(
            model, tokenizer, batch, processor, policy, max_new_tokens, cache=cache, **generate_kwargs
        )
    return StructuredGeneration(**vars(output), calls=[parse_calls(text) for text in output.texts])


def left_padded_batch(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], device) -> BatchEncoding:
    """``prompts`` tokenised (no special tokens added) and left-padded into one batch on ``device``."""
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    finally:
        tokenizer.padding_side = padding_side


def generate_structured(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: Mapping[str, torch.Tensor],
    processor: StructuralLogitsProcessor,
    policy,
    max_new_tokens: int,
    prefill_plan: torch.Tensor | None = None,
    cache: StructuredMixedPrecisionCache | None = None,
    int4_keys: str | None = None,
    **generate_kwargs,
) -> StructuredOutput:
    """One ``model.generate`` call under ``processor``'s grammar on a `StructuredMixedPrecisionCache` with
    ``policy`` (greedy unless ``generate_kwargs`` say otherwise); the core of `generate_calls` and ``generate_sql``.

    Args:
        batch: ``input_ids`` and ``attention_mask`` ``[B, P]``, left-padded (`left_padded_batch`).
        processor: a fresh `StructuralLogitsProcessor` (any grammar family; ``policy`` must be of the same family).
        prefill_plan: optional prompt actions for the cache (``[B, P, groups]``, the policy's layer groups).
        cache: a cache to continue instead of a new one: built with ``policy`` and ``processor`` and already holding
            a prefix of ``batch`` (``generate`` runs only the rest; the processor must have seen that prefix).
        int4_keys: the INT4 key layout of a new cache (`StructuredMixedPrecisionCache`; ``None``: ``policy``'s); a
            cache to continue keeps its own.
        generate_kwargs: passed to ``model.generate`` (not ``logits_processor`` / ``past_key_values`` / ``cache``).
    """
    for owned in ("logits_processor", "past_key_values", "cache"):
        if owned in generate_kwargs:
            raise ValueError(f"this call builds {owned} itself; call model.generate directly to pass your own")
    if cache is None:
        # declared so generate may prefill in chunks; attention-statistics policies read one prompt forward instead
        declared = None if policy.attention_statistics() is not None else batch["input_ids"].shape[1]
        cache = StructuredMixedPrecisionCache(
            model, policy, processor=processor, prefill_plan=prefill_plan, prompt_length=declared, int4_keys=int4_keys
        )
    elif prefill_plan is not None or cache.policy is not policy or cache.processor is not processor:
        raise ValueError("a cache to continue must be built with this policy and processor (and no prefill_plan)")
    generate_kwargs.setdefault("do_sample", False)
    sequences = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        logits_processor=LogitsProcessorList([processor]),
        cache=cache,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **generate_kwargs,
    )
    prompt_length = batch["input_ids"].shape[1]
    texts = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
    return StructuredOutput(
        sequences=sequences, texts=texts, cache=cache, processor=processor, prompt_length=prompt_length
    )
