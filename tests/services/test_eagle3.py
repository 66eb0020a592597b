"""EAGLE-3 heads through real target, draft and router servers on a tiny 2-layer model: the draft
names the target layers it reads in its peer hello, the target streams their inputs side by
side, and speculation stays lossless, chains and trees."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.peer_client import DraftPeer
from tandem import peer_codec
from tandem.models.config import ModelConfig
from tandem.ops import AddSequence, EntryKind, StepEntry, StepRequest
from tandem.peer import HiddenPairs, HiddenStep
from tandem.sampling.params import SamplingParams
from tandem.testing.drafts import random_eagle3_checkpoint
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests.services.harness import generate, peer_stream, start_services
from tests.services.test_generate import greedy, transformers_greedy

AUX = (0, 1)  # both layers of the tiny target: EAGLE-3 reads distinct layers in ascending order


@pytest.fixture(scope="module")
def reference(tiny_model):
    return transformers_greedy(tiny_model)


@pytest.fixture(scope="module")
def head(tiny_model, tmp_path_factory):
    vocab = ModelConfig.from_folder(tiny_model).vocab_size
    return random_eagle3_checkpoint(tmp_path_factory.mktemp("heads") / "eagle3", tiny_model, seed=2,
                                    vocab_ids=torch.arange(0, vocab, 2), aux_layers=AUX)


@pytest.mark.parametrize("draft", [{"lm_head_quant": "int8", "head_quant": "int8"},  # tandem up's CPU default
                                   {"shape": "tree", "tree_top_k": 2, "tree_node_budget": 6}],
                         ids=["int8 chain", "tree"])
def test_greedy_equals_target(tiny_model, reference, head, draft):
    s = start_services(tiny_model, draft_model=head, router={"spec_draft_length": 3}, draft=draft)
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: generate(s.stub, prompt=p, params=greedy())[0], TINY_PROMPTS))
        assert outs == [reference[p] for p in TINY_PROMPTS]
        assert s.stub.Stats(pb.StatsRequest()).draft_tokens_total > 0
        assert s.target_engine.peer.feature_layers == AUX
    finally:
        s.stop()


def test_the_target_streams_the_inputs_of_the_heads_layers(tiny_model, head):
    """What the draft's first prefill reads equals transformers' hidden_states of those layers at
    each position, side by side, paired with the next token."""
    s = start_services(tiny_model, draft_model=head, router={"spec_draft_length": 3})
    seen = []
    forward = s.draft_engine.head.forward
    s.draft_engine.head.forward = lambda tokens, features, *a: seen.append((tokens, features)) or forward(tokens, features, *a)
    try:
        prompt = [5, 17, 33, 60, 61, 2, 99, 140, 7]
        ids = generate(s.stub, token_ids=prompt, params=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    finally:
        s.stop()
    tokens, features = next((t, f) for t, f in seen if f.shape[-1] == len(AUX) * 64)
    assert tokens.tolist() == (prompt + ids)[1 : len(tokens) + 1]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt + ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[layer][0, : len(tokens)] for layer in AUX], dim=-1)
    assert (features - want).abs().max().item() < 1e-4


def test_a_hello_naming_layers_the_target_lacks_is_refused(tiny_model, reference):
    s = start_services(tiny_model)
    try:
        with pytest.raises(grpc.RpcError) as err:
            with peer_stream(s.target_port, [peer_codec.peer_hello_to_pb((0, 7))]):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft feature layers [7] are outside the target's 2 layers" in err.value.details()
        assert not s.target_engine.peer.connected
        prompt = TINY_PROMPTS[0]
        assert generate(s.stub, prompt=prompt, params=greedy())[0] == reference[prompt]
    finally:
        s.stop()


def test_a_draft_refused_by_the_target_knows_why(tiny_model):
    """A draft whose hello names layers the target lacks (a head for another model) is refused;
    the draft keeps the reason, which start_draft's error carries."""
    s = start_services(tiny_model)
    peer = DraftPeer(f"127.0.0.1:{s.target_port}")
    peer.use_features((0, 7), 128)
    try:
        peer.start()
        deadline = time.monotonic() + 20
        while peer.refusal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "draft feature layers [7] are outside the target's 2 layers" in peer.refusal
        assert not peer.connected and not s.target_engine.peer.connected
    finally:
        peer.stop()
        s.stop()


def test_a_new_peer_of_other_layers_changes_what_the_target_streams(tiny_model):
    """Pairs wait in a carry across chunks; a peer reading other layers drops the carries (old
    features) and gets its own width from the next step."""
    engine = TargetEngine(TargetConfig(model_dir=tiny_model, kv_cache_tokens=256, kv_page_size=4))
    out = engine.peer.attach(())
    engine.step(StepRequest(1, (AddSequence(1, SamplingParams(temperature=0)),), (StepEntry(1, EntryKind.PREFILL, (5, 6, 7), sample=False, emit_hidden=True),)))
    assert [p.hidden.shape for p in out.get_nowait().seqs] == [(2, 64)]  # the third waits for its next token
    out = engine.peer.attach((0, 1))
    engine.step(StepRequest(2, (), (StepEntry(1, EntryKind.PREFILL, (8, 9), sample=True, emit_hidden=True),)))
    pairs = out.get_nowait().seqs
    assert [(p.start, p.hidden.shape) for p in pairs] == [(3, (2, 128))]  # position 2's carry is gone


def test_the_draft_drops_hidden_states_of_another_width():
    peer = DraftPeer("127.0.0.1:1")
    peer.use_features((0, 1), 128)
    peer._receive(HiddenStep(1, (HiddenPairs(4, 0, (1, 2), torch.zeros(2, 64)), HiddenPairs(5, 0, (3,), torch.zeros(1, 128)))))
    assert peer.take(4) == [] and len(peer.take(5)) == 1
