"""`tandem bench --mode http`: what the OpenAI-compatible HTTP API (server-sent events) costs
against gRPC streaming, side by side in one run, on one router.

One target and one router process (plain decoding: the transport, not speculation, is under
test; no prefix cache: a prompt's second run, over the other transport, would skip its prefill);
the router serves gRPC and HTTP (--http-port). The same greedy requests (MT-bench first
turns as token ids, --max-tokens each, eos ignored) go over each transport in turn, stream by
stream at 1 stream and group by group at 8 concurrent streams, so that drift touches both
alike; each client is a thread with the lightest client of its transport (grpcio's stub; httpx2
reading the events and parsing each chunk's JSON). Reported per transport and concurrency: time
to first token, the client's time per token after the first, tokens per second, and the
router's own CPU time per token (from /proc: what serving a token over that transport costs the
router process); and whether both returned the same text.
"""

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.bench.inputs import bench_model, bench_prompts
from tandem.bench.machine import machine_facts, write_report
from tandem.bench.services import Devices, free_port, running_services
from tandem.channels import open_channel
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

TRANSPORTS = ("grpc", "http")
STREAMS_PER_CELL = 16  # at 1 stream (--questions fewer): streams per transport
GROUPS_PER_CELL = 4  # at 8 streams, at least: groups per transport, so that drift averages out


class _Clients:
    """One gRPC stub and one HTTP client, each streaming one request per call: returns
    (text, tokens, seconds to the first token, seconds in all)."""

    def __init__(self, grpc_address: str, http_base: str, max_tokens: int):
        import httpx2

        self._channel = open_channel(grpc_address)
        self.stub = generate_pb2_grpc.GenerationStub(self._channel)
        self.http = httpx2.Client(base_url=http_base, timeout=3600, limits=httpx2.Limits(max_connections=64))
        self.max_tokens = max_tokens

    def close(self) -> None:
        self.http.close()
        self._channel.close()

    def grpc(self, ids: list[int]) -> tuple[str, int, float, float]:
        params = pb.SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        started, first, text, tokens = time.perf_counter(), None, [], 0
        for response in self.stub.Generate(pb.GenerateRequest(token_ids=ids, params=params), timeout=3600):
            for choice in response.choices:
                if choice.token_ids and first is None:
                    first = time.perf_counter()
                tokens += len(choice.token_ids)
                text.append(choice.text)
        return "".join(text), tokens, first - started, time.perf_counter() - started

    def http_sse(self, ids: list[int]) -> tuple[str, int, float, float]:
        body = {"prompt": ids, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        started, first, text, tokens = time.perf_counter(), None, [], 0
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    first = first or time.perf_counter()
                    text.append(choice["text"])
        return "".join(text), tokens, first - started, time.perf_counter() - started


def _router_pid(port: int) -> int | None:
    """The router process serving gRPC on `port` (its command line names it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"router" in argv and str(port).encode() in argv:
            return int(entry.name)
    return None


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cell(records: list[tuple[str, int, float, float]], wall_s: float, cpu_s: float) -> dict:
    tokens = sum(r[1] for r in records)
    per_token = [(total - ttft) / (n - 1) * 1e3 for _, n, ttft, total in records if n > 1]
    return {
        "streams": len(records),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 2),
        "ttft_ms_median": round(statistics.median(r[2] for r in records) * 1e3, 3),
        "ms_per_token_median": round(statistics.median(per_token), 4),
        "ms_per_token_mean": round(statistics.fmean(per_token), 4),
        "router_cpu_ms_per_token": round(cpu_s * 1e3 / max(tokens, 1), 4),
    }


def _measure(clients: _Clients, pid: int | None, prompts: list[list[int]], concurrency: int) -> dict:
    """Both transports over the same prompts, alternating group by group."""
    groups = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
    records = {t: [] for t in TRANSPORTS}
    wall, cpu = dict.fromkeys(TRANSPORTS, 0.0), dict.fromkeys(TRANSPORTS, 0.0)
    texts = {t: [] for t in TRANSPORTS}
    call = {"grpc": clients.grpc, "http": clients.http_sse}
    with ThreadPoolExecutor(concurrency) as pool:
        for i, group in enumerate(groups):
            for transport in (TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]):
                cpu_before, started = _cpu_seconds(pid), time.perf_counter()
                done = list(pool.map(call[transport], group))
                wall[transport] += time.perf_counter() - started
                cpu[transport] += _cpu_seconds(pid) - cpu_before
                records[transport] += done
                texts[transport] += [text for text, *_ in done]
    cells = {t: _cell(records[t], wall[t], cpu[t]) for t in TRANSPORTS}
    cells["same_text"] = f"{sum(a == b for a, b in zip(texts['grpc'], texts['http']))}/{len(prompts)}"
    return cells


def _summary(results: dict) -> dict:
    summary = {}
    for c, cells in results.items():
        g, h = cells["grpc"], cells["http"]
        summary[f"x{c}"] = {
            "grpc_ms_per_token": g["ms_per_token_median"],
            "http_ms_per_token": h["ms_per_token_median"],
            "http_minus_grpc_ms_per_token": round(h["ms_per_token_median"] - g["ms_per_token_median"], 4),
            "http_over_grpc_time_per_token": round(h["ms_per_token_median"] / g["ms_per_token_median"], 4),
            "grpc_router_cpu_ms_per_token": g["router_cpu_ms_per_token"],
            "http_router_cpu_ms_per_token": h["router_cpu_ms_per_token"],
            "grpc_ttft_ms": g["ttft_ms_median"],
            "http_ttft_ms": h["ttft_ms_median"],
            "grpc_tokens_per_s": g["tokens_per_s"],
            "http_tokens_per_s": h["tokens_per_s"],
            "same_text": cells["same_text"],
        }
    return summary


def run_http_bench(args) -> int:
    from transformers import AutoTokenizer

    model = bench_model(args)
    streams = min(args.questions, STREAMS_PER_CELL)
    prompts = bench_prompts(args, AutoTokenizer.from_pretrained(model))
    cell_prompts = {c: (prompts * 64)[:max(streams, GROUPS_PER_CELL * c)] for c in (1, args.concurrency)}
    devices = Devices.from_args(args)
    http_port = free_port()
    print(f"bench http: {[len(p) for p in cell_prompts.values()]} streams x {args.max_tokens} tokens, {model}",
          flush=True)
    router = ("--http-port", str(http_port), "--prefix-cache-max-num-recycling-seqs", "0")
    with running_services(model, args.dtype, args.threads, extra_router=router, devices=devices) as address:
        clients = _Clients(address, f"http://127.0.0.1:{http_port}", args.max_tokens)
        try:
            pid = _router_pid(int(address.rsplit(":", 1)[1]))
            clients.grpc(prompts[0]), clients.http_sse(prompts[0])  # warm both paths
            results = {}
            for c in (1, args.concurrency):
                results[c] = _measure(clients, pid, cell_prompts[c], c)
                print(f"  x{c}: {json.dumps(results[c])}", flush=True)
        finally:
            clients.close()
    report = {
        "mode": "http", "model": str(model), "dtype": args.dtype, "reduced": args.reduced,
        "max_tokens": args.max_tokens, "router_cpu_measured": pid is not None,
        "cells": {f"x{c}": cells for c, cells in results.items()}, "summary": _summary(results),
        "devices": devices.record(with_draft=False), "machine": machine_facts(args.threads),
    }
    return write_report(report, args.out, "http", args.reduced, report["summary"])
