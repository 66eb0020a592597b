"""The draft's end of the peer stream when the target restarts: a new target numbers its steps
afresh, and the draft's health follows whether the stream is open."""

from draft_service.peer_client import DraftPeer
from tandem.peer import HiddenStep


def reconnect(peer: DraftPeer, instance: str, hello: int) -> None:
    peer._connected = False  # the stream was lost
    peer._begin_stream(instance)
    peer._receive(HiddenStep(hello, ()))


def test_a_restarted_target_is_waited_for_from_its_hello():
    """A restarted target (and router) count from 0 again: the draft must wait for their steps,
    not take them as long past (it would overtake the hidden states it drafts from)."""
    peer = DraftPeer("127.0.0.1:1")
    peer._begin_stream("a")
    peer._receive(HiddenStep(100, ()))
    assert peer.wait_step(100, 0)
    reconnect(peer, "b", 0)
    assert not peer.wait_step(1, 0)
    peer._receive(HiddenStep(1, ()))
    assert peer.wait_step(1, 0)


def test_a_stream_to_the_same_target_never_counts_backwards():
    """Its hello may name the step before the last one streamed (the target sends a step's
    hidden states before it records the step as its last)."""
    peer = DraftPeer("127.0.0.1:1")
    peer._begin_stream("a")
    peer._receive(HiddenStep(100, ()))
    reconnect(peer, "a", 99)
    assert peer.wait_step(100, 0)


def test_the_peer_says_when_its_stream_opens():
    seen = []
    peer = DraftPeer("127.0.0.1:1", on_connected=lambda p: seen.append(p.connected))
    peer._receive(HiddenStep(3, ()))
    peer._receive(HiddenStep(4, ()))
    assert seen == [True]
