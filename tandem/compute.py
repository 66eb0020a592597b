"""The thread a model service computes on."""

from concurrent.futures import ThreadPoolExecutor

import torch


def compute_thread(name: str, threads: int) -> ThreadPoolExecutor:
    """One thread for every forward pass, with torch's intra-op threads set on it: the setting
    is per calling thread (a gRPC worker thread would compute with torch's default, measured 1
    thread on this 2-vCPU machine, half the speed), and OpenMP keeps one team per caller.
    Build the model on it too: on an Intel Xeon here a decode step ran in 27 ms on the thread
    that loaded the weights and 48 ms on any other (tandem bench showed transformers 1.5x
    faster until the engine was built on its compute thread)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(threads,))
