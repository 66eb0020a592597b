"""Faults under `tandem up`, with real processes on loopback: a service killed (or stalled) while
requests stream. `tandem up` restarts what dies; the others serve on; requests complete or end
with a clean status, never hang.

The tiny model and a random EAGLE head: drafts are (almost) never accepted, but they are drafted
and verified at every step, which is what the faults must not disturb. Greedy outputs are
lossless, so a run without the fault gives the expected tokens.
"""

import signal
import time

import pytest

from tandem.models.eagle_io import random_eagle_checkpoint
from tests import reliability
from tests.e2e.faults import PROMPTS, Load, Up, greedy, serving, stream, wait_for

MAX_TOKENS = 400  # the streams outlast the fault (4 streams of 400 tokens: several seconds here)
# The bound for in-flight requests to end UNAVAILABLE once the target dies is 5 s; it is
# a liveness bound (never a hang), asserted with margin for this shared 2-core machine.
UNAVAILABLE_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def head(tiny_model, tmp_path_factory):
    return random_eagle_checkpoint(tmp_path_factory.mktemp("heads") / "eagle", tiny_model, seed=1)


@pytest.fixture
def up(tiny_model, head):
    # Speculation for every batch size: by default a CPU pauses drafts past one stream.
    up = Up(tiny_model, "--draft", "eagle", "--draft-model", str(head), "--spec-draft-length", "3",
            "--spec-disable-batch-size", "64")
    try:
        up.wait_ready()
        yield up
    finally:
        assert up.stop() == 0, up.output()[-3000:]


def expected(up: Up) -> list[list[int]]:
    return [stream(up.stub, p, greedy(MAX_TOKENS)).tokens for p in PROMPTS]


def speculating_again(up: Up) -> bool:
    """The router speculates again, and a new request is drafted for."""
    return up.router_stats().speculation_active and stream(up.stub, PROMPTS[0], greedy(8)).draft_tokens > 0


def test_the_draft_killed_mid_load_is_restarted_and_no_request_notices(up):
    reference = expected(up)
    load = Load(up.stub, PROMPTS, MAX_TOKENS)
    load.wait_streaming()
    killed = up.kill("draft")
    outcomes = load.outcomes()
    assert [o.code for o in outcomes] == ["OK"] * len(PROMPTS)
    assert [o.tokens for o in outcomes] == reference
    up.wait_line(f"tandem up: draft (pid {killed}) was killed by SIGKILL; restarting it in")
    up.wait_line("tandem up: draft restarted")
    assert up.pid("draft") != killed
    wait_for(lambda: speculating_again(up), 60, "speculation to come back", step_s=0.5)
    assert serving(up.address("target")) and serving(up.address("router"))
    assert "router: shutting down" not in up.output()  # the others served on
    reliability.faults()


def test_the_target_killed_mid_load_fails_its_requests_at_once_and_serves_again_after_its_restart(up):
    reference = expected(up)
    load = Load(up.stub, PROMPTS, MAX_TOKENS)
    load.wait_streaming()
    killed_at = time.monotonic()
    killed = up.kill("target")
    router_down = []  # what the router's health said while the target was down
    wait_for(lambda: router_down.append(serving(up.address("router"))) or not router_down[-1], 30,
             "the router's health to say NOT_SERVING")
    outcomes = load.outcomes()
    assert [o.code for o in outcomes] == ["UNAVAILABLE"] * len(PROMPTS), [o.details for o in outcomes]
    assert max(o.ended for o in outcomes) - killed_at < UNAVAILABLE_WITHIN_S
    up.wait_line(f"tandem up: target (pid {killed}) was killed by SIGKILL; restarting it in")
    up.wait_line("tandem up: target restarted")
    wait_for(lambda: serving(up.address("router")), 60, "the router to serve again")
    assert [stream(up.stub, p, greedy(MAX_TOKENS)).tokens for p in PROMPTS] == reference
    wait_for(lambda: speculating_again(up), 60, "speculation to come back", step_s=0.5)
    reliability.faults()


def test_the_router_killed_mid_load_leaves_no_sequence_behind(up):
    reference = expected(up)
    load = Load(up.stub, PROMPTS, MAX_TOKENS)
    load.wait_streaming()
    assert up.engine_stats("target").sequences_live >= len(PROMPTS)
    killed = up.kill("router")
    assert all(o.code == "UNAVAILABLE" for o in load.outcomes())
    up.wait_line(f"tandem up: router (pid {killed}) was killed by SIGKILL; restarting it in")
    for name in ("target", "draft"):
        wait_idle(up, name)
    up.wait_line("tandem up: router restarted")
    wait_for(lambda: serving(up.address("router")), 60, "the restarted router to serve")
    assert [stream(up.stub, p, greedy(MAX_TOKENS)).tokens for p in PROMPTS] == reference
    reliability.faults()


def test_a_stalled_draft_turns_speculation_off_until_it_resumes(up):
    reference = expected(up)
    load = Load(up.stub, PROMPTS, MAX_TOKENS, timeout_s=180)
    load.wait_streaming()
    up.kill("draft", signal.SIGSTOP)  # alive, its sockets open, answering nothing
    try:
        # The router's draft call times out (10 s): it serves on without speculation.
        wait_for(lambda: not up.router_stats().speculation_active, 60, "speculation to go off", step_s=0.2)
    finally:
        up.kill("draft", signal.SIGCONT)
    outcomes = load.outcomes()
    assert [o.code for o in outcomes] == ["OK"] * len(PROMPTS)
    assert [o.tokens for o in outcomes] == reference
    wait_for(lambda: speculating_again(up), 60, "speculation to come back", step_s=0.5)
    assert "restarted" not in up.output()  # stalled, not dead: nothing was restarted
    reliability.faults()


def wait_idle(up: Up, name: str) -> None:
    """The service holds no sequence and every page is free, or a leak is recorded."""
    try:
        wait_for(lambda: _idle(up.engine_stats(name)), 30, f"the {name} to drop the router's sequences")
    except AssertionError:
        reliability.leaks()
        raise


def _idle(stats) -> bool:
    return stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
