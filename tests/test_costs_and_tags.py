"""Layer groups and payload costs (PASK A.2, B.3) and structural-tag vocabulary / fallback chain (B.1)."""

import pytest

from hf_structkv.models import tiny_model
from hf_structkv.policy.costs import Action, GroupCosts, group_names, layer_groups
from hf_structkv.structure.tags import (
    NEXT,
    ROLES,
    STATES,
    TAG_CLASSES,
    TAG_VIEWS,
    StructuralTag,
    check_tag_view,
    position_bin_starts,
    position_tag,
    view_tags,
    view_vocabulary,
)


@pytest.mark.parametrize(
    ("layers", "bounds"), [(36, (12, 24)), (40, (14, 27)), (32, (11, 22)), (24, (8, 16)), (1, (1, 1)), (2, (1, 2))]
)
def test_layer_groups_match_the_papers_ranges(layers, bounds):
    lower, middle, upper = layer_groups(layers)
    assert (lower.stop, middle.stop, upper.stop) == (*bounds, layers)
    assert lower.start == 0 and middle.start == lower.stop and upper.start == middle.stop


def test_costs_by_the_formulas_with_odd_padding():
    costs = GroupCosts.from_dims([2, 2, 1, 4], [64, 64, 5, 3])  # groups [0,2), [2,3), [3,4)
    assert costs.elements == (2 * 2 * 64 * 2, 2 * 5, 2 * 4 * 3)
    assert costs.rows == (8, 2, 8) and costs.padding == (0, 2, 8)
    assert costs.cost(Action.H, 0) == 16 * 512 and costs.cost(Action.R, 1) == 0
    assert costs.cost(Action.L, 1) == 4 * 10 + 16 * 2 + 4 * 2
    assert costs.full == 16 * (512 + 10 + 24)
    assert costs.total((Action.H, Action.L, Action.R)) == 16 * 512 + 80
    assert costs.group_of_layer(2) == 1
    with pytest.raises(ValueError, match="outside"):
        costs.group_of_layer(4)


@pytest.mark.parametrize("dims", [([2, 2, 1, 4], [64, 64, 5, 3]), ([1], [7]), ([3] * 5, [9] * 5)])
def test_one_group_of_every_layer_costs_what_three_groups_with_one_action_cost(dims):
    """The no-layer-groups ablation: one group ``[0, L)`` whose cost of ``a`` is ``M((a, a, a))`` of the three groups
    (the payload formulas add up over layers)."""
    three, one = GroupCosts.from_dims(*dims), GroupCosts.from_dims(*dims, groups=1)
    assert one.groups == (range(0, len(dims[0])),) == layer_groups(len(dims[0]), 1)
    assert one.elements == (sum(three.elements),) and one.rows == (sum(three.rows),)
    assert one.padding == (sum(three.padding),) and one.full == three.full
    for action in Action:
        assert one.total((action,)) == three.total((action,) * 3)
    assert one.group_of_layer(len(dims[0]) - 1) == 0
    assert group_names(1) == ("all",) and group_names(3) == ("lower", "middle", "upper")


def test_costs_from_a_model_config():
    model = tiny_model("llama")  # 2 layers, 2 KV heads of 16
    costs = GroupCosts.from_config(model.config)
    assert costs.elements == (64, 64, 0) and costs.full == 2048


def test_bad_dimensions_are_named():
    with pytest.raises(ValueError, match="num_layers"):
        layer_groups(0)
    with pytest.raises(ValueError, match="kv_heads and head_dims"):
        GroupCosts.from_dims([2], [4, 4])
    for count in (2, 0, True):
        with pytest.raises(ValueError, match="layer_groups must be 3"):
            GroupCosts.from_dims([2] * 4, [4] * 4, groups=count)
    with pytest.raises(ValueError, match="layer_groups must be 3"):
        layer_groups(6, 2)


def test_tag_fallback_chain_and_protection():
    tag = StructuralTag("schema_bearing", "dispatch_key", "critical", "no_lookahead").validate()
    assert tag.fallback_keys() == (
        "schema_bearing|dispatch_key|critical|no_lookahead",
        "schema_bearing|dispatch_key|critical",
        "schema_bearing|dispatch_key",
        "schema_bearing",
    )
    assert tag.protects and StructuralTag.from_key(tag.fallback_keys()[0]) == tag
    assert StructuralTag("pure_scaffold", "scaffold_separator", "boundary", "lookahead_critical").protects
    assert not StructuralTag("pure_scaffold", "scaffold_separator", "boundary", "no_lookahead").protects


def test_tag_vocabulary_is_checked_per_family():
    StructuralTag("schema_bearing", "projection", "stable", "no_lookahead").validate("sql")
    with pytest.raises(ValueError, match="state must be one of"):
        StructuralTag("schema_bearing", "required", "stable", "no_lookahead").validate()
    with pytest.raises(ValueError, match="family"):
        StructuralTag("schema_bearing", "required", "boundary", "no_lookahead").validate("yaml")
    with pytest.raises(ValueError, match="four"):
        StructuralTag.from_key("a|b")


@pytest.mark.parametrize("family", ["function_calling", "sql"])
def test_tag_views_drop_exactly_their_fields(family):
    from itertools import product

    every = [StructuralTag(*f) for f in product(TAG_CLASSES, ROLES[family], STATES[family], NEXT)]
    dropped = {"full": (), "no_role": (1,), "no_class": (0,), "no_state_lookahead": (2, 3)}
    fixed = (TAG_CLASSES[0], ROLES[family][0], STATES[family][0], "no_lookahead")
    assert set(dropped) == set(TAG_VIEWS) - {"position_bins"}  # position tags need the token's index
    for view, fields in dropped.items():
        for tag in every:
            expected = StructuralTag(*(fixed[i] if i in fields else tag[i] for i in range(4)))
            assert view_tags((tag,), view, family) == (expected.validate(family),)
        # tags equal outside the dropped fields become one tag; the others stay apart
        kept = {tuple(tag[i] for i in range(4) if i not in fields) for tag in every}
        assert len({view_tags((tag,), view, family) for tag in every}) == len(kept)
    assert not any(tag.protects for t in every for tag in view_tags((t,), "no_state_lookahead", family))


def test_tag_views_deduplicate_candidates_in_order_and_check_their_arguments():
    a = StructuralTag("schema_bearing", "required", "critical", "no_lookahead")
    b = StructuralTag("schema_bearing", "optional", "critical", "no_lookahead")
    c = StructuralTag("free_generation", "optional", "boundary", "no_lookahead")
    assert view_tags((a, b, c), "full", "function_calling") == (a, b, c)
    merged = a._replace(role="scaffold_separator")
    assert view_tags((a, b, c), "no_role", "function_calling") == (merged, c._replace(role="scaffold_separator"))
    assert view_tags((), "no_class", "function_calling") == ()
    with pytest.raises(ValueError, match="tag_view must be one of"):
        view_tags((a,), "no_tags", "function_calling")
    with pytest.raises(ValueError, match="family"):
        view_tags((a,), "no_role", "yaml")
    with pytest.raises(ValueError, match="position_tag"):
        view_tags((a,), "position_bins", "function_calling")


@pytest.mark.parametrize("family", ["function_calling", "sql"])
def test_position_tags_are_the_bin_of_the_index_and_the_views_vocabulary(family):
    bins = (3, 5, 9)
    brute = [sum(start <= i for start in bins) for i in range(15)]  # bin k: starts[k] <= i < starts[k + 1]
    assert [position_tag(i, bins, family).role for i in range(15)] == [f"bin_{k}" for k in brute]
    tag = position_tag(0, bins, family)
    assert tag == StructuralTag("position", "bin_0", STATES[family][0], "no_lookahead") and not tag.protects
    assert view_vocabulary(family, "position_bins", bins) == [position_tag(i, bins, family) for i in (0, 3, 5, 9)]
    assert view_vocabulary(family, "position_bins", ()) == [position_tag(0, (), family)]  # one bin
    assert len(view_vocabulary(family)) == len(TAG_CLASSES) * len(ROLES[family]) * len(STATES[family]) * 2
    for bad in ((0, 3), (3, 3), (5, 3), (2.0,), (True,)):
        with pytest.raises(ValueError, match="strictly increasing ints >= 1"):
            check_tag_view("position_bins", family, bad)
    with pytest.raises(ValueError, match="apply to tag_view='position_bins' only"):
        check_tag_view("no_role", family, (3,))
    with pytest.raises(ValueError, match="position_bins must be a sequence of ints"):
        check_tag_view("position_bins", family, None)


def test_position_bin_starts_follow_c5():
    """Ten bins below the length reached by >= 75% of every category's requests, the last absorbing the tail."""
    lengths = {"simple": [40, 50, 60, 100], "multiple": [20, 80, 90, 95]}
    # reached by >= 3 of 4: simple 50, multiple 80 -> m = 50; bin k starts at floor(5 k)
    assert position_bin_starts(lengths) == (5, 10, 15, 20, 25, 30, 35, 40, 45)
    for data, bins in ((lengths, 10), ({"a": [7, 7, 7, 2], "b": [9, 30, 12]}, 4)):
        starts = position_bin_starts(data, bins=bins)
        assert 0 < len(starts) < bins
        for values in data.values():  # every bin reached by >= 75% of each category
            assert all(sum(n > start for n in values) >= 0.75 * len(values) for start in starts)
    assert position_bin_starts({"a": [4, 4, 4, 4]}) == (1, 2, 3)  # coinciding starts merge
    assert position_bin_starts({"a": [0, 0]}) == ()  # one bin
    with pytest.raises(ValueError, match="non-empty"):
        position_bin_starts({"a": []})
    with pytest.raises(ValueError, match="bins must be"):
        position_bin_starts({"a": [3]}, bins=0)
