"""The thread a model service computes on."""

from concurrent.futures import ThreadPoolExecutor

import torch


def compute_thread(name: str, threads: int) -> ThreadPoolExecutor:
    """One thread for every forward pass, with torch's intra-op threads set on it: the setting
    is per calling thread (a gRPC worker thread would compute with torch's default), and OpenMP
    keeps one team per caller. Build the model on it too: the thread that loaded the weights
    computes fastest (bench/results/notes/2026-12-03-compute-thread.md)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(threads,))
