"""How each mode of the speculation bench runs a group of prompts, and what a row adds up.

A group is `batch` prompts: concurrent streams for a tandem stack, one padded batch for
transformers. Accepted length is counted as tokens per verify step, the bonus token included.
"""

import time
from dataclasses import dataclass, field

from tandem.bench.hf import HFGenerator
from tandem.loops import loops
from tandem.bench.streams import generate_group, stats_counters


class Refused(Exception):
    """The mode cannot run this group at all (not a failure of the benchmark)."""


@dataclass(frozen=True, slots=True)
class GroupResult:
    completion_tokens: int
    verify_steps: int = 0  # tandem: verify steps (one per sequence per step that verified drafts)
    accepted_draft_tokens: int = 0
    accepted_by_depth: tuple[int, ...] = ()
    sequence_forwards: int = 0  # transformers: forward passes x sequences in them
    requests: int = 0
    looping: int = 0  # requests whose completion loops (tandem.loops)


@dataclass(slots=True)
class Tally:
    """A row's sums over its groups."""

    seconds: float = 0.0
    completion_tokens: int = 0
    verify_steps: int = 0
    accepted_draft_tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)
    sequence_forwards: int = 0
    requests: int = 0
    looping: int = 0

    def add(self, r: GroupResult, seconds: float) -> None:
        self.seconds += seconds
        self.requests += r.requests
        self.looping += r.looping
        self.completion_tokens += r.completion_tokens
        self.verify_steps += r.verify_steps
        self.accepted_draft_tokens += r.accepted_draft_tokens
        self.sequence_forwards += r.sequence_forwards
        while len(self.accepted_by_depth) < len(r.accepted_by_depth):
            self.accepted_by_depth.append(0)
        for i, a in enumerate(r.accepted_by_depth):
            self.accepted_by_depth[i] += a

    def mean_accepted_length(self) -> float:
        """Tokens per verify step, bonus included: tandem from Usage (plain decoding, which
        verifies nothing, emits 1 per step); transformers as tokens per sequence forward."""
        if self.sequence_forwards:
            return self.completion_tokens / self.sequence_forwards
        if not self.verify_steps:
            return 1.0
        return (self.accepted_draft_tokens + self.verify_steps) / self.verify_steps

    def acceptance_by_depth(self, depth: int) -> list[float]:
        """Per draft position i: the share of verify steps whose accepted drafts reached i + 1
        (1 + their sum is the mean accepted length); positions never reached count 0."""
        counts = self.accepted_by_depth + [0] * max(depth - len(self.accepted_by_depth), 0)
        return [a / self.verify_steps if self.verify_steps else 0.0 for a in counts]


class TandemRunner:
    def __init__(self, stub, max_tokens: int):
        self.stub = stub
        self.max_tokens = max_tokens

    def counters(self) -> dict | None:
        return stats_counters(self.stub)

    def run(self, group: list[list[int]], temperature: float, seeds: list[int]) -> GroupResult:
        usages = generate_group(self.stub, group, self.max_tokens, temperature)  # seeds: transformers' only
        depth = max((len(u.accepted_by_depth) for u in usages), default=0)
        by_depth = tuple(sum(u.accepted_by_depth[i] for u in usages if i < len(u.accepted_by_depth))
                         for i in range(depth))
        return GroupResult(sum(u.completion_tokens for u in usages), sum(u.verify_steps for u in usages),
                           sum(u.accepted_draft_tokens for u in usages), by_depth, requests=len(usages),
                           looping=sum(u.looping for u in usages))


class HFRunner:
    def __init__(self, generator: HFGenerator, lookup_tokens: int):
        self.generator = generator
        self.lookup_tokens = lookup_tokens

    def counters(self) -> dict | None:
        return None  # in-process: no service time to split

    def run(self, group: list[list[int]], temperature: float, seeds: list[int]) -> GroupResult:
        try:
            out = self.generator.generate(group, temperature, seeds[0], self.lookup_tokens)
        except ValueError as e:
            if self.lookup_tokens and len(group) > 1:
                raise Refused(f"skipped: transformers refuses batches for prompt lookup ({e})") from e
            raise
        return GroupResult(sum(map(len, out.outputs)), sequence_forwards=out.sequence_forwards,
                           requests=len(out.outputs), looping=sum(map(loops, out.outputs)))


def timed(runner, group, temperature: float, seeds: list[int]) -> tuple[GroupResult, float]:
    started = time.perf_counter()
    result = runner.run(group, temperature, seeds)
    return result, time.perf_counter() - started
