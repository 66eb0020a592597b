"""The threads that decode peer messages compute with one torch thread: a second OpenMP team's
spinning workers slowed the target's forward passes of sampled steps by a third (tandem.peer)."""

import queue
import threading

import pytest
import torch

from draft_service.peer_client import DraftPeer
from tandem import peer_codec
from tandem.peer import DraftProbs, TargetPeer
from target_service.servicer import _read_probs


@pytest.fixture(autouse=True)
def two_threads():
    """torch.set_num_threads also sets what threads started later begin with: 2, so that 1 is news."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_targets_reader_of_draft_probabilities_uses_one_torch_thread():
    seen = []

    class Peer(TargetPeer):
        def put_probs(self, message):
            seen.append((message.draft_step_id, torch.get_num_threads()))

    message = peer_codec.draft_probs_to_pb(DraftProbs(5, {3: torch.softmax(torch.randn(1, 100), -1)}))
    reader = threading.Thread(target=_read_probs, args=(Peer(), iter([message]), queue.Queue(), 100))
    reader.start()
    reader.join()
    assert seen == [(5, 1)] and torch.get_num_threads() == 2  # the caller's own setting stays


def test_the_drafts_peer_thread_uses_one_torch_thread(monkeypatch):
    seen = threading.Event()
    threads = []

    def stream_once(self):
        threads.append(torch.get_num_threads())
        self._stop.set()
        seen.set()

    monkeypatch.setattr(DraftPeer, "_stream_once", stream_once)
    DraftPeer("127.0.0.1:1").start()
    assert seen.wait(10) and threads == [1]
