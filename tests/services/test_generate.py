"""Generation through real gRPC servers (target + router) on a tiny random-weight model."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services

NEW_TOKENS = 64


def greedy(max_tokens=NEW_TOKENS, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return transformers_greedy(tiny_model)


def transformers_greedy(tiny_model) -> dict[str, list[int]]:
    """transformers' own greedy generate on the same weights, NEW_TOKENS past any eos."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    outputs = {}
    for prompt in TINY_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
        outputs[prompt] = out[0, ids.shape[1]:].tolist()
    return outputs


def test_greedy_equals_transformers(services, reference):
    for prompt in TINY_PROMPTS:
        ids, _, _, last = generate(services.stub, prompt=prompt, params=greedy())
        assert ids == reference[prompt], prompt
        assert last.choices[0].finish_reason == "length"
        assert last.usage.completion_tokens == NEW_TOKENS


def test_concurrent_streams_equal_one_at_a_time(services, reference):
    with ThreadPoolExecutor(len(TINY_PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(services.stub, prompt=p, params=greedy())[0], TINY_PROMPTS))
    assert results == [reference[p] for p in TINY_PROMPTS]


def test_chunked_prefill_equals_one_chunk(tiny_model, reference):
    chunked = start_services(tiny_model, router={"prefill_chunk_size": 3})
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: generate(chunked.stub, prompt=p, params=greedy())[0], TINY_PROMPTS))
        assert results == [reference[p] for p in TINY_PROMPTS]
        assert chunked.wait_idle().sequences_live == 0
    finally:
        chunked.stop()


def sampled(seed=None, **kw) -> pb.SamplingParams:
    params = pb.SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, ignore_eos=True, **kw)
    if seed is not None:
        params.seed = seed
    return params


def test_seeded_sampling_reproducible_alone_and_in_a_mixed_batch(services):
    prompt = TINY_PROMPTS[1]
    alone = generate(services.stub, prompt=prompt, params=sampled(seed=1234))[0]
    again = generate(services.stub, prompt=prompt, params=sampled(seed=1234))[0]
    others = [(TINY_PROMPTS[i % 8], sampled(seed=i) if i % 2 else greedy(40)) for i in range(6)]
    jobs = [(prompt, sampled(seed=1234))] + others
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda j: generate(services.stub, prompt=j[0], params=j[1])[0], jobs))
    assert alone == again == mixed[0]
    different = generate(services.stub, prompt=prompt, params=sampled(seed=4321))[0]
    assert different != alone


def test_unseeded_sampling_varies(services):
    outs = {tuple(generate(services.stub, prompt=TINY_PROMPTS[2], params=sampled())[0]) for _ in range(3)}
    assert len(outs) > 1


def test_inputs_prompt_messages_and_token_ids_agree(services):
    tok = AutoTokenizer.from_pretrained(services.router_engine.config.model_dir)
    messages = [pb.ChatMessage(role="user", content=TINY_PROMPTS[3])]
    templated = tok.apply_chat_template([{"role": "user", "content": TINY_PROMPTS[3]}], add_generation_prompt=True, tokenize=False)
    token_ids = tok(templated, add_special_tokens=False).input_ids
    by_messages = generate(services.stub, messages=messages, params=greedy(16))
    by_ids = generate(services.stub, token_ids=token_ids, params=greedy(16))
    assert by_messages[0] == by_ids[0]
    assert by_messages[3].usage.prompt_tokens == len(token_ids)
    tokenized = services.stub.Tokenize(pb.TokenizeRequest(messages=messages))
    assert list(tokenized.token_ids) == token_ids


def test_stream_text_matches_decoded_tokens(services):
    tok = AutoTokenizer.from_pretrained(services.router_engine.config.model_dir)
    ids, text, responses, _ = generate(services.stub, prompt=TINY_PROMPTS[4], params=greedy(48))
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert len(responses) == 48  # one delta per step


def test_max_tokens_and_stop_token_ids(services):
    ids, _, _, last = generate(services.stub, prompt=TINY_PROMPTS[0], params=greedy(10))
    assert len(ids) == 10 and last.choices[0].finish_reason == "length"
    stop_at = ids[4]
    first = ids.index(stop_at)
    ids2, _, _, last2 = generate(services.stub, prompt=TINY_PROMPTS[0], params=greedy(10, stop_token_ids=[stop_at]))
    assert ids2 == ids[: first + 1]  # the stop token is reported, its text is not shown
    assert last2.choices[0].finish_reason == "stop"
    assert last2.usage.completion_tokens == first + 1


def test_stop_string_cuts_text(services):
    _, text, _, _ = generate(services.stub, prompt=TINY_PROMPTS[5], params=greedy(48))
    stop = text[10:13]
    assert stop
    _, cut, _, last = generate(services.stub, prompt=TINY_PROMPTS[5], params=greedy(48, stop=[stop]))
    assert cut == text[: text.index(stop)]
    assert last.choices[0].finish_reason == "stop"


def test_eos_stops_unless_ignored(services):
    # logit_bias makes eos (2) the greedy choice at every step.
    forced = dict(max_tokens=5, temperature=0, logit_bias={2: 100.0})
    ids, text, _, last = generate(services.stub, prompt=TINY_PROMPTS[0], params=pb.SamplingParams(**forced))
    assert ids == [2] and text == "" and last.choices[0].finish_reason == "stop"
    ids, _, _, last = generate(services.stub, prompt=TINY_PROMPTS[0], params=pb.SamplingParams(ignore_eos=True, **forced))
    assert ids == [2] * 5 and last.choices[0].finish_reason == "length"


def test_logprobs_are_the_models(services, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids, _, responses, _ = generate(services.stub, prompt=TINY_PROMPTS[6], params=greedy(8, logprobs=True, top_logprobs=3))
    logprobs = [lp for r in responses for c in r.choices for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    prompt_ids = tok(TINY_PROMPTS[6]).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1)
    for i, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(expected[i, ids[i]].item(), abs=1e-4)
        assert len(lp.top) == 3
        assert lp.top[0].token_id == ids[i]  # greedy: the chosen token is the most likely
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)


def test_cancelled_stream_frees_its_pages(services):
    call = services.stub.Generate(
        pb.GenerateRequest(prompt=TINY_PROMPTS[7], params=greedy(400)), timeout=60
    )
    for i, _ in enumerate(call):
        if i == 3:
            break
    call.cancel()
    stats = services.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
    # the service still answers
    assert len(generate(services.stub, prompt=TINY_PROMPTS[0], params=greedy(4))[0]) == 4


def test_a_router_shutting_down_ends_live_streams_as_cancelled_with_usage(tiny_model):
    """What the router does as its grace period ends (router/server.py): each live request's
    stream ends with a "cancelled" delta and the usage so far, nothing is held after, and a
    request that comes later is refused as UNAVAILABLE."""
    s = start_services(tiny_model)
    try:
        calls = [s.stub.Generate(pb.GenerateRequest(prompt=p, params=greedy(400)), timeout=60) for p in TINY_PROMPTS[6:8]]
        firsts = [next(call) for call in calls]  # both streaming
        s.loop.call_soon_threadsafe(s.router_engine.cancel_all)
        for first, call in zip(firsts, calls):
            responses = [first, *call]
            last = responses[-1]
            assert last.choices[0].finish_reason == "cancelled" and last.HasField("usage")
            tokens = sum(len(c.token_ids) for r in responses for c in r.choices)
            assert 0 < tokens == last.usage.completion_tokens < 400
        stats = s.wait_idle()
        assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
        with pytest.raises(grpc.RpcError) as refused:
            generate(s.stub, prompt=TINY_PROMPTS[0], params=greedy(4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
    finally:
        s.stop()


def test_stats(services):
    generate(services.stub, prompt=TINY_PROMPTS[0], params=greedy(4))
    stats = services.stub.Stats(pb.StatsRequest())
    assert stats.requests_total >= 1 and stats.completion_tokens_total >= 4
    assert stats.requests_running == 0 and stats.kv_pages_total > 0
    info = services.stub.ModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == 448 and info.max_context_length == 512 and 2 in info.eos_token_ids
