"""Benchmarks behind ``lora-cupy bench``: ``kernels``, ``pool``, ``lane``, ``e2e`` and ``tp``."""

from __future__ import annotations

import os
import subprocess
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
