"""The public request's size caps: one frozen config, refused when it could admit nothing or
more than the engine serves."""

import dataclasses

import pytest

from router.limits import RequestLimits
from tandem.errors import InvalidArgument
from tandem.sampling.params import MAX_TOP_LOGPROBS


def test_defaults_are_frozen():
    limits = RequestLimits()
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_n = 5


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(RequestLimits)])
def test_a_cap_below_one_is_refused_by_name(name):
    with pytest.raises(InvalidArgument, match=name):
        RequestLimits(**{name: 0})


def test_top_logprobs_cannot_exceed_what_the_engine_ranks():
    assert RequestLimits(max_top_logprobs=MAX_TOP_LOGPROBS).max_top_logprobs == MAX_TOP_LOGPROBS
    with pytest.raises(InvalidArgument, match="max_top_logprobs"):
        RequestLimits(max_top_logprobs=MAX_TOP_LOGPROBS + 1)
