"""Facts of the machine a benchmark ran on, and its measured matrix-vector bandwidth."""

import os
import platform
import time
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts(threads: int) -> dict:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "torch": torch.__version__,
        "torch_threads": threads or torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def matvec_bandwidth(dtype: str, threads: int, device: str = "cpu", total_bytes: int = 256 * 2**20) -> float:
    """Bytes/s that a 1-row projection (the model's own kernel) streams on `device` over weights
    much larger than the caches."""
    import torch

    from tandem.models.linear import Linear

    if threads:
        torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    rows, cols = 576, 3072
    count = max(1, total_bytes // (rows * cols * torch.empty((), dtype=dt).element_size()))
    # No blocked copies: one row never reads them.
    layers = [Linear(torch.randn(cols, rows).to(device=device, dtype=dt)) for _ in range(count)]
    x = torch.randn(1, rows).to(device=device, dtype=dt)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for layer in layers[:4]:
        layer(x)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for layer in layers:
            layer(x)
        sync()
        best = min(best, time.perf_counter() - started)
    return sum(layer.weight.numel() * layer.weight.element_size() for layer in layers) / best


def decode_weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of weights one decode step reads: every layer and the lm_head (one embedding row
    is negligible)."""
    from tandem.models.config import ModelConfig

    c = ModelConfig.from_folder(model_dir)
    size = 2 if dtype in ("bfloat16", "float16") else 4
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    per_layer = attn + mlp + 2 * c.hidden_size
    return size * (c.num_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size)


def write_report(report: dict, out, name: str, reduced: bool, summary: dict) -> int:
    """Writes `report` as <name>[-reduced]-<stamp>.json and -latest.json under `out`, prints its
    summary and where it went; returns the command's exit code (0)."""
    import json
    import time
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stamp, kind = time.strftime("%Y%m%d-%H%M%S"), f"{name}-reduced" if reduced else name
    for file in (f"{kind}-{stamp}.json", f"{kind}-latest.json"):
        (out / file).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"results written to {out}/{kind}-{stamp}.json")
    return 0
