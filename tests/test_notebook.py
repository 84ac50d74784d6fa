"""The example notebooks run top to bottom (nbclient) on the embedded model with CI-sized settings."""

import re
from pathlib import Path

import nbclient  # the dev extra: nbclient, nbformat, ipykernel (the notebook's kernel)
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "compact_and_share.ipynb"
CI_SETTINGS = {
    "DEMO_ARTICLE": "Normans",
    "DEMO_PARAGRAPHS": "2",
    "DEMO_RATIO": "8",
    "DEMO_METHOD": "kv_surgeon",
    "DEMO_ON_POLICY": "0",
    "DEMO_QUERY_CAP": "256",
    "DEMO_QUESTIONS": "2",
    "DEMO_MAX_NEW_TOKENS": "16",
}


def printed(notebook) -> str:
    """Every stream output of every code cell, in order."""
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream" and output.name == "stdout"
    )


def run_notebook(path: Path, tmp_path: Path, monkeypatch) -> str:
    """Execute the notebook in ``tmp_path`` (2 threads) and return what its cells printed."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return printed(notebook)


@pytest.mark.slow
def test_notebook_compacts_saves_reloads_and_answers(tmp_path, monkeypatch, default_model):
    """The install cell is skipped (the package is importable), the push is skipped (no HF_TOKEN), the cache is
    saved under DEMO_OUT, reloaded, and two questions are answered from it. ``default_model`` makes sure the
    embedded model's snapshot exists, so the kernel loads it in about a second."""
    for name, value in {**CI_SETTINGS, "DEMO_OUT": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    text = run_notebook(NOTEBOOK, tmp_path, monkeypatch)
    assert "pip install" not in text.lower() and "Successfully installed" not in text
    assert re.search(r"compacted [\d,]+ tokens in [\d.]+ s \(kv_surgeon, ratio 8\)", text), text
    ratio = float(re.search(r"\(([\d.]+)x smaller", text).group(1))
    assert 7 < ratio < 8, text  # 1/8 of the entries of every KV head, plus biases and offsets
    assert re.search(r"held-out relative attention-output loss: 0\.\d+", text), text
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["README.md", "cache.safetensors", "config.json"]
    assert "no HF_TOKEN: not pushing" in text
    answers = re.findall(r"Q: (.+)\nA: (.*)   \((contains|misses) the gold answer", text)
    assert len(answers) == 2 and all(answer.strip() for _, answer, _ in answers), text


@pytest.mark.slow
def test_function_calling_notebook_tags_scores_saves_and_reloads(tmp_path, monkeypatch, default_model):
    """One call token by token, two BFCL development cases per category under all-high and the policy, the table
    saved (no HF_TOKEN: not pushed) and reloaded equal."""
    settings = {"DEMO_CATEGORIES": "simple_python", "DEMO_CASES": "2", "DEMO_MAX_NEW_TOKENS": "96"}
    for name, value in {**settings, "DEMO_OUT": str(tmp_path / "policy")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    text = run_notebook(EXAMPLES / "structured_function_calling.ipynb", tmp_path, monkeypatch)
    assert "pip install" not in text.lower() and "Successfully installed" not in text
    assert re.search(r"calls: +\[\{'name': 'get_weather'", text), text
    assert re.search(r"measured B = 0\.\d+", text), text
    found = re.findall(r"^(all_high|illustrative) +2 +[\d.]+% +[\d.]+$", text, flags=re.M)
    assert sorted(found) == ["all_high", "illustrative"], text
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == ["README.md", "policy_table.json"]
    assert "no HF_TOKEN: not pushing" in text and "reloaded table equals the saved one: True" in text
