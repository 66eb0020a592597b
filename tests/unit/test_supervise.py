"""`tandem up`'s supervisor: a service that dies is restarted after a backoff that doubles in a
crash loop, is capped, and starts afresh once the service stayed up a while."""

import signal

from tandem.launcher import Backoff, Supervised


class FakeProc:
    pid = 7

    def __init__(self):
        self.code = None
        self.signals = []

    def poll(self):
        return self.code

    def send_signal(self, sig):
        self.signals.append(sig)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def supervised(backoff=Backoff(initial_s=1, cap_s=4, stable_s=60)):
    clock, lines, procs = Clock(), [], []

    def spawn():
        procs.append(FakeProc())
        return procs[-1]

    service = Supervised("draft", spawn, backoff, lines.append, clock)
    service.start()
    return service, clock, lines, procs


def die(service, clock, after_s: float, code: int = -signal.SIGKILL) -> None:
    clock.now += after_s
    service.proc.code = code
    service.check()


def test_a_dead_service_is_restarted_after_its_backoff_and_says_so():
    service, clock, lines, procs = supervised()
    service.check()
    assert len(procs) == 1 and not lines  # alive: nothing happens
    die(service, clock, after_s=5)
    assert lines == ["tandem up: draft (pid 7) was killed by SIGKILL; restarting it in 1 s"]
    clock.now += 0.5
    service.check()
    assert len(procs) == 1  # not before its backoff is over
    clock.now += 0.5
    service.check()
    assert len(procs) == 2 and service.proc is procs[1] and service.restarts == 1
    assert lines[-1] == "tandem up: draft restarted (pid 7)"


def test_backoff_doubles_in_a_crash_loop_up_to_its_cap_and_resets_after_a_stable_run():
    service, clock, lines, _ = supervised()
    delays = []
    for _ in range(5):
        die(service, clock, after_s=2, code=1)
        delays.append(service._restart_at - clock.now)
        clock.now = service._restart_at
        service.check()
    assert delays == [1, 2, 4, 4, 4]
    assert "exited with code 1" in lines[0]
    die(service, clock, after_s=60)  # up a minute: a fresh start
    assert service._restart_at - clock.now == 1


def test_terminate_signals_a_live_service_and_cancels_a_pending_restart():
    service, clock, _, procs = supervised()
    service.terminate()
    assert procs[0].signals == [signal.SIGTERM]
    die(service, clock, after_s=1)
    service.terminate()
    clock.now += 10
    service.check()
    assert len(procs) == 1  # stopping: never started again
