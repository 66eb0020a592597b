"""Served acceptance of seeded (keyed) against unseeded (speculative sampling) requests at
temperature 1: the default model (fp32), the shipped EAGLE head, chains of 4 and the CPU's tree
(depth 2, top-2, 4 nodes); MT-bench first turns, one stream. Usage: python keyed_cost.py N TOKENS."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
from tandem.bench.data import mtbench_first_turns
from tandem.models.fetch import tandem_home
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services

n, tokens = int(sys.argv[1]), int(sys.argv[2])
model = tandem_home() / "models" / "SmolLM2-135M-Instruct" / "float32"
head = Path("/work/main/heads/eagle-smollm2-135m")
questions = mtbench_first_turns(tandem_home())[:n]
out = {}
for shape, draft in (("chain:4", {"shape": "chain"}), ("tree:2:2:4", {"shape": "tree", "tree_top_k": 2, "tree_node_budget": 4})):
    k = 4 if shape.startswith("chain") else 2
    s = start_services(model, draft_model=head, router={"spec_draft_length": k}, draft=draft)
    try:
        for seeded in (False, True):
            steps = accepted = produced = 0
            started = time.time()
            for i, q in enumerate(questions):
                params = pb.SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
                if seeded:
                    params.seed = 1000 + i
                _, _, _, last = generate(s.stub, messages=[pb.ChatMessage(role="user", content=q)], params=params)
                steps += last.usage.verify_steps
                accepted += last.usage.accepted_draft_tokens
                produced += last.usage.completion_tokens
            key = f"{shape} {'seeded (keyed)' if seeded else 'unseeded'}"
            out[key] = {"tokens_per_verify": round(produced / steps, 3), "accepted_draft_tokens": accepted,
                        "completion_tokens": produced, "seconds": round(time.time() - started, 1)}
            print(key, out[key], flush=True)
    finally:
        s.stop()
Path("/root/runs/v14/keyed_cost.json").write_text(json.dumps(out, indent=1))
