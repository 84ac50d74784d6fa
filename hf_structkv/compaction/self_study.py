"""Self-study calibration: the model writes conversations about the context; their answer tokens give the queries.

The KV-Surgeon seed (appendix "Calibration queries") generates five conversations per context: a verbatim
repetition (teacher-forced: the answer is the context itself), a summary, an aggregation of key facts, a JSON
structuring of the content, and three self-written questions with their answers. `self_study_conversations` generates
the last four (seeded sampling, or greedy) after a cache holding the context; `self_study_queries` returns the queries
of every answer token, the repetition's included. The conversations are generated once, from the full cache; on-policy
calibration re-runs the same token sequences through a partially compacted cache (`conversation_queries`).

Each of the four prompts is framed by ``SelfStudy.turn_prefix`` and ``turn_suffix``: after a document inside a chat
template's user turn only the end of the turn and the assistant header follow it (``turn_suffix``); after a context
that ends where a turn opens (a tool catalogue ends with the template's turn-start token, `catalogue_text`) the
prompt needs its own role header too (``turn_prefix``), else the model reads a turn without a role and may stop at
once (on the embedded model: 0 generated tokens). A conversation that ends at once gives no queries: a warning names
it and the framing to check.

Task prompts (``SelfStudy(prompts=...)``): whole texts of the task the context serves (e.g. the chat turn of a
question that needs a tool catalogue) add one conversation each, whose prompt part is empty and whose answer part is
the prompt's tokens followed by the model's sampled answer: the prompt's tokens, which read the context as the task's
questions will, are calibration queries too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..generation import context_copy
from ..user_warnings import warn_user
from ..validation import check_bool, check_int
from .context_prefill import prefill_context
from .queries import (
    DEFAULT_CAP,
    DEFAULT_INSTRUCTION,
    Conversation,
    cap_queries,
    conversation_queries,
    repetition_conversation,
)

__all__ = ["SELF_STUDY_PROMPTS", "SelfStudy", "SelfStudyTask", "sample_answer", "self_study_conversations"]

SELF_STUDY_PROMPTS = {
    "summary": "Summarize the text above.",
    "key_facts": "List the key facts stated in the text above.",
    "json": "Structure the content of the text above as JSON.",
    "questions": "Write three questions about the text above, then answer each of them.",
}
EXCERPT_INTRO = "The following is an excerpt of the text above:\n\n"
EXCERPT_OUTRO = "\n\nAbout this excerpt: "


@dataclass(frozen=True)
class SelfStudyTask:
    """One generated conversation: its prompt and how its answer is sampled (``temperature=0``: greedy)."""

    name: str
    prompt: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, 0)
        if not self.temperature >= 0 or not 0 < self.top_p <= 1 or not self.top_k >= 1:
            raise ValueError(
                f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 1, got {self.temperature!r}, {self.top_p!r}, "
                f"{self.top_k!r}"
            )


@dataclass(frozen=True)
class SelfStudy:
    """Settings of the self-study conversations.

    The defaults are CPU-sized (a few dozen tokens per answer); `SelfStudy.paper` gives the seed's lengths.

    Attributes:
        answer_tokens: at most this many tokens for the summary, key-facts and JSON answers (the seed: 2048), sampled
            at temperature 0.7, top-p 0.8, top-k 20.
        question_tokens: at most this many tokens for the questions-and-answers conversation (the seed: 8192 to
            write the questions and 4096 to answer them, with thinking; here one turn), temperature 0.6, top-p 0.95,
            top-k 20.
        greedy: decode every answer greedily instead of sampling.
        turn_suffix: text after each of the four prompts, e.g. the end of the user turn and the assistant header of
            a chat template (the ``question_suffix`` of `hf_structkv.prompts.document_chat_prompt`); empty by default.
        prompts: task prompts (whole texts, e.g. the chat turns of the questions a tool catalogue will be asked), one
            more conversation each after the four (`prompt_tasks`): its answer is the prompt's text as it is (no
            ``turn_prefix`` / ``turn_suffix``) followed by at most ``answer_tokens`` sampled tokens (temperature 0.7,
            top-p 0.8, top-k 20, or greedy). Stored as a tuple; empty by default.
        turn_prefix: text before each of the four prompts (before the excerpt part of a chunk's prompt), e.g. the
            user role header of a chat template when the context ends at a turn's opening token; empty by default.
    """

    answer_tokens: int = 48
    question_tokens: int = 96
    greedy: bool = False
    turn_suffix: str = ""
    prompts: Sequence[str] = ()
    turn_prefix: str = ""

    def __post_init__(self):
        for name in ("answer_tokens", "question_tokens"):
            check_int(f"SelfStudy.{name}", getattr(self, name), 1, counts="max new tokens")
        check_bool("SelfStudy.greedy", self.greedy)
        for name in ("turn_prefix", "turn_suffix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"SelfStudy.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if isinstance(self.prompts, str) or not isinstance(self.prompts, Sequence):
            raise TypeError(f"SelfStudy.prompts must be a sequence of str, got {type(self.prompts).__name__}")
        for index, prompt in enumerate(self.prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"SelfStudy.prompts[{index}] must be a str, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError(f"SelfStudy.prompts[{index}] is empty: a task prompt needs text")
        object.__setattr__(self, "prompts", tuple(self.prompts))

    @classmethod
    def paper(cls, turn_suffix: str = "") -> SelfStudy:
        """The seed's lengths: 2048 tokens per answer, 8192 + 4096 for the questions conversation."""
        return cls(answer_tokens=2048, question_tokens=8192 + 4096, turn_suffix=turn_suffix)

    def _task(self, name: str, prompt: str, tokens: int, temperature: float, top_p: float) -> SelfStudyTask:
        return SelfStudyTask(name, prompt, tokens, 0.0 if self.greedy else temperature, top_p, 20)

    @property
    def tasks(self) -> tuple[SelfStudyTask, ...]:
        """The four generated conversations, in order: summary, key facts, JSON, questions."""
        return (
            self._task("summary", SELF_STUDY_PROMPTS["summary"], self.answer_tokens, 0.7, 0.8),
            self._task("key_facts", SELF_STUDY_PROMPTS["key_facts"], self.answer_tokens, 0.7, 0.8),
            self._task("json", SELF_STUDY_PROMPTS["json"], self.answer_tokens, 0.7, 0.8),
            self._task("questions", SELF_STUDY_PROMPTS["questions"], self.question_tokens, 0.6, 0.95),
        )

    @property
    def prompt_tasks(self) -> tuple[SelfStudyTask, ...]:
        """One conversation per task prompt, after `tasks`: ``prompt_0``, ``prompt_1``, ... (each prompt's text is
        the start of its conversation's answer, see `self_study_conversations`)."""
        return tuple(
            self._task(f"prompt_{index}", prompt, self.answer_tokens, 0.7, 0.8)
            for index, prompt in enumerate(self.prompts)
        )

    def describe(self) -> dict:
        """JSON-serialisable record of every setting (for a cache's metadata), made of JSON's own types (lists, not
        tuples), so that it equals itself after a JSON round trip; ``prompt_tasks`` (the task prompts' texts and
        sampling) only when there are prompts and ``turn_prefix`` only when it is not empty, so a study without them
        is described as before they existed."""
        description = {
            **({"turn_prefix": self.turn_prefix} if self.turn_prefix else {}),
            "turn_suffix": self.turn_suffix,
            "excerpt_intro": EXCERPT_INTRO,
            "excerpt_outro": EXCERPT_OUTRO,
            "tasks": [asdict(task) for task in self.tasks],
        }
        if self.prompts:
            description["prompt_tasks"] = [asdict(task) for task in self.prompt_tasks]
        return description


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """End-of-sequence ids of the model's generation config and of the tokenizer."""
    stops = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            stops.add(source)
        elif source is not None:
            stops.update(int(i) for i in source)
    return stops


def _warpers(task: SelfStudyTask) -> LogitsProcessorList:
    return LogitsProcessorList(
        [TemperatureLogitsWarper(task.temperature), TopKLogitsWarper(task.top_k), TopPLogitsWarper(task.top_p)]
    )


def sample_answer(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    cache,
    task: SelfStudyTask,
    generator: torch.Generator,
    stop_ids: set[int] = frozenset(),
) -> torch.Tensor:
    """Decode at most ``task.max_new_tokens`` tokens after ``prompt_ids [P]``, continuing ``cache`` in place.

    Greedy when ``task.temperature == 0``; otherwise transformers' temperature, top-k and top-p warpers and a draw
    from ``generator`` (on the model's device). Stops after a token of ``stop_ids``, which is not returned.

    Returns:
        The answer ids ``[A]``, ``A <= max_new_tokens``, on the model's device.
    """
    warpers = None if task.temperature == 0 else _warpers(task)
    sequence = prompt_ids.reshape(1, -1).to(model.device)
    inputs, generated = sequence, 0
    with torch.no_grad():
        while generated < task.max_new_tokens:
            logits = model(inputs, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
            if warpers is None:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = torch.softmax(warpers(sequence, logits), dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)
            if int(token) in stop_ids:
                break
            sequence, inputs, generated = torch.cat([sequence, token], dim=1), token, generated + 1
    return sequence[0, prompt_ids.numel() :]


def self_study_conversations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_cache,
    config: SelfStudy | None = None,
    seed: int = 0,
    excerpt_ids: torch.Tensor | None = None,
) -> list[Conversation]:
    """Generate the summary, key-facts, JSON and questions conversations, then one per task prompt of
    ``config.prompts``, after the context held by ``context_cache``.

    Args:
        context_cache: a cache holding the context and nothing after it; each conversation continues a
            `context_copy` (the cache is left as it is).
        config: lengths, sampling, the turn prefix and suffix and the task prompts (default ``SelfStudy()``).
        seed: seeds one ``torch.Generator`` drawn from by the four conversations in order.
        excerpt_ids: ``[1, E]`` or ``[E]``, one chunk of a context compacted chunk by chunk: each prompt of
            ``config.tasks`` then quotes it (``EXCERPT_INTRO + excerpt + EXCERPT_OUTRO + task``), so the conversations
            are about that chunk; the task prompts' conversations do not (they are about the whole context).

    Returns:
        One `Conversation` per task of ``config.tasks``: prompt ``[P]``, the ids of ``turn_prefix + task prompt +
        turn_suffix`` (with an excerpt: of ``turn_prefix + EXCERPT_INTRO``, the excerpt's ids, then of
        ``EXCERPT_OUTRO`` and of ``task prompt + turn_suffix``), answer the generated ids without the end-of-sequence
        token; then one per task of ``config.prompt_tasks``: prompt ``[0]`` (empty), answer ``[Q + A]``, the ``Q``
        ids of the task prompt followed by the ``A`` generated ids. The four draw from the generator first, so they
        do not depend on the task prompts.
    """
    if tokenizer is None:
        raise ValueError("self-study calibration needs the tokenizer (its prompts are text); pass tokenizer=")

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.reshape(-1)

    config = SelfStudy() if config is None else config
    quote, head = [], config.turn_prefix  # the turn prefix opens the first text piece of each prompt
    if excerpt_ids is not None:
        quote, head = [ids(head + EXCERPT_INTRO), excerpt_ids.reshape(-1).cpu(), ids(EXCERPT_OUTRO)], ""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    stops = _stop_ids(model, tokenizer)
    conversations = []
    for task in config.tasks:
        prompt = torch.cat([*quote, ids(head + task.prompt + config.turn_suffix)])
        answer = sample_answer(model, prompt, context_copy(context_cache), task, generator, stops)
        conversations.append(Conversation(task.name, prompt, answer.cpu()))
    empty = [c.name for c in conversations if c.answer_ids.numel() == 0]
    if empty:
        framing = (
            "its prompts follow the context with no chat turn around them: frame them, e.g. "
            "SelfStudy(turn_suffix=question_suffix) after a context from document_chat_prompt, or turn_prefix after a "
            "context that ends where a turn opens"
            if not (config.turn_prefix or config.turn_suffix)
            else "check that turn_prefix / turn_suffix make each prompt a whole user turn followed by the assistant's"
        )
        warn_user(
            f"self-study: {len(empty)} of {len(conversations)} conversations ({', '.join(empty)}) ended at once and "
            f"give no calibration queries; {framing}",
            RuntimeWarning,
        )
    for task in config.prompt_tasks:
        question = ids(task.prompt)
        answer = sample_answer(model, question, context_copy(context_cache), task, generator, stops)
        conversations.append(Conversation(task.name, question[:0], torch.cat([question, answer.cpu()])))
    return conversations


def self_study_queries(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_ids: torch.Tensor,
    context_cache=None,
    config: SelfStudy | None = None,
    cap: int | None = DEFAULT_CAP,
    seed: int = 0,
    instruction: str = DEFAULT_INSTRUCTION,
) -> dict[int, torch.Tensor]:
    """Self-study calibration queries: the repetition's (as `repeat_pass_queries`) then the generated answers'.

    Args:
        context_ids: ``[1, T]``.
        context_cache: a cache holding the context; ``None`` prefills one. Generation and capture continue copies.
        config, seed: see `self_study_conversations`; ``seed`` also draws the ``cap`` subsample.
        cap: at most this many queries per KV head (`cap_queries`); ``None`` keeps them all.

    Returns:
        ``{layer_idx: [H_kv, min(g * A, cap), D]}`` for each global layer, ``A = T + `` the answer tokens of the
        generated conversations (a task prompt's tokens included).
    """
    if context_cache is None:
        context_cache = prefill_context(model, context_ids)
    conversations = [repetition_conversation(tokenizer, context_ids, instruction)]
    conversations += self_study_conversations(model, tokenizer, context_cache, config, seed)
    return cap_queries(conversation_queries(model, context_ids, conversations, context_cache), cap, seed)
