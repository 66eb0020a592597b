"""CUDA graphs of a forward pass over a paged KV cache, for the small steps of decoding.

On a GPU a small model's decode or verify step is bound by the host, not the device: the H200
spent 23 ms of host work on the default model's 30-layer step at batch 1, ~30 kernel launches
a layer from Python (bench/results/gpu-20261204.md). A captured graph replays the whole forward
as one launch, as vLLM, SGLang and gpt-fast do.

A graph fixes every shape and address. One is captured per (tokens, sequences, queries per
sequence, key pages rounded up to a power of two, the inputs' widths): each step copies its
inputs and its attention plan into that graph's static buffers, the plan's keys padded and the
pad masked out (the same attention). A shape's first step runs eagerly (a prefill chunk's shape
seldom comes again); its second captures the graph (the capture runs that step; the KV it writes
is the step's own).
Graphs share one memory pool; the least recently used is dropped past `max_graphs`. Steps of
more than `max_tokens` run eagerly. With `capture=False` the same buffers and padding run
eagerly: the CPU tests' way to check them against the plain forward.
"""

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from tandem.attention.torch_backend import TorchAttention, TorchPlan
from tandem.models.llama import ForwardBatch

log = logging.getLogger(__name__)

# forward(batch, *inputs) -> [T, D]; inputs: device tensors with the packed tokens on dim 0.
Forward = Callable[..., torch.Tensor]
GraphKey = tuple[int, ...]  # (tokens, sequences, queries per sequence, key pages, each input's last dim)


@dataclass(slots=True)
class _Graph:
    batch: ForwardBatch  # static tensors; the plan's keys padded to the key's pages
    inputs: tuple[torch.Tensor, ...]
    graph: object = None  # torch.cuda.CUDAGraph once captured
    out: torch.Tensor | None = None  # the graph's output buffer


class GraphedForward:
    def __init__(self, forward: Forward, max_tokens: int = 256, max_graphs: int = 64, capture: bool = True):
        self.forward = forward
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self._graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()
        self._seen: OrderedDict[GraphKey, None] = OrderedDict()  # shapes run once, eagerly
        self._pool = None
        self.failed = False  # a capture failed: every step runs eagerly from then on
        self.captured = 0

    def __call__(self, batch: ForwardBatch, *inputs: torch.Tensor) -> torch.Tensor:
        plan = batch.plan
        tokens = batch.positions.shape[0]
        if self.failed or tokens > self.max_tokens or not isinstance(plan, TorchPlan):
            return self.forward(batch, *inputs)
        rows, queries = plan.query_index.shape
        units = 1 << (plan.key_index.numel() // rows - 1).bit_length()  # the next power of two
        key = (tokens, rows, queries, units, *(x.shape[-1] for x in inputs))  # widths: an EAGLE-3 head's vary
        g = self._graphs.get(key)
        if g is None and self._first_sight(key):
            return self.forward(batch, *inputs)
        padded = TorchAttention.pad_keys(plan, units)
        if g is None:
            g = self._graphs[key] = _static(batch, padded, inputs)
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        _fill(g, batch, padded, inputs)
        if not self.capture:
            return self.forward(g.batch, *g.inputs)
        if g.graph is None and not self._capture(g, key):
            return self.forward(batch, *inputs)
        g.graph.replay()
        return g.out.clone()  # the next replay overwrites the buffer

    def _first_sight(self, key: GraphKey) -> bool:
        """True the first time a shape comes (remembered); False the second (forgotten)."""
        if key in self._seen:
            del self._seen[key]
            return False
        self._seen[key] = None
        if len(self._seen) > 16 * self.max_graphs:
            self._seen.popitem(last=False)
        return True

    def _capture(self, g: _Graph, key: GraphKey) -> bool:
        device = g.batch.positions.device
        try:
            # Warm-up outside the capture: lazy initialisation (cuBLAS workspaces, kernels).
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.forward(g.batch, *g.inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the services' other threads may use the device meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.forward(g.batch, *g.inputs)
        except RuntimeError as e:
            log.warning("CUDA graph capture of shape %s failed, running eagerly from now on: %s", key, e)
            self.failed = True
            self._graphs.clear()
            return False
        g.graph, g.out = graph, out
        self.captured += 1
        return True


def _static(batch: ForwardBatch, plan: TorchPlan, inputs: tuple[torch.Tensor, ...]) -> _Graph:
    static = ForwardBatch(
        input_ids=torch.empty_like(batch.input_ids),
        positions=torch.empty_like(batch.positions),
        slot_mapping=torch.empty_like(batch.slot_mapping),
        plan=TorchPlan(**{f.name: _empty(getattr(plan, f.name)) for f in fields(TorchPlan)}),
    )
    return _Graph(static, tuple(torch.empty_like(x) for x in inputs))


def _empty(value):
    return torch.empty_like(value) if isinstance(value, torch.Tensor) else value


def _fill(g: _Graph, batch: ForwardBatch, plan: TorchPlan, inputs: tuple[torch.Tensor, ...]) -> None:
    """Copies a step's inputs and its padded plan into the graph's buffers."""
    g.batch.input_ids.copy_(batch.input_ids)
    g.batch.positions.copy_(batch.positions)
    g.batch.slot_mapping.copy_(batch.slot_mapping)
    for f in fields(TorchPlan):
        value = getattr(plan, f.name)
        if isinstance(value, torch.Tensor):
            getattr(g.batch.plan, f.name).copy_(value)
    for static, x in zip(g.inputs, inputs):
        static.copy_(x)
