"""The draft's end of the peer stream when the target restarts: a new target numbers its steps
afresh, and the draft's health follows whether the stream is open."""

from draft_service.peer_client import DraftPeer
from tandem.peer import HiddenStep


def test_a_new_stream_counts_steps_from_its_hello():
    """A restarted target (and router) count from 0 again: the draft must wait for their steps,
    not take them as long past (a draft would then overtake the hidden states it needs)."""
    peer = DraftPeer("127.0.0.1:1")
    peer._receive(HiddenStep(100, ()))
    assert peer.wait_step(100, 0)
    peer._connected = False  # the stream was lost
    peer._receive(HiddenStep(0, ()))  # the new target's hello
    assert not peer.wait_step(1, 0)
    peer._receive(HiddenStep(1, ()))
    assert peer.wait_step(1, 0)


def test_the_peer_says_when_its_stream_opens():
    peer = DraftPeer("127.0.0.1:1")
    seen = []
    peer.on_connected = seen.append
    peer._receive(HiddenStep(3, ()))
    peer._receive(HiddenStep(4, ()))
    assert seen == [True] and peer.connected
