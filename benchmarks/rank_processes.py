"""What the sharded benchmarks share: the time and peak extra memory of a call on one rank, and a set of
gloo ranks started on this machine whose rank 0 writes the rows it measured.

Peak memory is the resident set's high-water mark (``VmHWM``) above the resident set before the call, reset
before each call through ``/proc/self/clear_refs`` (Linux).
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def measured(fn, cpu: bool = False):
    """``(seconds, peak extra MiB)`` of ``fn()`` on this rank: wall seconds, or the process's CPU seconds
    (``cpu=True``: what the call costs the rank, whatever else shares the machine)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _rss_kib("VmRSS")
    clock = time.process_time if cpu else time.perf_counter
    started = clock()
    fn()
    seconds = clock() - started
    return seconds, max(0, _rss_kib("VmHWM") - before) / 1024


MMAP_THRESHOLD = 1 << 16


def run_ranks(worker, world: int, *args, fixed_mmap_threshold: bool = True) -> list[dict]:
    """Start ``world`` processes running ``worker(rank, world, port, *args, out)``; rank 0 writes its rows as
    JSON to ``out``, returned here. ``fixed_mmap_threshold=False``: glibc's usual allocator, for timings (a freed
    block's memory is reused, without page faults); the peak memory it reports is not the call's own."""
    # glibc serves large blocks from its heap once a big block was freed (its mmap threshold grows), and the
    # heap is not given back: a fixed threshold keeps every matrix-sized block an mmap, returned when freed,
    # so each call's peak resident set is its own.
    if fixed_mmap_threshold:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.start_processes(worker, args=(world, port, *args, out), nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())
