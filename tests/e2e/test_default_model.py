"""The real default model (SmolLM2-135M-Instruct, fp32) through target and router processes:
greedy output equals transformers' generate token for token, alone and concurrently."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.bench.services import running_services
from tandem.grpc_server import CHANNEL_OPTIONS
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is to a beginner.",
    "List three tips for staying healthy.",
    "Translate 'good morning, my friend' into Spanish.",
    "What is 17 multiplied by 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Describe the water cycle in two sentences.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    tok = AutoTokenizer.from_pretrained(default_model)
    rendered = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in PROMPTS]
    return [tok(r, add_special_tokens=False)["input_ids"] for r in rendered]


@pytest.fixture(scope="module")
def reference(default_model, prompt_ids):
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def router(default_model):
    with running_services(default_model, "float32") as address:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            yield generate_pb2_grpc.GenerationStub(channel)


def complete(stub, ids) -> list[int]:
    params = pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    return [t for r in stub.Generate(pb.GenerateRequest(token_ids=ids, params=params), timeout=600) for t in r.choices[0].token_ids]


def test_greedy_equals_transformers(router, prompt_ids, reference):
    outputs = [complete(router, ids) for ids in prompt_ids]
    assert outputs == reference
    assert sum(map(len, outputs)) > 4 * NEW_TOKENS  # most prompts run long, not a trivial eos


def test_eight_concurrent_streams_equal_one_at_a_time(router, prompt_ids, reference):
    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        outputs = list(pool.map(lambda ids: complete(router, ids), prompt_ids))
    assert outputs == reference
