"""Every registered draft method's engine answers the servicer's protocol."""

import inspect

from draft_service.methods import DRAFT_METHODS
from draft_service.protocol import DraftEngine


def test_every_draft_method_engine_has_the_protocol_calls():
    members = [name for name, value in vars(DraftEngine).items() if inspect.isfunction(value) and not name.startswith("_")]
    assert sorted(members) == ["draft", "reset", "stats"]
    for name, method in DRAFT_METHODS.items():
        engine = method.engine()
        for member in members:
            ours = inspect.signature(getattr(DraftEngine, member)).parameters
            theirs = inspect.signature(getattr(engine, member)).parameters
            assert list(theirs)[: len(ours)] == list(ours), (name, member)
