"""``compact(ratio=r, storage=...)`` stores ``1/r`` of the full cache's bytes in the model's dtype (issue 31): the
achieved byte ratio ``full_nbytes() / nbytes()`` on tiny FP32 and BF16 models, uniform and skewed head budgets, and
the byte shares of `head_byte_budgets` against a brute-force reference.

Tolerances (stated): ``"int4"`` / ``"auto"``: each head spends at most its share and leaves less than one entry (in
either storage) and one row of INT4 key scales of it, so ``target - H · (dtype entry + key-scale row) <= nbytes <=
target + 8 · layers`` (the layers' extra row offset), ``target = full / r``. ``"bf16"``: ``ratio`` counts entries,
so the bytes are the closed form ``Σ t_h · ((D + D_v) e + 4) + 8 (H_kv + 1)`` per layer (the FP32 biases and offsets
on top of ``1/r`` of the keys and values).
"""

import math
import warnings

import pytest
import torch
from test_compaction_auto_storage import WordTokenizer  # one id per character

from hf_structkv.compaction import compact
from hf_structkv.compaction.byte_budgets import head_byte_budgets
from hf_structkv.compaction.head_storage import BIAS_BYTES, OFFSET_BYTES, StorageLayout
from hf_structkv.models import tiny_model

LENGTH = 192
DIM = 16  # tiny models: head_dim 16, 2 KV heads, 2 layers
HEADS = 4
KEY_GROUP = 32


class SkewedBudgets:
    """Three quarters of the context to layer 0's first head, the rest shared evenly (the shape of the shipped
    allocation, whose large heads a whole INT4 head cannot spend)."""

    def token_budgets(self, ratio: float, length: int) -> dict[int, list[int]]:
        total = round(HEADS * length / ratio)
        big = min(math.floor(0.75 * length), total - 3)
        rest = total - big
        return {0: [big, rest // 3], 1: [rest // 3, rest - 2 * (rest // 3)]}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    model = tiny_model("llama", dtype=request.param)
    ids = torch.randint(3, 256, (1, LENGTH), generator=torch.Generator().manual_seed(7))
    return model, ids, request.param.itemsize


def compacted(tiny, ratio, storage, budgets="uniform"):
    model, ids, _ = tiny
    return compact(
        model,
        WordTokenizer(),
        ids,
        ratio=ratio,
        storage=storage,
        budgets=budgets,
        on_policy=False,
        progress=False,
        **({} if storage == "bf16" else {"key_group": KEY_GROUP}),
    )


@pytest.mark.parametrize("budgets", ["uniform", SkewedBudgets()], ids=["uniform", "skewed"])
@pytest.mark.parametrize("storage", ["int4", "auto"])
def test_int4_and_auto_store_one_ratio_th_of_the_full_bytes(tiny, storage, budgets):
    element_bytes = tiny[2]
    ratio = 8 if element_bytes == 4 else 4  # above the whole cache's INT4 ratio in either dtype
    cache = compacted(tiny, ratio, storage, budgets)
    full = cache.full_nbytes()
    assert full == 2 * HEADS // 2 * LENGTH * 2 * DIM * element_bytes
    target = full / ratio
    slack = HEADS * ((2 * DIM * element_bytes + BIAS_BYTES) + 2 * DIM * 2)
    assert target - slack <= cache.nbytes() <= target + OFFSET_BYTES * 2
    assert cache.metadata["storage"]["byte_ratio"] == full / cache.nbytes()


def test_bf16_storage_counts_entries_and_its_bytes_are_the_closed_form(tiny):
    element_bytes = tiny[2]
    cache = compacted(tiny, 8, "bf16")
    entry = 2 * DIM * element_bytes
    per_layer = 2 * (LENGTH // 8) * (entry + BIAS_BYTES) + (2 + 1) * OFFSET_BYTES
    assert cache.nbytes() == 2 * per_layer
    assert cache.full_nbytes() / cache.nbytes() == pytest.approx(8 * entry / (entry + BIAS_BYTES), rel=0.01)


def test_int4_below_its_whole_cache_ratio_keeps_every_int4_head_whole(tiny):
    with pytest.warns(UserWarning, match="storage='auto' spends the bytes") as record:
        cache = compacted(tiny, 2, "int4")
    assert [w.filename for w in record] == [__file__]  # the caller's line, not the package's
    whole = StorageLayout("int4", DIM, DIM, key_group=KEY_GROUP).nbytes(LENGTH)
    in_dtype = StorageLayout("bf16", DIM, DIM, tiny[2])
    for storages, lengths in zip(cache.head_storage(), cache.head_lengths(), strict=True):
        for storage, length in zip(storages, lengths, strict=True):
            assert length == LENGTH if storage == "int4" else in_dtype.nbytes(length) <= whole
    assert cache.nbytes() <= HEADS * whole + 2 * OFFSET_BYTES
    assert cache.full_nbytes() / cache.nbytes() > 2  # the whole cache in INT4 is above ratio 2 in FP32 and BF16


# --------------------------------------------------------------------------------------------- the byte shares
def brute_force_shares(weights, total, cap):
    """The water-filling shares by bisection on the level ``c`` of ``min(cap, max(1, c w_h))``."""
    low, high = 0.0, float(total) + 1
    for _ in range(200):
        level = (low + high) / 2
        if sum(min(cap, max(1.0, level * w)) for w in weights) < total:
            low = level
        else:
            high = level
    return [min(cap, max(1.0, high * w)) for w in weights]


@pytest.mark.parametrize("storage", ["int4", "auto"])
@pytest.mark.parametrize("ratio", [2.0, 3.0, 8.0])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_head_byte_budgets_share_the_bytes_as_brute_force(storage, ratio, element_bytes):
    length, dim = 1024, 64
    counts = {
        layer: [max(1, round(c * 4 / ratio)) for c in cs] for layer, cs in {0: [768, 10, 40], 3: [9, 200, 1]}.items()
    }
    weights = [c for cs in counts.values() for c in cs]
    total = sum(weights) * 2 * dim * element_bytes
    whole_int4 = StorageLayout("int4", dim, dim, key_group=KEY_GROUP).nbytes(length)
    whole_dtype = StorageLayout("bf16", dim, dim, element_bytes).nbytes(length)
    capped = total > len(weights) * whole_int4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = head_byte_budgets(counts, length, dim, dim, element_bytes, storage, KEY_GROUP)
    assert len(caught) == (capped and storage == "int4")  # "int4" warns when it cannot spend the bytes
    assert list(got) == [0, 3] and [len(v) for v in got.values()] == [3, 3]
    flat = [b for bs in got.values() for b in bs]
    if total <= len(weights) * whole_int4:
        expected = brute_force_shares(weights, total, whole_int4)
        assert all(abs(b - e) <= 1 for b, e in zip(flat, expected, strict=True))
        assert sum(flat) == total
    else:  # every head whole in INT4; "auto" spends the rest on whole dtype heads, largest budget first
        promoted = 0
        if storage == "auto":
            promoted = min(len(flat), int((total - len(flat) * whole_int4) // (whole_dtype - whole_int4)))
        order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
        expected = [whole_int4] * len(flat)
        for i in order[:promoted]:
            expected[i] = whole_dtype
        assert flat == expected
