"""The soak: mixed requests over many concurrent streams under `tandem up` with EAGLE on, the
draft killed once midway (the supervisor restarts it). Afterwards every request completed
correctly (greedy and seeded ones equal to their run alone) or was refused with a clean status;
nothing runs or waits; the target and the draft hold no page and no sequence (recycling off);
the router's view equals the target's; the router's and the target's memory are back within a
few percent of their level after warm-up (the restarted draft: of the first draft's).

The reduced soak runs in the default suite; TANDEM_SOAK=full runs the issue's 200 requests over
32 streams."""

import os

import pytest

from tandem.models.eagle_io import random_eagle_checkpoint
from tests import reliability
from tests.e2e.faults import Up, serving, wait_for
from tests.e2e.soak import deterministic, judge, make_requests, rss_kib, run_all, run_one, settle

FULL = os.environ.get("TANDEM_SOAK") == "full"
SIZES = [pytest.param(60, 12, id="reduced"),
         pytest.param(200, 32, id="full", marks=pytest.mark.skipif(not FULL, reason="TANDEM_SOAK=full"))]
# Memory after the soak against after a warm-up pass of the same mix: allocators keep some of
# what a busy moment took.
RSS_SLACK = 0.05
RSS_SLACK_KIB = 24 * 1024


@pytest.fixture(scope="module")
def head(tiny_model, tmp_path_factory):
    return random_eagle_checkpoint(tmp_path_factory.mktemp("heads") / "eagle", tiny_model, seed=2)


@pytest.mark.parametrize("count, streams", SIZES)
def test_soak(tiny_model, head, count, streams):
    up = Up(tiny_model, "--draft", "eagle", "--draft-model", str(head), "--spec-draft-length", "3",
            "--spec-disable-batch-size", "64", "--prefix-cache-max-num-recycling-seqs", "0", "--max-waiting", "4096")
    try:
        up.wait_ready()
        items = make_requests(count, seed=count)
        alone = {i: run_one(up.stub, item) for i, item in enumerate(items) if deterministic(item)}
        run_all(up.stub, items, streams)  # warm-up: the same mix once (allocators settle), then memory is measured
        _idle(up)
        warm = {name: rss_kib(up.pid(name)) for name in ("router", "target", "draft")}
        killed = []

        def kill_draft_midway(done: int) -> None:
            if done == count // 2 and not killed:
                killed.append(up.kill("draft"))

        results = run_all(up.stub, items, streams, on_progress=kill_draft_midway)
        assert killed, "the draft was never killed"
        wrong = [why for i, (item, result) in enumerate(zip(items, results))
                 if (why := judge(item, result, alone.get(i)))]
        assert not wrong, wrong[:10]
        up.wait_line("tandem up: draft restarted")
        wait_for(lambda: serving(up.address("draft")), 120, "the restarted draft")
        leaks = _idle(up)
        reliability.leaks(leaks)
        assert not leaks
        # The draft was restarted: its new process (same head, half the soak) against the old one's warm level.
        after = {name: rss_kib(up.pid(name)) for name in warm}
        codes = {code: sum(r.code == code for r in results) for code in {r.code for r in results}}
        print(f"soak: {count} requests over {streams} streams, outcomes {codes}; RSS MiB after warm-up / after:",
              {name: (warm[name] // 1024, after[name] // 1024) for name in warm})
        for name, kib in after.items():
            assert kib <= warm[name] * (1 + RSS_SLACK) + RSS_SLACK_KIB, (name, warm[name], kib)
        reliability.served(sum(r.code == "OK" for r in results))
        reliability.bad_inputs(sum(item.kind == "bad" for item in items))
        reliability.faults(1 + sum(item.kind in ("cancel", "deadline") for item in items))
    finally:
        assert up.stop() == 0, up.output()[-3000:]


def _idle(up: Up) -> int:
    """Waits for the services to be idle; returns how many leaks remain (0 expected): requests
    running or waiting, the target's or the draft's pages or sequences held, the router's view
    differing from the target's."""
    def probe():
        router, target = up.router_stats(), up.engine_stats("target")
        draft = up.engine_stats("draft") if serving(up.address("draft")) else None
        leaks = [router.requests_running, router.requests_waiting, target.sequences_live,
                 target.kv_pages_total - target.kv_pages_free, router.sequences_live != target.sequences_live,
                 router.kv_pages_free != target.kv_pages_free]
        if draft is not None:
            leaks += [draft.sequences_live, draft.kv_pages_total - draft.kv_pages_free]
        return not any(leaks), sum(bool(x) for x in leaks)
    return settle(probe, timeout_s=30)
