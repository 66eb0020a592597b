"""The speculation bench's planning and bookkeeping, with fake runners (no services, no model)."""

import os
import signal

import pytest

from tandem.bench.services import Devices, bench_kv_cache_tokens, sigterm_held
from tandem.bench.spec import measure_cell
from tandem.bench.spec_modes import plan_modes, spec_config
from tandem.bench.spec_report import _ratios
from tandem.bench.spec_runners import GroupResult, Refused, Tally
from tandem.cli import build_parser
from tandem.models.heads import CPU_SHAPE
from tandem.bench.streams import stream_usage
from tandem.v1 import generate_pb2 as pb


def _config(tmp_path, *flags):
    args = build_parser().parse_args(["bench", "--mode", "spec", "--out", str(tmp_path), *flags])
    return spec_config(args)


def test_a_missing_head_skips_its_rows_with_the_folder(tmp_path):
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text("{}")
    cfg = _config(tmp_path, "--medusa-head", str(tmp_path / "nowhere"))
    modes = {m.name: m for m in plan_modes(cfg, eagle, cfg.medusa_head)}
    assert list(modes) == ["hf_generate", "hf_prompt_lookup", "tandem_plain", "tandem_ngram", "tandem_suffix",
                           "eagle_chain", "eagle_tree", "medusa"]
    assert modes["tandem_ngram"].speculative and modes["tandem_ngram"].stack.router[-2:] == ("--local-draft", "ngram")
    assert modes["medusa"].skipped == f"skipped: no head at {tmp_path / 'nowhere'}" and modes["medusa"].stack is None
    assert not modes["eagle_tree"].skipped and "tree" in modes["eagle_tree"].stack.draft
    assert modes["tandem_plain"].stack.draft is None and not modes["tandem_plain"].speculative


def test_rows_left_out_are_skipped_and_unknown_rows_refused(tmp_path, capsys):
    cfg = _config(tmp_path, "--rows", "tandem_plain, medusa", "--tree-node-budget", "30")
    modes = {m.name: m for m in plan_modes(cfg, cfg.eagle_head, cfg.medusa_head)}
    assert [n for n, m in modes.items() if not m.skipped] == ["tandem_plain", "medusa"]
    assert modes["eagle_tree"].skipped == modes["hf_generate"].skipped == "skipped: not in --rows"
    assert modes["medusa"].stack.draft[-2:] == ("--tree-node-budget", "30")  # the first 30 nodes of its tree
    with pytest.raises(SystemExit):
        _config(tmp_path, "--rows", "medusa,eagle")
    assert "unknown rows ['eagle']" in capsys.readouterr().err


def test_default_heads_are_the_shipped_folders(tmp_path):
    cfg = _config(tmp_path)
    assert cfg.eagle_head.name == "eagle-smollm2-135m" and cfg.medusa_head.name == "medusa-smollm2-135m"
    assert _config(tmp_path, "--reduced").eagle_head is None  # --reduced builds tiny ones


def test_devices_default_to_the_cpu_and_the_draft_follows_the_target(tmp_path):
    assert _config(tmp_path).devices == Devices("cpu", "cpu")
    assert _config(tmp_path, "--device", "cuda:0").devices == Devices("cuda:0", "cuda:0")
    assert _config(tmp_path, "--device", "cuda:0", "--draft-device", "cuda:1").devices == Devices("cuda:0", "cuda:1")


def test_enforce_eager_reaches_the_services_the_bench_starts(tmp_path):
    from tandem.cli import build_parser

    devices = _config(tmp_path, "--device", "cuda:0", "--enforce-eager").devices
    assert devices == Devices("cuda:0", "cuda:0", eager=True) and devices.record()["cuda_graphs"] is False
    for service in ("target", "draft"):  # the flags the bench appends parse as the service's own
        args = build_parser().parse_args([service, *devices.service_flags(devices.draft)])
        assert args.enforce_eager and args.device == "cuda:0"
    assert "--enforce-eager" not in _config(tmp_path).devices.service_flags("cpu")


def test_results_record_cuda_graphs_only_where_the_services_capture_them():
    assert Devices("cuda:0", "cuda:1").record() == {"target": "cuda:0", "draft": "cuda:1", "cuda_graphs": True}
    assert Devices().record(with_draft=False) == {"target": "cpu", "cuda_graphs": False}


def test_shape_flags_not_given_take_the_shape_tandem_up_gives_the_device(tmp_path):
    def shape(*flags):
        cfg = _config(tmp_path, *flags)
        return cfg.spec_draft_length, cfg.tree_top_k, cfg.tree_node_budget

    assert shape() == (2, 2, 4)  # a CPU: depth-2 trees of 4 nodes
    assert shape("--device", "cuda:0") == (4, 8, 30)
    assert shape("--device", "cuda:0", "--tree-node-budget", "12", "--spec-draft-length", "3") == (3, 8, 12)
    assert _config(tmp_path).spec_disable_batch_size == CPU_SHAPE.spec_disable_batch_size
    cfg = _config(tmp_path, "--spec-disable-batch-size", "5")
    routers = [m.stack.router for m in plan_modes(cfg, cfg.eagle_head, cfg.medusa_head) if m.stack]
    assert routers and all(r[r.index("--spec-disable-batch-size") + 1] == "5" for r in routers)


class FakeRunner:
    def __init__(self, result: GroupResult | None):
        self.result, self.calls = result, 0

    def counters(self):
        return None

    def run(self, group, temperature, seeds):
        self.calls += 1
        if self.result is None:
            raise Refused("skipped: refuses batches")
        return self.result


def test_cell_rows_skips_and_ratios(tmp_path):
    cfg = _config(tmp_path, "--medusa-head", str(tmp_path / "nowhere"), "--concurrency", "2")
    modes = [m for m in plan_modes(cfg, tmp_path / "nowhere", cfg.medusa_head)]
    runners = {
        "hf_generate": FakeRunner(GroupResult(16, sequence_forwards=16)),
        "hf_prompt_lookup": FakeRunner(None),
        "tandem_plain": FakeRunner(GroupResult(16)),
        "tandem_ngram": FakeRunner(GroupResult(16)),
        "tandem_suffix": FakeRunner(GroupResult(16)),
    }
    rows = measure_cell(runners, modes, [[1, 2]] * 4, 0.0, 2, cfg)
    assert runners["hf_prompt_lookup"].calls == 1  # refused once, not asked again
    assert runners["tandem_plain"].calls == 2
    by = {r["mode"]: r for r in rows}
    assert by["hf_prompt_lookup"] == {**by["hf_prompt_lookup"], "status": "skipped", "reason": "skipped: refuses batches"}
    assert by["eagle_chain"]["reason"].startswith("skipped: no head at")
    assert by["tandem_plain"]["completion_tokens"] == 32 and by["tandem_plain"]["mean_accepted_length"] == 1.0
    _ratios(rows)
    assert by["tandem_plain"]["ratio_to_tandem_plain"] == 1.0 and "ratio_to_tandem_plain" not in by["medusa"]


def test_a_streams_tokens_add_up_to_its_usage_and_its_loop_is_seen():
    """Generate messages as the router streams them: tokens in each, usage on the last."""
    def stream(parts, completion_tokens):
        messages = [pb.GenerateResponse(choices=[pb.Choice(token_ids=p)]) for p in parts]
        messages[-1].usage.completion_tokens = completion_tokens
        return messages

    loop = list(range(5)) + [7, 8] * 20
    usage = stream_usage(stream([loop[:10], loop[10:30], loop[30:]], len(loop)))
    assert usage.looping and usage.completion_tokens == len(loop)
    assert not stream_usage(stream([list(range(20)), list(range(20, 40))], 40)).looping
    with pytest.raises(RuntimeError, match="carried 40 tokens, its usage counts 41"):
        stream_usage(stream([list(range(40))], 41))


def test_accepted_length_is_one_plus_the_positions():
    t = Tally()
    t.add(GroupResult(7, verify_steps=4, accepted_draft_tokens=3, accepted_by_depth=(2, 1), requests=2, looping=1), 1.0)
    t.add(GroupResult(5, verify_steps=2, accepted_draft_tokens=3, accepted_by_depth=(2, 1), requests=2), 1.0)
    assert t.mean_accepted_length() == (6 + 6) / 6 and (t.requests, t.looping) == (4, 1)
    rates = t.acceptance_by_depth(4)
    assert rates == [4 / 6, 2 / 6, 0.0, 0.0] and abs(1 + sum(rates) - t.mean_accepted_length()) < 1e-12


def test_sigterm_held_during_a_spawn_reaches_the_handler_after_it():
    """bench spawns services under sigterm_held: a SIGTERM during the spawn reaches cmd_bench's
    handler (SystemExit) only once the new process is in the list of those to stop."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(("handler", signum)))
    try:
        with sigterm_held():
            os.kill(os.getpid(), signal.SIGTERM)
            seen.append("spawned")
        seen.append("after")
        with sigterm_held():
            seen.append("quiet")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == ["spawned", ("handler", signal.SIGTERM), "after", "quiet"]


def test_a_bench_stack_reserves_the_kv_its_streams_need():
    assert bench_kv_cache_tokens(300, 128, 1) == 4096  # the floor
    sized = bench_kv_cache_tokens(300, 1024, 8)
    assert sized % 1024 == 0 and 8 * (300 + 1024 + 64) <= sized < 8 * (300 + 1024 + 64) + 2048
