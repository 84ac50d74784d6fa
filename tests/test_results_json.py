"""`benchmarks/results_json.py`, the one writer of every benchmark's result JSON: the script's fields kept as they are,
and a provenance block that matches what git, the installed packages and the process say."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import results_json  # noqa: E402


def test_write_json_keeps_the_fields_and_adds_provenance(tmp_path):
    payload = {"rows": [{"ratio": 10.0, "correct": 3}], "threads": 1, "nested": {"a": None}}
    started = time.perf_counter() - 2.0  # a run that began two seconds ago
    written = results_json.write_json(tmp_path / "deep" / "result.json", payload, started=started)

    on_disk = json.loads((tmp_path / "deep" / "result.json").read_text())
    assert on_disk == written and {k: v for k, v in written.items() if k != "provenance"} == payload
    assert "provenance" not in payload  # the caller's dict is not changed
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["result.json"]  # no partial file left behind
    block = written["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=results_json.REPOSITORY, capture_output=True, text=True)
    assert block["commit"] == head.stdout.strip() and len(block["commit"]) == 40 and block["dirty"] in (True, False)
    assert block["packages"]["torch"] == torch.__version__
    assert block["packages"]["transformers"] == transformers.__version__
    assert block["packages"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert block["argv"] == sys.argv and block["torch_threads"] == torch.get_num_threads()
    assert block["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS")
    assert 2.0 <= block["wall_seconds"] < 600 and block["written_at"].endswith("+00:00")


def test_package_versions_name_a_missing_package_none():
    versions = results_json.package_versions(("torch", "no-such-distribution-hf-structkv"))
    assert versions["no-such-distribution-hf-structkv"] is None and versions["torch"] is not None


def test_git_state_outside_a_checkout_is_unknown(tmp_path):
    assert results_json.git_state(tmp_path) == {"commit": None, "dirty": None}


def test_write_json_rejects_bad_arguments(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(TypeError, match="payload must be a dict"):
        results_json.write_json(out, [1, 2], started=time.perf_counter())
    with pytest.raises(TypeError, match="started must be"):
        results_json.write_json(out, {}, started="now")
    with pytest.raises(ValueError, match="already has a 'provenance' field"):
        results_json.write_json(out, {"provenance": "calibrated"}, started=time.perf_counter())
    assert not out.exists()
