"""Self-study calibration: seeded generation of the conversations and the queries of their answer tokens."""

import dataclasses
import json

import pytest
import torch

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.compaction import (
    QUERY_TIERS,
    SelfStudy,
    capture_queries,
    compact,
    prefill_context,
    repeat_pass_queries,
    self_study_conversations,
    self_study_queries,
)
from hf_structkv.compaction.self_study import (
    EXCERPT_INTRO,
    EXCERPT_OUTRO,
    SELF_STUDY_PROMPTS,
    SelfStudyTask,
    sample_answer,
)
from hf_structkv.generation import context_copy, generation_inputs
from hf_structkv.models import tiny_model

N_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 16


def token_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


class CharTokenizer:
    """One id per character (never the tiny models' eos id 1), with a vocabulary hash."""

    eos_token_id = None
    all_special_tokens = []

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": torch.tensor([[3 + ord(ch) % 250 for ch in text]])})()

    def get_vocab(self):
        return {chr(i): 3 + i % 250 for i in range(256)}


def encode(text: str) -> torch.Tensor:
    return CharTokenizer()(text).input_ids[0]


SMALL = SelfStudy(answer_tokens=5, question_tokens=7)


# ---------------------------------------------------------------------------------------------------- settings
def test_self_study_settings():
    assert QUERY_TIERS == ("repeat", "self_study")
    tasks = SelfStudy().tasks
    assert [t.name for t in tasks] == ["summary", "key_facts", "json", "questions"]
    assert [t.prompt for t in tasks] == [SELF_STUDY_PROMPTS[t.name] for t in tasks]
    assert [(t.max_new_tokens, t.temperature, t.top_p, t.top_k) for t in tasks] == [(48, 0.7, 0.8, 20)] * 3 + [
        (96, 0.6, 0.95, 20)
    ]
    paper = SelfStudy.paper(turn_suffix="<end>")
    assert [t.max_new_tokens for t in paper.tasks] == [2048, 2048, 2048, 12288] and paper.turn_suffix == "<end>"
    assert all(t.temperature == 0 for t in SelfStudy(greedy=True).tasks)
    assert SelfStudy().describe()["tasks"][3]["max_new_tokens"] == 96
    with pytest.raises(ValueError, match=r"SelfStudy.answer_tokens must be an integer >= 1 \(max new tokens\)"):
        SelfStudy(answer_tokens=0)
    with pytest.raises(TypeError, match="SelfStudy.greedy must be True or False"):
        SelfStudy(greedy="yes")
    with pytest.raises(TypeError, match="SelfStudy.turn_suffix must be a str, got int"):
        SelfStudy(turn_suffix=3)
    with pytest.raises(TypeError, match="SelfStudy.turn_prefix must be a str, got NoneType"):
        SelfStudy(turn_prefix=None)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        SelfStudyTask("t", "p", -1, 0.0, 1.0, 1)
    with pytest.raises(ValueError, match="need temperature >= 0, 0 < top_p <= 1 and top_k >= 1"):
        SelfStudyTask("t", "p", 4, 0.7, 0.0, 20)


def test_task_prompts_are_stored_described_and_validated():
    study = SelfStudy(answer_tokens=5, prompts=["Book a table?", "Weather in Oslo?"])
    assert study.prompts == ("Book a table?", "Weather in Oslo?") and hash(study) == hash(dataclasses.replace(study))
    assert study.tasks == SMALL.tasks[:3] + (dataclasses.replace(SMALL.tasks[3], max_new_tokens=96),)
    assert study.prompt_tasks == (
        SelfStudyTask("prompt_0", "Book a table?", 5, 0.7, 0.8, 20),
        SelfStudyTask("prompt_1", "Weather in Oslo?", 5, 0.7, 0.8, 20),
    )
    assert all(t.temperature == 0 for t in dataclasses.replace(study, greedy=True).prompt_tasks)
    described = study.describe()
    assert described["prompt_tasks"] == [dataclasses.asdict(t) for t in study.prompt_tasks]
    assert json.loads(json.dumps(described)) == described  # JSON's own types: a saved description compares equal
    assert "prompt_tasks" not in SelfStudy().describe()  # a study without prompts is described as before
    assert SelfStudy(prompts=[]).describe() == SelfStudy().describe()
    assert "turn_prefix" not in SelfStudy().describe()  # nor one without a turn prefix
    framed = SelfStudy(turn_prefix="<u>", turn_suffix="</u>").describe()
    assert framed == {"turn_prefix": "<u>", **SelfStudy(turn_suffix="</u>").describe()}
    for bad, error, message in [
        ("Book a table?", TypeError, "SelfStudy.prompts must be a sequence of str, got str"),
        (None, TypeError, "SelfStudy.prompts must be a sequence of str, got NoneType"),
        (["ok", 3], TypeError, r"SelfStudy.prompts\[1\] must be a str, got int"),
        (["ok", ""], ValueError, r"SelfStudy.prompts\[1\] is empty"),
    ]:
        with pytest.raises(error, match=message):
            SelfStudy(prompts=bad)


# ---------------------------------------------------------------------------------------------------- generation
def greedy(tokens: int) -> SelfStudyTask:
    return SelfStudyTask("t", "p", tokens, 0.0, 1.0, 20)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_answer_equals_transformers_generate(arch):
    model = tiny_model(arch)
    context, prompt = token_ids(20), torch.tensor([5, 6, 7])
    answer = sample_answer(model, prompt, prefill_context(model, context), greedy(12), torch.Generator())
    cache = prefill_context(model, context)
    inputs = generation_inputs(cache, prompt[None])
    with torch.no_grad():
        out = model.generate(
            **inputs, past_key_values=cache, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert answer.shape == (12,) and answer.dtype == torch.long
    assert torch.equal(answer, out[0, inputs["input_ids"].shape[1] :])


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny_model("llama")
    cache = prefill_context(model, token_ids(20))
    prompt = torch.tensor([5, 6, 7])
    task = SelfStudyTask("t", "p", 15, 1.0, 1.0, 200)

    def sample(task, seed):
        return sample_answer(model, prompt, context_copy(cache), task, torch.Generator().manual_seed(seed))

    assert torch.equal(sample(task, 0), sample(task, 0))
    assert not torch.equal(sample(task, 0), sample(task, 1))
    top1 = SelfStudyTask("t", "p", 15, 1.0, 1.0, 1)
    assert torch.equal(sample(top1, 0), sample(greedy(15), 3))


def test_answer_stops_at_the_end_of_sequence_token_and_leaves_it_out():
    model = tiny_model("llama")
    cache = prefill_context(model, token_ids(20))
    prompt = torch.tensor([5, 6, 7])
    free = sample_answer(model, prompt, context_copy(cache), greedy(10), torch.Generator())
    stop = int(free[3])
    stopped = sample_answer(model, prompt, context_copy(cache), greedy(10), torch.Generator(), stop_ids={stop})
    first = int((free == stop).nonzero()[0])
    assert torch.equal(stopped, free[:first])


def test_conversations_are_seeded_and_prompted_with_the_task_and_turn_suffix():
    model = tiny_model("qwen2")
    cache = prefill_context(model, token_ids(24))
    config = SelfStudy(answer_tokens=6, question_tokens=9, turn_suffix="|A:")
    first = self_study_conversations(model, CharTokenizer(), cache, config, seed=4)
    again = self_study_conversations(model, CharTokenizer(), cache, config, seed=4)
    other = self_study_conversations(model, CharTokenizer(), cache, config, seed=5)
    assert cache.get_seq_length() == 24  # generated on copies
    assert [c.name for c in first] == ["summary", "key_facts", "json", "questions"]
    for conversation, task in zip(first, config.tasks):
        assert torch.equal(conversation.prompt_ids, encode(task.prompt + "|A:"))
        assert 0 < conversation.answer_ids.numel() <= task.max_new_tokens
    assert all(torch.equal(a.answer_ids, b.answer_ids) for a, b in zip(first, again))
    assert any(not torch.equal(a.answer_ids, b.answer_ids) for a, b in zip(first, other))
    excerpt = token_ids(5, seed=9)
    quoted = self_study_conversations(model, CharTokenizer(), cache, config, seed=4, excerpt_ids=excerpt)
    expected = torch.cat(
        [encode(EXCERPT_INTRO), excerpt[0], encode(EXCERPT_OUTRO), encode(SELF_STUDY_PROMPTS["json"] + "|A:")]
    )
    assert torch.equal(quoted[2].prompt_ids, expected)
    # a turn prefix opens each prompt (a context that ends where a turn opens: the prompt needs its role header)
    framed = dataclasses.replace(config, turn_prefix="U>")
    turns = self_study_conversations(model, CharTokenizer(), cache, framed, seed=4)
    for conversation, task in zip(turns, framed.tasks):
        assert torch.equal(conversation.prompt_ids, encode("U>" + task.prompt + "|A:"))
        assert 0 < conversation.answer_ids.numel() <= task.max_new_tokens
    quoted = self_study_conversations(model, CharTokenizer(), cache, framed, seed=4, excerpt_ids=excerpt)
    expected = torch.cat(
        [encode("U>" + EXCERPT_INTRO), excerpt[0], encode(EXCERPT_OUTRO), encode(SELF_STUDY_PROMPTS["json"] + "|A:")]
    )
    assert torch.equal(quoted[2].prompt_ids, expected)
    with pytest.raises(ValueError, match="self-study calibration needs the tokenizer"):
        self_study_conversations(model, None, cache)


@pytest.mark.parametrize(
    ("framing", "hint"), [({}, "no chat turn around them"), ({"turn_suffix": "|A:"}, "whole user turn")]
)
def test_conversations_that_end_at_once_are_named_in_a_warning(monkeypatch, framing, hint):
    """The summary and JSON prompts answered by an end of sequence at once (as the embedded model answers prompts
    with no chat turn around them after a plain document): a warning names them and the framing to check."""
    from hf_structkv.compaction import self_study

    answer = self_study.sample_answer

    def ends_at_once_for_two(model, prompt, cache, task, generator, stops):
        return prompt[:0] if task.name in ("summary", "json") else answer(model, prompt, cache, task, generator, stops)

    monkeypatch.setattr(self_study, "sample_answer", ends_at_once_for_two)
    model = tiny_model("qwen2")
    cache = prefill_context(model, token_ids(12))
    config = SelfStudy(answer_tokens=3, question_tokens=4, **framing)
    with pytest.warns(RuntimeWarning, match=rf"2 of 4 conversations \(summary, json\) ended at once.*{hint}") as record:
        conversations = self_study_conversations(model, CharTokenizer(), cache, config)
    assert [w.filename for w in record] == [__file__]  # the caller's line, not the package's
    assert [c.answer_ids.numel() == 0 for c in conversations] == [True, False, True, False]


def test_task_prompts_add_conversations_whose_answer_is_the_prompt_then_the_reply():
    """A task prompt is a whole text (e.g. a question's chat turn): the turn prefix and suffix frame the four only."""
    model = tiny_model("qwen2")
    cache = prefill_context(model, token_ids(24))
    config = SelfStudy(
        answer_tokens=6, question_tokens=9, turn_suffix="|A:", turn_prefix="U>", prompts=["Q one?", "Where is it"]
    )
    got = self_study_conversations(model, CharTokenizer(), cache, config, seed=4)
    plain = self_study_conversations(model, CharTokenizer(), cache, dataclasses.replace(config, prompts=()), seed=4)
    assert [c.name for c in got] == ["summary", "key_facts", "json", "questions", "prompt_0", "prompt_1"]
    for a, b in zip(got[:4], plain):  # the four draw first: the prompts change nothing before them
        assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.answer_ids, b.answer_ids)
    for conversation, prompt in zip(got[4:], config.prompts):
        question = encode(prompt)
        assert conversation.prompt_ids.shape == (0,) and conversation.prompt_ids.dtype == torch.long
        assert torch.equal(conversation.answer_ids[: question.numel()], question)
        assert question.numel() < conversation.answer_ids.numel() <= question.numel() + 6
    again = self_study_conversations(model, CharTokenizer(), cache, config, seed=4)
    assert all(torch.equal(a.answer_ids, b.answer_ids) for a, b in zip(got, again))
    # greedy: the reply is the model's greedy continuation of context + prompt, whatever came before
    greedy_config = dataclasses.replace(config, greedy=True)
    last = self_study_conversations(model, CharTokenizer(), cache, greedy_config, seed=4)[-1]
    question = encode("Where is it")
    reply = sample_answer(model, question, context_copy(cache), greedy(6), torch.Generator())
    assert torch.equal(last.answer_ids, torch.cat([question, reply]))
    excerpt = token_ids(5, seed=9)
    quoted = self_study_conversations(model, CharTokenizer(), cache, config, seed=4, excerpt_ids=excerpt)
    assert quoted[4].prompt_ids.numel() == 0  # task prompts do not quote a chunk


# ---------------------------------------------------------------------------------------------------- queries
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_queries_are_the_repetition_then_the_generated_answer_tokens(arch):
    model, tokenizer = tiny_model(arch), CharTokenizer()
    context = token_ids(16)
    got = self_study_queries(model, tokenizer, context, config=SMALL, cap=None, seed=2)
    conversations = self_study_conversations(model, tokenizer, prefill_context(model, context), SMALL, seed=2)
    repeat = repeat_pass_queries(model, tokenizer, context, cap=None)
    answers = []
    for conversation in conversations:
        sequence = torch.cat([context[0], conversation.prompt_ids, conversation.answer_ids])[None]
        start = 16 + conversation.prompt_ids.numel()
        answers.append(capture_queries(model, sequence, positions=slice(start, None)))
    n_answer = sum(c.answer_ids.numel() for c in conversations)
    for layer, queries in got.items():
        assert queries.shape == (N_KV_HEADS, GROUP * (16 + n_answer), HEAD_DIM)
        expected = torch.cat([repeat[layer], *[a[layer] for a in answers]], dim=1)
        torch.testing.assert_close(queries, expected, atol=1e-5, rtol=1e-5)
    capped = self_study_queries(model, tokenizer, context, config=SMALL, cap=10, seed=2)
    assert all(q.shape == (N_KV_HEADS, 10, HEAD_DIM) for q in capped.values())


def test_queries_continue_a_partially_compacted_cache():
    """On-policy use: the context cache is a CompactedCache; the answers' queries are those it produces."""
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    context = token_ids(30)
    compacted = compact(model, None, context, ratio=3, method="streaming_llm")
    hf_structkv.enable(model)
    got = self_study_queries(model, tokenizer, context, context_cache=compacted, config=SMALL, cap=None)
    conversations = self_study_conversations(model, tokenizer, compacted, SMALL)
    last = conversations[-1]
    tail = capture_queries(
        model,
        torch.cat([last.prompt_ids, last.answer_ids])[None],
        positions=slice(last.prompt_ids.numel(), None),
        cache=compacted.copy(),
    )
    n = GROUP * last.answer_ids.numel()
    for layer in got:
        assert torch.equal(got[layer][:, -n:], tail[layer])
    assert compacted.get_seq_length() == 30


def test_task_prompt_tokens_are_calibration_queries_with_their_reply():
    """The queries of a task prompt's conversation start at the prompt's first token (brute force: one forward over
    context + prompt + reply, positions from the end of the context)."""
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    context = token_ids(16)
    config = dataclasses.replace(SMALL, prompts=["Call f(x)?", "Call g"])
    got = self_study_queries(model, tokenizer, context, config=config, cap=None, seed=2)
    without = self_study_queries(model, tokenizer, context, config=SMALL, cap=None, seed=2)
    conversations = self_study_conversations(model, tokenizer, prefill_context(model, context), config, seed=2)
    tasks = [
        capture_queries(model, torch.cat([context[0], c.answer_ids])[None], slice(16, None)) for c in conversations[4:]
    ]
    added = sum(c.answer_ids.numel() for c in conversations[4:])
    for layer, queries in got.items():
        assert queries.shape == (N_KV_HEADS, without[layer].shape[1] + GROUP * added, HEAD_DIM)
        expected = torch.cat([without[layer], *[t[layer] for t in tasks]], dim=1)
        torch.testing.assert_close(queries, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- compact
def test_compact_with_self_study_is_deterministic_under_a_seed_and_records_its_settings():
    model, tokenizer, context = tiny_model("gemma3"), CharTokenizer(), token_ids(40)
    first = compact(model, tokenizer, context, ratio=4, queries="self_study", self_study=SMALL, seed=3)
    again = compact(model, tokenizer, context, ratio=4, queries="self_study", self_study=SMALL, seed=3)
    repeat = compact(model, tokenizer, context, ratio=4, queries="repeat", seed=3)
    assert first.head_lengths() == [None, [10, 10], None, [10, 10]]
    for a, b, c in zip(first.layers[1::2], again.layers[1::2], repeat.layers[1::2]):
        assert all(torch.equal(x, y) for x, y in zip(a.context_tensors(), b.context_tensors()))
        assert not torch.equal(a.prefix_bias, c.prefix_bias)  # the generated answers changed the fit
    calibration = first.metadata["calibration"]
    assert calibration["queries"] == "self_study" and calibration["on_policy"] is True
    assert calibration["self_study"]["tasks"] == [dict(vars(t)) for t in SMALL.tasks]
    tokens = calibration["answer_tokens_per_chunk"]
    assert len(tokens) == 1 and tokens[0]["repetition"] == 40
    assert set(tokens[0]) == {"repetition", "summary", "key_facts", "json", "questions"}
    assert repeat.metadata["calibration"]["answer_tokens_per_chunk"] == [{"repetition": 40}]
    assert "self_study" not in repeat.metadata["calibration"]


def test_compact_with_task_prompts_records_them_and_keeps_them_through_a_save(tmp_path):
    model, tokenizer, context = tiny_model("gemma3"), CharTokenizer(), token_ids(40)
    study = dataclasses.replace(SMALL, prompts=["Which tool?", "Call it"])
    cache = compact(model, tokenizer, context, ratio=4, queries="self_study", self_study=study, seed=3)
    plain = compact(model, tokenizer, context, ratio=4, queries="self_study", self_study=SMALL, seed=3)
    assert not torch.equal(cache.layers[1].prefix_bias, plain.layers[1].prefix_bias)  # the prompts enter the fit
    calibration = cache.metadata["calibration"]
    assert calibration["self_study"]["prompt_tasks"] == [dataclasses.asdict(t) for t in study.prompt_tasks]
    tokens = calibration["answer_tokens_per_chunk"][0]
    assert [tokens[f"prompt_{i}"] > len(p) for i, p in enumerate(study.prompts)] == [True, True]
    cache.save_pretrained(tmp_path / "saved")
    loaded = CompactedCache.from_pretrained(tmp_path / "saved")
    assert loaded.metadata["calibration"] == calibration
    assert "Which tool?" in (tmp_path / "saved" / "README.md").read_text()


@pytest.mark.slow
def test_self_study_on_the_embedded_model(default_model):
    from hf_structkv.eval.squad import squad_document
    from hf_structkv.prompts import document_chat_prompt

    model, tokenizer = default_model
    context_text, suffix = document_chat_prompt(tokenizer, squad_document("Normans", 1).text)
    config = SelfStudy(answer_tokens=6, question_tokens=8, turn_suffix=suffix)
    ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids
    conversations = self_study_conversations(model, tokenizer, prefill_context(model, ids), config, seed=0)
    texts = [tokenizer.decode(c.answer_ids) for c in conversations]
    assert all(0 < c.answer_ids.numel() <= 8 for c in conversations), texts
    assert all(text.strip() for text in texts), texts
    cache = compact(model, tokenizer, ids, ratio=8, queries="self_study", self_study=config, on_policy=False)
    assert cache.metadata["calibration"]["answer_tokens_per_chunk"][0]["repetition"] == ids.shape[1]
    assert 0 <= cache.metadata["quality"]["heldout_relative_loss_mean"] < 1
