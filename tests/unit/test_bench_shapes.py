"""`tandem bench --mode shapes`: its shape list and the stacks it starts."""

import pytest

from tandem.bench.shapes import ShapeRow, parse_shapes, shape_modes
from tandem.errors import InvalidArgument
from tandem.models.heads import DraftShape


def test_parse_shapes():
    assert parse_shapes("chain:1, tree:2:3:5@int8, chain:2@none") == [
        ShapeRow(DraftShape("chain", 1)), ShapeRow(DraftShape("tree", 2, 3, 5), "int8"), ShapeRow(DraftShape("chain", 2), "none")]


def test_parse_shapes_takes_the_heads_own_projections_after_a_slash():
    assert parse_shapes("chain:2@auto/none, tree:2:2:4@none/int8") == [
        ShapeRow(DraftShape("chain", 2), "auto", "none"), ShapeRow(DraftShape("tree", 2, 2, 4), "none", "int8")]


@pytest.mark.parametrize("bad", ["", "chain", "chain:0", "tree:1:3", "tree:1:x:3", "star:2", "chain:2@int4",
                                 "chain:2@int8/int4", "chain:2@/int8", "chain:2@int8/none/int8"])
def test_parse_shapes_names_a_bad_item(bad):
    with pytest.raises(InvalidArgument, match="--shapes"):
        parse_shapes(bad)


def test_shape_modes_plain_first_then_one_stack_per_shape():
    modes = shape_modes("/heads/h", parse_shapes("chain:2,tree:1:3:3"))
    assert [m.name for m in modes] == ["tandem_plain", "eagle_chain_2", "eagle_tree_1_3_3"]
    assert modes[0].stack.draft is None
    assert modes[1].stack.router == ("--spec-draft-length", "2") and "--tree-top-k" not in modes[1].stack.draft
    tree = modes[2].stack.draft
    assert tree[tree.index("--shape") + 1] == "tree" and tree[tree.index("--tree-node-budget") + 1] == "3"
    assert all(m.speculative for m in modes[1:])
    assert all(m.stack.draft[m.stack.draft.index("--draft-lm-head-quant") + 1] == "auto" for m in modes[1:])


def test_a_shape_with_an_lm_head_is_a_stack_of_its_own():
    modes = shape_modes("/heads/h", parse_shapes("chain:4@none,chain:4@int8"))
    assert [m.name for m in modes] == ["tandem_plain", "eagle_chain_4_none", "eagle_chain_4_int8"]
    assert [m.stack.draft[m.stack.draft.index("--draft-lm-head-quant") + 1] for m in modes[1:]] == ["none", "int8"]


def test_a_shape_with_the_heads_own_projections_is_a_stack_of_its_own():
    modes = shape_modes("/heads/h", parse_shapes("tree:2:2:4@auto/none,tree:2:2:4@auto/int8"))
    assert [m.name for m in modes] == ["tandem_plain", "eagle_tree_2_2_4_head_none", "eagle_tree_2_2_4_head_int8"]
    assert [m.stack.draft[m.stack.draft.index("--draft-head-quant") + 1] for m in modes[1:]] == ["none", "int8"]
    assert modes[2].label.endswith("head int8")
