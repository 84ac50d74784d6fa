"""A compacted tool catalogue served before PASK-managed calls (issue 33, part 1): `catalogue_text` splits the chat
template's rendering token-exactly, ``generate_calls(..., context=)`` answers as the full prompt does, mismatches are
refused before any forward."""

import json
import re

import pytest
import torch
from test_compacted_serving import keep_all, prefill
from test_structured_generation import QUESTIONS, TOOLS

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.policy import PolicyTable
from hf_structkv.structured_generation import (
    _common_prefix_length,
    call_prompt,
    catalogue_metadata,
    catalogue_text,
    conversation_text,
    generate_calls,
)

MORE_TOOLS = [
    *TOOLS,
    {
        "name": "book_table",
        "description": "Book a restaurant table",
        "parameters": {
            "type": "dict",
            "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}},
            "required": ["restaurant", "people"],
        },
    },
]


@pytest.fixture(scope="module")
def model(tokenizer):
    return hf_structkv.enable(tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))


def compacted_catalogue(model, tokenizer, tools) -> CompactedCache:
    """Every entry of the catalogue kept (bias 0), with the catalogue recorded as `compact --tools` records it."""
    ids = tokenizer(catalogue_text(tokenizer, tools), return_tensors="pt", add_special_tokens=False).input_ids
    metadata = {"fingerprint": model_fingerprint(model, tokenizer), "catalogue": catalogue_metadata(tokenizer, tools)}
    return CompactedCache.from_selection(prefill(model, ids), keep_all(prefill(model, ids)), metadata=metadata)


@pytest.mark.parametrize("tools", [TOOLS, MORE_TOOLS], ids=["one_tool", "two_tools"])
def test_catalogue_then_conversation_tokens_are_the_full_prompt_tokens(tokenizer, tools):
    catalogue = catalogue_text(tokenizer, tools)
    assert all(tool["name"] in catalogue for tool in tools) and "user" not in catalogue.split("<|im_start|>")[-1]
    for question in [*QUESTIONS, [{"role": "user", "content": "Book for 4 at Noma."}]]:
        full = call_prompt(tokenizer, question, tools)
        conversation = conversation_text(tokenizer, full, catalogue)
        assert catalogue + conversation == full
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (catalogue, conversation, full)]
        assert ids[0] + ids[1] == ids[2]
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    with pytest.raises(ValueError, match="does not start with the tool catalogue"):
        conversation_text(tokenizer, call_prompt(tokenizer, own_system, tools), catalogue)


def test_generate_calls_on_a_compacted_catalogue_answers_as_the_full_prompt(model, tokenizer):
    policy = PolicyTable.all_high(model.config, window=2)
    full = generate_calls(model, tokenizer, QUESTIONS, TOOLS, policy, max_new_tokens=16)
    context = compacted_catalogue(model, tokenizer, TOOLS)
    composed = generate_calls(model, tokenizer, QUESTIONS, TOOLS, policy, max_new_tokens=16, context=context)
    assert composed.texts == full.texts and composed.calls == full.calls
    generated = [result.sequences[:, result.prompt_length :] for result in (full, composed)]
    assert torch.equal(generated[0], generated[1])
    # the prompt fed to generate excludes the catalogue: placeholders stand for its tokens
    assert composed.prompt_length == full.prompt_length
    assert composed.cache.get_seq_length() == full.cache.get_seq_length()
    assert composed.bytes_report()["budget_ratio"] == 1.0
    layer = composed.cache.mixed_layers()[0]
    assert layer.context is context.layers[0] and layer.context_length == context.original_length
    chunked = generate_calls(
        model, tokenizer, QUESTIONS, TOOLS, policy, max_new_tokens=16, context=context, prefill_chunk_size=4
    )
    assert torch.equal(chunked.sequences, composed.sequences)


def test_a_context_of_other_tools_or_text_is_refused_before_generating(model, tokenizer):
    policy = PolicyTable.all_high(model.config)
    other = compacted_catalogue(model, tokenizer, MORE_TOOLS)
    with pytest.raises(ValueError, match="not the catalogue of these 1 tools"):
        generate_calls(model, tokenizer, QUESTIONS, TOOLS, policy, context=other)
    with pytest.raises(TypeError, match="context must be the CompactedCache"):
        generate_calls(model, tokenizer, QUESTIONS, TOOLS, policy, context="catalogue")
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    with pytest.raises(ValueError, match="own system message"):
        generate_calls(
            model, tokenizer, own_system, TOOLS, policy, context=compacted_catalogue(model, tokenizer, TOOLS)
        )


@pytest.fixture
def cli_model(monkeypatch, model, tokenizer):
    """``hf-structkv`` loading the tiny Qwen2 over the embedded tokenizer whatever --model says."""
    from hf_structkv import cli

    monkeypatch.setattr(cli, "load_model", lambda name, dtype: (model, tokenizer))


def test_cli_compacts_a_catalogue_and_generates_calls_after_it(tmp_path, cli_model, tokenizer, capsys):
    from hf_structkv.cli import main

    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(MORE_TOOLS))
    folder = tmp_path / "catalogue"
    argv = ["compact", "--tools", str(tools_file), "--method", "random", "--ratio", "2", "--out", str(folder)]
    argv += ["--storage", "bf16"]
    assert main(argv) == 0
    saved = CompactedCache.from_pretrained(folder)
    assert saved.metadata["catalogue"] == catalogue_metadata(tokenizer, MORE_TOOLS)
    capsys.readouterr()
    calls = ["generate-calls", "--tools", str(tools_file), "--policy", "all-high", "--max-new-tokens", "8"]
    assert main([*calls, "--prompt", "Book for 4 at Noma.", "--catalogue", str(folder)]) == 0
    out = capsys.readouterr().out
    catalogue_bytes = int(re.search(r"\(([\d,]+) of them the compacted catalogue\)", out).group(1).replace(",", ""))
    assert catalogue_bytes == saved.nbytes() > 0 and "Q: 'Book for 4 at Noma.'" in out
    assert main([*calls, "--prompt", "Book for 4 at Noma."]) == 0
    assert "(0 of them the compacted catalogue)" in capsys.readouterr().out
    assert main([*calls, "--prompt", "Book for 4 at Noma.", "--int4-keys", "centred"]) == 0
    assert "Q: 'Book for 4 at Noma.'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate-calls", "--tools", "missing.json", "--prompt", "x"], r"--tools 'missing.json' is not a file"),
        (["generate-calls", "--tools", "{tools}", "--prompt", " "], r"argument --prompt: must hold a question"),
        (["generate-calls", "--tools", "{tools}", "--prompt", "x", "--policy", "best"], r"argument --policy: takes"),
        (["generate-calls", "--tools", "{bad}", "--prompt", "x"], r"--tools '.*bad.json': tools must contain"),
        (["generate-calls", "--tools", "{tools}", "--prompt", "x", "--catalogue", "/no/such/dir"], r"--catalogue"),
        (["generate-calls", "--tools", "{tools}", "--prompt", "x", "--int4-keys", "channel"], r"--int4-keys: invalid"),
        (["compact", "--tools", "{tools}", "--keep-template", "--out", "{out}"], r"--keep-template applies"),
        (["compact", "--tools", "{tools}", "--context-file", "a.txt", "--out", "x"], r"not allowed with"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line_before_loading_the_model(tmp_path, monkeypatch, capsys, argv, message):
    from hf_structkv import cli

    monkeypatch.setattr(cli, "load_model", lambda name, dtype: pytest.fail("the model was loaded"))
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "bad.json").write_text("[]")
    paths = {"tools": tmp_path / "tools.json", "bad": tmp_path / "bad.json", "out": tmp_path / "out"}
    argv = [arg.format(**paths) for arg in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert re.search(message, lines[-1]) and (len(lines) == 1 or lines[0].startswith("usage")), err


def test_a_prefill_policy_plans_the_conversation_after_the_catalogue(model, tokenizer):
    """``prefill_policy`` with a context plans the conversation tokens only (their labels, at slots after the
    catalogue); an all-high prefill policy on a keep-all catalogue answers what the full prompt answers."""
    from test_mixed_precision_cache import mixed_policy
    from test_prefill_plan import tiny_prefill_policy

    from hf_structkv.policy import Action, GroupCosts, PrefillPolicy
    from hf_structkv.policy.prefill import plan_prefill
    from hf_structkv.structure.prompt_spans import label_prompt, token_labels

    context = compacted_catalogue(model, tokenizer, TOOLS)
    policy = PolicyTable.all_high(model.config, window=2)
    keep_high = PrefillPolicy(GroupCosts.from_config(model.config), {}, budget=1.0, provenance="illustrative")
    full = generate_calls(model, tokenizer, QUESTIONS, TOOLS, policy, max_new_tokens=16, prefill_policy=keep_high)
    composed = generate_calls(
        model, tokenizer, QUESTIONS, TOOLS, policy, max_new_tokens=16, prefill_policy=keep_high, context=context
    )
    assert composed.texts == full.texts and composed.calls == full.calls
    assert torch.equal(composed.sequences[:, composed.prompt_length :], full.sequences[:, full.prompt_length :])

    decode_policy, prefill_policy = mixed_policy(model, window=3, sink=2), tiny_prefill_policy(model)
    mixed = generate_calls(
        model,
        tokenizer,
        QUESTIONS,
        TOOLS,
        decode_policy,
        max_new_tokens=8,
        prefill_policy=prefill_policy,
        context=context,
    )
    start, width = context.original_length, mixed.prompt_length - context.original_length
    schedule = mixed.cache.schedule
    for row, question in enumerate(QUESTIONS):
        conversation = conversation_text(
            tokenizer, call_prompt(tokenizer, question, TOOLS), catalogue_text(tokenizer, TOOLS)
        )
        labels = token_labels(tokenizer, conversation, label_prompt(conversation, TOOLS))
        want = torch.full((width, 3), int(Action.R))  # left padding released, the conversation's own plan after it
        want[width - len(labels) :] = plan_prefill(labels, decode_policy.costs, prefill_policy, 2, 3).actions
        assert {Action.R, Action.L} & set(want[width - len(labels) :].flatten().tolist())  # precision really drops
        scheduled = torch.stack([schedule.actions(start, width, group)[row] for group in range(3)], dim=-1)
        assert torch.equal(scheduled, want)
        for layer in mixed.cache.mixed_layers():  # the conversation's tokens are stored as planned, after the catalogue
            _, positions = layer.high.view() if layer.high.num_entries() else (None, torch.empty(2, 0))
            stored = sorted(p - start for p in positions[row].tolist() if start <= p < start + width)
            assert stored == (want[:, layer.group] == Action.H).nonzero().flatten().tolist()


# ---------------------------------------------------------------------------------------------------- self-study
def test_the_catalogue_turn_frames_a_text_as_the_user_turn_after_the_catalogue(tokenizer):
    from hf_structkv.compaction.catalogue import catalogue_turn
    from hf_structkv.compaction.self_study import SELF_STUDY_PROMPTS

    before, after = catalogue_turn(tokenizer, MORE_TOOLS)
    catalogue = catalogue_text(tokenizer, MORE_TOOLS)
    assert catalogue.endswith("<|im_start|>")  # the catalogue ends where the conversation's turn opens
    assert (before, after) == ("user\n", "<|im_end|>\n<|im_start|>assistant\n")  # this template's user turn
    for text in [*SELF_STUDY_PROMPTS.values(), *QUESTIONS]:
        full = call_prompt(tokenizer, text, MORE_TOOLS)
        assert before + text + after == conversation_text(tokenizer, full, catalogue)


def test_self_study_after_a_catalogue_prompts_with_chat_turns_and_generates(model, tokenizer):
    """Each of the four conversations' prompt is, token for token, the user turn `generate_calls` would feed after
    the catalogue with that prompt as the question; the tiny random model then answers (no end of sequence early)."""
    from hf_structkv.compaction import SelfStudy, prefill_context, self_study_conversations
    from hf_structkv.compaction.catalogue import catalogue_self_study

    study = catalogue_self_study(tokenizer, MORE_TOOLS, config=SelfStudy(answer_tokens=5, question_tokens=6))
    assert study.prompts == () and (study.answer_tokens, study.question_tokens) == (5, 6)
    catalogue = catalogue_text(tokenizer, MORE_TOOLS)
    ids = tokenizer(catalogue, return_tensors="pt", add_special_tokens=False).input_ids
    conversations = self_study_conversations(model, tokenizer, prefill_context(model, ids), study, seed=0)
    assert [c.name for c in conversations] == ["summary", "key_facts", "json", "questions"]
    for conversation, task in zip(conversations, study.tasks):
        turn = conversation_text(tokenizer, call_prompt(tokenizer, task.prompt, MORE_TOOLS), catalogue)
        assert conversation.prompt_ids.tolist() == tokenizer(turn, add_special_tokens=False)["input_ids"]
        assert 0 < conversation.answer_ids.numel() <= task.max_new_tokens


def test_a_catalogue_study_holds_the_turn_and_each_questions_turn_after_the_catalogue(tokenizer):
    from hf_structkv.compaction import SelfStudy
    from hf_structkv.compaction.catalogue import catalogue_self_study, catalogue_turn

    chat = [{"role": "user", "content": "Book for 4 at Noma."}]
    config = SelfStudy(answer_tokens=7, greedy=True)
    study = catalogue_self_study(tokenizer, MORE_TOOLS, [*QUESTIONS, chat], config)
    catalogue = catalogue_text(tokenizer, MORE_TOOLS)
    assert study.answer_tokens == 7 and study.greedy and len(study.prompts) == 3
    assert (study.turn_prefix, study.turn_suffix) == catalogue_turn(tokenizer, MORE_TOOLS)
    for prompt, question in zip(study.prompts, [*QUESTIONS, chat]):
        full = call_prompt(tokenizer, question, MORE_TOOLS)
        assert catalogue + prompt == full  # the turn generate_calls feeds after the catalogue, token for token
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (catalogue, prompt, full)]
        assert ids[0] + ids[1] == ids[2]
    assert study.prompts[1].count("Lima") == 1 and study.prompts[1].rstrip().endswith("assistant")
    prefix, suffix = catalogue_turn(tokenizer, TOOLS)
    assert catalogue_self_study(tokenizer, TOOLS, QUESTIONS[:1]) == SelfStudy(
        turn_prefix=prefix,
        turn_suffix=suffix,
        prompts=[
            conversation_text(tokenizer, call_prompt(tokenizer, QUESTIONS[0], TOOLS), catalogue_text(tokenizer, TOOLS))
        ],
    )
    assert catalogue_self_study(tokenizer, TOOLS) == SelfStudy(turn_prefix=prefix, turn_suffix=suffix)
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    for bad, error, message in [
        ("Weather in Oslo?", TypeError, "questions must be a list of questions, got str"),
        ([], ValueError, "questions must hold at least one question"),
        ([QUESTIONS[0], own_system], ValueError, r"questions\[1\]: the prompt does not start with the tool catalogue"),
        ([QUESTIONS[0], ""], ValueError, r"questions\[1\]: each question must be a non-empty string"),
    ]:
        with pytest.raises(error, match=message):
            catalogue_self_study(tokenizer, TOOLS, bad)
    with pytest.raises(TypeError, match="config must be a SelfStudy or None, got dict"):
        catalogue_self_study(tokenizer, TOOLS, QUESTIONS, {"answer_tokens": 4})
    for framed in (SelfStudy(turn_suffix="</u>"), SelfStudy(turn_prefix="u:"), SelfStudy(prompts=["Q?"])):
        with pytest.raises(ValueError, match="pass a SelfStudy without turn_prefix, turn_suffix or prompts"):
            catalogue_self_study(tokenizer, TOOLS, QUESTIONS, framed)


def test_compact_catalogue_with_questions_calibrates_on_them_and_serves(model, tokenizer):
    from hf_structkv.compaction import SelfStudy
    from hf_structkv.compaction.catalogue import catalogue_self_study, compact_catalogue

    study = SelfStudy(answer_tokens=4, question_tokens=4)
    kwargs = {"ratio": 2, "self_study": study, "on_policy": False, "progress": False, "seed": 1}
    cache = compact_catalogue(model, tokenizer, MORE_TOOLS, questions=QUESTIONS, **kwargs)
    generic = compact_catalogue(model, tokenizer, MORE_TOOLS, queries="self_study", **kwargs)
    repeat = compact_catalogue(model, tokenizer, MORE_TOOLS, ratio=2, on_policy=False, progress=False, seed=1)
    calibration = cache.metadata["calibration"]
    framed = catalogue_self_study(tokenizer, MORE_TOOLS, QUESTIONS, study)
    assert calibration["queries"] == "self_study" and repeat.metadata["calibration"]["queries"] == "repeat"
    assert [task["prompt"] for task in calibration["self_study"]["prompt_tasks"]] == list(framed.prompts)
    for made in (cache, generic):  # the four prompts are user turns after the catalogue, and answered
        described = made.metadata["calibration"]["self_study"]
        assert (described["turn_prefix"], described["turn_suffix"]) == (framed.turn_prefix, framed.turn_suffix)
        tokens = made.metadata["calibration"]["answer_tokens_per_chunk"][0]
        assert all(0 < tokens[name] <= 4 for name in ("summary", "key_facts", "json", "questions"))
    assert "prompt_tasks" not in generic.metadata["calibration"]["self_study"]
    tokens = calibration["answer_tokens_per_chunk"][0]
    for index, prompt in enumerate(framed.prompts):
        question = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert question <= tokens[f"prompt_{index}"] <= question + 4  # the question's tokens count, then the reply
    assert cache.metadata["catalogue"] == catalogue_metadata(tokenizer, MORE_TOOLS)
    assert cache.head_lengths() == repeat.head_lengths() == generic.head_lengths()
    for other in (generic, repeat):  # the questions' queries change what is kept
        pairs = zip(cache.layers, other.layers)
        assert any(not torch.equal(x, y) for a, b in pairs for x, y in zip(a.context_tensors(), b.context_tensors()))
    policy = PolicyTable.all_high(model.config, window=2)
    served = generate_calls(model, tokenizer, QUESTIONS, MORE_TOOLS, policy, max_new_tokens=8, context=cache)
    assert served.prompt_length > cache.original_length and len(served.calls) == 2
    with pytest.raises(ValueError, match="questions calibrate with queries='self_study', got queries='repeat'"):
        compact_catalogue(model, tokenizer, TOOLS, questions=QUESTIONS, queries="repeat")
    with pytest.raises(ValueError, match="method 'streaming_llm' uses none"):
        compact_catalogue(model, tokenizer, TOOLS, questions=QUESTIONS, method="streaming_llm", ratio=2)
    with pytest.raises(TypeError, match="questions must be a list of questions"):
        compact_catalogue(model, tokenizer, TOOLS, questions="Weather in Oslo?")
    with pytest.raises(ValueError, match="pass a SelfStudy without turn_prefix, turn_suffix or prompts"):
        compact_catalogue(model, tokenizer, TOOLS, queries="self_study", self_study=SelfStudy(turn_suffix="x"))


@pytest.mark.slow
def test_self_study_after_a_catalogue_generates_on_the_embedded_model(default_model):
    """On the embedded model each of the four conversations after a catalogue answers in its user turn."""
    from hf_structkv.compaction import SelfStudy, prefill_context, self_study_conversations
    from hf_structkv.compaction.catalogue import catalogue_self_study

    model, tokenizer = default_model
    study = catalogue_self_study(tokenizer, MORE_TOOLS, config=SelfStudy(answer_tokens=6, question_tokens=6))
    ids = tokenizer(catalogue_text(tokenizer, MORE_TOOLS), return_tensors="pt", add_special_tokens=False).input_ids
    conversations = self_study_conversations(model, tokenizer, prefill_context(model, ids), study, seed=0)
    texts = [tokenizer.decode(c.answer_ids) for c in conversations]
    assert all(0 < c.answer_ids.numel() <= 6 for c in conversations) and all(t.strip() for t in texts), texts


@pytest.mark.parametrize(
    ("first", "second"),
    [("", ""), ("", "abc"), ("abc", "abc"), ("abcd", "abx"), ("x", "y"), ("ab" * 500 + "a", "ab" * 500 + "b")],
)
def test_common_prefix_length_is_the_character_loop(first, second):
    brute = 0
    while brute < min(len(first), len(second)) and first[brute] == second[brute]:
        brute += 1
    assert _common_prefix_length(first, second) == brute == _common_prefix_length(second, first)
