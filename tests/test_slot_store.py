"""`SlotStore`: per-row appends keep positions, crop by position, row selection, honest bytes."""

import pytest
import torch

from hf_structkv.cache.slot_store import SlotStore


def _fields(batch, k, start):
    base = torch.arange(start, start + k, dtype=torch.float32).view(1, 1, k, 1)
    return {"keys": base.expand(batch, 2, k, 3).clone()}


def test_rows_fill_their_own_slots_and_keep_positions():
    store = SlotStore(grow=4)
    store.append(_fields(2, 3, 0), torch.arange(3), torch.tensor([[True, False, True], [False, False, True]]))
    store.append(_fields(2, 2, 3), torch.arange(3, 5), torch.tensor([[True, True], [True, False]]))
    fields, positions = store.view()
    assert store.counts == [4, 2] and positions.tolist() == [[0, 2, 3, 4], [2, 3, -1, -1]]
    assert fields["keys"][0, 0, :, 0].tolist() == [0, 2, 3, 4] and fields["keys"][1, 1, :2, 0].tolist() == [2, 3]
    assert store.capacity == 4 and store.num_entries() == 6


def test_bulk_appends_fit_exactly_small_ones_grow_in_blocks_and_bytes_count_it():
    store = SlotStore(grow=4)
    store.append(_fields(1, 5, 0), torch.arange(5), torch.ones(1, 5, dtype=torch.bool))
    assert store.capacity == 5
    store.append(_fields(1, 1, 5), torch.arange(5, 6), torch.ones(1, 1, dtype=torch.bool))
    assert store.capacity == 9
    assert store.nbytes() == 1 * 2 * 9 * 3 * 4 + 9 * 4  # keys fp32 + int32 slot map


def test_long_histories_grow_by_a_thirty_second_of_the_capacity():
    store = SlotStore(grow=4)
    store.append(_fields(1, 320, 0), torch.arange(320), torch.ones(1, 320, dtype=torch.bool))
    store.append(_fields(1, 1, 320), torch.arange(320, 321), torch.ones(1, 1, dtype=torch.bool))
    assert store.capacity == 330


def test_crop_and_select_rows():
    store = SlotStore(grow=2)
    store.append(_fields(2, 4, 0), torch.arange(4), torch.tensor([[True, True, False, True], [True] * 4]))
    store.crop(3)
    assert store.counts == [2, 3] and store.view()[1].tolist() == [[0, 1, -1], [0, 1, 2]]
    store.select_rows(torch.tensor([1, 1, 0]))
    assert store.counts == [3, 3, 2] and store.view()[1][2].tolist() == [0, 1, -1]


def test_nothing_taken_allocates_nothing_and_bad_grow():
    store = SlotStore()
    store.append(_fields(1, 2, 0), torch.arange(2), torch.zeros(1, 2, dtype=torch.bool))
    assert store.nbytes() == 0 and store.num_entries() == 0
    with pytest.raises(ValueError, match="grow"):
        SlotStore(grow=0)
