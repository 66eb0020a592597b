"""The reliability summary the suite prints (issue 36): requests served, faults injected and
survived, bad inputs tried, leaks found. Tests record what they did with the functions below;
`pytest_terminal_summary` (re-exported by tests/conftest.py) prints the totals once at the end.

Record a fault only once the test has checked the service survived it, and a leak whenever a
check finds pages or sequences left behind (the summary must then show it, even if the test's
assertion fails right after)."""

from collections import Counter

_COUNTS: Counter = Counter()
_NAMES = (
    ("served", "requests served"),
    ("faults", "faults injected and survived"),
    ("bad_inputs", "bad inputs tried"),
    ("leaks", "leaks found"),
)


def served(n: int = 1) -> None:
    _COUNTS["served"] += n


def faults(n: int = 1) -> None:
    _COUNTS["faults"] += n


def bad_inputs(n: int = 1) -> None:
    _COUNTS["bad_inputs"] += n


def leaks(n: int = 1) -> None:
    _COUNTS["leaks"] += n


def served_by(router_stub) -> None:
    """Records the requests a router finished (stop or length); call it as the router stops."""
    from tandem.v1 import generate_pb2

    finished = router_stub.Stats(generate_pb2.StatsRequest(), timeout=10).finished_by_reason
    served(finished.get("stop", 0) + finished.get("length", 0))


def counts() -> dict[str, int]:
    return {key: _COUNTS[key] for key, _ in _NAMES}


def summary() -> str:
    return "reliability: " + ", ".join(f"{_COUNTS[key]} {words}" for key, words in _NAMES)


def pytest_terminal_summary(terminalreporter) -> None:
    if any(_COUNTS.values()):
        terminalreporter.write_line(summary())
