"""`tandem bench --mode rpc`: what a target step costs beyond its compute, by transport and by
channel security.

Two target processes, one plaintext and one serving mutual TLS (certificates from `tandem certs
create`, the router's identity presenting its own); the router's own client stack (grpcio's
asyncio channel, tandem.codec) sends steps every way, block by block in turn so that drift
touches all alike: a Step call each (unary) and the Steps stream the router uses. Three kinds of
step: ops only (no model run: the round trip alone), one sequence's one-token decode, and eight
sequences' (a batch of 8 streams). Reported per cell: the median wall time of a step and its
overhead (wall less the target's own compute_ms); per kind, what mutual TLS adds on the stream
as a fraction of the plaintext step.
"""

import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from tandem import codec
from tandem.bench.inputs import bench_model
from tandem.bench.machine import machine_facts, write_report
from tandem.bench.services import Devices, running_target
from tandem.channels import open_channel
from tandem.ops import AddSequence, EntryKind, RemoveSequence, StepEntry, StepRequest
from tandem.sampling.params import SamplingParams
from tandem.security.certs import create_dir
from tandem.security.tls import PLAINTEXT, TlsConfig
from tandem.v1 import engine_pb2_grpc

BLOCK = 16  # steps per turn of one transport
PROMPT = tuple(range(5, 37))
BATCH = 8  # the "8 streams" decode: eight sequences in one step
SECURITIES = ("plain", "mtls")


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


async def _measure(addresses: dict[str, tuple[str, TlsConfig]], empty_steps: int, decode_steps: int) -> dict:
    """addresses: security -> (target address, the client's TLS)."""
    samples: dict[tuple, list] = {}
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for security, (address, tls) in addresses.items():
            channel = await stack.enter_async_context(open_channel(address, tls, aio=True))
            clients[security] = _Client(engine_pb2_grpc.TargetEngineStub(channel))
        cells = [(sec, t) for sec in clients for t in ("unary", "stream")]
        for security, transport in cells:  # warm every cell
            for _ in range(BLOCK):
                await clients[security].step(transport)
        for i in range(empty_steps):
            security, transport = cells[(i // BLOCK) % len(cells)]
            result, wall = await clients[security].step(transport)
            samples.setdefault((security, transport, "ops_only"), []).append((wall, result.compute_ms))
        for batch, kind in ((1, "decode"), (BATCH, f"decode{BATCH}")):
            tokens = {sec: await _prefill(c, batch) for sec, c in clients.items()}
            for i in range(decode_steps):
                security, transport = cells[(i // BLOCK) % len(cells)]
                entries = [StepEntry(seq, EntryKind.DECODE, (tok,), True) for seq, tok in tokens[security].items()]
                result, wall = await clients[security].step(transport, entries=entries)
                tokens[security] = {r.seq_id: r.tokens[-1].token_id for r in result.results}
                samples.setdefault((security, transport, kind), []).append((wall, result.compute_ms))
            for security, client in clients.items():
                await client.step("stream", ops=[RemoveSequence(seq) for seq in tokens[security]])
        for client in clients.values():
            client.stream.cancel()
    return {"/".join(key): _figures(xs) for key, xs in samples.items()}


async def _prefill(client: _Client, batch: int) -> dict[int, int]:
    """`batch` sequences prefilled; returns seq id -> the token each decodes next."""
    seqs = range(1, batch + 1)
    prefilled, _ = await client.step("stream", ops=[AddSequence(s, SamplingParams(temperature=0)) for s in seqs],
                                     entries=[StepEntry(s, EntryKind.PREFILL, PROMPT, True) for s in seqs])
    return {r.seq_id: r.tokens[-1].token_id for r in prefilled.results}


def _figures(xs: list[tuple[float, float]]) -> dict:
    walls, overheads = [w for w, _ in xs], [w - c for w, c in xs]
    return {
        "steps": len(xs),
        "wall_ms_median": round(statistics.median(walls), 4),
        "overhead_ms_median": round(statistics.median(overheads), 4),
        "overhead_ms_mean": round(statistics.fmean(overheads), 4),
    }


def _summary(cells: dict) -> dict:
    summary = {}
    for kind in ("ops_only", "decode", f"decode{BATCH}"):
        plain, mtls = cells[f"plain/stream/{kind}"], cells[f"mtls/stream/{kind}"]
        summary[kind] = {
            "overhead_ms_median_unary": cells[f"plain/unary/{kind}"]["overhead_ms_median"],
            "overhead_ms_median_stream": plain["overhead_ms_median"],
            "stream_over_unary": round(plain["overhead_ms_median"]
                                       / max(cells[f"plain/unary/{kind}"]["overhead_ms_median"], 1e-9), 3),
            "mtls_overhead_ms_median_stream": mtls["overhead_ms_median"],
            # what mutual TLS adds to a step on the stream, as a fraction of the plaintext step
            "mtls_added_fraction_of_step": round((mtls["overhead_ms_median"] - plain["overhead_ms_median"])
                                                 / max(plain["wall_ms_median"], 1e-9), 4),
        }
    return summary


def run_rpc_bench(args) -> int:
    model = bench_model(args)
    devices = Devices.from_args(args)
    empty_steps, decode_steps = (8 * BLOCK, 4 * BLOCK) if args.reduced else (64 * BLOCK, 4 * args.max_tokens)
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        certs = Path(folder)
        create_dir(certs, identities=("router", "target"))
        served, router = TlsConfig.of_identity(certs, "target"), TlsConfig.of_identity(certs, "router")
        addresses = {
            "plain": (stack.enter_context(running_target(model, args.dtype, args.threads, devices)), PLAINTEXT),
            "mtls": (stack.enter_context(running_target(model, args.dtype, args.threads, devices, served)), router),
        }
        cells = asyncio.run(_measure(addresses, empty_steps, decode_steps))
    summary = _summary(cells)
    report = {
        "mode": "rpc", "model": str(model), "dtype": args.dtype, "reduced": args.reduced,
        "cells": cells, "summary": summary,
        "devices": devices.record(with_draft=False), "machine": machine_facts(args.threads),
    }
    return write_report(report, args.out, "rpc", args.reduced, summary)
