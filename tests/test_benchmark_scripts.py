"""The GPU benchmark script `benchmarks/attention_kernels.py`: its cache-mix helpers against closed forms and stored
bytes, its embedded-model architecture against the real model, and its ``--smoke`` run (CPU, Triton interpreter)."""

import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_structkv.attention.compacted_inputs import CompactedPrefix
from hf_structkv.policy.costs import Action
from hf_structkv.quant.int4 import dequantize_int4, quantize_int4
from hf_structkv.quant.int4_channels import dequantize_int4_channels, quantize_int4_channels

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "attention_kernels.py"


def load_script(path: Path):
    """Import a benchmark script (not a package) as a module named after its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


ak = load_script(SCRIPT)


@pytest.mark.parametrize("history", [160, 4096, 131072])
@pytest.mark.parametrize("payload_ratio", ak.PAYLOAD_RATIOS)
@pytest.mark.parametrize("head_dim", [64, 128, 65])
def test_mixed_entry_counts_hit_the_payload_ratio(history, payload_ratio, head_dim):
    window = 8 if history == 160 else 32
    counts = ak.mixed_entry_counts(history, payload_ratio, window, head_dim)
    older = history - window
    assert counts.recent == window
    assert counts.released == round(ak.RELEASED_FRACTION * older)
    assert counts.high + counts.low + counts.recent + counts.released == history
    assert min(counts.high, counts.low) >= 0
    # Stored bytes of one KV head's K and V rows: BF16 rows 2 * D bytes, INT4 rows ceil(D / 2) code bytes + a 2-byte
    # FP16 scale (quantize_int4's own output), the B.3 cost convention in bytes.
    codes, scales = quantize_int4(torch.randn(1, head_dim))
    int4_row = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    bf16_row = 2 * head_dim
    stored = (counts.high + counts.recent) * bf16_row + counts.low * int4_row
    measured = stored / (history * bf16_row)
    assert measured == pytest.approx(counts.payload_ratio(ak.GroupCosts.from_dims([1], [head_dim])), rel=1e-12)
    assert abs(measured - payload_ratio) <= 1 / history  # rounding to whole tokens


def test_mixed_entry_counts_reject_unreachable_ratios():
    with pytest.raises(ValueError, match="payload_ratio 0.1 is outside"):
        ak.mixed_entry_counts(4096, 0.1, 32, 64)  # below all-INT4 with 20% released
    with pytest.raises(ValueError, match="payload_ratio 0.95 is outside"):
        ak.mixed_entry_counts(4096, 0.95, 32, 64)  # above all-BF16 with 20% released


def test_prefill_plan_permutes_the_counts_per_group():
    counts = ak.EntryCounts(high=5, low=7, recent=3, released=4)
    plan = ak.prefill_plan(counts, batch=2, generator=torch.Generator().manual_seed(0))
    assert plan.shape == (2, 19, 3)
    assert torch.equal(plan[0], plan[1])
    for group in range(3):
        column = plan[0, :, group]
        assert [int((column == int(a)).sum()) for a in (Action.H, Action.L, Action.R)] == [5 + 3, 7, 4]
        assert bool((column[-3:] == int(Action.H)).all())
    assert not torch.equal(plan[0, :, 0], plan[0, :, 1])  # each group its own permutation


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_ragged_head_lengths_spread_around_the_mean(kv_heads):
    lengths = ak.ragged_head_lengths(409.6, kv_heads)
    assert len(lengths) == kv_heads
    if kv_heads > 1:
        assert lengths[0] == round(0.5 * 409.6) and lengths[-1] == round(1.5 * 409.6)
    assert abs(sum(lengths) - kv_heads * 409.6) <= kv_heads / 2
    assert ak.ragged_head_lengths(0.2, 2) == [1, 1]
    with pytest.raises(ValueError, match="kv_heads"):
        ak.ragged_head_lengths(10.0, 0)


@pytest.mark.parametrize("key_group", [None, 3])
def test_int4_prefix_serves_every_head_quantised_as_compact_stores_it(key_group):
    # every head round-tripped through the package's INT4 quantisers (keys per channel, values per row), the biases
    # and ragged offsets kept, no head left in bf16 rows
    g = torch.Generator().manual_seed(0)
    offsets = [0, 2, 7, 15]
    prefix = CompactedPrefix(
        torch.randn(15, 6, generator=g).bfloat16(), torch.randn(15, 5, generator=g).bfloat16(), torch.randn(15), offsets
    )
    got = ak.int4_prefix(prefix, key_group)
    assert got.offsets == offsets and torch.equal(got.bias, prefix.bias)
    assert got.quantized.int4_heads == (True,) * 3 and got.quantized.key_group == key_group
    assert got.keys.shape[0] == got.values.shape[0] == 0
    for h in range(3):
        keys, values, bias = prefix.head(h)
        served_keys, served_values, served_bias = got.head(h)
        want_keys = dequantize_int4_channels(*quantize_int4_channels(keys, key_group), 6, key_group)
        torch.testing.assert_close(served_keys, want_keys, rtol=0, atol=0)
        torch.testing.assert_close(served_values, dequantize_int4(*quantize_int4(values), 5), rtol=0, atol=0)
        assert torch.equal(served_bias, bias)
        assert (served_keys - keys.float()).abs().max() < 0.5  # a quantisation, not another tensor


@pytest.mark.slow
def test_embedded_model_config_matches_the_embedded_model(default_model):
    config = default_model[0].config
    for name, value in ak.EMBEDDED_MODEL_CONFIG.items():
        actual = getattr(config, name)
        if isinstance(value, float):
            assert actual == pytest.approx(value, rel=1e-6), name
        else:
            assert actual == value, name
    assert config.model_type == "qwen2"


def test_attention_kernels_smoke(tmp_path):
    out = tmp_path / "attention_kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        check=True,
        env=env,
        timeout=120,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["copy_bytes_per_s"] > 0
    rows = result["kernels"]
    grid = len(ak.SHAPES) * len(ak.SMOKE.lengths) * len(ak.SMOKE.batches)
    compacted = len(ak.COMPACTION_RATIOS) * len(ak.COMPACTED_STORAGES)
    assert len(rows) == grid * (1 + compacted + len(ak.PAYLOAD_RATIOS))
    assert {row["kernel"] for row in rows} == {"sdpa", "compacted", "mixed"}
    by_storage = {}  # (shape, ratio) -> storage -> row
    for row in (r for r in rows if r["kernel"] == "compacted"):
        by_storage.setdefault((row["shape"], row["variant"].split()[0]), {})[row["storage"]] = row
    assert len(by_storage) == len(ak.SHAPES) * len(ak.COMPACTION_RATIOS)
    for pair in by_storage.values():  # the same entries per head; the INT4 prefix reads fewer bytes
        assert set(pair) == set(ak.COMPACTED_STORAGES) and pair["int4"]["variant"].endswith(" int4")
        assert pair["int4"]["entries_per_head"] == pair["bf16"]["entries_per_head"]
        assert pair["int4"]["bytes_read"] < pair["bf16"]["bytes_read"]
    for row in rows:
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0
        assert row["bytes_read"] > 0 and row["speedup_vs_sdpa"] > 0
        if row["kernel"] != "sdpa":  # the smoke grid is one point: every kernel row is checked
            assert row["reference_rel_error"] < ak.REFERENCE_TOLERANCE
        if row["kernel"] == "mixed":
            assert abs(row["payload_ratio"] - float(row["variant"].removeprefix("B="))) <= 1 / row["history"]
    e2e = result["end_to_end"]
    assert e2e["weights"] == "random" and e2e["context_tokens"] == ak.SMOKE.e2e_context
    caches = {row["cache"].split()[0]: row for row in e2e["rows"]}
    assert set(caches) == {"DynamicCache", "CompactedCache", "StructuredMixedPrecisionCache"}
    assert all(row["tpot_s"] > 0 for row in e2e["rows"])
    assert caches["CompactedCache"]["stored_bytes"] < caches["DynamicCache"]["stored_bytes"]
    assert 0.4 < caches["StructuredMixedPrecisionCache"]["payload_ratio"] < 0.65


# --------------------------------------------------------------------------------- benchmarks/compaction_qa.py
QA_SCRIPT = BENCHMARKS / "compaction_qa.py"


@pytest.fixture(scope="module")
def qa():
    return load_script(QA_SCRIPT)


def word_counter(text: str) -> int:
    return len(text.split())


def test_compaction_qa_token_f1_matches_the_closed_form(qa):
    # prediction "the cat sat on mat" -> [cat, sat, on, mat]; gold "a cat on a hat" -> [cat, on, hat]: 2 common
    precision, recall = 2 / 4, 2 / 3
    assert qa.token_f1("The cat sat on mat!", ("a cat on a hat",)) == pytest.approx(
        2 * precision * recall / (precision + recall)
    )
    assert qa.token_f1("Paris.", ("London", "paris")) == 1.0  # best gold answer
    assert qa.token_f1("nothing shared", ("Paris",)) == 0.0
    assert qa.token_f1("", ("Paris",)) == 0.0 and qa.token_f1("the", (".",)) == 0.0  # empty after normalising


def test_compaction_qa_take_until_and_sentences(qa):
    pieces = ["a b", "c d e", "f"]  # costs 2 + 1, 3 + 1, 1 + 1
    assert [qa.take_until(pieces, word_counter, budget) for budget in (2, 3, 6, 7, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert qa.split_sentences("One.  Two!\nThree? four.five ") == ["One.", "Two!", "Three?", "four.five"]


def test_compaction_qa_pareto_front_is_the_non_dominated_set(qa):
    points = [(1.0, 0.2), (2.0, 0.5), (2.0, 0.4), (3.0, 0.5), (0.5, 0.1), (4.0, 0.9), (5.0, 0.3)]
    brute = {
        p
        for p in points
        if not any(q != p and q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1]) for q in points)
    }
    front = qa.pareto_front(points)
    assert set(front) == brute and front == sorted(front)


def test_compaction_qa_variant_parse(qa):
    assert qa.Variant.parse("kv_surgeon") == qa.Variant("kv_surgeon", "repeat")
    assert qa.Variant.parse("loo:self_study").label == "loo:self_study"
    with pytest.raises(ValueError, match="is not a method"):
        qa.Variant.parse("kv_surgery")
    with pytest.raises(ValueError, match="must be one of"):
        qa.Variant.parse("kv_surgeon:chat")
    with pytest.raises(ValueError, match="query-free"):
        qa.Variant.parse("streaming_llm:self_study")


def test_compaction_qa_needle_documents_hold_each_needle_once(qa):
    pytest.importorskip("long_context_eval")
    (document,) = qa.needle_documents(word_counter, 300, 3, 1, qa.random.Random(0))
    assert document.task == "needle" and len(document.questions) == 3
    assert word_counter(document.text) <= 300
    sentences = qa.split_sentences(document.text)
    for depth, key, item in zip(document.source["depths"], document.source["keys"], document.questions, strict=True):
        needle = qa.NEEDLE.format(key=key, value=item.answers[0])
        assert document.text.count(needle) == 1 and key in item.question
        assert abs(sentences.index(needle) / len(sentences) - depth) < 0.05


def test_compaction_qa_squad_and_hotpotqa_documents(qa):
    pytest.importorskip("long_context_eval")
    squad = qa.squad_documents(word_counter, 1500, 4, 2, qa.random.Random(1))
    titles = [article["title"] for document in squad for article in document.source["articles"]]
    assert len(titles) == len(set(titles))  # no article in two documents
    for document in squad:
        assert len(document.questions) == 4 and word_counter(document.text) <= 1500
        for item in document.questions:
            assert any(answer in document.text for answer in item.answers)
    (hotpot,) = qa.hotpotqa_documents(word_counter, 1500, 3, 1, qa.random.Random(2))
    assert 1 <= len(hotpot.questions) <= 3 and word_counter(hotpot.text) <= 1500 + 2 * hotpot.text.count("Document ")
    data = {item["_id"]: item for item in qa.package_json("hotpotqa.json")}
    for question_id, item in zip(hotpot.source["question_ids"], hotpot.questions, strict=True):
        assert item.answers[0].lower() not in ("yes", "no")
        for title, _ in data[question_id]["supporting_facts"]:
            assert f"\n{title}\n" in hotpot.text  # every gold paragraph is in the document


def stored_run(cache, ratio, seed, task, seconds, rows, storage="bf16"):
    """A run of document 0 whose cache stores 1/ratio of 1000 bytes."""
    entry = {"cache": cache, "ratio": ratio, "seed": seed, "document": 0, "task": task, "seconds": seconds}
    return entry | {"rows": rows, "storage": storage, "stored_bytes": 1000 / ratio, "full_bytes": 1000}


def test_compaction_qa_summary_and_targets(qa):
    def run(cache, ratio, seed, correct):
        rows = [{"correct": c, "f1": float(c), "gold_answer_nll": 2.0 - c + seed} for c in correct]
        return stored_run(cache, ratio, seed, "squad", 2.0, rows)

    runs = [run("full", 1.0, 0, [1, 1, 1, 0]), run("full", 1.0, 1, [1, 1, 1, 1])]
    runs += [run("kv_surgeon", 10.0, 0, [1, 1, 0, 0]), run("kv_surgeon", 10.0, 1, [1, 1, 1, 1])]
    runs += [run("kv_surgeon", 50.0, s, [1, 0, 0, 0]) for s in (0, 1)]
    runs += [run("loo", 50.0, s, [0, 0, 0, 0]) for s in (0, 1)]
    summary = {(row["cache"], row["ratio"]): row for row in qa.summarize(runs)}
    assert summary[("full", 1.0)]["accuracy"] == pytest.approx(0.875)
    ours = summary[("kv_surgeon", 10.0)]
    assert ours["accuracy_per_seed"] == [0.5, 1.0] and ours["accuracy_std"] == pytest.approx(0.25)
    assert ours["accuracy_vs_full"] == pytest.approx(0.75 / 0.875) and ours["questions_per_seed"] == 4
    # gold NLL per seed: 2 - accuracy + seed -> 1.5 and 2.0; mean over seeds
    assert ours["gold_answer_nll"] == pytest.approx(1.75) and ours["gold_answer_nll_per_task"] == {"squad": 1.75}
    verdicts = qa.target_verdicts(list(summary.values()))["kv_surgeon"]
    assert verdicts["at 10x keeps >= 90% of full-context accuracy"].startswith("not met (85.7% of full)")
    assert verdicts["at 20x ahead of every baseline"].startswith("not measured")
    assert verdicts["at 50x ahead of every baseline"].startswith("met (25.0% vs best baseline loo 0.0%")


def choice_document(qa, answers):
    from hf_structkv.eval.squad import SquadQuestion

    questions = tuple(SquadQuestion(f"q{i}?", tuple(gold)) for i, gold in enumerate(answers))
    return qa.QADocument("squad", "text", questions, {})


def test_compaction_qa_choice_distractors_are_other_questions_answers(qa):
    answers = [["Paris", "the city of Paris"], ["1984"], ["The Beatles"], ["paris"], ["Oslo"], ["city of Paris"]]
    document = choice_document(qa, answers)
    drawn = qa.choice_distractors(document, 3, qa.random.Random(0))
    firsts = {"Paris", "1984", "The Beatles", "Oslo", "city of Paris"}  # "paris" normalises as "Paris" does
    assert len(drawn) == len(answers)
    for distractors, gold in zip(drawn, answers, strict=True):
        assert len(distractors) == 2 and set(distractors) <= firsts
        normalized = {qa.normalize_answer(option) for option in distractors}
        assert len(normalized) == 2 and not normalized & {qa.normalize_answer(answer) for answer in gold}
    assert drawn == qa.choice_distractors(document, 3, qa.random.Random(0))  # seeded
    assert drawn != qa.choice_distractors(document, 3, qa.random.Random(1))
    with pytest.raises(ValueError, match="only 3 distinct other answers"):
        qa.choice_distractors(document, 5, qa.random.Random(0))
    with pytest.raises(ValueError, match="--choices must be 0"):
        qa.choice_distractors(document, 1, qa.random.Random(0))
    with pytest.raises(SystemExit):
        qa.parse_args(["--choices", "9"])


def test_compaction_qa_scored_choices_pick_the_lowest_nll(qa):
    distractors = [("b", "c"), ("d", "e"), ("f", "g")]
    slots = [[2.0, 0.5, 1.0], [3.0, 4.0, 1.5]]  # slot j: each question's j-th distractor
    rows = qa.scored_choices(distractors, slots, [1.0, 1.0, 1.0])
    assert [row["choice_distractor_nlls"] for row in rows] == [[2.0, 3.0], [0.5, 4.0], [1.0, 1.5]]
    assert [row["choice_correct"] for row in rows] == [True, False, False]  # a tie is not a win
    for row, gold in zip(rows, [1.0, 1.0, 1.0], strict=True):
        weights = [math.exp(-nll) for nll in [gold, *row["choice_distractor_nlls"]]]
        assert row["choice_gold_share"] == pytest.approx(weights[0] / sum(weights))
    alike = qa.scored_choices([("b", "c", "d")], [[2.0], [2.0], [2.0]], [2.0])[0]
    assert alike["choice_gold_share"] == pytest.approx(0.25) and not alike["choice_correct"]
    assert rows[1]["choice_distractors"] == ["d", "e"]


def choice_run(cache, ratio, correct, chosen, storage="bf16"):
    """A run of one needle document whose rows have both answer forms (``correct``, ``chosen``: 0/1 per question)."""
    rows = [
        {"correct": c, "f1": 0.0, "gold_answer_nll": 1.0, "choice_correct": k, "choice_gold_share": 0.25 + k / 2}
        for c, k in zip(correct, chosen, strict=True)
    ]
    return stored_run(cache, ratio, 0, "needle", 1.0, rows, storage)


def choice_runs():
    """Full cache, kv_surgeon at 10x and 20x, h2o at 20x (`choice_run`)."""
    return [
        choice_run("full", 1.0, [1, 1, 0, 0], [1, 1, 1, 1]),
        choice_run("kv_surgeon", 10.0, [0, 0, 0, 0], [1, 1, 1, 0]),
        choice_run("h2o", 20.0, [0, 0, 0, 0], [1, 0, 0, 0]),
        choice_run("kv_surgeon", 20.0, [0, 0, 0, 0], [1, 1, 0, 0]),
    ]


def test_compaction_qa_summary_of_multiple_choice_rows(qa):
    runs = choice_runs()
    summary = {(row["cache"], row["ratio"]): row for row in qa.summarize(runs)}
    ours = summary[("kv_surgeon", 10.0)]
    assert ours["accuracy"] == 0.0 and ours["choice_accuracy"] == 0.75 and ours["choice_accuracy_vs_full"] == 0.75
    assert ours["choice_accuracy_per_task"] == {"needle": 0.75} and ours["choice_gold_share"] == pytest.approx(0.625)
    assert ours["choice_gold_share_per_task"] == {"needle": pytest.approx(0.625)} and ours["gold_answer_nll"] == 1.0
    verdicts = qa.target_verdicts(list(summary.values()), "choice_")["kv_surgeon"]
    assert verdicts["at 10x keeps >= 90% of full-context accuracy"].startswith("not met (75.0% of full)")
    assert verdicts["at 20x ahead of every baseline"].startswith("met (50.0% vs best baseline h2o 25.0%")
    free_form = [
        run | {"rows": [{key: row[key] for key in ("correct", "f1", "gold_answer_nll")} for row in run["rows"]]}
        for run in runs
    ]
    assert all("choice_accuracy" not in row for row in qa.summarize(free_form))


def test_compaction_qa_storage_rows_paired_with_the_full_cache_and_the_dtype_rows(qa):
    from hf_structkv.eval.paired import mcnemar_exact

    runs = [*choice_runs(), choice_run("kv_surgeon+int4", 20.0, [1, 0, 0, 0], [1, 1, 1, 1], storage="int4")]
    runs.append(choice_run("kv_surgeon+auto", 20.0, [0, 0, 0, 0], [1, 0, 1, 0], storage="auto"))
    summary = qa.summarize(runs)
    rows = {(row["cache"], row["ratio"]): row for row in summary}
    assert rows[("kv_surgeon+int4", 20.0)]["storage"] == "int4" and rows[("kv_surgeon", 10.0)]["storage"] == "bf16"
    assert rows[("kv_surgeon+int4", 20.0)]["byte_ratio"] == 20.0 and rows[("h2o", 20.0)]["stored_bytes"] == 50.0
    # full MC [1, 1, 1, 1]: kv_surgeon@10x [1, 1, 1, 0] loses one; the row against itself loses and gains none
    assert rows[("full", 1.0)]["choice_vs_full"] == {"questions": 4, "lost": 0, "gained": 0, "p_value": 1.0}
    assert rows[("kv_surgeon", 10.0)]["choice_vs_full"] == {"questions": 4, "lost": 1, "gained": 0, "p_value": 1.0}
    assert rows[("h2o", 20.0)]["choice_vs_full"]["p_value"] == mcnemar_exact(3, 0) == 0.25
    # free form: full [1, 1, 0, 0], kv_surgeon+int4@20x [1, 0, 0, 0]
    assert rows[("kv_surgeon+int4", 20.0)]["vs_full"] == {"questions": 4, "lost": 1, "gained": 0, "p_value": 1.0}
    assert all(0 <= row[key]["p_value"] <= 1 for row in summary for key in ("vs_full", "choice_vs_full"))
    assert qa.target_verdicts(summary, "choice_").keys() == {"kv_surgeon"}  # the issue-6 targets: dtype rows only
    verdicts = qa.storage_target_verdicts(summary, runs, "choice_")
    assert set(verdicts) == {"kv_surgeon+int4", "kv_surgeon+auto"}
    ahead = "at 20x fewer bytes ahead of kv_surgeon at 10x"
    assert verdicts["kv_surgeon+int4"][ahead] == (
        "met (100.0% at 20.00x bytes vs 75.0% at 10.00x; lost 0, gained 1, McNemar p 1)"
    )
    # auto MC [1, 0, 1, 0] against kv_surgeon@10x [1, 1, 1, 0]: lost 1, gained 0
    assert verdicts["kv_surgeon+auto"][ahead].startswith("not met (50.0% at 20.00x bytes vs 75.0% at 10.00x; lost 1,")
    kept = "at 10x fewer bytes keeps >= 90% of full-context accuracy"
    assert verdicts["kv_surgeon+int4"][kept] == "not measured (10x not run)"
    free_form = qa.storage_target_verdicts(summary, runs)["kv_surgeon+int4"][ahead]
    assert free_form.startswith("met (25.0% at 20.00x bytes vs 0.0% at 10.00x; lost 0, gained 1")
    # largest byte ratio keeping >= 95% of the full cache's accuracy, per row family
    assert qa.byte_ratio_kept(summary, "choice_") == {
        "kv_surgeon": None,
        "h2o": None,
        "kv_surgeon+int4": 20.0,
        "kv_surgeon+auto": None,
    }
    assert set(qa.byte_ratio_kept(summary).values()) == {None}  # free form: every row below 95% of the full 50%
    assert qa.byte_ratio_kept(summary, share=0.5)["kv_surgeon+int4"] == 20.0


def test_compaction_qa_plot_is_against_bytes_with_storage_rows(qa, tmp_path):
    pytest.importorskip("matplotlib")
    in_dtype = qa.plot_pareto(qa.summarize(choice_runs()), tmp_path / "entries.png", "tiny").axes[0]
    assert in_dtype.get_xlabel().startswith("compression ratio")
    runs = [*choice_runs(), choice_run("kv_surgeon+int4", 20.0, [1, 0, 0, 0], [1, 1, 1, 1], storage="int4")]
    runs[-1]["stored_bytes"] = 40.0  # 25x fewer bytes than asked for: plotted where measured
    by_bytes = qa.plot_pareto(qa.summarize(runs), tmp_path / "bytes.png", "tiny").axes[0]
    assert by_bytes.get_xlabel().startswith("byte ratio")
    assert [list(line.get_xdata()) for line in by_bytes.lines if 25.0 in line.get_xdata()] == [[25.0]]


def test_compaction_qa_plot_draws_chance_on_the_multiple_choice_panel(qa, tmp_path):
    pytest.importorskip("matplotlib")
    summary = qa.summarize(choice_runs())
    figure = qa.plot_pareto(summary, tmp_path / "qa.png", "tiny", choices=4)
    free_form, _, _, multiple_choice = figure.axes
    labelled = {axis: {line.get_label(): list(line.get_ydata()) for line in axis.lines} for axis in figure.axes}
    assert labelled[multiple_choice]["chance (1/4)"] == [0.25, 0.25]
    assert labelled[multiple_choice]["full cache"] == [1.0, 1.0] and labelled[free_form]["full cache"] == [0.5, 0.5]
    assert not any(label.startswith("chance") for label in labelled[free_form])
    assert (tmp_path / "qa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    without = qa.plot_pareto(summary, tmp_path / "no_chance.png", "tiny").axes[3]
    assert [line.get_label() for line in without.lines] == [line.get_label() for line in multiple_choice.lines][:-1]


def test_compaction_qa_choices_add_a_multiple_choice_form_of_the_same_questions(qa, tmp_path):
    pytest.importorskip("long_context_eval")
    from hf_structkv.compaction import prefill_context

    argv = ["--tiny", "--tasks", "needle", "--doc-tokens", "300", "--questions", "4", "--methods", "h2o"]
    argv += ["--ratios", "8", "--max-new-tokens", "3", "--query-cap", "32"]
    payloads = []
    for extra, name in (([], "plain.json"), (["--choices", "3"], "choices.json")):
        qa.main([*argv, *extra, "--out", str(tmp_path / name)])
        payloads.append(json.loads((tmp_path / name).read_text()))
    plain, choices = payloads
    assert "targets_multiple_choice" not in plain and set(choices["targets_multiple_choice"]) == set(choices["targets"])
    full_rows = []
    for before, after in zip(plain["runs"], choices["runs"], strict=True):
        for row, chosen in zip(before["rows"], after["rows"], strict=True):
            assert chosen.items() >= row.items()  # the free-form answers do not change
            assert len(chosen["choice_distractors"]) == 2 and row["answers"][0] not in chosen["choice_distractors"]
            weights = [math.exp(-nll) for nll in [chosen["gold_answer_nll"], *chosen["choice_distractor_nlls"]]]
            assert chosen["choice_gold_share"] == pytest.approx(weights[0] / sum(weights))
        full_rows += after["rows"] if after["cache"] == "full" else []
    assert {row["cache"] for row in choices["summary"] if "choice_accuracy" in row} == {"full", "h2o"}
    # a distractor's NLL is that of the distractor teacher forced after the question, from the full cache
    model, tokenizer = qa.load_model("default", tiny=True)
    (document,) = qa.needle_documents(
        lambda text: len(tokenizer(text, add_special_tokens=False).input_ids), 300, 4, 1, qa.random.Random(0)
    )
    opening, body, suffix = qa.document_chat_parts(tokenizer, document.text)
    cache = prefill_context(model, tokenizer(opening + body, return_tensors="pt", add_special_tokens=False).input_ids)
    prompt = qa.question_text(document.questions[0].question, suffix)
    distractor = full_rows[0]["choice_distractors"][1]
    ((reference,),) = qa.gold_references(tokenizer, [prompt], [[distractor]], 1)
    assert reference.nll(model, cache).item() == pytest.approx(full_rows[0]["choice_distractor_nlls"][1], abs=1e-5)


def test_compaction_qa_keeps_the_chat_opening_whole_with_keep_template(qa, tmp_path):
    pytest.importorskip("long_context_eval")
    model, tokenizer = qa.load_model("default", tiny=True)
    opening, body, _ = qa.document_chat_parts(tokenizer, "Some text.")
    ids = tokenizer(opening + body, return_tensors="pt", add_special_tokens=False).input_ids
    count = qa.opening_tokens(tokenizer, opening, ids)
    assert 0 < count < ids.shape[1]
    assert tokenizer.decode(ids[0, :count]) == opening
    with pytest.raises(ValueError, match="the chat opening tokenizes differently inside the prompt"):
        qa.opening_tokens(tokenizer, opening, ids[:, 1:])
    argv = ["--tiny", "--tasks", "needle", "--doc-tokens", "200", "--questions", "2", "--methods", "streaming_llm"]
    argv += ["--ratios", "8", "--max-new-tokens", "2", "--keep-template", "--out", str(tmp_path / "kept.json")]
    qa.main(argv)
    payload = json.loads((tmp_path / "kept.json").read_text())
    (document,) = payload["documents"]
    assert document["template_tokens_kept_whole"] == count and payload["settings"]["keep_template"] is True
    compacted = [run for run in payload["runs"] if run["cache"] == "streaming_llm"]
    assert len(compacted) == 1 and len(compacted[0]["rows"]) == 2


def test_compaction_qa_gold_nlls_do_not_depend_on_the_batching(qa):
    pytest.importorskip("long_context_eval")
    from hf_structkv.compaction import prefill_context
    from hf_structkv.models import tiny_byte_tokenizer, tiny_model

    model, tokenizer = tiny_model("qwen2", vocab_size=300), tiny_byte_tokenizer()
    (document,) = qa.needle_documents(word_counter, 300, 3, 1, qa.random.Random(0))
    prompts = [f"Q: {item.question} A:" for item in document.questions]
    cache = prefill_context(model, tokenizer(document.text, return_tensors="pt").input_ids)
    answers = [item.answers[0] for item in document.questions]
    (together,) = qa.gold_references(tokenizer, prompts, [answers], 3)
    (one_by_one,) = qa.gold_references(tokenizer, prompts, [answers], 1)
    together, one_by_one = qa.gold_nlls(model, together, cache), qa.gold_nlls(model, one_by_one, cache)
    assert len(together) == 3 and together == pytest.approx(one_by_one, abs=1e-5)
    # answer sets share the prompts and nothing else: a second set scores as it does alone
    _, reversed_set = qa.gold_references(tokenizer, prompts, [answers, answers[::-1]], 3)
    (alone,) = qa.gold_references(tokenizer, prompts, [answers[::-1]], 2)
    assert qa.gold_nlls(model, reversed_set, cache) == pytest.approx(qa.gold_nlls(model, alone, cache), abs=1e-5)


def test_compaction_qa_self_study_lengths_come_from_the_command_line(qa):
    from hf_structkv.compaction import SelfStudy

    default = qa.self_study_of(qa.parse_args([]), "</u>")
    assert default == SelfStudy(turn_suffix="</u>")
    args = qa.parse_args(["--self-study-answer-tokens", "256", "--self-study-question-tokens", "512"])
    longer = qa.self_study_of(args, "")
    assert (longer.answer_tokens, longer.question_tokens) == (256, 512)
    with pytest.raises(SystemExit):
        qa.parse_args(["--self-study-answer-tokens", "0"])


class _HalfBudgets:
    def token_budgets(self, ratio, length):
        return {0: [length // 2, 1], 2: [3, 4]}


def test_compaction_qa_layers_kept_whole_replace_only_their_counts(qa):
    from hf_structkv.models import tiny_model

    model = tiny_model("qwen2", vocab_size=300, num_hidden_layers=3)
    budgets = qa.LayersKeptWhole(model, _HalfBudgets(), frozenset({2}))
    assert budgets.token_budgets(10.0, 40) == {0: [20, 1], 2: [40, 40]}
    with pytest.raises(ValueError, match=r"--uncompacted-layers: \[1\] are not global layers"):
        qa.LayersKeptWhole(model, _HalfBudgets(), frozenset({1, 2})).token_budgets(10.0, 40)
    # "auto" on a model without a shipped allocation: compact()'s uniform floor rule in the other layers
    assert qa.LayersKeptWhole(model, "auto", frozenset({1})).token_budgets(3.0, 40) == {
        0: [13, 13],
        1: [40, 40],
        2: [13, 13],
    }
    args = qa.parse_args(["--uncompacted-layers", "13", "12", "--methods", "kv_surgeon:self_study"])
    assert args.uncompacted_layers == [13, 12]
    assert qa.run_label(args, args.variants[0]) == "kv_surgeon:self_study[12 13 whole]"
    assert qa.run_label(qa.parse_args([]), qa.Variant("loo")) == "loo"
    with pytest.raises(SystemExit):
        qa.parse_args(["--uncompacted-layers", "-1"])
    # rows with whole layers are not at their ratio: no target verdicts for them
    rows = [("full", 1.0), ("kv_surgeon[1 whole]", 10.0), ("kv_surgeon:self_study[1 whole]", 10.0)]
    summary = [{"cache": cache, "ratio": ratio, "accuracy": 1.0} for cache, ratio in rows]
    assert qa.target_verdicts(summary) == {}


def test_compaction_qa_every_layer_whole_answers_as_the_full_cache(qa, tmp_path):
    pytest.importorskip("long_context_eval")
    from hf_structkv.compaction import HeadBudgets
    from hf_structkv.models import tiny_model

    model = tiny_model("qwen2", vocab_size=300, max_position_embeddings=8192)
    args = qa.parse_args(["--uncompacted-layers", "0", "1"])
    assert qa.budgets_of(args, model) == qa.LayersKeptWhole(model, "auto", frozenset({0, 1}))
    assert qa.budgets_of(qa.parse_args(["--budgets", "uniform"]), model) == "uniform"
    HeadBudgets.uniform(model).save_pretrained(tmp_path / "equal")
    assert qa.budgets_of(qa.parse_args(["--budgets", str(tmp_path / "equal")]), model) == str(tmp_path / "equal")
    with pytest.raises(SystemExit):
        qa.parse_args(["--budgets", str(tmp_path / "missing")])
    out = tmp_path / "qa.json"
    argv = ["--tiny", "--tasks", "needle", "--doc-tokens", "300", "--questions", "2", "--methods", "kv_surgeon"]
    argv += ["--ratios", "10", "--max-new-tokens", "4", "--query-cap", "64", "--uncompacted-layers", "0", "1"]
    qa.main([*argv, "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    full, whole = (next(run for run in runs if run["cache"] == cache) for cache in ("full", "kv_surgeon[0 1 whole]"))
    assert [row["reply"] for row in whole["rows"]] == [row["reply"] for row in full["rows"]]
    nlls = [[row["gold_answer_nll"] for row in run["rows"]] for run in (whole, full)]
    assert nlls[0] == pytest.approx(nlls[1], abs=1e-5) and all(value > 0 for value in nlls[1])
    assert whole["heldout_relative_loss"] == pytest.approx(0.0, abs=1e-6)


def test_compaction_qa_writes_its_results_after_every_cache(qa, tmp_path, monkeypatch):
    pytest.importorskip("long_context_eval")
    out, written = tmp_path / "qa.json", []
    write = qa.write_results

    def recording(*args, **kwargs):
        result = write(*args, **kwargs)
        payload = json.loads(out.read_text())
        written.append((payload["complete"], len(payload["documents"]), len(payload["runs"])))
        return result

    monkeypatch.setattr(qa, "write_results", recording)
    argv = ["--tiny", "--tasks", "needle", "--documents", "2", "--doc-tokens", "200", "--questions", "1"]
    qa.main(
        [*argv, "--methods", "h2o", "--ratios", "8", "--max-new-tokens", "2", "--query-cap", "32", "--out", str(out)]
    )
    assert written == [(False, 1, 1), (False, 1, 2), (False, 2, 3), (False, 2, 4), (True, 2, 4)]  # full, h2o per doc


QA_RESUMED = ["--tiny", "--tasks", "needle", "--documents", "2", "--doc-tokens", "200", "--questions", "2"]
QA_RESUMED += ["--choices", "2", "--methods", "streaming_llm", "--storage", "bf16", "int4", "--ratios", "4", "8"]
QA_RESUMED += ["--max-new-tokens", "2"]


@pytest.fixture(scope="module")
def qa_uninterrupted(qa, tmp_path_factory):
    """The JSON of an uninterrupted tiny run of `QA_RESUMED`: 2 documents x (full, full+int4, streaming_llm and
    streaming_llm+int4 at 4x and 8x)."""
    pytest.importorskip("long_context_eval")
    out = tmp_path_factory.mktemp("qa") / "uninterrupted.json"
    qa.main([*QA_RESUMED, "--out", str(out)])
    return json.loads(out.read_text())


def without(mapping: dict, *keys: str) -> dict:
    return {key: value for key, value in mapping.items() if key not in keys}


DOCUMENT_1_COMPACTED = [(1, cache, ratio) for cache in ("streaming_llm", "streaming_llm+int4") for ratio in (4.0, 8.0)]


@pytest.mark.parametrize(
    ("missing", "prefills"),
    [
        # one run of document 0 missing; document 1 reached, its full cache and full+int4 done
        ([(0, "streaming_llm+int4", 4.0), *DOCUMENT_1_COMPACTED], 0),
        # document 1 never reached: every cache of it, the full cache's prefill included
        ([(1, "full", 1.0), (1, "full+int4", 1.0), *DOCUMENT_1_COMPACTED], 1),
        ([], 0),  # a finished file: nothing to compute, the same JSON rewritten
    ],
)
def test_compaction_qa_resumes_an_interrupted_run(qa, qa_uninterrupted, tmp_path, monkeypatch, missing, prefills):
    uninterrupted = qa_uninterrupted
    runs = uninterrupted["runs"]
    assert len(runs) == 12
    kept = [run for run in runs if (run["document"], run["cache"], run["ratio"]) not in missing]
    reached = {run["document"] for run in kept}
    out = tmp_path / "qa.json"
    partial = {"complete": not missing, "runs": kept}
    partial["documents"] = [document for document in uninterrupted["documents"] if document["index"] in reached]
    out.write_text(json.dumps(uninterrupted | partial))
    compacted, prefilled = [], []
    compact, prefill = qa.compact, qa.prefill_context

    def counted_compact(*args, **kwargs):
        compacted.append((kwargs["storage"], kwargs["ratio"]))
        return compact(*args, **kwargs)

    def counted_prefill(*args, **kwargs):
        prefilled.append(args[1].shape)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(qa, "compact", counted_compact)
    monkeypatch.setattr(qa, "prefill_context", counted_prefill)
    qa.main([*QA_RESUMED, "--out", str(out)])
    resumed = json.loads(out.read_text())

    expected = [("int4" if "+" in cache else "bf16", ratio) for _, cache, ratio in missing if cache != "full"]
    assert compacted == expected and len(prefilled) == prefills  # only what was missing ran
    assert resumed["complete"] and resumed["documents"] == uninterrupted["documents"]
    assert [qa.run_key(run) for run in resumed["runs"]] == [qa.run_key(run) for run in runs]  # uninterrupted order
    for run, before in zip(resumed["runs"], runs, strict=True):
        if run in kept:
            assert run == before  # kept as it was: same seconds, same piece
        else:
            assert run["piece"] == 1 and without(run, "seconds", "piece") == without(before, "seconds", "piece")
    assert [without(row, "pipeline_seconds") for row in resumed["summary"]] == [
        without(row, "pipeline_seconds") for row in uninterrupted["summary"]
    ]  # accuracies, vs_full's paired counts and p-values, bytes
    for key in ("byte_ratio_kept_95", "targets", "targets_multiple_choice", "settings"):
        assert resumed[key] == uninterrupted[key]
    first, second = resumed["pieces"]
    assert first == uninterrupted["pieces"][0] and first["runs_computed"] == 12
    assert second["runs_computed"] == len(missing) and second["threads"] == 1
    assert resumed["seconds_total"] == pytest.approx(first["seconds"] + second["seconds"])


def test_compaction_qa_refuses_to_resume_other_settings(qa, tmp_path):
    out = tmp_path / "qa.json"
    argv = [*QA_RESUMED, "--out", str(out)]
    settings = qa.run_settings(qa.parse_args(argv))
    assert "threads" in settings and not {"out", "plot", "fresh", "variants"} & set(settings)
    out.write_text(json.dumps({"settings": settings, "runs": [], "documents": [], "seconds_total": 1.5}))
    with pytest.raises(
        ValueError,
        match=r"--out \S+qa.json holds a run with other settings \(--ratios: file \[4.0, "
        r"8.0\], this run \[4.0\]; --choices: file 2, this run 0\)",
    ):
        qa.main([*argv, "--ratios", "4", "--choices", "0"])  # refused before the model loads
    earlier = qa.Earlier.load(qa.parse_args([*argv, "--threads", "3", "--plot", str(tmp_path / "p.png")]))  # resumes
    assert earlier.runs == {} and earlier.pieces == [
        {"seconds": 1.5, "threads": None, "runs_computed": 0, "git": {"commit": None}}
    ]  # a file written before pieces: one piece of its seconds_total
    assert qa.Earlier.load(qa.parse_args([*argv, "--ratios", "4", "--fresh"])) == qa.Earlier({}, {}, [])
    out.write_text(
        json.dumps({"settings": without(settings, "storage"), "runs": [], "documents": [], "seconds_total": 1})
    )
    with pytest.raises(ValueError, match=r"--storage: file absent, this run \['bf16', 'int4'\]"):
        qa.Earlier.load(qa.parse_args(argv))
    run = {"seed": 0, "document": 0, "cache": "h2o", "ratio": 4.0, "storage": "bf16"}
    out.write_text(json.dumps({"settings": settings, "runs": [run], "documents": [], "seconds_total": 1}))
    with pytest.raises(ValueError, match=r"holds a run this run does not plan: \(0, 0, 'h2o', 4.0, 'bf16'\)"):
        qa.Earlier.load(qa.parse_args(argv))
    out.write_text("{}")
    with pytest.raises(ValueError, match="is not a compaction_qa.py result"):
        qa.Earlier.load(qa.parse_args(argv))
    document = {"seed": 0, "index": 1, "task": "needle", "source": {"depths": (0.25, 0.75)}}
    earlier = qa.Earlier({}, {(0, 1): json.loads(json.dumps(document))}, [])
    assert earlier.check_document(document, "x.json") and not earlier.check_document(document | {"index": 0}, "x")
    with pytest.raises(ValueError, match="x.json: seed 0 document 1 differs"):
        earlier.check_document(document | {"task": "squad"}, "x.json")


def test_compaction_qa_loads_a_model_folder(qa, tmp_path):
    from hf_structkv.models import tiny_byte_tokenizer, tiny_model

    model, tokenizer = tiny_model("qwen2", vocab_size=300), tiny_byte_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = qa.load_model(str(tmp_path), tiny=False)
    assert loaded.dtype == torch.float32 and not loaded.training
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert loaded_tokenizer("a b").input_ids == tokenizer("a b").input_ids
    assert qa.parse_args([]).model == "default" and qa.model_label("default") == "embedded Qwen2.5-Coder-0.5B"
    assert qa.model_label(str(tmp_path)) == str(tmp_path)


def test_compaction_qa_whole_cache_in_int4_keeps_every_entry(qa):
    from hf_structkv.compaction.head_storage import StorageLayout

    model, tokenizer = qa.load_model("default", tiny=True)
    ids = tokenizer("The special magic number is 1234567. " * 8, return_tensors="pt", add_special_tokens=False)
    length, dim = ids.input_ids.shape[1], model.config.hidden_size // model.config.num_attention_heads
    cache = qa.whole_cache_int4(model, tokenizer, ids.input_ids, seed=0)
    heads = model.config.num_key_value_heads
    assert cache.head_lengths() == [[length] * heads] * model.config.num_hidden_layers
    assert cache.head_storage() == [["int4"] * heads] * model.config.num_hidden_layers
    assert all(not layer.prefix_bias.any() for layer in cache.layers)
    per_layer = heads * StorageLayout("int4", dim, dim).nbytes(length) + 8  # key scales per head; + the offset
    assert cache.nbytes() == model.config.num_hidden_layers * per_layer
    assert cache.full_nbytes() == model.config.num_hidden_layers * heads * length * 2 * dim * 4  # FP32 keys, values


def test_compaction_qa_storage_rejects_what_compact_cannot_do(qa):
    assert [v.label for v in qa.parse_args(["--methods", "kv_surgeon", "h2o", "--storage", "int4"]).variants] == [
        "kv_surgeon+int4",
        "h2o+int4",
    ]
    args = qa.parse_args(["--methods", "kv_surgeon", "key_norm", "--storage", "bf16", "auto", "auto"])
    assert [v.label for v in args.variants] == ["kv_surgeon", "kv_surgeon+auto", "key_norm"]  # auto: calibrated only
    assert args.storage == ["bf16", "auto"] and qa.parse_args([]).storage == ["bf16"]
    for argv in (
        ["--storage", "nf4"],
        ["--storage", "int4", "--keep-template"],
        ["--storage", "auto", "--chunk-tokens", "512"],
        ["--storage", "auto", "--methods", "streaming_llm"],
    ):
        with pytest.raises(SystemExit):
            qa.parse_args(argv)


def test_compaction_qa_quality_against_bytes_tiny_run(qa, tmp_path):
    pytest.importorskip("long_context_eval")
    out = tmp_path / "bytes.json"
    argv = ["--tiny", "--tasks", "needle", "--doc-tokens", "300", "--questions", "3", "--choices", "3"]
    argv += ["--methods", "kv_surgeon", "streaming_llm", "--storage", "bf16", "int4", "auto", "--ratios", "10", "20"]
    qa.main([*argv, "--max-new-tokens", "2", "--query-cap", "32", "--out", str(out)])
    payload = json.loads(out.read_text())
    families = ["kv_surgeon", "kv_surgeon+int4", "kv_surgeon+auto", "streaming_llm", "streaming_llm+int4"]
    expected = [("full", 1.0), ("full+int4", 1.0)] + [(family, ratio) for family in families for ratio in (10.0, 20.0)]
    summary = payload["summary"]
    assert [(row["cache"], row["ratio"]) for row in summary] == expected
    (document,) = payload["documents"]
    runs = {run["cache"] + f"@{run['ratio']:g}": run for run in payload["runs"]}
    full, whole = runs["full@1"], runs["full+int4@1"]
    assert full["stored_bytes"] == full["full_bytes"] == 2 * 2 * document["context_tokens"] * 2 * 16 * 4  # FP32
    assert whole["full_bytes"] == full["full_bytes"] and whole["storage_heads"]["int4_heads"] == 4
    from hf_structkv.compaction.head_storage import StorageLayout

    int4_bytes = 2 * (2 * StorageLayout("int4", 16, 16).nbytes(document["context_tokens"]) + 8)  # 2 layers, 2 heads
    assert whole["stored_bytes"] == int4_bytes  # INT4 (D = 16, key scales per head) + each layer's offset
    for run in payload["runs"]:
        assert run["byte_ratio"] == pytest.approx(run["full_bytes"] / run["stored_bytes"])
        assert run["storage"] == ("bf16" if "+" not in run["cache"] else run["cache"].rpartition("+")[2])
        if run["cache"] in ("full", "full+int4"):
            continue
        if run["storage"] == "bf16":
            assert run["ratio"] * 0.95 < run["byte_ratio"] < run["ratio"]  # entry ratios: biases and offsets cost
        else:
            assert run["stored_bytes"] <= run["full_bytes"] / run["ratio"]  # byte ratios, measured
    for row in summary:
        assert row["vs_full"]["questions"] == row["choice_vs_full"]["questions"] == 3
        assert all(0 <= row[key]["p_value"] <= 1 for key in ("vs_full", "choice_vs_full"))
    assert summary[0]["choice_vs_full"] == {"questions": 3, "lost": 0, "gained": 0, "p_value": 1.0}
    for form, prefix in (("free-form", ""), ("multiple-choice", "choice_")):
        kept = payload["byte_ratio_kept_95"][form]
        assert list(kept) == ["full+int4", *families]
        full_accuracy = summary[0][f"{prefix}accuracy"]
        for family, ratio in kept.items():
            rows = [row for row in summary if row["cache"] == family]
            keeping = [row["byte_ratio"] for row in rows if row[f"{prefix}accuracy"] >= 0.95 * full_accuracy]
            assert ratio == (max(keeping) if keeping else None)
    for targets in (payload["targets"], payload["targets_multiple_choice"]):
        assert set(targets) == {"kv_surgeon", "kv_surgeon+int4", "kv_surgeon+auto"}
        ahead = targets["kv_surgeon+int4"]["at 20x fewer bytes ahead of kv_surgeon at 10x"]
        assert ahead.startswith(("met (", "not met (")) and "McNemar p" in ahead


def test_compaction_qa_smoke(tmp_path):
    pytest.importorskip("long_context_eval")
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "compaction_qa.json", tmp_path / "compaction_qa.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(QA_SCRIPT), "--tiny", "--doc-tokens", "900", "--questions", "2", "--seeds", "0", "1"]
    command += ["--ratios", "10", "50", "--max-new-tokens", "3", "--query-cap", "128", "--out", str(out)]
    subprocess.run([*command, "--plot", str(plot)], check=True, env=env, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    variants = ["kv_surgeon", "kv_surgeon:self_study", "loo", "am_hak", "h2o", "streaming_llm", "key_norm"]
    assert [(row["cache"], row["ratio"]) for row in result["summary"]] == [("full", 1.0)] + [
        (variant, ratio) for variant in variants for ratio in (10.0, 50.0)
    ]
    documents = result["documents"]
    tasks = ("squad", "hotpotqa", "needle")
    assert [(d["seed"], d["task"]) for d in documents] == [(seed, task) for seed in (0, 1) for task in tasks]
    assert len(result["runs"]) == len(documents) * (1 + 2 * len(variants))
    for row in result["summary"]:
        assert 0 <= row["accuracy"] <= 1 and len(row["accuracy_per_seed"]) == 2 and row["pipeline_seconds"] > 0
        assert set(row["accuracy_per_task"]) == set(tasks)
    for run in result["runs"]:
        if run["cache"] != "full":
            assert run["stored_bytes"] > 0
            assert (run["heldout_relative_loss"] is None) == (run["cache"] in ("streaming_llm", "key_norm"))
    assert set(result["targets"]) == {"kv_surgeon", "kv_surgeon:self_study"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------- benchmarks/compaction_loss.py
LOSS_SCRIPT = BENCHMARKS / "compaction_loss.py"


def test_compaction_loss_tiny_run_writes_json_and_plot(tmp_path):
    from hf_structkv.compaction import HEAD_METHODS

    pytest.importorskip("matplotlib")
    benchmark = load_script(LOSS_SCRIPT)
    out, plot = tmp_path / "loss.json", tmp_path / "loss.png"
    argv = ["--tiny", "--min-tokens", "200", "--questions", "3", "--self-study-tokens", "4", "--query-cap", "256"]
    argv += ["--threads", str(torch.get_num_threads())]  # main() sets the thread count: keep the session's
    payload = benchmark.main([*argv, "--out", str(out), "--plot", str(plot)])

    assert json.loads(out.read_text())["summary"] == payload["summary"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["text"]["context_tokens"] >= 200
    heads = len(payload["heads"])
    assert heads == 4  # tiny qwen2: 2 layers x 2 KV heads
    repeat, self_study = payload["summary"]["repeat"], payload["summary"]["self_study"]
    assert sorted(repeat) == ["10", "100", "20", "5", "50"] and sorted(self_study) == ["100", "50"]
    for by_method in (*repeat.values(), *self_study.values()):
        assert sorted(by_method) == sorted(HEAD_METHODS)
        for cell in by_method.values():
            assert cell["heads"] == heads and math.isfinite(cell["median_loss"]) and cell["median_loss"] >= 0
            assert cell["seconds_per_head"] > 0 and 0 <= cell["worse_than_eviction"] <= 1
    assert len(payload["records"]) == heads * len(HEAD_METHODS) * (5 + 2)
    for tier in ("repeat", "self_study"):
        for per_rival in payload["kv_surgeon_beats"][tier].values():
            assert sorted(per_rival) == ["am_hak", "loo"] and all(0 <= v <= 1 for v in per_rival.values())
    assert_loss_targets_follow_the_records(benchmark, payload)
    # query-free methods ignore the calibration tier: identical losses on both tiers
    assert self_study["50"]["streaming_llm"]["median_loss"] == repeat["50"]["streaming_llm"]["median_loss"]


def assert_loss_targets_follow_the_records(benchmark, payload):
    """Each verdict's ``met`` is what its target says of the per-head records (repeat tier), recomputed here."""
    repeat = [r for r in payload["records"] if r["tier"] == "repeat"]

    def per_head(ratio, method, field="heldout_loss"):
        return {(r["layer"], r["kv_head"]): r[field] for r in repeat if r["ratio"] == ratio and r["method"] == method}

    beats, lowest, time_factor = payload["targets"]
    surgeon, loo = per_head(10, "kv_surgeon"), per_head(10, "loo")
    share = sum(surgeon[head] < loo[head] for head in surgeon) / len(surgeon)
    assert payload["kv_surgeon_beats"]["repeat"]["10"]["loo"] == pytest.approx(share)
    assert beats["measured"] == f"{share:.1%} of heads" and beats["met"] == (share >= benchmark.TARGET_BEATS_LOO)
    medians = {
        (ratio, method): statistics.median(per_head(ratio, method).values())
        for ratio in {r["ratio"] for r in repeat if r["ratio"] >= 10}
        for method in {r["method"] for r in repeat}
    }
    assert lowest["met"] == all(
        medians[(ratio, "kv_surgeon")] < value for (ratio, method), value in medians.items() if method != "kv_surgeon"
    )
    seconds = [statistics.fmean(per_head(50, m, "seconds").values()) for m in ("kv_surgeon", "loo")]
    assert time_factor["met"] == (seconds[0] / seconds[1] <= benchmark.TARGET_TIME_FACTOR)


def loss_record(ratio, method, head, loss, **fields):
    """One repeat-tier record of compaction_loss.py on layer 0, with any further ``fields``."""
    return {
        "tier": "repeat",
        "ratio": ratio,
        "method": method,
        "layer": 0,
        "kv_head": head,
        "heldout_loss": loss,
    } | fields


def test_compaction_loss_reductions_match_hand_counts():
    benchmark = load_script(LOSS_SCRIPT)

    def record(ratio, method, head, loss, seconds=1.0):
        return loss_record(ratio, method, head, loss, heldout_eviction_loss=0.5, seconds=seconds)

    losses = {  # per ratio: method -> loss on heads 0, 1, 2
        10: {"kv_surgeon": [0.1, 0.2, 0.6], "loo": [0.2, 0.3, 0.4], "am_hak": [0.1, 0.1, 0.1]},
        50: {"kv_surgeon": [0.3, 0.3, 0.3], "loo": [0.4, 0.4, 0.4], "am_hak": [0.5, 0.5, 0.5]},
    }
    records = [
        record(ratio, method, head, loss, seconds=2.0 if method == "kv_surgeon" else 1.0)
        for ratio, per_method in losses.items()
        for method, per_head in per_method.items()
        for head, loss in enumerate(per_head)
    ]
    summary = benchmark.summarize(records)
    assert summary["repeat"]["10"]["kv_surgeon"]["median_loss"] == 0.2
    assert math.isclose(summary["repeat"]["10"]["kv_surgeon"]["mean_loss"], 0.3)
    assert math.isclose(summary["repeat"]["10"]["kv_surgeon"]["worse_than_eviction"], 1 / 3)
    fractions = benchmark.win_fractions(records)
    assert fractions["repeat"]["10"] == {"loo": 2 / 3, "am_hak": 0.0}  # a tie (0.1 vs 0.1) is not a win
    assert fractions["repeat"]["50"] == {"loo": 1.0, "am_hak": 1.0}
    verdicts = benchmark.target_verdicts(summary, fractions, [10, 50])
    assert [v["met"] for v in verdicts] == [False, False, False]  # 67% < 90%; am_hak lowest at 10x; 2x > 1.5x
    assert verdicts[1]["measured"] == "10x: kv_surgeon 0.2000, lowest am_hak 0.1000; 50x: kv_surgeon 0.3000 lowest"
    assert verdicts[2]["measured"] == "2.00x loo's time per head"


def test_compaction_loss_storage_run_compares_formats_at_equal_bytes(tmp_path):
    benchmark = load_script(LOSS_SCRIPT)
    argv = ["--tiny", "--min-tokens", "200", "--questions", "3", "--query-cap", "256", "--self-study-ratios"]
    argv += ["--storage", "bf16", "int4", "auto", "--key-groups", "none", "4", "--methods", "kv_surgeon", "loo"]
    argv += ["--ratios", "5", "10", "--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "int4.json")]
    payload = benchmark.main(argv)

    stored = ["+int4", "+int4/g4", "+auto", "+auto/g4"]
    labels = sorted(method + suffix for method in ("kv_surgeon", "loo") for suffix in ["", *stored])
    assert sorted(payload["summary"]["repeat"]["10"]) == labels
    records = payload["records"]
    assert len(records) == len(payload["heads"]) * 2 * len(labels)
    by_key = {(r["ratio"], r["method"], r["layer"], r["kv_head"]): r for r in records}
    for record in records:
        # each variant keeps the most entries its format fits in the byte budget, and stays within it
        assert record["bytes"] <= record["byte_budget"]
        if record["storage"] == "auto":
            # auto keeps INT4 or the dtype head of the same bytes, whichever fits the calibration queries better
            dtype_head = by_key[(record["ratio"], record["method"].split("+")[0], record["layer"], record["kv_head"])]
            assert record["train_loss"] <= dtype_head["train_loss"] + 1e-9
            assert record["storage_used"] in ("int4", "bf16")
            continue
        assert record["storage_used"] == ("bf16" if record["storage_fallback"] else record["storage"])
        if not record["storage_fallback"]:
            assert record["kept"] == record["budget"]
    length = payload["text"]["context_tokens"]
    one = next(r for r in records if r["ratio"] == 10 and r["method"] == "kv_surgeon")
    assert one["byte_budget"] == math.floor(length * (16 + 16) * 2 / 10)  # tiny qwen2: head_dim 16, BF16
    verdicts = {(v["variant"], v["ratio"]): v for v in payload["int4_targets"]}
    assert sorted(verdicts) == [(f"kv_surgeon{suffix}", ratio) for suffix in sorted(stored) for ratio in (5, 10)]
    assert verdicts[("kv_surgeon+int4", 5)]["met"] is None  # no target at 5x
    assert verdicts[("kv_surgeon+int4", 10)]["met"] in (True, False)


def test_compaction_loss_storage_verdicts_match_hand_counts():
    benchmark = load_script(LOSS_SCRIPT)

    def record(ratio, method, head, loss, fallback=False):
        storage = "int4" if "+int4" in method else "bf16"
        return loss_record(ratio, method, head, loss, storage=storage, storage_fallback=fallback)

    records = [record(20, "kv_surgeon", head, loss) for head, loss in enumerate([0.2, 0.4, 0.1])]
    records += [record(20, "kv_surgeon+int4", 0, 0.1), record(20, "kv_surgeon+int4", 1, 0.2)]
    records += [record(20, "kv_surgeon+int4", 2, 0.16, fallback=True)]
    (verdict,) = benchmark.storage_verdicts(records)
    assert verdict["median_int4"] == 0.16 and verdict["median_bf16"] == 0.2
    assert math.isclose(verdict["median_ratio"], 0.8) and math.isclose(verdict["worst_head_ratio"], 1.6)
    assert math.isclose(verdict["fallback_share"], 1 / 3) and verdict["heads"] == 3
    assert verdict["met"] is False  # 0.8x > 0.75x at 20x, and one head at 1.6x > 1.5x


# --------------------------------------------------------------------------------- benchmarks/bfcl_budget.py
def test_bfcl_budget_tiny_run_writes_records_and_plot(tmp_path):
    pytest.importorskip("bfcl_eval")
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "bfcl_budget.json", tmp_path / "bfcl_budget.png"
    command = [sys.executable, str(BENCHMARKS / "bfcl_budget.py"), "--tiny", "--categories", "simple_python"]
    command += ["--max-new-tokens", "6", "--budgets", "0.33", "1.0", "--out", str(out), "--plot", str(plot)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    methods = ["full_kv", "streaming_llm", "h2o", "snapkv", "mikv", "criticalkv", "pask"]
    assert [(r["method"], r["target_B"]) for r in result["records"]] == [("full_kv", 1.0)] + [
        (m, 0.33) for m in methods[1:]
    ]
    for record in result["records"]:
        assert record["cases"] == 1 and 0 <= record["accuracy"] <= 1 and 0 < record["measured_B"] <= 1
        assert set(record["per_category"]) == {"simple_python"} and record["nbytes"] > 0
        assert 0 < record["measured_B_P"] <= 1 and 0 <= record["measured_B_D"] <= 1
        (case,) = record["records"]
        for stage in ("prefill", "decode"):
            want = case[f"{stage}_payload_bytes"] / case[f"{stage}_full_bytes"]
            assert record[f"measured_B_{stage[0].upper()}"] == pytest.approx(want)
    full_kv = result["records"][0]
    assert full_kv["measured_B"] == full_kv["measured_B_P"] == full_kv["measured_B_D"] == 1.0
    assert result["records"][-1]["label"] == "pask (illustrative)"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bfcl_budget_skips_the_development_split_when_no_method_uses_its_lengths(tmp_path):
    pytest.importorskip("bfcl_eval")
    script = load_script(BENCHMARKS / "bfcl_budget.py")
    common = ["--tiny", "--categories", "simple_python", "--max-new-tokens", "4", "--budgets", "0.5"]
    alone = script.main([*common, "--methods", "full_kv", "pask", "--out", str(tmp_path / "a.json")])
    assert alone["dev_cases_per_category"] == 0 and alone["dev_lengths"] == [] and alone["dev_full_kv_accuracy"] is None
    with_baseline = script.main([*common, "--methods", "mikv", "--dev-cases", "1", "--out", str(tmp_path / "b.json")])
    assert with_baseline["dev_cases_per_category"] == 1 and len(with_baseline["dev_lengths"]) == 1
    split = script.main(
        [*common, "--methods", "pask", "--dev-cases", "1", "--pask-stage-split", "calibrated_decode"]
        + ["--out", str(tmp_path / "c.json")]
    )
    assert len(split["dev_lengths"]) == 1


def test_bfcl_budget_pask_prefill_swaps_the_prefill_policy_of_the_pask_row(tmp_path):
    pytest.importorskip("bfcl_eval")
    from hf_structkv.policy import GroupCosts, illustrative_prefill_policy

    script = load_script(BENCHMARKS / "bfcl_budget.py")
    tokenizer = script.tiny_byte_tokenizer()
    model = script.tiny_model("qwen2", vocab_size=len(tokenizer), num_hidden_layers=3)
    costs = GroupCosts.from_config(model.config)
    # no entry: every prompt label is planned H, so the swapped-in policy keeps the whole prompt (B_P = 1)
    keep_all = dataclasses.replace(illustrative_prefill_policy(), costs=costs, fingerprint=None, entries={})
    keep_all.save_pretrained(tmp_path / "keep_all")
    common = ["--tiny", "--categories", "simple_python", "--max-new-tokens", "4", "--budgets", "0.33"]
    common += ["--methods", "pask"]
    own = script.main([*common, "--out", str(tmp_path / "own.json")])
    folder = str(tmp_path / "keep_all")
    swapped = script.main([*common, "--pask-prefill", folder, "--out", str(tmp_path / "swapped.json")])
    (own_row,), (swapped_row,) = own["records"], swapped["records"]
    assert own_row["label"] == "pask (illustrative)" and own_row["measured_B_P"] < 1
    assert swapped_row["label"] == f"pask +prefill {folder} (illustrative)"
    assert swapped_row["measured_B_P"] == 1.0 and swapped_row["knobs"]["B_D"] == own_row["knobs"]["B_D"] == 0.33
    with pytest.raises(ValueError, match="neither a shipped pair nor a folder with prefill_policy.json"):
        script.load_prefill(str(tmp_path), None)
    # the provenance of what is served: a calibrated table swapped beside a calibrated prefill is "calibrated", not
    # joined with the illustrative prefill its folder lacked
    calibrated, illustrative = SimpleNamespace(provenance="calibrated"), SimpleNamespace(provenance="illustrative")
    assert script.pair_provenance(calibrated, calibrated) == "calibrated"
    assert script.pair_provenance(calibrated, illustrative) == "calibrated+illustrative"
    with pytest.raises(SystemExit):
        script.main(["--tiny", "--methods", "full_kv", "--pask-prefill", folder, "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):  # refused before the model is loaded
        script.main([*common, "--pask-prefill", str(tmp_path), "--out", str(tmp_path / "y.json")])


def test_bfcl_budget_int4_keys_serves_every_cache_with_that_key_layout(tmp_path, monkeypatch):
    pytest.importorskip("bfcl_eval")
    script = load_script(BENCHMARKS / "bfcl_budget.py")
    layouts, evaluate = [], script.evaluate_bfcl
    monkeypatch.setattr(script, "evaluate_bfcl", lambda *a, **k: layouts.append(k["int4_keys"]) or evaluate(*a, **k))
    common = ["--tiny", "--categories", "simple_python", "--max-new-tokens", "4", "--budgets", "0.33"]
    result = script.main(
        [*common, "--methods", "full_kv", "pask", "--int4-keys", "centred", "--out", str(tmp_path / "c.json")]
    )
    full_kv, pask = result["records"]
    assert layouts == ["centred", "centred"] and "int4_keys" not in full_kv["knobs"]
    assert pask["label"] == "pask (illustrative) [centred keys]" and pask["knobs"]["int4_keys"] == "centred"
    plain = script.main([*common, "--methods", "pask", "--out", str(tmp_path / "row.json")])  # the policy's: row
    assert plain["records"][0]["label"] == "pask (illustrative)" and plain["records"][0]["knobs"]["int4_keys"] == "row"
    with pytest.raises(SystemExit):
        script.main([*common, "--int4-keys", "channel"])


def test_bfcl_budget_split_development_answers_the_development_partition(tmp_path):
    pytest.importorskip("bfcl_eval")
    from hf_structkv.eval.bfcl import bfcl_split

    script = load_script(BENCHMARKS / "bfcl_budget.py")
    common = ["--tiny", "--categories", "simple_python", "--max-new-tokens", "2", "--budgets", "0.33"]
    common += ["--cases", "2", "--first-case", "1", "--methods", "full_kv", "pask"]
    dev = script.main([*common, "--split", "development", "--out", str(tmp_path / "dev.json")])
    expected = [entry.id for entry in bfcl_split(["simple_python"], "development", limit=2, start=1)]
    assert dev["split"] == "development" and len(dev["records"]) == 2
    for row in dev["records"]:
        assert [case["id"] for case in row["records"]] == expected
    test = script.main([*common, "--out", str(tmp_path / "test.json")])
    assert test["split"] == "test" and not set(expected) & {c["id"] for c in test["records"][0]["records"]}
    with pytest.raises(ValueError, match="the runs differ in 'split'"):  # a development run never joins a test run
        script.merge_runs([dev, {**test, "records": []}])
    old = {key: value for key, value in test.items() if key != "split"}  # files written before --split answered test
    assert script.merge_runs([test, {**old, "records": []}])["split"] == "test"
    for refused in (["--methods", "mikv"], ["--pask-stage-split", "calibrated_decode"]):
        with pytest.raises(SystemExit):  # baselines' knobs and stage splits are fitted on the development cases
            script.main([*common, *refused, "--split", "development", "--out", str(tmp_path / "x.json")])


def test_int4_key_layouts_attention_errors_match_a_per_query_loop_and_the_row_bytes_are_closed_form(tmp_path):
    script = load_script(BENCHMARKS / "int4_key_layouts.py")
    torch.manual_seed(0)
    heads, groups, window, total, d, sinks = 2, 2, 3, 9, 8, 2
    queries = torch.randn(heads, groups * window, d)
    keys, values = torch.randn(heads, total, d), torch.randn(heads, total, d)
    kept = slice(sinks, total - window)  # the stored tokens: after the sinks, before the window
    served_keys = keys[:, kept] + 0.3 * torch.randn(heads, total - window - sinks, d)
    served_values = values[:, kept] - 0.2
    errors = script.attention_errors(queries, keys, values, served_keys, served_values, window, 0.5, sinks)
    expected = []
    for head in range(heads):
        for row in range(groups * window):
            position = total - window + row % window  # causal: the row sees positions 0 .. position
            q, k, v = queries[head, row], keys[head, : position + 1], values[head, : position + 1]
            k2, v2 = keys[head].clone(), values[head].clone()
            k2[kept], v2[kept] = served_keys[head], served_values[head]
            k2, v2 = k2[: position + 1], v2[: position + 1]
            exact, served = torch.softmax(k @ q * 0.5, 0) @ v, torch.softmax(k2 @ q * 0.5, 0) @ v2
            expected.append(float((served - exact).norm() / exact.norm()))
    assert errors == pytest.approx(expected, rel=1e-5)
    unchanged = script.attention_errors(queries, keys, values, keys[:, kept], values[:, kept], window, 0.5, sinks)
    assert unchanged == [0.0] * 12
    n = 64  # bytes of one K row per head: codes d/2, plus a row scale or a scale and offset per channel and group
    rows = torch.randn(heads, n, d)
    assert script.stored_keys(rows, "keys exact")[1] == 2 * d
    assert script.stored_keys(rows, "row")[1] == d / 2 + 2
    assert script.stored_keys(rows, "row/smoothed")[1] == d / 2 + 2 + 2 * d / n
    assert script.stored_keys(rows, "row/centred")[1] == d / 2 + 2 + 4 * d / n
    assert script.stored_keys(rows, "channel/g32")[1] == d / 2 + 4 * d / 32
    assert script.stored_keys(rows, "channel/prompt")[1] == d / 2 + 4 * d / n
    assert script.stored_keys(rows, "row/centred+rotated")[1] == d / 2 + 2 + 4 * d / n
    assert script.stored_keys(rows, "row/centred/g64")[1] == d / 2 + 2 + 4 * d / 64
    assert script.stored_keys(rows, "row/centred/g48")[1] == d / 2 + 2 + 4 * d * 2 / n  # groups of 48 and 16 rows
    assert script.stored_keys(rows, "row/centre/g32")[1] == d / 2 + 2 + 2 * d * 3 / n  # two centres and one spread
    # one group holding every stored token is the prompt-wide centred layout fitted to them
    assert torch.equal(script.stored_keys(rows, "row/centred/g64")[0], script.stored_keys(rows, "row/centred", rows)[0])
    halves = [script.stored_keys(rows[:, a : a + 32], "row/centred")[0] for a in (0, 32)]
    assert torch.equal(script.stored_keys(rows, "row/centred/g32")[0], torch.cat(halves, dim=1))
    hadamard = script.hadamard(d)
    assert torch.allclose(hadamard @ hadamard.T, torch.eye(d), atol=1e-6)
    assert torch.allclose(hadamard.abs(), torch.full((d, d), d**-0.5))
    # the rotated layout is the centred one turned by the rotation: by the identity, the same rows
    assert torch.equal(script.centred(rows, rows, torch.eye(d)), script.centred(rows, rows))
    for layout in set(script.LAYOUTS) - {"row/centred+rotated"}:  # a rotation spreads a row's error over its channels
        served, _ = script.stored_keys(rows, layout)
        assert served.shape == rows.shape and (served - rows).abs().max() < 0.6 * rows.abs().max() / 7


def test_int4_key_layouts_runs_on_the_tiny_model(tmp_path):
    pytest.importorskip("bfcl_eval")
    script = load_script(BENCHMARKS / "int4_key_layouts.py")
    out = tmp_path / "layouts.json"
    payload = script.main(["--tiny", "--cases", "1", "--categories", "simple_python", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == payload["rows"] and payload["split"] == "development"
    rows = {row["layout"]: row for row in payload["rows"]}
    assert list(rows) == list(script.LAYOUTS) and rows["keys exact"]["bytes_per_row"] > rows["row"]["bytes_per_row"]
    assert all(0 < row["median"] <= row["p90"] for row in payload["rows"])


def test_bfcl_budget_serves_the_shipped_calibrated_pair_at_the_target_budgets():
    pytest.importorskip("bfcl_eval")
    from hf_structkv.policy import calibrated_policy, calibrated_prefill_policy

    script = load_script(BENCHMARKS / "bfcl_budget.py")
    table, prefill, label = script.load_pask("calibrated", None)
    assert label == "calibrated" and table == calibrated_policy() and prefill == calibrated_prefill_policy()
    served, served_prefill = script.pask_at(table, prefill, 0.33)
    assert served.budget == served_prefill.budget == 0.33
    assert served.entries == table.entries and served_prefill.entries == prefill.entries
    # calibrated_decode: B_D stays the calibrated one, B_P makes the development total equal the target
    lengths = [(300, 40), (700, 60)]
    served, served_prefill = script.pask_at(table, prefill, 0.33, "calibrated_decode", lengths)
    assert served is table and served_prefill.entries == prefill.entries
    total = (1000 * served_prefill.budget + 100 * table.budget) / 1100
    assert total == pytest.approx(0.33) and 0 <= served_prefill.budget <= 1
    assert script.pask_at(table, prefill, 0.01, "calibrated_decode", lengths)[1].budget == 0.0  # clipped
    with pytest.raises(ValueError, match="development lengths"):
        script.pask_at(table, prefill, 0.33, "calibrated_decode")
    with pytest.raises(ValueError, match="split must be one of"):
        script.pask_at(table, prefill, 0.33, "halves")


def _budget_case(case_id: str, valid: bool, payload: float) -> dict:
    """A per-case record as `evaluate_bfcl` writes it (the fields `merge_runs`, `--compare` and the summaries read)."""
    return {
        "id": case_id,
        "category": case_id.rsplit("_", 1)[0],
        "valid": valid,
        "text": f"reply to {case_id}",
        "budget_ratio": payload / 100,
        "nbytes": 10,
        "full_nbytes": 20,
        "seconds": 1.0,
        "scheduled_payload_bytes": payload,
        "full_payload_bytes": 100.0,
        "prefill_payload_bytes": payload / 2,
        "prefill_full_bytes": 50.0,
        "decode_payload_bytes": payload / 2,
        "decode_full_bytes": 50.0,
    }


def _budget_run(script, first: int, payloads: dict[str, float], categories=("simple_python",)) -> dict:
    rows = []
    for label, payload in payloads.items():
        cases = [_budget_case(f"{c}_{i}", i % 2 == 0, payload) for c in categories for i in (first, first + 1)]
        row = {"method": label, "label": label, "target_B": 0.33, "knobs": {"k": 1}, "provenance": None}
        rows.append(script.method_record(row, cases, seconds=2.0 * len(cases)))
    settings = dict(seed=0, window=32, max_new_tokens=160, torch="t", transformers="x")
    return {
        "model": "m",
        "categories": list(categories),
        "first_case": first,
        "cases_per_category": 2,
        **settings,
        "records": rows,
    }


def test_bfcl_budget_merge_joins_disjoint_runs_case_for_case(tmp_path):
    script = load_script(BENCHMARKS / "bfcl_budget.py")
    first, second = _budget_run(script, 0, {"a": 30.0, "b": 50.0}), _budget_run(script, 2, {"a": 40.0, "b": 50.0})
    merged = script.merge_runs([first, second])
    assert [r["label"] for r in merged["records"]] == ["a", "b"]
    a = merged["records"][0]
    assert a["cases"] == 4 and a["accuracy"] == 0.5 and a["seconds"] == 8.0  # cases 0 and 2 valid, 1 and 3 not
    assert a["measured_B"] == pytest.approx((30 * 2 + 40 * 2) / 400)  # pooled over the union, not a mean of runs
    assert [c["id"] for c in a["records"]] == [f"simple_python_{i}" for i in range(4)]
    assert [m["first_case"] for m in merged["merged_from"]] == [0, 2]
    other = _budget_run(script, 0, {"a": 30.0, "b": 50.0}, categories=("multiple",))  # other categories join too
    assert script.merge_runs([first, other])["categories"] == ["simple_python", "multiple"]
    # the command line: --merge reads the files and writes the joined result
    paths = [tmp_path / "first.json", tmp_path / "second.json"]
    for path, payload in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(payload))
    out = tmp_path / "merged.json"
    assert script.main(["--merge", *map(str, paths), "--out", str(out)])["records"][0]["cases"] == 4
    assert json.loads(out.read_text())["records"][1]["label"] == "b"
    # --drop leaves a row of one file out: "b" of the first run is superseded by a "b" over all four cases
    whole = _budget_run(script, 0, {"b": 70.0})
    whole["records"][0]["records"] += _budget_run(script, 2, {"b": 70.0})["records"][0]["records"]
    (tmp_path / "whole.json").write_text(json.dumps(whole))
    merged = script.main(
        ["--merge", *map(str, paths), str(tmp_path / "whole.json"), "--out", str(out)]
        + ["--drop", f"{paths[0]}:b", "--drop", f"{paths[1]}:b"]
    )
    assert [(r["label"], r["cases"], r["measured_B"]) for r in merged["records"]] == [("a", 4, 0.35), ("b", 4, 0.7)]
    with pytest.raises(SystemExit):
        script.main(["--merge", *map(str, paths), "--drop", f"{paths[0]}:c", "--out", str(out)])


def test_bfcl_budget_compare_pairs_rows_case_for_case(tmp_path, capsys):
    script = load_script(BENCHMARKS / "bfcl_budget.py")
    first = _budget_run(script, 0, {"a": 30.0, "b": 50.0})  # cases 0 solved, 1 not, in both rows
    second = _budget_run(script, 0, {"c": 40.0})
    second["records"][0]["records"][0]["valid"] = False  # c loses case 0 ...
    second["records"][0]["records"][1]["valid"] = True  # ... and gains case 1
    second["records"][0]["records"][1]["text"] = "another reply"
    paths = [tmp_path / "first.json", tmp_path / "second.json"]
    for path, payload in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(payload))
    out = tmp_path / "compare.json"
    result = script.main(["--compare", f"{paths[0]}:a", f"{paths[0]}:b@0.33", f"{paths[1]}:c", "--out", str(out)])
    b, c = result["comparisons"]
    assert (b["lost"], b["gained"], b["same_text"], b["p_value"]) == ([], [], 2, 1.0)
    assert (c["lost"], c["gained"], c["same_text"]) == (["simple_python_0"], ["simple_python_1"], 1)
    assert json.loads(out.read_text()) == result and "McNemar p" in capsys.readouterr().out
    assert not (tmp_path / "benchmarks").exists()
    for argv in (
        [f"{paths[0]}:a"],  # one row: nothing to compare
        [f"{paths[0]}:a", f"{paths[0]}:z"],  # no such label
        [f"{paths[0]}:a", f"{paths[0]}:a@0.5"],  # no such target
        [f"{paths[0]}:a", str(tmp_path / "missing.json") + ":a"],
        [f"{paths[0]}:a", f"{_write(tmp_path, _budget_run(script, 2, {'a': 30.0}))}:a"],  # other cases
    ):
        with pytest.raises(SystemExit):
            script.main(["--compare", *argv])


def _write(tmp_path, payload: dict):
    path = tmp_path / "other_cases.json"
    path.write_text(json.dumps(payload))
    return path


def test_bfcl_budget_merge_refuses_what_would_not_compare():
    script = load_script(BENCHMARKS / "bfcl_budget.py")
    first = _budget_run(script, 0, {"a": 30.0, "b": 50.0})
    with pytest.raises(ValueError, match="at least two"):
        script.merge_runs([first])
    with pytest.raises(ValueError, match="answers a case twice"):
        script.merge_runs([first, _budget_run(script, 1, {"a": 30.0, "b": 50.0})])
    with pytest.raises(ValueError, match="different cases"):
        script.merge_runs([first, _budget_run(script, 2, {"a": 30.0})])
    with pytest.raises(ValueError, match="differ in 'max_new_tokens'"):
        script.merge_runs([first, {**_budget_run(script, 2, {"a": 30.0, "b": 50.0}), "max_new_tokens": 96}])
    with pytest.raises(ValueError, match="ran h2o with different knobs"):
        script.merge_runs(
            [
                {**first, "baseline_knobs": {"h2o": {"sink_tokens": 4}}},
                {**_budget_run(script, 2, {"a": 30.0, "b": 50.0}), "baseline_knobs": {"h2o": {"sink_tokens": 8}}},
            ]
        )
    changed = _budget_run(script, 2, {"a": 30.0, "b": 50.0})
    changed["records"][0]["knobs"] = {"k": 2}
    with pytest.raises(ValueError, match="different knobs"):
        script.merge_runs([first, changed])
    # a row written before --int4-keys served row keys: it joins a row that says so, not a centred one, and the
    # merged row states the layout
    first["records"][0]["knobs"] = {"k": 1}
    for layout, joins in (("row", True), ("centred", False)):
        later = _budget_run(script, 2, {"a": 30.0, "b": 50.0})
        later["records"][0]["knobs"] = {"k": 1, "int4_keys": layout}
        if joins:
            assert script.merge_runs([first, later])["records"][0]["knobs"] == {"k": 1, "int4_keys": "row"}
        else:
            with pytest.raises(ValueError, match="different knobs"):
                script.merge_runs([first, later])


# --------------------------------------------------------------------------------- benchmarks/bfcl_accuracy.py
def test_bfcl_accuracy_aligns_the_decode_budget_of_compressing_tables_only():
    pytest.importorskip("bfcl_eval")
    from hf_structkv.policy import PolicyTable, illustrative_policy

    script = load_script(BENCHMARKS / "bfcl_accuracy.py")
    table, reference = illustrative_policy(), PolicyTable.all_high(illustrative_policy().costs)
    assert script.at_decode_budget(table, 0.25).budget == 0.25 and table.budget == 0.5
    assert script.at_decode_budget(table, 0.25).entries == table.entries
    assert script.at_decode_budget(table, None) is table and script.at_decode_budget(reference, 0.25) is reference
    assert script.build_parser().parse_args(["--decode-budget", "0.3"]).decode_budget == 0.3


def test_runtime_v_resume_smoke(tmp_path):
    """The tiny runs compare full and resumed decode and prefill interventions and find them equal."""
    pytest.importorskip("bfcl_eval")
    out = tmp_path / "runtime_v_resume.json"
    command = [sys.executable, str(BENCHMARKS / "runtime_v_resume.py"), "--tiny", "--category", "simple_python"]
    command += ["--max-new-tokens", "24", "--window", "3", "--interventions", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for stage in ("decode", "prefill"):
        subprocess.run([*command, "--stage", stage], check=True, env=env, timeout=600, capture_output=True)
        result = json.loads(out.read_text())
        assert result["stage"] == stage and result["rows"] and result["all_equal"] and result["record_seconds"] > 0
        assert all(row["first_changed_forward"] <= row["generated_tokens"] for row in result["rows"])
    assert all(row["first_changed_forward"] == 1 for row in result["rows"])  # prefill: after the prompt forward


def test_on_policy_cost_smoke(tmp_path):
    out = tmp_path / "on_policy_cost.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    variants = ["block replay", "forward per layer", "block replay, reference attention"]
    command = [sys.executable, str(BENCHMARKS / "on_policy_cost.py"), "--tiny", "--ratio", "8", "--out", str(out)]
    subprocess.run([*command, "--variants", *variants], check=True, env=env, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert [row["variant"] for row in result["rows"]] == variants and result["context_tokens"] == 96
    assert all(row["max_abs_difference_from_first"] < 1e-4 for row in result["rows"])
    assert result["rows"][0]["max_abs_difference_from_first"] == 0 and result["rows"][0]["seconds_over_first"] == 1
    losses = [row["heldout_relative_loss"] for row in result["rows"]]
    assert losses == pytest.approx([losses[0]] * 3, abs=1e-5) and all(row["seconds"] > 0 for row in result["rows"])


def test_head_fit_cost_smoke(tmp_path):
    out = tmp_path / "head_fit_cost.json"
    argv = ["--length", "250", "--queries", "48", "--kept", "25", "6", "--head-dim", "8", "--repeats", "1"]
    argv += ["--threads", str(torch.get_num_threads()), "--out", str(out)]  # main() sets the thread count
    result = load_script(BENCHMARKS / "head_fit_cost.py").main(argv)
    assert json.loads(out.read_text()) == result
    assert [row["kept"] for row in result["fits"]] == [25, 6]
    assert all(row["seconds"] > 0 and row["peak_gib_growth"] >= 0 and row["train_loss"] >= 0 for row in result["fits"])
    assert [(row["kept"], row["pool"]) for row in result["eliminations"]] == [(25, 100), (6, 24)]
    assert all(row["same_kept_positions"] and row["in_place_seconds"] > 0 for row in result["eliminations"])


# ------------------------------------------------------------------------------------ benchmarks/controller_overhead.py
def test_controller_overhead_smoke(tmp_path):
    """Both engines walk a short call list: per-history medians, ratios to the shortest history, memory added."""
    out = tmp_path / "controller_overhead.json"
    command = [sys.executable, str(BENCHMARKS / "controller_overhead.py"), "--engine", "xgrammar", "lmfe"]
    command += ["--histories", "16", "48", "--lmfe-histories", "16", "--window", "6", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert list(result["engines"]) == ["xgrammar", "lmfe"] and result["threads"] == 1 and "provenance" in result
    for engine, histories in (("xgrammar", [16, 48]), ("lmfe", [16])):
        record = result["engines"][engine]
        assert [row["history"] for row in record["rows"]] == histories and record["rows"][0]["ratio_to_shortest"] == 1
        for row in record["rows"]:
            assert row["tokens_timed"] == 6 and row["per_token_ms"] >= row["masking_ms"] > 0 and row["tagging_us"] > 0
        assert record["max_per_token_ms"] == max(row["per_token_ms"] for row in record["rows"])
    assert result["engines"]["lmfe"]["rss_mib_per_1k_tokens"] is None  # one history: no slope
    assert result["max_rollback_tokens"] is None


def test_controller_overhead_with_a_rollback_bound(tmp_path):
    out = tmp_path / "bounded.json"
    command = [sys.executable, str(BENCHMARKS / "controller_overhead.py"), "--engine", "xgrammar"]
    command += ["--histories", "16", "48", "--window", "4", "--max-rollback-tokens", "8", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert result["max_rollback_tokens"] == 8 and [r["history"] for r in result["engines"]["xgrammar"]["rows"]] == [
        16,
        48,
    ]
    refused = subprocess.run(
        [sys.executable, str(BENCHMARKS / "controller_overhead.py"), "--max-rollback-tokens", "8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode == 2 and "pass --engine xgrammar" in refused.stderr


def test_controller_overhead_summary_against_hand_counts():
    script = load_script(BENCHMARKS / "controller_overhead.py")
    rows = [
        {"history": 128, "per_token_ms": 0.4, "ratio_to_shortest": 1.0, "rss_growth_mib": 1.0},
        {"history": 1152, "per_token_ms": 0.42, "ratio_to_shortest": 1.05, "rss_growth_mib": 3.0},
    ]
    assert script.summary(rows) == {
        "max_per_token_ms": 0.42,
        "max_ratio_to_shortest": 1.05,
        "rss_mib_per_1k_tokens": 2.0,  # 2 MiB over 1024 tokens
        "time_target_met": True,
    }
    rows[1]["ratio_to_shortest"] = 1.2
    assert not script.summary(rows)["time_target_met"]


# ------------------------------------------------------------------------------------------ benchmarks/serving_cost.py
@pytest.fixture(scope="module")
def serving():
    return load_script(BENCHMARKS / "serving_cost.py")


def test_serving_cost_random_kv_tiny_run(serving, tmp_path):
    """Every (context, batch, cache) row with its fields; the compacted caches store what their ratios promise."""
    out = tmp_path / "serving_cost.json"
    argv = ["--random-kv", "--tiny", "--contexts", "64", "160", "--batches", "1", "4", "--new-tokens", "3"]
    result = serving.main([*argv, "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["mode"] == "random_kv" and "provenance" in result
    caches = [serving.FULL, serving.BF16, serving.INT4, serving.FLOOR]
    keys = [(row["context_tokens"], row["batch"], row["cache"]) for row in result["rows"]]
    assert keys == [(t, b, cache) for t in (64, 160) for b in (1, 4) for cache in caches]
    layers, kv_heads, head_dim, element_bytes = 2, 2, 16, 4  # tiny_model("qwen2"), float32
    for row in result["rows"]:
        full_bytes = row["context_tokens"] * layers * kv_heads * 2 * head_dim * element_bytes
        assert math.isfinite(row["s_per_token"])  # tiny-model times are noise, even negative
        if row["cache"] == serving.FULL:
            assert row["stored_bytes"] == full_bytes and row["batch_bytes"] == full_bytes * row["batch"]
            assert row["speedup"] == row["byte_ratio"] == 1
        elif row["cache"] == serving.FLOOR:
            assert row["stored_bytes"] == row["batch_bytes"] == 0 and row["byte_ratio"] is None
            assert row["over_floor"] == 1
        else:  # one shared copy of the context for the whole batch
            assert row["batch_bytes"] == row["stored_bytes"] and row["byte_ratio"] == full_bytes / row["stored_bytes"]
        if row["cache"] == serving.BF16:  # floor(T / 10) entries per head, each with an FP32 bias; H + 1 offsets
            entries = row["context_tokens"] // 10
            assert row["stored_bytes"] == layers * (kv_heads * entries * (2 * head_dim * element_bytes + 4) + 8 * 3)
        if row["cache"] == serving.INT4:  # the bytes of floor(T / 20) entries per head, spent to within one INT4
            # entry and one row of key scales and offsets per head; the extra row offset of each layer is no head's
            budget = layers * kv_heads * (row["context_tokens"] // 20) * 2 * head_dim * element_bytes
            rounding = layers * kv_heads * ((head_dim + 2 + 4) + 2 * head_dim * 2)
            assert budget - rounding <= row["stored_bytes"] <= budget + 8 * layers <= full_bytes / 20 + 8 * layers
    verdicts = result["verdicts"]
    assert len(verdicts) == 2 and all(name.startswith(f"{serving.INT4} at 160 tokens, batch ") for name in verdicts)
    assert all(verdict.split(" (")[0] in ("met", "not met") for verdict in verdicts.values())


def test_serving_cost_random_caches_are_those_compact_builds(serving):
    """The random contexts are compacted as compact(method="streaming_llm", budgets="uniform") compacts a prefill."""
    from hf_structkv.compaction import compact, prefill_context
    from hf_structkv.models import tiny_model

    model = tiny_model("qwen2", vocab_size=300)
    ids = torch.randint(3, 259, (1, 200), generator=torch.Generator().manual_seed(0))
    prefilled = prefill_context(model, ids)
    for ratio, storage in ((serving.BF16_RATIO, "bf16"), (serving.INT4_RATIO, "int4")):
        built = serving.compacted_random_cache(model, prefilled, ratio, storage)
        expected = compact(
            model, None, ids, ratio=ratio, method="streaming_llm", budgets="uniform", storage=storage, progress=False
        )
        assert built.head_storage() == [[storage] * 2] * 2 and built.head_lengths() == expected.head_lengths()
        for layer, expected_layer in zip(built.layers, expected.layers, strict=True):
            assert all(map(torch.equal, layer.context_tensors(), expected_layer.context_tensors()))
    random_cache = serving.random_context_cache(model, 96)
    assert [tuple(layer.keys.shape) for layer in random_cache.layers] == [(1, 2, 96, 16)] * 2
    assert serving.context_nbytes(random_cache) == 2 * 2 * 96 * 2 * 16 * 4


def serving_row(context, batch, cache, speedup, over_floor):
    return {"context_tokens": context, "batch": batch, "cache": cache, "speedup": speedup, "over_floor": over_floor}


def test_serving_cost_verdicts_at_the_longest_context(serving):
    int4 = serving.INT4
    rows = [serving_row(4096, 4, int4, 9.0, 1.0), serving_row(4096, 1, int4, 1.0, 1.0)]
    rows += [serving_row(16384, 4, int4, 4.0, 2.0), serving_row(16384, 1, int4, 1.0, 1.15)]
    rows.append(serving_row(16384, 1, serving.FULL, 1.0, 1.0))
    fast = f"{int4} at 16384 tokens, batch 4: >= 4x faster than DynamicCache"
    floor = f"{int4} at 16384 tokens, batch 1: within 1.1x of the weights-only floor"
    assert serving.target_verdicts(rows) == {fast: "met (4.00x)", floor: "not met (1.15x)"}
    rows[-2] = serving_row(16384, 1, int4, 1.0, 1.1)
    assert serving.target_verdicts(rows)[floor] == "met (1.10x)"
    assert serving.target_verdicts(rows[1:2] + rows[-2:])[fast] == "not measured (batch 4 not run)"
    rows[2] = serving_row(16384, 4, int4, 3.99, 1.0)
    assert serving.target_verdicts(rows)[fast] == "not met (3.99x)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--contexts", "64"], "--contexts is for --random-kv only"),
        (["--tiny"], "--tiny is for --random-kv only"),
        (["--random-kv", "--ratios", "4"], "--ratios is for a real context"),
        (["--random-kv", "--batches", "1", "0"], "--batches must be >= 1"),
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    ],
)
def test_serving_cost_rejects_options_of_the_other_mode(serving, capsys, argv, message):
    with pytest.raises(SystemExit):
        serving.parse_args(argv)
    assert message in capsys.readouterr().err


def test_serving_cost_defaults_per_mode(serving):
    real = serving.parse_args([])
    assert (real.paragraphs, real.ratios, real.out) == (20, [1.0, 4.0, 16.0], "benchmarks/results/serving_cost.json")
    random_kv = serving.parse_args(["--random-kv"])
    assert (random_kv.contexts, random_kv.batches, random_kv.tiny) == ([4096, 16384], [1, 4], False)
    assert random_kv.out == "benchmarks/results/serving_cost_random_kv.json"


# ------------------------------------------------------------------------------ benchmarks/pask_flip_points.py
def test_pask_flip_points_summary_counts_flips_and_checks_them_against_the_replies(tmp_path, monkeypatch):
    script = load_script(BENCHMARKS / "pask_flip_points.py")

    def flip(reference, chosen):
        return {"index": 3, "reference_piece": reference, "chosen_piece": chosen}

    def record(case, valid, text, pair_flip, decode_flip=None):
        entries = {name: {"loss": 0.0, "flip": None} for name in script.SCHEDULES}
        entries["pair"] = {"loss": 0.5, "flip": pair_flip}
        entries["decode_only"]["flip"] = decode_flip
        return {"id": case, "reference_valid": valid, "reference_text": text, **entries}

    records = [
        record("a", True, "[1]", None),
        record("b", True, "[2]", flip("]", ","), flip("]", ",")),
        record("c", False, "[3]", flip("x", "y")),
        record("d", True, "[4]", flip("]", ",")),
    ]
    replies = {"a": {"text": "[1]\n", "valid": True}, "b": {"text": "[2, 2]", "valid": False}}
    replies |= {"c": {"text": "[3 ]", "valid": True}, "d": {"text": "[4]", "valid": True}}  # d: a flip, same text
    summary = script.summarise(records, replies)
    assert summary["pair"]["flipped"] == 3 and summary["pair"]["flipped_valid_references"] == 2
    assert summary["pair"]["mean_loss"] == 0.5 and summary["all_high"]["flipped"] == 0
    assert summary["pair"]["commonest_flips"][0] == ("']' -> ','", 2)
    assert summary["decode_only"]["flipped"] == 1
    assert summary["pair_vs_generated"] == {
        "flip, other reply": 2,
        "flip, same reply": 1,
        "flip, verdict gained": 1,
        "flip, verdict kept": 1,
        "flip, verdict lost": 1,
        "no flip, same reply": 1,
    }
    for r, category in zip(records, ("simple_python", "multiple", "parallel", "parallel")):
        r["category"] = category
    records[0]["all_high"]["flip"] = flip("a", "b")  # a float tie on the control: generated too
    records.append({**record("e", True, "[5]", None), "category": "multiple"})
    assert [script.must_generate(r) for r in records] == [True, True, True, True, False]
    calls = []

    def fake_evaluate(model, tokenizer, cases, table, max_new_tokens, prefill_policy=None):
        calls.append(cases[0].id)
        reply = {"id": cases[0].id, "valid": cases[0].id == "c", "text": "[]", "budget_ratio": 0.3, "seconds": 1.0}
        return types.SimpleNamespace(records=[{**reply, "error": None}])

    monkeypatch.setattr(script, "evaluate_bfcl", fake_evaluate)
    cases = [types.SimpleNamespace(id=r["id"]) for r in records]
    done = {r["id"]: r for r in records[1:]}  # "a" not measured yet: not generated
    path = tmp_path / "run.json.flipped.jsonl"
    flipped = script.generate_flipped(None, None, cases, done, None, None, 8, path)
    assert calls == ["b", "c", "d"] and sorted(flipped) == ["b", "c", "d"]
    assert script.pair_accuracy(records, flipped) is None  # "a" flips and is not generated
    done["a"] = records[0]
    flipped = script.generate_flipped(None, None, cases, done, None, None, 8, path)
    assert calls == ["b", "c", "d", "a"] and len(path.read_text().splitlines()) == 4  # resumed, "a" added
    accuracy = script.pair_accuracy(records, flipped)
    assert (accuracy["correct"], accuracy["generated"], accuracy["replayed"]) == (2, 4, 1)  # c generated, e replayed
    assert accuracy["reference_correct"] == 4 and accuracy["per_category"]["multiple"] == {"correct": 1, "cases": 2}
    assert accuracy["verdicts"] == {"a": False, "b": False, "c": True, "d": False, "e": True}
    vs = script.against_generated(accuracy, replies)  # replies: a, b, c, d (e not generated there)
    assert (vs["cases"], vs["generated_correct"], vs["this_correct"]) == (4, 3, 1)
    assert vs["lost"] == ["a", "d"] and vs["gained"] == [] and vs["p_value"] == pytest.approx(0.5)
    H, L, R = int(Action.H), int(Action.L), int(Action.R)
    plan = torch.tensor([[[H, L, R], [R, R, L], [L, H, H]]])
    names = ("all_high", "prefill_releases_only", "prefill_int4_only", "pair")
    got = script.schedules("table", plan, "high", names)
    assert list(got) == list(names) and got["all_high"] == ("high", None) and got["pair"] == ("table", plan)
    assert got["prefill_releases_only"][0] == got["prefill_int4_only"][0] == "high"
    assert got["prefill_releases_only"][1].tolist() == [[[H, H, R], [R, R, H], [H, H, H]]]
    assert got["prefill_int4_only"][1].tolist() == [[[H, L, H], [H, H, L], [L, H, H]]]
    groups = script.schedules("table", plan, "high", tuple(f"prefill_releases_group_{g}" for g in range(3)))
    assert [p.tolist() for _, p in groups.values()] == [
        [[[H, H, H], [R, H, H], [H, H, H]]],
        [[[H, H, H], [H, R, H], [H, H, H]]],
        [[[H, H, R], [H, H, H], [H, H, H]]],
    ]
    assert list(script.summarise(records, None, ("all_high", "pair"))) == ["all_high", "pair"]
    others = {r["id"]: {**r, "pair": {"loss": 0.0, "flip": None}} for r in records[:3]}  # "b", "c" flip here only
    others["a"]["pair"] = {"loss": 0.0, "flip": flip("x", "y")}  # "a" flips there only
    compared = script.compare_runs(records, others, ("all_high", "pair", "prefill_int4_only"))
    assert list(compared) == ["all_high", "pair"]  # a schedule neither run replayed is left out
    assert compared["pair"] == {
        "cases": 3, "flipped_here": 2, "flipped_there": 1, "flipped_both": 0,
        "valid_flipped_here": 1, "valid_flipped_there": 1, "valid_flipped_both": 0,
    }  # fmt: skip
    assert compared["all_high"]["flipped_both"] == 1  # "a"'s control flips in both
    settings = {"budget": 0.33}
    log = tmp_path / "run.json.cases.jsonl"
    assert script.read_log(log, settings) == {}
    log.write_text(json.dumps({"settings": settings}) + "\n" + json.dumps(records[0]) + "\n")
    assert script.read_log(log, settings) == {"a": records[0]}
    with pytest.raises(SystemExit):
        script.read_log(log, {"budget": 0.25})
