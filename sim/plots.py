"""Plots of a played trace: slot occupancy over time, hit rate against slot count, admission waits.

matplotlib is imported only here, and only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .player import PlayResult


def _pyplot():
    import matplotlib.pyplot as plt  # the caller picks the backend (the CLI uses Agg)

    return plt


def plot_occupancy(result: PlayResult, ax=None):
    """Held and resident slots, running and queued requests over time (step plots)."""
    plt = _pyplot()
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    usable = result.config.num_slots - 1
    ax.step(result.times, result.resident, where="post", label="resident adapters")
    ax.step(result.times, result.held, where="post", label="held slots")
    ax.axhline(usable, color="k", lw=0.8, ls="--", label=f"usable slots ({usable})")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("slots")
    ax2 = ax.twinx()
    ax2.step(result.times, result.queued, where="post", color="tab:red", alpha=0.5, lw=0.8,
             label="queued requests")
    ax2.set_ylabel("queued requests", color="tab:red")
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(f"slot occupancy, {usable} usable slots")
    return ax


def plot_hit_rate(results: Sequence[PlayResult], ax=None):
    """Hit rate (and p99 admission wait) against the usable slot count, one point per result."""
    plt = _pyplot()
    ax = ax or plt.subplots(figsize=(5, 3))[1]
    slots = np.array([r.config.num_slots - 1 for r in results])
    ax.plot(slots, [r.hit_rate for r in results], "o-", label="hit rate")
    ax.set_xlabel("usable slots")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax2 = ax.twinx()
    ax2.plot(slots, [r.p99_wait for r in results], "s--", color="tab:orange", label="p99 wait")
    ax2.set_ylabel("p99 admission wait (s)", color="tab:orange")
    if all(r.p99_wait > 0 for r in results):
        ax2.set_yscale("log")  # waits span orders of magnitude between a small pool and a big one
    ax.set_title("hit rate against slot count")
    return ax


def plot_waits(result: PlayResult, ax=None, bins: int = 50):
    """Histogram of admission waits, with the mean and p99 marked."""
    plt = _pyplot()
    ax = ax or plt.subplots(figsize=(5, 3))[1]
    ax.hist(result.waits, bins=bins, color="tab:blue", alpha=0.8)
    ax.axvline(result.mean_wait, color="k", ls="--", label=f"mean {result.mean_wait:.3f} s")
    ax.axvline(result.p99_wait, color="tab:red", ls="--", label=f"p99 {result.p99_wait:.3f} s")
    ax.set_yscale("log")
    ax.set_xlabel("admission wait (s)")
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")
    ax.set_title("admission waits")
    return ax


def save_report(result: PlayResult, path, sweep: Sequence[PlayResult] | None = None) -> Path:
    """One PNG with the occupancy, the wait histogram and (given a sweep) hit rate vs slots."""
    plt = _pyplot()
    panels = 3 if sweep else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.6))
    plot_occupancy(result, axes[0])
    plot_waits(result, axes[1])
    if sweep:
        plot_hit_rate(sweep, axes[2])
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
