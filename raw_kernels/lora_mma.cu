// Slot-grouped LoRA delta on tensor cores (mma.sync m16n8k16, fp32 accumulation):
//   shrink: v[p, j, :r] = x[t] @ A[s, j, :r].T
//   expand: y[t, cols_j] += scaling[s, j] * v[p, j, :r] @ B[s, cols_j, :r].T
// for every position p < slot_indptr[S] of token_order, t = token_order[p], s its slot (s >= 1),
// r = ranks[s, j]. Slot 0, rank-0 slices and positions past slot_indptr[S] are never touched.
//
// Work units. Positions [0, bucket) are cut into tiles of BM, whose rows are runs of one slot each;
// or (`chunked`) each slot's range is cut into chunks of at most BM positions, a tile of one run,
// so that a step's slots run side by side in separate blocks (decode: a tile of 16 positions over
// 8 adapters would stream 8 runs one after another). A chunked launch is sized for the most chunks
// a step can have (units = min(bucket, tiles + S - 1)); its blocks count the step's chunks (one warp
// scans slot_indptr) and spread the grid over them: split-K finer and more column groups when the
// chunks are few. A block streams every run of its unit through one cp.async pipeline with the
// rows of other runs zero-filled, so each row's accumulators only see its own slot's weights, and
// a slot's weights are read once per unit. Rank loops stop at each slot's rank (rounded up to 16):
// a pool's rows beyond an adapter's rank cost nothing.
//   shrink task (unit, split q, slice j, rank block rb of 64): `in` split over `splits` blocks,
//     each adding its partial sums into v (ws) with 16-byte red.add (a plain store with one
//     split); v starts at zero. An unfused shrink whose slices' rank widths fit one rank block
//     together (n * rw <= 64: q/k/v at rank 16) packs them into one task (unit, split q), so x
//     is read once for every slice rather than once a slice.
//   expand task (unit, column group of `cpb` blocks of BN): one pipeline over every (column block,
//     slice, run, chunk of 16 ranks), y tiles prefetched into a ring in shared memory, v * scaling
//     times B on tensor cores added in fp32 and rounded once, written back with 16-byte stores. The
//     last expand block of a unit zeroes the unit's v again (its slices with columns: an expand of
//     one slice after a shrink of every slice leaves the others' v to theirs), so every launch (and
//     graph replay) starts from a zero v and zero counters.
// The kernels, one per role, 128 threads a block (lora_chunk in chunks of 128: 256), a 1-D grid sized
// by the capture bucket only:
//   lora_chunk<..., RW, BM, ALIGNED, SLICED> (chunk.cuh: shrink and expand of each chunk of one slot
//     in the same blocks, no second kernel waiting on the first): by default every call of a 16-bit
//     one-slice target (or one member of a fused target served alone) from 2 positions on, and of
//     a fused target whose slices start on its column blocks from 64 at rank width 16 (backends/cupy.py,
//     default_chunk, chunk_fits; SLICED for the second, the slice loops compiled out of the first);
//     at rank widths above 16 chunks of 64 positions from 2048 and of 128 from 4096 (chunk_bm). The
//     kernels below serve every other call.
//   lora_shrink  (one shrink task a block): every unfused launch but lora_chunk's.
//   lora_expand  (one expand task a block): unfused launches of fewer than 1024 positions but those of
//     expand_stream's buckets (of the default capture buckets: 128 and 512).
//   lora_expand_stream (expand_stream.cuh): the same expand tasks with y streamed through registers
//     by each warp on its own; chosen for the buckets where it measured fastest (256 positions).
//   lora_expand_ring (expand_ring.cuh): tiles of 64 positions, y and B through a ring of cp.async
//     stages with v in registers; unfused launches from 1024 positions on.
//   lora_expand_glu (expand_glu.cuh): a gated MLP's activation with its gate / up expands folded
//     in (h = silu(g + dg) * (u + du)), after the gate_up target's lora_shrink; the attachment's
//     large steps on models with a silu gated MLP.
//   lora_one<..., RW, ALIGNED> (one.cuh: clusters of 8 blocks, no workspace): the capture bucket of
//     one position on sm_90, every type, where a block's share of A is at most one_max_share
//     (backends/cupy.py, default_one: the Llama-8B layer's rank-16 targets and, in the 16-bit types,
//     rank 64 of one slice at in = 4096; larger shares keep lora_chunk or lora_fused). Its chunks of
//     8 positions for the buckets above one, the default of the 16-bit types at rank width 16 until
//     lora_pair took their place, were deleted when they were the default nowhere (NOTES.md, "lora_one
//     in chunks on tensor cores", "lora_pair").
//   lora_pair_shrink<..., NS, RW, ALIGNED> then lora_pair_expand<..., RW, ALIGNED> (pair.cuh: two light
//     launches that overlap the call before under programmatic dependent launch, partial sums of v
//     through ws): the decode buckets from 2 to PAIR_TO positions in the 16-bit types at rank width
//     RW = 16 (NS slices: 1, 2, 3, 4, 8) and 64 (NS: 1, 2), by default (backends/cupy.py,
//     default_pair; NOTES.md, "lora_pair", "lora_pair at rank width 64").
//   lora_fused<..., CHUNKED, ALIGNED> (both in one launch): launches of 64 positions or fewer (decode)
//     that lora_chunk and lora_one do not take (one position below sm_90 or above one_max_share; fp32;
//     several slices with columns below 64
//     positions or off its column blocks), on
//     chunks from 2 to 32 positions (CHUNKED), on tiles at 1 and 64; lora_shrink and lora_expand
//     run tiles only (the chunk code would only make them larger). Each block takes a ticket when it starts, shrink
//     tasks first, and an expand task (after prefetching its y and B) waits for its unit's ready
//     count, raised only by blocks already running.
// Kernels tried and not chosen anywhere (each warp streaming x through registers; per-warp rings of
// cp.async stages) are kept in raw_kernels/dev/, outside the wheel, with their measurements in NOTES.md.
// Shapes: x [rows, in], y [rows, out], A [S, n, R, in], B [S, out, R] or rank-blocked [S, ceil(R / 16),
// out, 16] (Args::b_at; b_slot elements from one slot to the next: out * R, or more where B is one slice's
// columns of a fused target's B), scaling [S, n] f32,
// ranks [S, n] i32, out_offsets [n + 1] i32 (null: one slice), token_order [positions] i32,
// slot_indptr [S + 1] i32, ws = v [bucket, n, rw] f32 (rw = R rounded up to 16), counters i32:
// [0] ticket, [1] done, [2, 2 + units) ready, [2 + units, 2 + 2 * units) v readers done.
// flags: 1 = x and A take 16-byte loads, 2 = B does, 4 = y does (else element-wise paths). Every
// kernel has a last template flag ALIGNED: true is built for flags == 7 alone (every 16-byte path
// taken, no element-wise code in it), false reads the flags at run time; the host picks per call.
#include "common.cuh"

namespace lora {

constexpr int THREADS = 128;
constexpr int MAX_SLICES = 8;
template <int N>
struct Int {  // a count known at compile time, passed to a generic lambda
  static constexpr int value = N;
};

template <typename T>
struct Args {
  T* y;
  const T* x;
  const T* A;
  const T* B;
  const float* scaling;
  const int* ranks;
  const int* out_offsets;
  const int* token_order;
  const int* slot_indptr;
  float* ws;
  int* counters;
  int num_slots, n_slices, max_rank, in_features, out_features, bucket, positions, rw, splits, k_split,
      col_blocks, cpb, flags;
  long long b_slot;  // B's elements from one slot to the next (out * R, more for a slice's view of a fused B)
  // B's layout inside a slot: column c, rank k at b_at(c, k) = c * b_ld + (k / 16) * b_blk + k % 16.
  // [S, out, R]: b_ld = R, b_blk = 16 (so b_at = c * R + k). Rank-blocked [S, ceil(R / 16), out, 16] (a
  // pool of max_rank above 16; lora_cupy/spec.py, b_shape): b_ld = 16, b_blk = out_total * 16, so an
  // adapter of rank 16 reads one contiguous block whatever the pool's max_rank. A piece of 8 ranks
  // from a multiple of 8 (16 bytes of a 2-byte type) is contiguous in both.
  int b_ld;
  long long b_blk;
  int chunked = 0;  // work units are chunks of one slot (lora_fused<..., true>), else tiles
  // The ranks a call runs: the layout's max_rank, or the narrower rank width the host planned the
  // call for (a pool of a large max_rank whose step's slots all have smaller ranks; rw = that width
  // rounded up to 16, < max_rank). Every slot's rank is clamped to it, so a slot above it reads no
  // A row or v entry past the width (its delta is then cut to the width: the host's promise broken).
  __device__ int rank_cap() const { return min(max_rank, rw); }
  // The unfused kernels' stage copies (lora_shrink, lora_expand, lora_expand_ring, lora_fused) go
  // through L2 only at rank widths above 16 (cp_async16_l2; NOTES.md, "Wide B through L2 only").
  __device__ bool copies_l2_only() const { return rw > 16; }
  __device__ size_t b_at(int col, int k) const {
    return (size_t)col * b_ld + (size_t)(k >> 4) * b_blk + (k & 15);
  }
  __device__ int rank_blocks() const { return (rank_cap() + 63) / 64; }
  __device__ int tiles(int bm) const { return (bucket + bm - 1) / bm; }
  // Work units a launch is sized for: tiles of BM positions, or (chunked) the most chunks of one
  // slot a step can have: a slot's range cut from its start into pieces of at most BM, so
  // sum(ceil(len / BM)) < tiles + slots - 1, and at most one per position.
  __device__ int units(int bm) const { return chunked ? min(bucket, tiles(bm) + num_slots - 1) : tiles(bm); }
  __device__ int col_groups() const { return (col_blocks + cpb - 1) / cpb; }
};

// How a chunked launch spreads its fixed grid over the step's `chunks`: the shrink's blocks
// (units x splits x slices x rank blocks) over chunks x slices x rank blocks, each taking `per`
// stages of `in` (so a step of few chunks splits `in` finer), and the expand's blocks (units x
// column groups) over chunks, each taking `cpb` column blocks.
struct Spread {
  int splits, per, groups, cpb;
};
template <typename T>
__device__ __forceinline__ Spread spread_of(const Args<T>& g, int bm, int kc, int chunks) {
  Spread d;
  const int nk = max((g.in_features + kc - 1) / kc, 1), c = max(chunks, 1);
  const int units = g.units(bm), items = c * g.n_slices * g.rank_blocks();
  const int want = max(1, min(nk, units * g.n_slices * g.rank_blocks() * g.splits / items));
  d.per = (nk + want - 1) / want;
  d.splits = (nk + d.per - 1) / d.per;
  const int groups = max(1, min(g.col_blocks, units * g.col_groups() / c));
  d.cpb = (g.col_blocks + groups - 1) / groups;
  d.groups = (g.col_blocks + d.cpb - 1) / d.cpb;
  return d;
}

// Shrink task u: (tile, split q, slice j, rank block rb). Rank blocks vary slowest: the blocks of
// every adapter's first rank block fill the first waves and those past the pool's largest
// adapters (which stop at once) come last, so a rank-128 pool's rank-16 step runs its real work
// as a rank-16 pool's does, with a tail of idle blocks rather than one between every two.
// Packed slices (an unfused shrink of several slices whose rank widths fit one rank block
// together, n * rw <= 64: q/k/v or gate/up at rank 16): one task per (tile, split) covers every
// slice, slice j in the block's ranks [j * rw, j * rw + rw), so x is read once, not once a slice;
// its v columns are then the row's whole [n * rw] (v's layout), j = rb = 0.
struct ShrinkTask {
  int tile, q, j, rb;
};
template <typename T>
__device__ __forceinline__ bool packed_slices(const Args<T>& g, bool fused) {
  return !fused && g.n_slices > 1 && g.n_slices * g.rw <= 64;
}
template <typename T, int BM>
__device__ __forceinline__ ShrinkTask shrink_task_of(const Args<T>& g, int u, int units, int splits, int n) {
  const int per = units * splits * n, w = u % per;
  return {w / (n * splits), (w / n) % splits, w % n, u / per};
}

// The positions [p0, p0 + BM) of one tile: token rows, slots, and the runs of one slot >= 1.
template <int BM>
struct TileRows {
  int tok[BM];     // token row, -1 where the position addresses nothing (slot 0, padding)
  int slot[BM];    // 0 where it addresses nothing
  int run_of[BM];  // the run a row belongs to (rows with a slot >= 1)
  int run_slot[BM], run_lo[BM], run_hi[BM];
  int nrun, pend;
  int warp_count[4];
};

// A chunked block's view of the step's chunks (shared memory of the chunked kernel only: the
// tile kernels' shared memory stays as it was, which their blocks per multiprocessor depend on).
struct ChunkScan {
  int chunks;           // chunks of the step
  int lane_chunks[32];  // chunks up to and including each lane's slots (inclusive scan)
  int chunk[3];         // first position, rows and slot of this block's chunk
};

// Reads slot_indptr and the tile's token rows in one round of loads, then finds the runs.
template <int BM>
__device__ void read_tile(TileRows<BM>& tr, int* s_indptr, const int* __restrict__ slot_indptr,
                          const int* __restrict__ token_order, int num_slots, int positions, int p0) {
  static_assert(BM <= 128, "a tile has at most 128 positions");
  const int tid = threadIdx.x;
  for (int i = tid; i <= num_slots; i += THREADS) s_indptr[i] = slot_indptr[i];
  int t = -1;
  if (tid < BM && p0 + tid < positions) t = token_order[p0 + tid];
  __syncthreads();
  const int pend = s_indptr[num_slots];
  if (tid < BM) {
    const int p = p0 + tid;
    int s = 0;
    if (p < pend && p < positions) s = max(slot_of_position(s_indptr, num_slots, p), 0);
    tr.tok[tid] = s > 0 ? t : -1;
    tr.slot[tid] = s;
  }
  if (tid == 0) tr.pend = pend;
  __syncthreads();
  constexpr int NW = (BM + 31) / 32;
  const int lane = tid & 31, w = tid >> 5;
  bool start = false, end = false;
  int s = 0;
  if (tid < BM) {
    s = tr.slot[tid];
    start = s > 0 && (tid == 0 || tr.slot[tid - 1] != s);
    end = s > 0 && (tid == BM - 1 || tr.slot[tid + 1] != s);
  }
  unsigned ms = 0;
  if (w < NW) {
    ms = __ballot_sync(0xffffffffu, start);
    if (lane == 0) tr.warp_count[w] = __popc(ms);
  }
  __syncthreads();
  if (w < NW) {
    int base = 0;
    for (int k = 0; k < w; ++k) base += tr.warp_count[k];
    const int run = base + __popc(ms & ((2u << lane) - 1u)) - 1;  // starts at or before this row
    if (s > 0) tr.run_of[tid] = run;
    if (start) {
      tr.run_slot[run] = s;
      tr.run_lo[run] = tid;
    }
    if (end) tr.run_hi[run] = tid + 1;
  }
  if (tid == 0) {
    int total = 0;
    for (int k = 0; k < NW; ++k) total += tr.warp_count[k];
    tr.nrun = total;
  }
  __syncthreads();
}

// The step's chunks: slot s's range of positions (s >= 1, clipped to `positions`) cut into
// pieces of at most BM from its start, in slot order. Stages slot_indptr (NT: the block's
// threads); one warp counts each lane's run of slots and scans the counts; cs.chunks is their
// number (every thread, on return).
template <int BM, int NT = THREADS>
__device__ void count_chunks(ChunkScan& cs, int* s_indptr, const int* __restrict__ slot_indptr, int num_slots,
                             int positions) {
  const int tid = threadIdx.x;
  for (int i = tid; i <= num_slots; i += NT) s_indptr[i] = slot_indptr[i];
  __syncthreads();
  if (tid < 32) {
    const int per = (num_slots - 1 + 31) / 32, s0 = 1 + tid * per, s1 = min(s0 + per, num_slots);
    int c = 0;
    for (int s = s0; s < s1; ++s) c += (max(min(s_indptr[s + 1], positions) - s_indptr[s], 0) + BM - 1) / BM;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, c, o);
      if (tid >= o) c += v;
    }
    cs.lane_chunks[tid] = c;
    if (tid == 31) cs.chunks = c;
  }
  __syncthreads();
}

// Chunk k (< cs.chunks, after count_chunks): its first position, rows and slot into cs.chunk
// (every thread, on return).
template <int BM>
__device__ void locate_chunk(ChunkScan& cs, const int* s_indptr, int num_slots, int positions, int k) {
  const int tid = threadIdx.x;
  if (tid < 32) {
    const int per = (num_slots - 1 + 31) / 32, s0 = 1 + tid * per, s1 = min(s0 + per, num_slots);
    const int before = tid ? cs.lane_chunks[tid - 1] : 0;
    int kk = k - before;
    if (kk >= 0 && k < cs.lane_chunks[tid]) {
      for (int s = s0; s < s1; ++s) {
        const int lo = s_indptr[s], len = max(min(s_indptr[s + 1], positions) - lo, 0), nc = (len + BM - 1) / BM;
        if (kk < nc) {
          cs.chunk[0] = lo + kk * BM;
          cs.chunk[1] = min(BM, len - kk * BM);
          cs.chunk[2] = s;
          break;
        }
        kk -= nc;
      }
    }
  }
  __syncthreads();
}

// Chunk k (< cs.chunks, after count_chunks) as a tile of one run: rows [0, m) hold positions
// [p0, p0 + m) of one slot (p0 = cs.chunk[0]), so its token rows are one round of loads after the count.
template <int BM>
__device__ void find_chunk(TileRows<BM>& tr, ChunkScan& cs, const int* s_indptr, const int* __restrict__ token_order,
                           int num_slots, int positions, int k) {
  static_assert(BM <= 128, "a chunk has at most 128 positions");
  const int tid = threadIdx.x;
  locate_chunk<BM>(cs, s_indptr, num_slots, positions, k);
  const int p0 = cs.chunk[0], m = cs.chunk[1];
  if (tid < BM) {
    const bool in = tid < m;
    tr.tok[tid] = in ? token_order[p0 + tid] : -1;
    tr.slot[tid] = in ? cs.chunk[2] : 0;
    tr.run_of[tid] = 0;
  }
  __syncthreads();
  if (tid == 0) {
    tr.nrun = 1;
    tr.run_slot[0] = cs.chunk[2];
    tr.run_lo[0] = 0;
    tr.run_hi[0] = m;
  }
  __syncthreads();
}

// The first and last runs of a tile meeting rows [m0, m0 + 16) (ka > kb where none does).
template <int BM>
__device__ __forceinline__ void runs_meeting(const TileRows<BM>& tr, int m0, int& ka, int& kb) {
  ka = tr.nrun;
  kb = -1;
  for (int k = 0; k < tr.nrun; ++k) {
    if (tr.run_lo[k] < m0 + 16 && tr.run_hi[k] > m0) {
      ka = min(ka, k);
      kb = k;
    }
  }
}

// What an expand block reads once after its tile: slice offsets, and rank and scaling of every
// (slice, run); last_reader is release_v's flag.
template <int BM>
struct RunMeta {
  int s_off[MAX_SLICES + 1];
  int pr[MAX_SLICES][BM];    // rank of (slice, run), at most the pool's
  float ps[MAX_SLICES][BM];  // scaling of (slice, run)
  int last_reader;
};

template <typename T, int BM>
__device__ void read_run_meta(const Args<T>& g, const TileRows<BM>& tr, RunMeta<BM>& rm) {
  const int tid = threadIdx.x, n = g.n_slices, nrun = tr.nrun;
  if (tid <= n) rm.s_off[tid] = g.out_offsets ? g.out_offsets[tid] : (tid == 0 ? 0 : g.out_features);
  for (int e = tid; e < n * nrun; e += THREADS) {
    const int jj = e / nrun, k = e % nrun, idx = tr.run_slot[k] * n + jj;
    rm.pr[jj][k] = min(g.ranks[idx], g.rank_cap());
    rm.ps[jj][k] = g.scaling[idx];
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------------
// shrink
template <typename T, int BM>
struct Shrink {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int CH = 16 / sizeof(T);   // elements per 16-byte chunk
  static constexpr int KC = 128 / sizeof(T);  // in-features per pipeline stage
  static constexpr int LDK = KC + 8;          // padded shared row: conflict-free fragment loads
  static constexpr int RB = 64;               // ranks per block
  static constexpr int STAGES = 3;
  static constexpr int MT = BM / 16, WN = 4 / MT, NTW = RB / 8 / WN;
  static constexpr int STAGE = (BM + RB) * LDK;  // elements
  static constexpr int SMEM = STAGES * STAGE * (int)sizeof(T);
};

template <typename T, int BM, bool CHUNKED, bool ALIGNED>
__device__ void shrink_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int u,
                            bool fused) {
  using C = Shrink<T, BM>;
  using M = typename C::M;
  __shared__ int row_r[BM];  // this row's rank inside the rank block (0..64)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  int splits = g.splits, k_split = g.k_split, p0;
  const bool packed = !CHUNKED && packed_slices(g, fused);
  ShrinkTask task;
  if constexpr (CHUNKED) {  // the grid spread over the step's chunks: u past them has nothing to do
    __shared__ ChunkScan cs;
    count_chunks<BM>(cs, s_indptr, g.slot_indptr, g.num_slots, g.positions);
    const Spread d = spread_of(g, BM, C::KC, cs.chunks);
    splits = d.splits;
    k_split = d.per * C::KC;
    if (u >= cs.chunks * splits * g.n_slices * g.rank_blocks()) return;
    task = shrink_task_of<T, BM>(g, u, cs.chunks, splits, g.n_slices);
    find_chunk<BM>(tr, cs, s_indptr, g.token_order, g.num_slots, g.positions, task.tile);
    p0 = cs.chunk[0];
  } else {
    task = shrink_task_of<T, BM>(g, u, g.tiles(BM), splits, packed ? 1 : g.n_slices);
    p0 = task.tile * BM;
    read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
    if (p0 >= tr.pend) return;
  }
  const int q = task.q, j = task.j, rb = task.rb, tile = task.tile;
  // a slice with no columns (a call serving one slice of a fused target) has nothing to expand
  auto no_cols = [&](int jj) { return g.out_offsets != nullptr && g.out_offsets[jj] == g.out_offsets[jj + 1]; };
  // slot s's rank of slice jj inside this block (0: nothing to compute)
  auto rank_in = [&](int s, int jj) {
    return no_cols(jj) ? 0 : min(max(min(g.ranks[s * g.n_slices + jj], g.rank_cap()) - rb * C::RB, 0), C::RB);
  };
  if (tid < BM) {
    const int s = tr.slot[tid];
    int r = 0;
    if (s > 0) {
      if (packed) {  // the block's ranks up to the last slice with any: j * rw + its rank
        for (int jj = 0; jj < g.n_slices; ++jj) {
          const int rj = rank_in(s, jj);
          if (rj > 0) r = jj * g.rw + rj;
        }
      } else {
        r = rank_in(s, j);
      }
    }
    row_r[tid] = r;
  }
  const int any = __syncthreads_or(tid < BM && row_r[tid] > 0);
  const int in = g.in_features;
  const int kbeg = q * k_split, kend = min(kbeg + k_split, in);
  const int nk = kend > kbeg ? (kend - kbeg + C::KC - 1) / C::KC : 0;
  const int F = any ? tr.nrun * nk : 0;
  const bool vec = ALIGNED || (g.flags & 1);  // ALIGNED: no element-wise path compiled
  T* stages = reinterpret_cast<T*>(dsmem);
  const size_t a_slot = (size_t)g.n_slices * g.max_rank * in;

  // Each thread copies the same 16-byte columns of rows my_row + 16 i of every stage; its row
  // pointers change only with the run, so they are kept across the run's chunks.
  constexpr int CPR = C::KC / C::CH;            // 16-byte chunks per row of a stage
  constexpr int XPT = BM * CPR / THREADS;       // x chunks per thread
  constexpr int APT = C::RB * CPR / THREADS;    // A chunks per thread (rows past r16 skipped)
  static_assert(THREADS % CPR == 0 && XPT >= 1, "tile too small for the block");
  const int my_row = tid / CPR, my_col = (tid % CPR) * C::CH;
  const T* xp[XPT];
  const T* ap[APT];
  int cached = -1, cached_r16 = 0;

  // Row `row` (< r, the run's extent in this block) of the block's A for run `run`: slice j's
  // rank rb * 64 + row, or with packed slices slice row / rw's rank row % rw; null past the
  // slice's rank (zero-filled).
  auto a_row = [&](int run, int row, int r) -> const T* {
    if (row >= r) return nullptr;
    const int s = tr.run_slot[run];
    if (packed) {
      const int jj = row / g.rw, rr = row - jj * g.rw;
      if (rr >= rank_in(s, jj)) return nullptr;
      return g.A + s * a_slot + ((size_t)jj * g.max_rank + rr) * in;
    }
    return g.A + s * a_slot + ((size_t)j * g.max_rank + rb * C::RB + row) * in;
  };
  // Step f = run * nk + kc of the block's walk (its run, then its stage of `in`), loaded into
  // stage f % STAGES; run and kc are kept by the caller's cursor (no division per step).
  auto load = [&](int f, int run, int kc) {
    if (f < F) {
      const int lo = tr.run_lo[run], hi = tr.run_hi[run], r = row_r[lo];
      if (r > 0) {
        T* sx = stages + (f % C::STAGES) * C::STAGE;
        T* sa = sx + BM * C::LDK;
        const int k0 = kbeg + kc * C::KC, r16 = (r + 15) & ~15;
        if (vec) {
          if (run != cached) {
            cached = run;
            cached_r16 = r16;
#pragma unroll
            for (int i = 0; i < XPT; ++i) {
              const int row = my_row + 16 * i;
              xp[i] = row >= lo && row < hi ? g.x + (size_t)tr.tok[row] * in + my_col : nullptr;
            }
#pragma unroll
            for (int i = 0; i < APT; ++i) {
              const T* a = a_row(run, my_row + 16 * i, r);
              ap[i] = a != nullptr ? a + my_col : nullptr;
            }
          }
          const bool kin = k0 + my_col < kend;
#pragma unroll
          for (int i = 0; i < XPT; ++i) {
            const bool ok = kin && xp[i] != nullptr;
            cp_async16_l2(sx + (my_row + 16 * i) * C::LDK + my_col, ok ? xp[i] + k0 : g.x, ok ? 16 : 0,
                          g.copies_l2_only());
          }
#pragma unroll
          for (int i = 0; i < APT; ++i) {
            const int row = my_row + 16 * i;
            if (row < cached_r16) {
              const bool ok = kin && ap[i] != nullptr;
              cp_async16_l2(sa + row * C::LDK + my_col, ok ? ap[i] + k0 : g.A, ok ? 16 : 0, g.copies_l2_only());
            }
          }
        } else {
          for (int e = tid; e < BM * C::KC; e += THREADS) {
            const int row = e / C::KC, col = e % C::KC;
            const bool ok = row >= lo && row < hi && k0 + col < kend;
            sx[row * C::LDK + col] = ok ? g.x[(size_t)tr.tok[row] * in + k0 + col] : from_float<T>(0.f);
          }
          for (int e = tid; e < r16 * C::KC; e += THREADS) {
            const int row = e / C::KC, col = e % C::KC;
            const T* a = a_row(run, row, r);
            sa[row * C::LDK + col] = a != nullptr && k0 + col < kend ? a[k0 + col] : from_float<T>(0.f);
          }
        }
      }
    }
    cp_async_commit();
  };

  float acc[C::NTW][4];
#pragma unroll
  for (int i = 0; i < C::NTW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const int m0 = (warp % C::MT) * 16;

  auto advance = [nk](int& run, int& kc) {
    if (++kc == nk) {
      kc = 0;
      ++run;
    }
  };
  int load_run = 0, load_kc = 0, run = 0, kc = 0;  // the cursors of the step loaded next and computed next
#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) {
    load(st, load_run, load_kc);
    advance(load_run, load_kc);
  }
  for (int f = 0; f < F; ++f, advance(run, kc)) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    load(f + C::STAGES - 1, load_run, load_kc);
    advance(load_run, load_kc);
    const int lo = tr.run_lo[run], hi = tr.run_hi[run], r = row_r[lo];
    if (r > 0 && lo < m0 + 16 && hi > m0) {
      const T* sx = stages + (f % C::STAGES) * C::STAGE;
      const T* sa = sx + BM * C::LDK;
      const int nta = ((r + 15) >> 4) * 2;  // n-tiles of 8 ranks
      // One stage's products over this warp's first NT n-tiles (a warp's i-th is warp / MT + WN i).
      auto stage_mma = [&](auto nt_const) {
        constexpr int NT = decltype(nt_const)::value;
#pragma unroll
        for (int ks = 0; ks < C::KC / 16; ++ks) {
          Frags<M, C::SPLIT, T> fa;
          fa.load_a(sx, C::LDK, m0, ks * 16, gq, tq, 1.f);
#pragma unroll
          for (int i = 0; i < NT; ++i) {
            const int nt = warp / C::MT + C::WN * i;
            if (nt < nta) {
              Frags<M, C::SPLIT, T> fb;
              fb.load_b(sa, C::LDK, nt * 8, ks * 16, gq, tq);
              mma_frags<M, C::SPLIT, C::SPLIT>(acc[i], fa, fb);
            }
          }
        }
      };
      // A block of 64 ranks walked for a rank-16 run would issue (predicated off) three times the
      // fragment loads and products it needs: the n-tiles a run's rank reaches, rounded up to 2 or
      // 4 a warp where the block has more, are what is unrolled.
      if constexpr (C::NTW > 2) {
        if (nta <= 2 * C::WN) stage_mma(Int<2>{});
        else if (C::NTW > 4 && nta <= 4 * C::WN) stage_mma(Int<4>{});
        else stage_mma(Int<C::NTW>{});
      } else {
        stage_mma(Int<C::NTW>{});
      }
    }
  }
  cp_async_wait<0>();

  // this split's share of v: lanes tq and tq ^ 1 swap halves so each holds four consecutive ranks
  // of one row, then one 16-byte store (one split) or reduction (v starts at zero; the expand
  // zeroes it again). Ranks in [r, r16) carry zeros.
  if (F > 0) {
    const bool odd = tq & 1;
#pragma unroll
    for (int i = 0; i < C::NTW; ++i) {
      const float s0 = odd ? acc[i][0] : acc[i][2], s1 = odd ? acc[i][1] : acc[i][3];
      const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
      const float4 quad = odd ? make_float4(r0, r1, acc[i][2], acc[i][3]) : make_float4(acc[i][0], acc[i][1], r0, r1);
      const int row = m0 + gq + (odd ? 8 : 0), col = (warp / C::MT + C::WN * i) * 8 + 2 * (tq & ~1);
      const int r = row_r[row];
      // packed: only the columns below each slice's rank rounded up to 16, what its expand reads
      // and zeroes again (a float4 never crosses a 16-column boundary); the zero rows between
      // them would leave 0 * inf = NaN in v where x holds an inf, read by no expand, zeroed by none
      if (r > 0 && col < ((r + 15) & ~15) &&
          (!packed || col % g.rw < ((rank_in(tr.slot[row], col / g.rw) + 15) & ~15))) {
        float* p = g.ws + ((size_t)(p0 + row) * g.n_slices + j) * g.rw + rb * C::RB + col;
        if (splits == 1) *reinterpret_cast<float4*>(p) = quad;
        else red_add4(p, quad);
      }
    }
  }
  if (fused) {
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(g.counters + 2 + tile, 1);
  }
}

// ------------------------------------------------------------------------------------------------
// expand

// p[0] += d0 and (when both) p[1] += d1 in fp32, rounded once; an element whose delta is exactly
// zero keeps its bits (so a slice of rank 0 leaves y untouched).
template <typename T>
__device__ __forceinline__ void add_pair(T* p, float d0, float d1, bool both) {
  if (both && (d0 != 0.f || d1 != 0.f)) {
    T a = p[0], b = p[1];
    if (d0 != 0.f) a = from_float<T>(to_float(a) + d0);
    if (d1 != 0.f) b = from_float<T>(to_float(b) + d1);
    p[0] = a;
    p[1] = b;
  } else if (!both && d0 != 0.f) {
    p[0] = from_float<T>(to_float(p[0]) + d0);
  }
}

// After a column group's last read of v: the last group of the tile to finish zeroes the tile's
// v, so the next launch (or graph replay) starts from zero. Each group releases its reads of v
// (fence, then count); the last one acquires them (count, then fence) before it writes. Only the
// slices with columns are zeroed: an expand serving one slice of a fused target (after a shrink
// of every slice, the delta in halves) leaves the other slices' v for their own expands.
template <typename T, int BM>
__device__ void release_v(const Args<T>& g, const TileRows<BM>& tr, RunMeta<BM>& rm, int tile, int groups,
                          int p0, int n) {
  const int(&pr)[MAX_SLICES][BM] = rm.pr;
  int& last_reader = rm.last_reader;
  const int tid = threadIdx.x;
  int* readers = g.counters + 2 + g.units(BM) + tile;
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last_reader = atomicAdd(readers, 1) == groups - 1;
  }
  __syncthreads();
  if (last_reader) {
    __threadfence();
    const int r4 = g.rw / 4;
    for (int e = tid; e < BM * n * r4; e += THREADS) {
      const int row = e / (n * r4), jj = (e / r4) % n, c4 = (e % r4) * 4;
      if (tr.tok[row] >= 0 && c4 < ((pr[jj][tr.run_of[row]] + 15) & ~15) && rm.s_off[jj] < rm.s_off[jj + 1])
        __stcg(reinterpret_cast<float4*>(g.ws + ((size_t)(p0 + row) * n + jj) * g.rw + c4),
               make_float4(0.f, 0.f, 0.f, 0.f));
    }
    if (tid == 0) atomicExch(readers, 0);
  }
}

template <typename T, int BM, int BN>
struct Expand {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int CH = 16 / sizeof(T);
  static constexpr int KC = 16;  // ranks per pipeline stage (one k-step)
  static constexpr int LDB = KC + 8, LDV = KC + 8, LDY = BN + CH;  // conflict-free fragment rows
  static constexpr int STAGES = BM >= 64 ? 2 : 3;  // also the ring of y tiles
  static constexpr int WM = BM >= 32 ? 2 : 1, WN = 4 / WM, MT = BM / WM / 16, NT = BN / WN / 8;
  static constexpr int BCPR = KC / CH, VCPR = KC / 4;  // 16-byte chunks per row of B, of v
  static constexpr int STAGE_BYTES = BN * LDB * (int)sizeof(T) + BM * LDV * 4;
  static constexpr int Y_BYTES = BM * LDY * (int)sizeof(T);
  static constexpr int SMEM = STAGES * (STAGE_BYTES + Y_BYTES);
};

// One step of the expand's walk over (column block, slice, run, rank chunk).
struct ExpandWalk {
  int cb, j, jl, run, kc, nc, vis;  // vis: column blocks with work met so far (the y ring slot)
  bool first, done;                 // first: the first step of its column block
};

// The slices j0 .. j1 meeting columns [cb * bn, cb * bn + bn) of a target of `out` columns.
__device__ __forceinline__ void slices_meeting(const int* s_off, int n, int out, int bn, int cb, int& j0, int& j1) {
  const int c0 = cb * bn, c1 = min(c0 + bn, out);
  j0 = 0;
  while (j0 + 1 < n && s_off[j0 + 1] <= c0) ++j0;
  j1 = j0;
  while (j1 + 1 < n && s_off[j1 + 1] < c1) ++j1;
}

// w to the next step that has ranks, column blocks up to cb1 of bn columns: the next chunk of kc
// ranks of its run, else the next run (then slice, then column block) whose rank is not zero.
template <int BM>
__device__ __forceinline__ void walk_step(ExpandWalk& w, bool newcb, const RunMeta<BM>& rm, int n, int nrun,
                                          int out, int bn, int cb1, int kc) {
  if (!newcb && ++w.kc < w.nc) {
    w.first = false;
    return;
  }
  w.kc = 0;
  while (true) {
    if (++w.run >= nrun) {
      w.run = 0;
      if (++w.j > w.jl) {
        if (++w.cb >= cb1) {
          w.done = true;
          return;
        }
        slices_meeting(rm.s_off, n, out, bn, w.cb, w.j, w.jl);
        newcb = true;
      }
    }
    w.nc = (rm.pr[w.j][w.run] + kc - 1) / kc;
    if (w.nc > 0) break;
  }
  w.first = newcb;
  if (newcb) ++w.vis;
}

// The walk of column blocks [cb0, cb1) at its first step (done at once where none has work).
template <int BM>
__device__ __forceinline__ ExpandWalk walk_start(const RunMeta<BM>& rm, int n, int nrun, int out, int bn, int cb0,
                                                 int cb1, int kc) {
  ExpandWalk w;
  w.cb = cb0;
  slices_meeting(rm.s_off, n, out, bn, cb0, w.j, w.jl);
  w.run = -1;
  w.kc = w.nc = 0;
  w.vis = -1;
  w.first = w.done = false;
  walk_step<BM>(w, true, rm, n, nrun, out, bn, cb1, kc);
  return w;
}

template <typename T, int BM, int BN, bool CHUNKED, bool ALIGNED>
__device__ void expand_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int u,
                            bool fused) {
  using C = Expand<T, BM, BN>;
  using M = typename C::M;
  __shared__ RunMeta<BM> rm;
  const int(&pr)[MAX_SLICES][BM] = rm.pr;
  const float(&ps)[MAX_SLICES][BM] = rm.ps;
  const int* s_off = rm.s_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  int groups = g.col_groups(), cpb = g.cpb, splits = g.splits, p0;
  if constexpr (CHUNKED) {  // the grid spread over the step's chunks: u past them has nothing to do
    __shared__ ChunkScan cs;
    count_chunks<BM>(cs, s_indptr, g.slot_indptr, g.num_slots, g.positions);
    const Spread d = spread_of(g, BM, Shrink<T, BM>::KC, cs.chunks);
    groups = d.groups;
    cpb = d.cpb;
    splits = d.splits;
    if (u >= cs.chunks * groups) return;
    find_chunk<BM>(tr, cs, s_indptr, g.token_order, g.num_slots, g.positions, u / groups);
    p0 = cs.chunk[0];
  } else {
    p0 = (u / groups) * BM;
    read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
    if (tr.nrun == 0 || p0 >= tr.pend) return;
  }
  const int cg = u % groups, tile = u / groups;
  const int out = g.out_features, n = g.n_slices, nrun = tr.nrun;
  const int cb0 = cg * cpb, cb1 = min(cb0 + cpb, g.col_blocks);
  read_run_meta<T, BM>(g, tr, rm);

  const bool vec_y = ALIGNED || (g.flags & 4), vec_b = ALIGNED || (g.flags & 2);
  constexpr int YCPR = BN / C::CH;
  auto y_tile = [&](int vis) {
    return reinterpret_cast<T*>(dsmem + C::STAGES * C::STAGE_BYTES + (vis % C::STAGES) * C::Y_BYTES);
  };
  auto step = [&](ExpandWalk& w, bool newcb) { walk_step<BM>(w, newcb, rm, n, nrun, out, BN, cb1, C::KC); };

  // loads of one step: part 1 = its y tile (first step of a column block) and B, part 2 = its v
  auto load = [&](const ExpandWalk& w, int st, int part) {
    if (!w.done) {
      char* base = dsmem + st * C::STAGE_BYTES;
      const int c0 = w.cb * BN, c1 = min(c0 + BN, out);
      if (part & 1) {
        if (w.first) {
          T* sy = y_tile(w.vis);
          if (vec_y) {
            for (int c = tid; c < BM * YCPR; c += THREADS) {
              const int row = c / YCPR, col = (c % YCPR) * C::CH;
              if (tr.tok[row] >= 0 && c0 + col < c1)
                cp_async16_l2(sy + row * C::LDY + col, g.y + (size_t)tr.tok[row] * out + c0 + col, 16,
                              g.copies_l2_only());
            }
          } else {
            for (int e = tid; e < BM * BN; e += THREADS) {
              const int row = e / BN, col = e % BN;
              if (tr.tok[row] >= 0 && c0 + col < c1)
                sy[row * C::LDY + col] = g.y[(size_t)tr.tok[row] * out + c0 + col];
            }
          }
        }
        T* sb = reinterpret_cast<T*>(base);
        const int s = tr.run_slot[w.run], r = pr[w.j][w.run], k0 = w.kc * C::KC;
        const int ca = max(c0, s_off[w.j]), cz = min(c1, s_off[w.j + 1]);
        const T* bs = g.B + (size_t)s * g.b_slot;
        if (vec_b) {
#pragma unroll
          for (int c = tid; c < BN * C::BCPR; c += THREADS) {
            const int row = c / C::BCPR, k = (c % C::BCPR) * C::CH, col = c0 + row;
            const bool ok = col >= ca && col < cz;
            const int bytes = ok ? min(max(r - (k0 + k), 0), C::CH) * (int)sizeof(T) : 0;
            cp_async16_l2(sb + row * C::LDB + k, bytes ? bs + g.b_at(col, k0 + k) : g.B, bytes, g.copies_l2_only());
          }
        } else {
          for (int e = tid; e < BN * C::KC; e += THREADS) {
            const int row = e / C::KC, k = e % C::KC, col = c0 + row;
            const bool ok = col >= ca && col < cz && k0 + k < r;
            sb[row * C::LDB + k] = ok ? bs[g.b_at(col, k0 + k)] : from_float<T>(0.f);
          }
        }
      }
      if (part & 2) {
        float* sv = reinterpret_cast<float*>(base + BN * C::LDB * sizeof(T));
        const int lo = tr.run_lo[w.run], hi = tr.run_hi[w.run];
        const float* v0 = g.ws + ((size_t)p0 * n + w.j) * g.rw + w.kc * C::KC;
#pragma unroll
        for (int c = tid; c < BM * C::VCPR; c += THREADS) {
          const int row = c / C::VCPR, k = (c % C::VCPR) * 4;
          const bool ok = row >= lo && row < hi;
          cp_async16_cg(sv + row * C::LDV + k, ok ? v0 + (size_t)row * n * g.rw + k : g.ws, ok ? 16 : 0);
        }
      }
    }
    cp_async_commit();
  };

  float acc[C::MT][C::NT][4];
  auto clear = [&]() {
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  };
  clear();
  const int wm0 = (warp / C::WN) * (BM / C::WM), wn0 = (warp % C::WN) * (BN / C::WN);

  ExpandWalk wp = walk_start<BM>(rm, n, nrun, out, BN, cb0, cb1, C::KC);
  ExpandWalk wc = wp, wb = wp;
  // y and B of the first steps do not depend on v: issue them before waiting for the shrink
#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) {
    load(wb, st, 1);
    if (!wb.done) step(wb, false);
  }
  if (fused) {
    if (tid == 0) {
      const int want = splits * n * g.rank_blocks();
      const int* ready = g.counters + 2 + tile;
      while (load_acquire(ready) < want) __nanosleep(32);
    }
    __syncthreads();
  }
#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) {
    load(wp, st, 2);
    if (!wp.done) step(wp, false);
  }

  for (int f = 0; !wc.done; ++f) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    load(wp, (f + C::STAGES - 1) % C::STAGES, 3);
    if (!wp.done) step(wp, false);
    {
      const int lo = tr.run_lo[wc.run], hi = tr.run_hi[wc.run];
      const float scale = ps[wc.j][wc.run];
      const char* base = dsmem + (f % C::STAGES) * C::STAGE_BYTES;
      const T* sb = reinterpret_cast<const T*>(base);
      const float* sv = reinterpret_cast<const float*>(base + BN * C::LDB * sizeof(T));
      Frags<M, C::SPLIT, float> fa[C::MT];
      bool live[C::MT];
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        const int m0 = wm0 + mt * 16;
        live[mt] = lo < m0 + 16 && hi > m0;
        if (live[mt]) fa[mt].load_a(sv, C::LDV, m0, 0, gq, tq, scale);
      }
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        Frags<M, C::SPLIT, T> fb;
        fb.load_b(sb, C::LDB, wn0 + nt * 8, 0, gq, tq);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
          if (live[mt]) mma_frags<M, C::SPLIT, C::SPLIT>(acc[mt][nt], fa[mt], fb);
      }
    }
    const int cb = wc.cb, vis = wc.vis;
    step(wc, false);
    if (wc.done || wc.cb != cb) {
      // the column block is complete: add into its y tile (a zero delta keeps y's bits), write back
      T* sy = y_tile(vis);
      const int c0 = cb * BN, c1 = min(c0 + BN, out);
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = wm0 + mt * 16 + gq + 8 * h, col = wn0 + nt * 8 + 2 * tq;
            if (tr.tok[row] >= 0 && c0 + col < c1)
              add_pair(sy + row * C::LDY + col, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1], c0 + col + 1 < c1);
          }
      clear();
      __syncthreads();
      if (vec_y) {
        for (int c = tid; c < BM * YCPR; c += THREADS) {
          const int row = c / YCPR, col = (c % YCPR) * C::CH;
          if (tr.tok[row] >= 0 && c0 + col < c1)
            *reinterpret_cast<uint4*>(g.y + (size_t)tr.tok[row] * out + c0 + col) =
                *reinterpret_cast<const uint4*>(sy + row * C::LDY + col);
        }
      } else {
        for (int e = tid; e < BM * BN; e += THREADS) {
          const int row = e / BN, col = e % BN;
          if (tr.tok[row] >= 0 && c0 + col < c1) g.y[(size_t)tr.tok[row] * out + c0 + col] = sy[row * C::LDY + col];
        }
      }
    }
  }
  cp_async_wait<0>();

  release_v<T, BM>(g, tr, rm, tile, groups, p0, n);
}

template <typename T, int BM, int BN>
__host__ __device__ constexpr int fused_smem() {
  return Shrink<T, BM>::SMEM > Expand<T, BM, BN>::SMEM ? Shrink<T, BM>::SMEM : Expand<T, BM, BN>::SMEM;
}

// One block of the fused launch: a ticket taken when the block starts picks its task, shrink
// tasks first (every chunk's, split and rank block), then expand tasks, so an expand task only
// ever waits for shrink tasks of blocks already running. The last block to finish resets the
// ticket, done and ready counts for the next launch.
template <typename T, int BM, int BN, bool CHUNKED, bool ALIGNED>
__device__ void fused_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int blocks) {
  __shared__ int ticket;
  const int units = g.units(BM);
  const int n_shrink = units * g.splits * g.n_slices * g.rank_blocks();
  if (threadIdx.x == 0) ticket = atomicAdd(g.counters, 1);
  __syncthreads();
  const int u = ticket;
  if (u < n_shrink) shrink_task<T, BM, CHUNKED, ALIGNED>(g, dsmem, s_indptr, tr, u, true);
  else expand_task<T, BM, BN, CHUNKED, ALIGNED>(g, dsmem, s_indptr, tr, u - n_shrink, true);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(g.counters + 1, 1) == blocks - 1) {  // every other block has finished
      for (int i = 0; i < units; ++i) g.counters[2 + i] = 0;
      g.counters[0] = 0;
      g.counters[1] = 0;
      __threadfence();
    }
  }
}

}  // namespace lora

#include "expand_stream.cuh"
#include "expand_ring.cuh"
#include "expand_glu.cuh"
#include "chunk.cuh"
#include "one.cuh"
#include "pair.cuh"

#define LORA_PARAMS                                                                                   \
  T *y, const T *x, const T *A, const T *B, const float *scaling, const int *ranks,                   \
      const int *out_offsets, const int *token_order, const int *slot_indptr, float *ws, int *counters, \
      int num_slots, int n_slices, int max_rank, int in_features, int out_features, int bucket,        \
      int positions, int rw, int splits, int k_split, int col_blocks, int cpb, int flags, long long b_slot, \
      int b_ld, long long b_blk
#define LORA_ARGS                                                                                  \
  lora::Args<T> g{y, x, A, B, scaling, ranks, out_offsets, token_order, slot_indptr, ws, counters,  \
                  num_slots, n_slices, max_rank, in_features, out_features, bucket, positions, rw,  \
                  splits, k_split, col_blocks, cpb, flags, b_slot, b_ld, b_blk}

// Dynamic shared memory: the kernel's stages (and y tiles), then slot_indptr (S + 1 ints).
// Blocks per multiprocessor the shrink's registers are capped for (tuning runs may set it): 4,
// as its shared memory allows (on an H200 the T=4096 shrink ran 21-26% faster than uncapped at 165
// registers and 3 blocks). The expand stays uncapped: capped for 4 blocks it ran slower, and an
// explicit minimum of 1 block let ptxas take 186 registers (2 blocks) and slowed it by a third.
#ifndef LORA_SHRINK_BLOCKS
#define LORA_SHRINK_BLOCKS 4
#endif
// ALIGNED (every kernel): the host launches the instantiation with ALIGNED = true only when every
// 16-byte path is allowed (flags == 7: x, A, B and y rows start 16-byte aligned and in, R and out
// are multiples of 16 bytes); it then ignores `flags` and carries no element-wise code, which
// shrinks its SASS (instruction fetch is a cost of its own after a flush, NOTES.md). ALIGNED =
// false reads the flags at run time, as every launch did before, and serves every other call.
template <typename T, int BM, bool ALIGNED>
__global__ void __launch_bounds__(128, LORA_SHRINK_BLOCKS) lora_shrink(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  LORA_ARGS;
  lora::enter_grid<true>();
  lora::require_smem(lora::Shrink<T, BM>::SMEM + 4 * (num_slots + 1));
  lora::shrink_task<T, BM, false, ALIGNED>(g, dsmem, reinterpret_cast<int*>(dsmem + lora::Shrink<T, BM>::SMEM), tr,
                                           blockIdx.x, false);
}

template <typename T, int BM, int BN, bool ALIGNED>
__global__ void __launch_bounds__(128) lora_expand(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  LORA_ARGS;
  lora::enter_grid<true>();
  lora::require_smem(lora::Expand<T, BM, BN>::SMEM + 4 * (num_slots + 1));
  lora::expand_task<T, BM, BN, false, ALIGNED>(
      g, dsmem, reinterpret_cast<int*>(dsmem + lora::Expand<T, BM, BN>::SMEM), tr, blockIdx.x, false);
}

// CHUNKED: work units are chunks of one slot (buckets of 2 to 32 positions), else tiles.
template <typename T, int BM, int BN, bool CHUNKED, bool ALIGNED>
__global__ void __launch_bounds__(128) lora_fused(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  LORA_ARGS;
  lora::enter_grid<true>();
  g.chunked = CHUNKED;
  lora::require_smem(lora::fused_smem<T, BM, BN>() + 4 * (num_slots + 1));
  lora::fused_task<T, BM, BN, CHUNKED, ALIGNED>(
      g, dsmem, reinterpret_cast<int*>(dsmem + lora::fused_smem<T, BM, BN>()), tr, gridDim.x);
}

// lora_expand_stream (expand_stream.cuh): registers capped for 4 blocks per multiprocessor;
// dynamic shared memory holds slot_indptr alone.
template <typename T, int BM, bool ALIGNED>
__global__ void __launch_bounds__(128, 4) lora_expand_stream(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  LORA_ARGS;
  lora::enter_grid<true>();
  lora::require_smem(4 * (num_slots + 1));
  lora::expand_stream_task<T, BM, ALIGNED>(g, reinterpret_cast<int*>(dsmem), tr, blockIdx.x);
}

// lora_expand_ring (expand_ring.cuh): tiles of 64 positions; registers capped for the blocks per
// multiprocessor its shared memory allows (3 for 16-bit types, 2 for fp32).
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(128, sizeof(T) == 4 ? 2 : 3) lora_expand_ring(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<64> tr;
  LORA_ARGS;
  lora::enter_grid<true>();
  lora::require_smem(lora::Ring<T>::SMEM + 4 * (num_slots + 1));
  lora::expand_ring_task<T, ALIGNED>(g, dsmem, reinterpret_cast<int*>(dsmem + lora::Ring<T>::SMEM), tr, blockIdx.x);
}

// lora_expand_glu (expand_glu.cuh): a gated MLP's silu(g + dg) * (u + du) into h, tiles of 64
// positions; KS k-steps of 16 ranks (the smallest of 1, 2, 4 covering the pool's rank width); 16-bit types only.
// Registers capped for the 4 blocks per multiprocessor its shared memory allows.
template <typename T, int KS>
__global__ void __launch_bounds__(128, 4) lora_expand_glu(LORA_PARAMS, const T* up, T* h, int ld, int ld_h, int inter) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<64> tr;
  LORA_ARGS;
  lora::require_smem(lora::Glu<T>::SMEM + 4 * (num_slots + 1));
  lora::expand_glu_task<T, KS>(g, up, h, ld, ld_h, inter, dsmem, reinterpret_cast<int*>(dsmem + lora::Glu<T>::SMEM),
                               tr, blockIdx.x);
}

// lora_chunk (chunk.cuh): a large step's whole delta in one launch, shrink and expand of each
// chunk of BM positions of one slot in the same blocks; 16-bit types, rank widths 16, 64 and 128,
// chunks of 16 (decode buckets), 32 or (rank widths 64 and 128) 64 or 128; SLICED for a fused
// target served whole. Blocks of 128 threads (256 in chunks of 128), registers capped for the
// blocks per multiprocessor its shared memory allows (4; 2 in chunks of 128).
template <typename T, int RW, int BM, bool ALIGNED, bool SLICED>
__global__ void __launch_bounds__(lora::Chunk<T, RW, BM>::NTHREADS, lora::Chunk<T, RW, BM>::BLOCKS_PER_SM)
    lora_chunk(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  // static shared memory: lora::CHUNK_STATIC_SMEM at most (CHUNK_TALL_STATIC_SMEM in chunks of 128)
  __shared__ lora::ChunkRows<BM> tr;
  __shared__ lora::ChunkScan cs;
  __shared__ lora::ChunkWork cw;
  LORA_ARGS;
  // EARLY_READS: the chunks' count and the first item's setup before the wait (chunk_items)
  const bool early = flags & lora::EARLY_READS;
  lora::enter_grid<true>(early);
  g.chunked = 1;
  constexpr int SMEM = lora::Chunk<T, RW, BM>::SMEM + lora::Chunk<T, RW, BM>::SUMS;  // stages, the shrink's sums
  lora::require_smem(SMEM + 4 * (num_slots + 1));
  lora::chunk_task<T, RW, BM, ALIGNED, SLICED>(g, dsmem, reinterpret_cast<int*>(dsmem + SMEM), tr, cs, cw, early);
}

// lora_one (one.cuh): the delta of the capture bucket of one position in clusters of 8 blocks, the
// partial sums of v met in distributed shared memory; every type, rank widths 16, 64 and 128. No
// workspace, no counters; dynamic shared memory for A's share staged before the wait (one_stage_a,
// one_stage_smem bytes; a launch given none reads it from L2). sm_90 only: below it the body traps (the plan
// never launches it there) and the cluster attribute is left out so the source still builds.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define LORA_ONE_CLUSTER __cluster_dims__(lora::ONE_CLUSTER, 1, 1)
#else
#define LORA_ONE_CLUSTER
#endif
template <typename T, int RW, bool ALIGNED>
__global__ void LORA_ONE_CLUSTER __launch_bounds__(128, 1) lora_one(LORA_PARAMS) {
#if __CUDA_ARCH__ >= 900
  LORA_ARGS;
  // EARLY_READS: the addressing, ranks and the first B rows before the wait (and A's share sent
  // towards L2), overlapping the grid before this one
  const bool early = flags & lora::EARLY_READS;
  lora::enter_grid<true>(early);
  extern __shared__ __align__(16) char one_dsmem[];  // one_stage_a's share of A (one_stage_smem bytes)
  __shared__ lora::OneStep st;
  __shared__ float part[lora::ONE_SLICES * RW], vs[lora::ONE_SLICES * RW];
  __shared__ unsigned long long abar;    // one_stage_a's copies land (one_setup's barrier orders its init)
  if constexpr (ALIGNED && sizeof(T) == 2)
    if (early && threadIdx.x == 0) lora::mbar_init(&abar, blockDim.x);
  if (!lora::one_setup(g, st)) {  // the same in every block: a cluster leaves whole
    if (early && blockIdx.x == 0) lora::wait_prior_grid();  // no grid finishes before the one before it
    return;
  }
  lora::OneCol<T, RW, ALIGNED> pc;       // the thread's first columns, in flight through the shrink
  lora::one_prefetch<T, RW, ALIGNED>(g, st, blockIdx.x, gridDim.x, pc);
  const T* sa = nullptr;                 // A's share in shared memory (ALIGNED 16-bit types, early)
  if (early) {
    if constexpr (ALIGNED && sizeof(T) == 2) {
      T* s = reinterpret_cast<T*>(one_dsmem);
      if (lora::one_stage_a<T>(g, st, lora::cluster_rank(), s, &abar)) sa = s;
    }
    if (sa == nullptr) lora::one_prefetch_a<T>(g, st, lora::cluster_rank());
    lora::wait_prior_grid();
  }
  lora::one_prefetch_y<T, RW, ALIGNED>(g, st, blockIdx.x, gridDim.x, pc);
  if (sa != nullptr) lora::mbar_wait(&abar, 0);  // every row of the share has landed
  lora::one_shrink<T, RW, ALIGNED>(g, st, part, lora::cluster_rank(), sa);
  lora::cluster_arrive();  // part written (release) ...
  lora::cluster_wait();    // ... and every block's seen (acquire)
  lora::one_sum<RW>(n_slices, st, vs, [&](int b, int e) { return lora::cluster_load(part, b, e); });
  lora::cluster_arrive();  // done reading the others' part: they may leave once all have said so
  __syncthreads();
  lora::one_expand<T, RW, ALIGNED>(g, st, vs, blockIdx.x, gridDim.x, pc);
  lora::cluster_wait();
#else
  __trap();
#endif
}

// lora_pair (pair.cuh): the decode buckets' delta in two launches, v in ws (added into by the shrink).
// Dynamic shared memory: slot_indptr and the chunks before each slot (2 x (S + 1) ints).
template <typename T, int NS, int RW, bool ALIGNED>
__global__ void __launch_bounds__(lora::PAIR_SW * 32) lora_pair_shrink(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  LORA_ARGS;
  lora::require_smem(8 * (num_slots + 1));
  lora::pair_shrink<T, NS, RW, ALIGNED>(g, reinterpret_cast<int*>(dsmem));
}
template <typename T, int RW, bool ALIGNED>
__global__ void __launch_bounds__(lora::PAIR_EW * 32, 3) lora_pair_expand(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  LORA_ARGS;
  lora::require_smem(8 * (num_slots + 1));
  lora::pair_expand<T, RW, ALIGNED>(g, reinterpret_cast<int*>(dsmem));
}
