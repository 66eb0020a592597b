"""`tandem bench --mode structured`: its workload's schemas compile and their reports add up."""

import argparse
import json

import jsonschema

from tandem.bench.json_workload import TASKS
from tandem.bench.services import Devices
from tandem.bench.structured import MODES, _report, _valid


def test_the_workload_holds_extraction_and_tool_calls_with_valid_schemas():
    kinds = {t.kind for t in TASKS}
    assert kinds == {"extraction", "tool_call"} and 10 <= len(TASKS) <= 20
    for t in TASKS:
        jsonschema.Draft202012Validator.check_schema(t.schema)
    assert _valid(json.dumps({"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}), TASKS[10].schema)
    assert not _valid('{"name": "get_weather"', TASKS[10].schema)


def test_the_report_puts_the_three_modes_side_by_side():
    def run(seconds, verify, accepted):
        return {"seconds": seconds, "completion_tokens": 20, "verify_steps": verify, "draft_tokens": 2 * verify,
                "accepted_draft_tokens": accepted, "finish": "stop", "valid": True, "text": "{}", "ids": [1, 2]}

    runs = {"plain": [run(2.0, 0, 0)], "eagle_unconstrained": [run(1.6, 15, 5)], "eagle_constrained": [run(1.0, 10, 10)]}
    args = argparse.Namespace(questions=1, max_tokens=64, threads=1, reduced=True, dtype="float32",
                              spec_draft_length=2, tree_top_k=2, tree_node_budget=4)
    report = _report(args, "m", "h", TASKS[:1], runs, Devices())
    summary = report["summary"]
    assert set(report["modes"]) == set(MODES)
    assert summary["tokens_per_s"] == {"plain": 10.0, "eagle_unconstrained": 12.5, "eagle_constrained": 20.0}
    assert summary["mean_accepted_length"]["eagle_constrained"] == 2.0
    assert summary["constrained_over_plain"] == 2.0 and summary["aim_eagle_structured_1_3x_plain"]
    assert summary["aim_constrained_faster_than_unconstrained"] and summary["greedy_outputs_identical_to_plain"] == "2/2"
