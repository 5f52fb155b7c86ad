"""What the gloo-process tests share: a free loopback port, and running every case of one world size
in one spawn of processes (process start-up and the gloo rendezvous dominate a tiny case)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RunCase = Callable[[int, int, dict], dict]
"""(rank, world, case) -> rank 0's result (other ranks return {}); a module-level function (pickled)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, run_case: RunCase, cases: dict[str, dict], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for key, case in cases.items():
            start = time.perf_counter()
            results[key] = {**run_case(rank, world, case), "wall_s": time.perf_counter() - start}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_cases(folder: Path, world: int, cases: dict[str, dict], run_case: RunCase) -> dict[str, dict]:
    """Every case on `world` gloo processes, in one process group; rank 0's results by case name."""
    out = folder / f"results-{world}.json"
    mp.spawn(_worker, args=(world, run_case, cases, free_port(), str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())
