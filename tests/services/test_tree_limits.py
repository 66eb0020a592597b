"""Request trees under tight limits through real services (plain decoding, tiny model): each
case hung or failed before parents were kept from holding slots and pages their children need."""
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.testing.tiny import build_tiny_model
from tests.services.harness import generate, start_services
from tests.services.test_generate import greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny1", seed=0, num_layers=1)


def test_two_trees_at_once_with_two_held_sequences_complete(tiny):
    # target max_num_sequence = 2 (router slots default to it): two n = 2 requests at once
    s = start_services(tiny, target={"max_num_sequence": 2})
    try:
        params = greedy(8)
        params.n = 2
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(generate, s.stub, timeout=15, token_ids=[10 + i, 11, 12, 13], params=params) for i in range(2)]
            errors = []
            for f in futs:
                try:
                    f.result()
                except grpc.RpcError as e:
                    errors.append(e.code())
        assert not errors
    finally:
        s.stop()


def test_a_lone_decode_beside_a_waiting_parent_completes(tiny):
    # 8 pages of 8 tokens, 2 running sequences at a time, plain decoding.
    s = start_services(tiny, target={"kv_cache_tokens": 64, "kv_page_size": 8}, router={"max_num_sequence": 2})
    try:
        tree = greedy(10)
        tree.n = 3
        with ThreadPoolExecutor(2) as pool:
            x = pool.submit(generate, s.stub, timeout=60, token_ids=[5, 6, 7, 8], params=greedy(50))
            time.sleep(0.05)
            a = pool.submit(generate, s.stub, timeout=60, token_ids=list(range(20, 37)), params=tree)
            outcome = {}
            for name, f in (("x", x), ("tree", a)):
                try:
                    outcome[name] = len(f.result()[0])
                except grpc.RpcError as e:
                    outcome[name] = f"{e.code().name}: {e.details()}"
        assert outcome == {"x": 50, "tree": 30}
    finally:
        s.stop()


def test_a_tree_near_the_kv_size_completes(tiny):
    s = start_services(tiny, target={"kv_cache_tokens": 32, "kv_page_size": 8})
    try:
        p = greedy(1)
        one = generate(s.stub, timeout=15, token_ids=list(range(20, 43)), params=p)  # n = 1 fits
        assert len(one[0]) == 1
        p.n = 2
        ids = generate(s.stub, timeout=15, token_ids=list(range(20, 43)), params=p)[0]
        assert len(ids) == 2  # one token each
    finally:
        s.stop()
