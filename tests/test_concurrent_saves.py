"""Issue 34, defect 1: saves are all-or-nothing for the folder as a whole. Real processes save two different caches
(and two policy tables) into one folder at once while another process loads it: every load is one of the two whole
(a ValueError would be the only other acceptable outcome, and the lock avoids even that); never a mix, never another
exception. A save killed mid-write leaves a folder that loading
refuses, and the next save cleans up after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_hub import compacted_cache, tiny_llama

from hf_structkv import CompactedCache
from hf_structkv.policy.table import PolicyTable, illustrative_policy

ROOT = Path(__file__).resolve().parents[1]
LOADS = 60

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from hf_structkv import CompactedCache
    from hf_structkv.policy.table import PolicyTable

    role, cls_name, target, *sources = sys.argv[1:]
    cls = {"cache": CompactedCache, "table": PolicyTable}[cls_name]
    target = Path(target)

    def key(artifact):
        if cls is PolicyTable:
            return json.dumps(artifact.to_json_dict(), sort_keys=True)
        tensors = [t.tolist() for layer in artifact.layers for t in layer.context_tensors()]
        return json.dumps([tensors, artifact.metadata], sort_keys=True)

    done = target.parent / "reader_done"
    if role == "write":  # save until the reader is done (and at least a few times)
        artifact = cls.from_pretrained(sources[0])
        saves = 0
        while saves < 5 or not done.exists():
            artifact.save_pretrained(target)
            saves += 1
        print(saves)
    else:
        whole = {key(cls.from_pretrained(source)): i for i, source in enumerate(sources)}
        seen = {"whole": [0] * len(sources), "value_errors": [], "other": [], "mixed": 0}
        for _ in range(%d):
            try:
                loaded = cls.from_pretrained(target)
            except ValueError as err:
                seen["value_errors"].append(str(err)[:200])
                continue
            except Exception as err:
                seen["other"].append(f"{type(err).__name__}: {err}"[:200])
                continue
            index = whole.get(key(loaded))
            if index is None:
                seen["mixed"] += 1
            else:
                seen["whole"][index] += 1
        done.touch()
        print(json.dumps(seen))
    """
)


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER % LOADS, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err.decode()[-2000:]
    return out.decode()


def two_caches(tmp_path: Path) -> tuple[Path, Path]:
    """Two caches of one structure that differ in every tensor and in their metadata."""
    model = tiny_llama()
    first, second = tmp_path / "a", tmp_path / "b"
    compacted_cache(model, quality={"which": "a"}).save_pretrained(first)
    other = compacted_cache(model, quality={"which": "b"})
    for layer in other.layers:
        layer.prefix_keys, layer.prefix_values = layer.prefix_keys * 0.5, layer.prefix_values + 1
    other.save_pretrained(second)
    return first, second


def two_tables(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "a", tmp_path / "b"
    table = illustrative_policy()
    table.save_pretrained(first)
    PolicyTable.all_high(table.costs).save_pretrained(second)
    return first, second


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("kind", "make"), [("cache", two_caches), ("table", two_tables)])
def test_concurrent_saves_and_loads_never_mix_two_artifacts(tmp_path, kind, make):
    first, second = make(tmp_path)
    target = tmp_path / "shared"
    cls = CompactedCache if kind == "cache" else PolicyTable
    cls.from_pretrained(first).save_pretrained(target)
    processes = [
        start("write", kind, target, first),
        start("write", kind, target, second),
        start("read", kind, target, first, second),
    ]
    seen = json.loads(finish(processes[2]))
    saves = [int(finish(process)) for process in processes[:2]]
    assert seen["mixed"] == 0 and seen["other"] == []
    # the readers' shared lock waits out every save: each load sees the folder between two saves, whole
    assert seen["value_errors"] == [] and sum(seen["whole"]) == LOADS
    assert min(saves) >= 5
    assert {p.name for p in target.iterdir()} == set(cls.SAVED_FILES)  # no temporary file left
    loaded = cls.from_pretrained(target)  # the folder ends as one of the two, whole
    if kind == "cache":
        final = (target / "cache.safetensors").read_bytes()
        assert final in ((first / "cache.safetensors").read_bytes(), (second / "cache.safetensors").read_bytes())
        assert loaded.metadata["quality"]["which"] in ("a", "b")
    else:
        assert loaded in (cls.from_pretrained(first), cls.from_pretrained(second))


KILLED_SAVE = textwrap.dedent(
    """
    import os, sys
    import hf_structkv.persistence.folders as folders
    from hf_structkv import CompactedCache

    def die(*args):  # the process is killed between writing the tensors' temporary file and renaming it
        os._exit(3)

    cache = CompactedCache.from_pretrained(sys.argv[1])
    folders.os.replace = die
    cache.save_pretrained(sys.argv[2])
    """
)


def test_a_save_killed_mid_write_leaves_a_refused_folder_and_the_next_save_cleans_up(tmp_path):
    first, second = two_caches(tmp_path)
    target = tmp_path / "shared"
    CompactedCache.from_pretrained(first).save_pretrained(target)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, second, target], env=env, timeout=300)
    assert killed.returncode == 3
    left = {p.name for p in target.iterdir()}
    assert "config.json" not in left and any(name.startswith(".cache.safetensors.") for name in left)
    with pytest.raises(ValueError, match="config.json is missing"):
        CompactedCache.from_pretrained(target)
    CompactedCache.from_pretrained(second).save_pretrained(target)  # the kernel released the dead save's lock
    assert {p.name for p in target.iterdir()} == {"config.json", "cache.safetensors", "README.md"}
    assert CompactedCache.from_pretrained(target).metadata["quality"] == {"which": "b"}
