"""Hostile ``hf-structkv`` command lines (issue 34), in-process with the tiny Llama: each exits 0 having done its job
or exits 2 with one ``error:`` line naming the option, never a traceback. Hypothesis draws option values; the fixed
catalogue of `hostile_cli` runs whole; the regressions are the defects the fuzzing found."""

from __future__ import annotations

import pytest
from hostile_cli import CharTokenizer, cli_cases, cli_inputs, run_cli
from hostile_outcomes import FUZZ, GOOD_OUTCOMES, Case, assert_good, run_case
from hypothesis import given
from hypothesis import strategies as st

import hf_structkv.cli as cli
from hf_structkv.models import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

OPTION_TEXT = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=6),
)


@pytest.fixture(scope="module")
def inputs(arts, tmp_path_factory):
    return cli_inputs(arts, tmp_path_factory.mktemp("cli"))


def saved_cache_or_refused(argv, words):
    def run():
        _, stdout, _ = run_cli(argv)
        return None if "compacted" in stdout else f"exit 0 without compacting: {stdout[:80]!r}"

    assert_good(Case("cli", "hf-structkv compact", " ".join(argv[-4:]), run, words))


@FUZZ
@given(option=st.sampled_from(["--ratio", "--chunk-tokens", "--query-cap", "--method", "--budgets"]), value=OPTION_TEXT)
def test_compact_options_compact_or_are_refused_naming_the_option(inputs, tmp_path_factory, option, value):
    out = tmp_path_factory.mktemp("out") / "cache"
    argv = ["compact", "--context-file", str(inputs["context"]), "--ratio", "4", option, value, "--out", str(out)]
    saved_cache_or_refused(argv, (option, option.strip("-").replace("-", "_"), "budgets"))


@FUZZ
@given(content=st.binary(max_size=64) | st.text(max_size=40).map(str.encode))
def test_any_context_file_compacts_or_is_refused_naming_it(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("context")
    (folder / "context.txt").write_bytes(content)
    argv = ["compact", "--context-file", str(folder / "context.txt"), "--ratio", "2", "--out", str(folder / "o")]
    saved_cache_or_refused(argv, ("--context-file",))


@FUZZ
@given(question=st.text(max_size=20), tokens=OPTION_TEXT)
def test_generate_answers_or_refuses_naming_the_option(inputs, question, tokens):
    argv = ["generate", "--cache", str(inputs["good_cache"]), "--question", question, "--max-new-tokens", tokens]

    def run():
        _, stdout, _ = run_cli(argv)
        return None if "\nA: " in stdout else "exit 0 without an answer"

    assert_good(
        Case("cli", "hf-structkv generate", f"{question!r} {tokens!r}", run, ("--question", "--max-new-tokens"))
    )


def test_the_catalogue_of_command_lines_has_no_bad_outcome(arts, tmp_path):
    results = [run_case(case) for case in cli_cases(arts, tmp_path)]
    bad = [
        f"{r.case.target} | {r.case.name}: {r.outcome}: {r.detail}" for r in results if r.outcome not in GOOD_OUTCOMES
    ]
    assert not bad, "\n".join(bad)
    assert len(results) > 80 and sum(r.outcome == "handled" for r in results) >= 5


# ---------------------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda arts, tmp: arts.copy("table", tmp / "table"), r"holds a saved PolicyTable \(policy_table\.json\)"),
        (lambda arts, tmp: arts.copy("budgets", tmp / "budgets"), r"holds a saved HeadBudgets"),
        (lambda arts, tmp: tmp, None),
    ],
)
def test_compact_refuses_an_out_folder_of_another_artifact_before_any_work(arts, tmp_path, monkeypatch, make, message):
    """It compacted first and failed at the save (an empty --out compacted, then named save_directory)."""

    def no_model(name, dtype):
        raise AssertionError("the model was loaded before --out was refused")

    monkeypatch.setattr(cli, "load_model", no_model)
    context = tmp_path / "context.txt"
    context.write_text("Some text.", encoding="utf-8")
    if message is None:
        tiny_model("llama").config.save_pretrained(tmp_path / "model")
        out, message = str(tmp_path / "model"), r"config\.json is not a compacted cache's configuration"
    else:
        out = str(make(arts, tmp_path))
    with pytest.raises(ValueError, match=f"--out '{out}': .*{message}"):
        run_cli(["compact", "--context-file", str(context), "--out", out])
    with pytest.raises(ValueError, match="--out is empty"):
        run_cli(["compact", "--context-file", str(context), "--out", ""])


def test_budgets_of_another_model_name_the_budgets_option(inputs, tmp_path):
    argv = ["compact", "--context-file", str(inputs["context"]), "--budgets", str(inputs["qwen_budgets"])]
    with pytest.raises(
        ValueError, match=r"error: budgets '.*qwen2\.5-coder-0\.5b-instruct': this head-budget allocation"
    ):
        run_cli([*argv, "--out", str(tmp_path / "o")])


def test_the_character_tokenizer_round_trips_text():
    tokenizer = CharTokenizer()
    assert tokenizer.decode(tokenizer("Normans!").input_ids[0]) == "Normans!"
