"""`tandem bench --mode rpc`: what a target step costs beyond its compute, by transport.

One target process; the router's own client stack (grpcio's asyncio channel, tandem.codec)
sends steps both ways, block by block in turn so that drift touches both alike: a Step call
each (unary) and the Steps stream the router uses. Two kinds of step: ops only (no model run:
the round trip alone) and one sequence's one-token decode. Reported per transport: the median
wall time of a step and its overhead (wall less the target's own compute_ms).
"""

import asyncio
import json
import statistics
import time
from pathlib import Path

import grpc

from tandem import codec
from tandem.bench.inputs import bench_model
from tandem.bench.machine import machine_facts
from tandem.bench.services import Devices, running_target
from tandem.grpc_server import CHANNEL_OPTIONS
from tandem.ops import AddSequence, EntryKind, RemoveSequence, StepEntry, StepRequest
from tandem.sampling.params import SamplingParams
from tandem.v1 import engine_pb2_grpc

BLOCK = 16  # steps per turn of one transport
PROMPT = tuple(range(5, 37))


class _Client:
    """Numbers the steps; sends each by the named transport; keeps (wall ms, compute ms)."""

    def __init__(self, stub):
        self.stub, self.stream, self.step_id = stub, stub.Steps(), 0

    async def step(self, transport: str, ops=(), entries=()):
        self.step_id += 1
        message = codec.step_request_to_pb(StepRequest(self.step_id, tuple(ops), tuple(entries)))
        started = time.perf_counter()
        if transport == "unary":
            response = await self.stub.Step(message, timeout=60)
        else:
            await self.stream.write(message)
            response = await self.stream.read()
            if response is grpc.aio.EOF:
                raise RuntimeError(f"the target ended the Steps stream at step {self.step_id}")
        wall_ms = (time.perf_counter() - started) * 1e3
        if response.HasField("error"):
            raise RuntimeError(f"step {self.step_id} failed: {response.error.message}")
        return codec.step_result_from_pb(response), wall_ms


async def _measure(address: str, empty_steps: int, decode_steps: int) -> dict:
    samples = {(t, kind): [] for t in ("unary", "stream") for kind in ("ops_only", "decode")}
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        client = _Client(engine_pb2_grpc.TargetEngineStub(channel))
        for transport in ("unary", "stream"):  # warm both
            for _ in range(BLOCK):
                await client.step(transport)
        for i in range(empty_steps):
            transport = _turn(i)
            result, wall = await client.step(transport)
            samples[(transport, "ops_only")].append((wall, result.compute_ms))
        prefilled, _ = await client.step("stream", ops=[AddSequence(1, SamplingParams(temperature=0))],
                                         entries=[StepEntry(1, EntryKind.PREFILL, PROMPT, True)])
        token = prefilled.results[0].tokens[-1].token_id  # each decode feeds the token just sampled
        for i in range(decode_steps):
            transport = _turn(i)
            result, wall = await client.step(transport, entries=[StepEntry(1, EntryKind.DECODE, (token,), True)])
            token = result.results[0].tokens[-1].token_id
            samples[(transport, "decode")].append((wall, result.compute_ms))
        await client.step("stream", ops=[RemoveSequence(1)])
        client.stream.cancel()
    return {f"{t}/{kind}": _figures(xs) for (t, kind), xs in samples.items() if xs}


def _turn(i: int) -> str:
    return "unary" if (i // BLOCK) % 2 == 0 else "stream"


def _figures(xs: list[tuple[float, float]]) -> dict:
    walls, overheads = [w for w, _ in xs], [w - c for w, c in xs]
    return {
        "steps": len(xs),
        "wall_ms_median": round(statistics.median(walls), 4),
        "overhead_ms_median": round(statistics.median(overheads), 4),
        "overhead_ms_mean": round(statistics.fmean(overheads), 4),
    }


def run_rpc_bench(args) -> int:
    model = bench_model(args)
    devices = Devices.from_args(args)
    empty_steps, decode_steps = (4 * BLOCK, 2 * BLOCK) if args.reduced else (64 * BLOCK, 2 * args.max_tokens)
    with running_target(model, args.dtype, args.threads, devices) as address:
        cells = asyncio.run(_measure(address, empty_steps, decode_steps))
    summary = {
        kind: {
            "overhead_ms_median_unary": cells[f"unary/{kind}"]["overhead_ms_median"],
            "overhead_ms_median_stream": cells[f"stream/{kind}"]["overhead_ms_median"],
            "stream_over_unary": round(cells[f"stream/{kind}"]["overhead_ms_median"]
                                       / max(cells[f"unary/{kind}"]["overhead_ms_median"], 1e-9), 3),
        }
        for kind in ("ops_only", "decode")
    }
    report = {
        "mode": "rpc", "model": str(model), "dtype": args.dtype, "reduced": args.reduced,
        "cells": cells, "summary": summary,
        "devices": devices.record(with_draft=False), "machine": machine_facts(args.threads),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp, kind = time.strftime("%Y%m%d-%H%M%S"), "rpc-reduced" if args.reduced else "rpc"
    for name in (f"{kind}-{stamp}.json", f"{kind}-latest.json"):
        (out / name).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"results written to {out}/{kind}-{stamp}.json")
    return 0
