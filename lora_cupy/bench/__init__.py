"""Benchmarks behind ``lora-cupy bench``: ``kernels``, ``pool``, ``lane``, ``e2e``, ``tp`` and ``overlap``."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path


def commit() -> str:
    """The commit a run measures: ``$COMMIT`` where the caller names it (a copy of the tree sent
    to a GPU host may carry no repository, or a stale one), else the checkout's HEAD."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no git, no repository: the run still reports
        return "unknown"


def event_ms(fn, reps: int, cuda: bool | None = None) -> float:
    """Median over ``reps`` of ``fn``'s device time in ms between two CUDA events on torch's
    current stream (``cuda``: default, whether torch sees a GPU); wall time on the CPU."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def emit(result: dict, markdown, json_path: str | None = None) -> int:
    """Print ``markdown(result)`` and, with ``json_path``, write ``result`` there as JSON; 0."""
    import json

    print(markdown(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return 0


def parse(p, argv, markdown=None):
    """``argv`` (default ``sys.argv[1:]``) parsed by ``p``, kept as ``args.argv`` (the command a
    report names). With ``markdown``, a ``--report FILE`` run prints that saved run instead:
    ``(args, 0)``; else ``(args, None)``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    if markdown is not None and getattr(args, "report", None):
        return args, saved_report(args.report, markdown)
    return args, None


def saved_report(path: str, markdown) -> int:
    """Print a run saved with ``--json`` as ``markdown`` renders it (no GPU needed); 0."""
    import json

    print(markdown(json.loads(Path(path).read_text())))
    return 0


def wait_host_copies(pool, names, timeout: float = 300.0) -> None:
    """Wait until the host copies the pool is reading for ``names`` (None skipped) are in, so a
    timed step does not wait at admission for an adapter's read."""
    for name in {n for n in names if n is not None}:
        copy = pool.store.get(name)
        if copy is not None:
            copy.wait(timeout)

