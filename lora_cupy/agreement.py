"""The instance's agreement on where each miss's host copy stands (the README's invariant 7).

Every rank of a lockstep instance makes the same slot decisions; the one input that can differ
per rank is whether an adapter's read has landed or failed. One collective per admit (the
``agree`` callable: an all-reduce MAX over per-miss outcomes, READY < READING < FAILED) tells
every rank where each miss stands everywhere, before any rank waits for a copy; a read that
failed on any rank then fails its rows on every rank.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .errors import LoraError
from .store import FAILED, READING, HostCopy


class ReadAgreement:
    """``agree(outcomes) -> outcomes`` over the instance (None: a one-rank instance, its own
    outcomes), and ``read_timeout``: seconds a rank waits for a copy still in flight before it
    counts as failed (None: no limit)."""

    def __init__(self, agree: Callable[[np.ndarray], np.ndarray] | None = None, read_timeout: float | None = None):
        self.agree = agree
        self.read_timeout = read_timeout

    def outcomes(self, copies: list[HostCopy | None]) -> tuple[list, np.ndarray]:
        """The agreed outcome per miss, and this rank's own error per miss (None where its copy
        did not fail here). Where some rank's copy is still in flight, each rank waits for its
        own (call this outside every lock), and every rank (all saw the same first answer)
        agrees once more, so no rank installs an adapter whose read failed on another."""
        local = np.array([FAILED if e is None else e.outcome() for e in copies], np.int8)
        agreed = self._agree(local)
        errors: list = [None] * len(copies)
        if (agreed == READING).any():
            for i, e in enumerate(copies):
                if agreed[i] == FAILED:
                    local[i] = FAILED
                elif local[i] == READING:
                    try:
                        local[i] = e.wait(self.read_timeout)
                    except TimeoutError as err:
                        errors[i], local[i] = LoraError(str(err), adapter=e.name, path=e.path), FAILED
            agreed = self._agree(local)
        for i, e in enumerate(copies):
            if errors[i] is None and local[i] == FAILED and e is not None:
                errors[i] = e.error
        return errors, agreed

    def _agree(self, local: np.ndarray) -> np.ndarray:
        if not len(local) or self.agree is None:
            return local
        agreed = np.asarray(self.agree(local))
        if agreed.shape != local.shape:
            raise ValueError(f"agree returned shape {agreed.shape} for {local.shape} outcomes")
        return agreed
