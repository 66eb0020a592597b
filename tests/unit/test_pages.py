"""PageAllocator: literal cases (the model-based test of copy-on-write isolation is in
test_pages_model.py)."""

import pytest

from tandem.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tandem.kv.pages import PageAllocator, PageCopy, pages_for


def _filled(alloc: PageAllocator, seq_id: int, num_tokens: int) -> list[int]:
    alloc.add(seq_id)
    slots, copies = alloc.append(seq_id, num_tokens)
    assert copies == []
    return slots


# -- pages_for and construction ----------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, page_size, pages", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 1, 9)]
)
def test_pages_for(tokens, page_size, pages):
    assert pages_for(tokens, page_size) == pages


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_non_positive_sizes(num_pages, page_size):
    with pytest.raises(ValueError):
        PageAllocator(num_pages, page_size)


# -- add / append ------------------------------------------------------------------------------


def test_append_hands_out_low_pages_first():
    alloc = PageAllocator(num_pages=8, page_size=4)
    alloc.add(1)
    assert alloc.length(1) == 0 and alloc.page_table(1) == [] and alloc.slots(1) == []
    assert alloc.append(1, 3) == ([0, 1, 2], [])
    assert alloc.page_table(1) == [0]
    assert alloc.append(1, 2) == ([3, 4], [])
    assert alloc.page_table(1) == [0, 1]
    assert alloc.length(1) == 5
    assert alloc.slots(1) == [0, 1, 2, 3, 4]
    assert alloc.num_free_pages == 6
    alloc.add(2)
    assert alloc.append(2, 6) == ([8, 9, 10, 11, 12, 13], [])
    assert alloc.page_table(2) == [2, 3]
    assert alloc.num_free_pages == 4
    assert alloc.num_sequences == 2 and alloc.seq_ids() == [1, 2]
    assert alloc.has(1) and not alloc.has(3)


def test_append_zero_tokens_is_a_no_op():
    alloc = PageAllocator(num_pages=2, page_size=4)
    _filled(alloc, 1, 4)
    assert alloc.append(1, 0) == ([], [])
    assert alloc.page_table(1) == [0] and alloc.num_free_pages == 1


def test_page_table_is_a_copy():
    alloc = PageAllocator(num_pages=4, page_size=4)
    _filled(alloc, 1, 5)
    alloc.page_table(1).append(3)
    assert alloc.page_table(1) == [0, 1]


# -- fork and copy-on-write ------------------------------------------------------------------------


def test_fork_at_page_boundary_shares_full_pages_without_copy():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 8)  # pages [0, 1]
    alloc.fork(2, 1, 4)
    assert alloc.page_table(2) == [0] and alloc.length(2) == 4
    assert alloc.slots(2) == [0, 1, 2, 3]
    assert alloc.num_free_pages == 6  # nothing taken by the fork
    assert alloc.pages_needed(2, 1) == 1
    assert alloc.append(2, 1) == ([8], [])  # a fresh page 2, no copy
    assert alloc.page_table(2) == [0, 2]
    assert alloc.append(1, 1) == ([12], [])  # parent's pages were full: fresh page 3
    assert alloc.page_table(1) == [0, 1, 3]


def test_fork_mid_page_child_writes_first():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 6)  # pages [0, 1]; page 1 holds 2 tokens
    alloc.fork(2, 1, 6)
    assert alloc.page_table(2) == [0, 1]
    assert alloc.num_free_pages == 6
    assert alloc.pages_needed(2, 1) == 1  # the private copy of page 1
    assert alloc.append(2, 1) == ([10], [PageCopy(src=1, dst=2, num_slots=2)])
    assert alloc.page_table(2) == [0, 2]
    assert alloc.slots(2) == [0, 1, 2, 3, 8, 9, 10]
    # The parent now holds page 1 alone: it writes in place.
    assert alloc.pages_needed(1, 1) == 0
    assert alloc.append(1, 1) == ([6], [])
    assert alloc.page_table(1) == [0, 1]
    # Both now own their last page: no more copies.
    assert alloc.append(2, 1) == ([11], [])
    assert alloc.append(1, 1) == ([7], [])
    assert alloc.num_free_pages == 5


def test_fork_mid_page_parent_writes_first():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 6)
    alloc.fork(2, 1, 6)
    assert alloc.pages_needed(1, 1) == 1
    assert alloc.append(1, 1) == ([10], [PageCopy(src=1, dst=2, num_slots=2)])
    assert alloc.page_table(1) == [0, 2]
    assert alloc.slots(1) == [0, 1, 2, 3, 8, 9, 10]
    assert alloc.append(2, 1) == ([6], [])  # the child inherited page 1 alone
    assert alloc.page_table(2) == [0, 1]


def test_fork_before_parent_end_copies_only_the_childs_slots():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 7)  # pages [0, 1]
    alloc.fork(2, 1, 5)
    assert alloc.page_table(2) == [0, 1] and alloc.length(2) == 5
    assert alloc.slots(2) == [0, 1, 2, 3, 4]
    assert alloc.append(2, 4) == ([9, 10, 11, 12], [PageCopy(src=1, dst=2, num_slots=1)])
    assert alloc.page_table(2) == [0, 2, 3]
    assert alloc.append(1, 1) == ([7], [])


def test_fork_at_zero_shares_nothing():
    alloc = PageAllocator(num_pages=4, page_size=4)
    _filled(alloc, 1, 3)
    alloc.fork(2, 1, 0)
    assert alloc.page_table(2) == [] and alloc.length(2) == 0
    assert alloc.append(2, 1) == ([4], [])


def test_fork_of_fork_copies_once_per_writer():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 2)  # page 0 half full
    alloc.fork(2, 1, 2)
    alloc.fork(3, 2, 2)  # page 0 held three times
    assert alloc.append(3, 1) == ([6], [PageCopy(src=0, dst=1, num_slots=2)])
    assert alloc.append(2, 1) == ([10], [PageCopy(src=0, dst=2, num_slots=2)])
    assert alloc.append(1, 1) == ([2], [])  # last holder of page 0
    alloc.remove(1)
    alloc.remove(2)
    alloc.remove(3)
    assert alloc.num_free_pages == 8


# -- pop -----------------------------------------------------------------------------------------


def test_pop_releases_pages_no_longer_covered():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 10)  # pages [0, 1, 2]
    assert alloc.num_free_pages == 5
    alloc.pop(1, 0)
    assert alloc.length(1) == 10 and alloc.num_free_pages == 5
    alloc.pop(1, 2)  # 8 tokens: still 2 full pages
    assert alloc.page_table(1) == [0, 1] and alloc.num_free_pages == 6
    alloc.pop(1, 1)  # 7 tokens: page 1 still covered
    assert alloc.page_table(1) == [0, 1] and alloc.num_free_pages == 6
    assert alloc.append(1, 1) == ([7], [])  # the freed slot is written again
    alloc.pop(1, 8)
    assert alloc.page_table(1) == [] and alloc.length(1) == 0 and alloc.num_free_pages == 8


def test_pop_then_append_into_shared_page_copies():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 8)  # pages [0, 1]
    alloc.fork(2, 1, 8)  # shares both full pages
    alloc.pop(2, 2)  # 6 tokens: page 1 still shared, now partial for the child
    assert alloc.page_table(2) == [0, 1] and alloc.num_free_pages == 6
    assert alloc.pages_needed(2, 1) == 1
    assert alloc.append(2, 1) == ([10], [PageCopy(src=1, dst=2, num_slots=2)])
    assert alloc.slots(1) == list(range(8))  # the parent is untouched
    assert alloc.slots(2) == [0, 1, 2, 3, 8, 9, 10]


def test_pop_of_a_shared_page_keeps_it_for_the_other_holder():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 8)
    alloc.fork(2, 1, 8)
    alloc.pop(1, 4)  # the parent drops page 1; the child still holds it
    assert alloc.page_table(1) == [0]
    assert alloc.num_free_pages == 6
    assert alloc.append(1, 1) == ([8], [])  # a fresh page, not page 1
    assert alloc.page_table(2) == [0, 1]
    alloc.pop(2, 8)
    assert alloc.num_free_pages == 6  # page 0 still the parent's; page 1 free; page 2 parent's
    assert alloc.page_table(1) == [0, 2]


# -- remove / clear ------------------------------------------------------------------------------


def test_remove_frees_pages_only_when_no_sequence_holds_them():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 6)  # pages [0, 1]
    alloc.fork(2, 1, 6)
    alloc.append(2, 3)  # child: [0, 2, 3] after copying page 1
    assert alloc.num_free_pages == 4
    alloc.remove(1)  # page 0 is still the child's; page 1 only the parent's
    assert not alloc.has(1)
    assert alloc.num_free_pages == 5
    assert alloc.page_table(2) == [0, 2, 3]
    alloc.remove(2)
    assert alloc.num_free_pages == 8 and alloc.num_sequences == 0
    alloc.add(1)  # the id can be reused
    assert len(alloc.append(1, 1)[0]) == 1 and alloc.num_free_pages == 7


def test_clear_frees_everything():
    alloc = PageAllocator(num_pages=8, page_size=4)
    _filled(alloc, 1, 6)
    alloc.fork(2, 1, 5)
    alloc.fork(3, 1, 2)
    alloc.append(3, 7)
    alloc.clear()
    assert alloc.num_sequences == 0 and alloc.seq_ids() == []
    assert alloc.num_free_pages == 8
    alloc.add(1)
    slots, _ = alloc.append(1, 32)  # every page is usable again
    assert sorted(slots) == list(range(32)) and alloc.num_free_pages == 0


# -- exhaustion ----------------------------------------------------------------------------------


def test_append_raises_before_changing_anything_when_pages_run_out():
    alloc = PageAllocator(num_pages=2, page_size=4)
    _filled(alloc, 1, 5)
    assert alloc.num_free_pages == 0
    assert alloc.pages_needed(1, 3) == 0
    assert alloc.pages_needed(1, 4) == 1
    with pytest.raises(ResourceExhausted):
        alloc.append(1, 4)
    assert alloc.length(1) == 5 and alloc.page_table(1) == [0, 1] and alloc.num_free_pages == 0
    assert alloc.append(1, 3) == ([5, 6, 7], [])  # what fits still goes in
    with pytest.raises(ResourceExhausted):
        alloc.append(1, 1)
    assert alloc.length(1) == 8


def test_copy_on_write_counts_against_the_free_pages():
    alloc = PageAllocator(num_pages=2, page_size=4)
    _filled(alloc, 1, 2)  # page 0, half full
    alloc.fork(2, 1, 2)
    assert alloc.num_free_pages == 1
    assert alloc.pages_needed(2, 3) == 2  # the copy + one more page
    with pytest.raises(ResourceExhausted):
        alloc.append(2, 3)
    assert alloc.length(2) == 2 and alloc.page_table(2) == [0] and alloc.num_free_pages == 1
    assert alloc.pages_needed(2, 2) == 1
    assert alloc.append(2, 2) == ([6, 7], [PageCopy(src=0, dst=1, num_slots=2)])
    assert alloc.num_free_pages == 0
    alloc.add(3)
    with pytest.raises(ResourceExhausted):
        alloc.append(3, 1)
    assert alloc.length(3) == 0 and alloc.page_table(3) == []


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.length(9),
        lambda a: a.page_table(9),
        lambda a: a.slots(9),
        lambda a: a.pages_needed(9, 1),
        lambda a: a.append(9, 1),
        lambda a: a.pop(9, 0),
        lambda a: a.remove(9),
        lambda a: a.fork(10, 9, 0),
    ],
)
def test_unknown_sequence_is_not_found(call):
    alloc = PageAllocator(num_pages=4, page_size=4)
    _filled(alloc, 1, 3)
    with pytest.raises(NotFound):
        call(alloc)
    assert alloc.num_free_pages == 3 and alloc.seq_ids() == [1]


def test_duplicate_ids_fail_precondition():
    alloc = PageAllocator(num_pages=4, page_size=4)
    _filled(alloc, 1, 3)
    alloc.add(2)
    with pytest.raises(FailedPrecondition):
        alloc.add(1)
    with pytest.raises(FailedPrecondition):
        alloc.fork(2, 1, 1)
    assert alloc.length(1) == 3 and alloc.length(2) == 0 and alloc.num_free_pages == 3


@pytest.mark.parametrize("position", [-1, 4, 100])
def test_fork_position_outside_parent_is_invalid(position):
    alloc = PageAllocator(num_pages=4, page_size=4)
    _filled(alloc, 1, 3)
    with pytest.raises(InvalidArgument):
        alloc.fork(2, 1, position)
    assert not alloc.has(2)
    alloc.fork(2, 1, 3)  # the refcounts were not touched: the copy-on-write still happens
    assert alloc.append(2, 1)[1] == [PageCopy(src=0, dst=1, num_slots=3)]


@pytest.mark.parametrize("count", [-1, 4])
def test_pop_beyond_length_is_invalid(count):
    alloc = PageAllocator(num_pages=4, page_size=4)
    _filled(alloc, 1, 3)
    with pytest.raises(InvalidArgument):
        alloc.pop(1, count)
    assert alloc.length(1) == 3 and alloc.num_free_pages == 3
