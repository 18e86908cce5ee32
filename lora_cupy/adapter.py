"""One adapter's weights on the host, mapped onto a spec's targets: what the host tier holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TargetWeights:
    """One adapter's weights for one target, every stack layer, on this tensor-parallel rank.

    ``a[L, n, r, in]`` and ``b[L, out, r]`` in the pool's dtype, where ``r`` is this adapter's
    largest rank at the target (slices and layers of smaller rank are zero-padded);
    ``ranks[L, n]`` (int32, 0 where the adapter adds nothing) and ``scaling[L, n]`` (float32).
    Slice ``j`` owns rows ``out_offsets[j]:out_offsets[j+1]`` of ``b``. A pool's image of it
    (``AdapterStore.build_image``) is padded to the pool's ``max_rank`` and in the pool's layout:
    ``b`` rank-blocked, ``[L, ceil(R / 16), out, 16]``, where ``LoraSpec.b_blocked``.
    """

    a: np.ndarray
    b: np.ndarray
    ranks: np.ndarray
    scaling: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes + self.ranks.nbytes + self.scaling.nbytes

    @property
    def rank(self) -> int:
        return int(self.a.shape[2])


@dataclass
class AdapterWeights:
    """An adapter read and checked against a spec: its targets' weights and a sha256 digest.

    ``targets`` holds only the targets the adapter has something for; a pool whose targets it
    touches nowhere holds no slot for it.
    """

    name: str
    path: str
    digest: str
    targets: dict[str, TargetWeights] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.targets.values())

    @property
    def max_rank(self) -> int:
        return max((int(t.ranks.max()) for t in self.targets.values()), default=0)
