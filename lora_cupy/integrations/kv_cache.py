"""RowKVCache: a static KV cache of one row per running request, each with its own length.

Hugging Face attention layers call ``cache.update(k, v, layer_idx, ...)`` and attend to what
it returns. Here every layer's keys and values live in fixed tensors
``k[rows, kv_heads, max_len, head_dim]`` (and v), made once; each running request owns a row
(the generator keeps them packed in rows ``0..n-1``), and a forward runs a run of consecutive
rows (row ``b`` of its batch is cache row ``row0 + b``). A step
gives each row ``q`` query tokens, right-padded: row ``b``'s token ``j`` sits at position
``lengths[b] + j`` and writes its key and value into that column. :func:`step_inputs` builds
the step's position ids, write columns and additive 4-D attention mask from ``lengths`` with
device ops only, so a CUDA graph can capture it and replay it after ``lengths`` is refilled.

A query at position ``p`` of row ``b`` attends to columns ``0..p`` of that row (and, with a
sliding window ``w``, only to columns ``> p - w``). A padding token (a decode row's extra
queries in a step that also prefills, a batch bucket's empty rows) writes past its row's
length, where no real query reads and the next real token overwrites it; its writes are
clamped into the cache, and the positions real tokens take are checked at admission to stay
below ``max_len - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepInputs:
    """What one step's forward reads: ``position_ids[B, q]``, the columns each query writes
    ``write_cols[B, q]``, the additive mask ``[B, 1, q, kv_len]`` (a dict of masks by layer
    type for models that mix full and sliding-window layers) and the key length attended."""

    position_ids: object
    write_cols: object
    mask: object
    kv_len: int


def step_inputs(lengths, q: int, kv_len: int, max_len: int, dtype, *, window: int | None = None,
                layer_types: tuple[str, ...] | None = None) -> StepInputs:
    """Positions, write columns and masks for rows of ``lengths[B]`` (int64) and ``q`` queries."""
    import torch

    dev = lengths.device
    offs = torch.arange(q, device=dev)
    pos = lengths[:, None] + offs[None, :]  # [B, q]
    cols = torch.arange(kv_len, device=dev)[None, None, :]  # [1, 1, K]
    allowed = cols <= pos[:, :, None]  # [B, q, K]
    neg = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=dev)
    low = torch.full((), neg, dtype=dtype, device=dev)
    full = torch.where(allowed, zero, low)[:, None]  # [B, 1, q, K]
    mask = full
    if window is not None:
        windowed = torch.where(allowed & (cols > pos[:, :, None] - window), zero, low)[:, None]
        kinds = set(layer_types or ("sliding_attention",))
        if kinds == {"sliding_attention"}:
            mask = windowed
        elif "sliding_attention" in kinds:
            mask = {"full_attention": full, "sliding_attention": windowed}
    return StepInputs(pos, pos.clamp(max=max_len - 1), mask, kv_len)


class RowKVCache:
    """Fixed per-layer key/value tensors, one row per running request (see the module docstring).

    Duck-types what Hugging Face attention layers call on a cache (``update``); ``begin`` sets
    the step's write columns and the key length returned.
    """

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        import torch

        self.rows, self.max_len = rows, max_len
        shape = (rows, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._cols = None
        self._row0 = 0
        self._row_index: dict = {}  # B -> arange(B)[:, None], kept: a captured graph reads its own
        self._kv_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def begin(self, write_cols, kv_len: int, row0: int = 0) -> None:
        """The step's write columns ``[B, q]`` (row b of the batch is cache row ``row0 + b``) and
        key length."""
        import torch

        B = write_cols.shape[0]
        if row0 + B > self.rows:
            raise ValueError(f"a step of rows {row0}..{row0 + B - 1} exceeds the cache's {self.rows}")
        self._row0 = row0
        if B not in self._row_index:
            self._row_index[B] = torch.arange(B, device=write_cols.device)[:, None]
        self._rows = self._row_index[B]
        self._cols = write_cols
        self._kv_len = kv_len

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write the step's keys and values ``[B, kv_heads, q, head_dim]`` into their columns;
        return the batch's rows up to the step's key length ``[B, kv_heads, kv_len, head_dim]``."""
        B, r0 = key_states.shape[0], self._row0
        k, v = self.k[layer_idx][r0:r0 + B], self.v[layer_idx][r0:r0 + B]
        k[self._rows, :, self._cols] = key_states.transpose(1, 2)
        v[self._rows, :, self._cols] = value_states.transpose(1, 2)
        return k[:, :, :self._kv_len], v[:, :, :self._kv_len]

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` into row ``dst`` in every layer (packing rows when one finishes)."""
        if src == dst:
            return
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])

    # What a Hugging Face model may ask of a cache outside the attention layers.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def __len__(self) -> int:
        return len(self.k)
