// lora_chunk: the whole delta of a large step in one launch, shrink and expand of each chunk of
// one slot in the same blocks, for 16-bit types: a one-slice target, one member of a fused target
// served into its own output, or a fused target (q/k/v, gate/up) whose slices' columns start on
// its column blocks (multiples of BN). Included by lora_mma.cu (it uses Args, ChunkScan,
// count_chunks and locate_chunk from there, add_word from expand_stream.cuh).
//
// Why: an unfused large step runs lora_shrink, then lora_expand_ring, and each streams its bytes
// at 1.7-1.9 TB/s (NOTES.md): the second waits for the whole first, and neither alone keeps
// enough bytes in flight. Here every block streams x and A, then y and B, so the device reads x of
// some chunks while it writes y of others, and the y and B of a block's first column blocks are
// in flight while it waits for its chunk's v.
//
// Algebra (for each slice j with columns [c_lo_j, c_hi_j) = [out_offsets[j], out_offsets[j + 1]),
// r_j = ranks[s, j]; positions p of a chunk of slot s, t = token_order[p]):
//   v[p, j, :r_j] = sum over parts q of x[t, K_q] @ A[s, j, :r_j, K_q].T      (fp32, in ws)
//   y[t, c]      += round(scaling[s, j] * v[p, j, :r_j]) @ B[s, c, :r_j].T    (c in [c_lo_j, c_hi_j))
// Work: the step's chunks (each slot's positions cut into pieces of at most BM from its start, as
// lora_fused's chunks; BM is the instantiation's: 16 up to the plan's CHUNK_NARROW_TO positions,
// where a chunk holds a few, 32, or at rank widths above 16 64 from the plan's CHUNK_WIDE_FROM
// positions and 128 from its CHUNK_TALL_FROM, so a wide A and B are read once for 64 or 128 rows)
// times P parts,
// P = chunk_parts: as many as fill the grid (one wave of blocks) for the chunks the step has, at
// most `splits`. Part q of chunk c takes an equal share of `in` (stages of KC) and of the column
// blocks with columns (BN columns, counted from column 0; each in one slice):
//   1. shrink: passes (slice, rank block of RB ranks) over its share of `in`, every slice with
//      columns and a rank, all in one ring of cp.async stages of x rows and A rows (rows up to the
//      block's ranks rounded up to 16, zero past them), WARPS warps (4; 8 in chunks of 128): warp
//      w holds m-tile w % MT and k-steps w / MT, w / MT + WK, ... of each stage (MT = BM / 16
//      m-tiles, WK = WARPS / MT warps on each); at a pass's last stage its sums (ranks below the
//      slice's only: 0 * inf stays out of v) are added into v with 8-byte red.add (where WK > 1
//      the WK warps of an m-tile first sum theirs in shared memory past the stages and one of them
//      adds: a quarter of the reductions at chunks of 16, half at 32); then the part counts itself
//      into the chunk's ready count. A warp whose m-tile lies past the chunk's rows (a slot's last,
//      short chunk) runs no MMA, here or in the expand.
//      One slice at rank width 64 in chunks of 32 whose parts are even (chunk_shrink_rs): part q sums
//      half the ranks (half q % 2) over share q / 2 of `in` cut in parts / 2, so each element of v
//      takes half the adds (RSPLIT).
//   2. expand: steps (column block, rank block; rank blocks past the block's slice's rank are
//      empty). The first STAGES - 1 steps' y tiles (whole 16-byte pieces of BM rows, at a column
//      block's first step, in a ring of their own) and B tiles (BN columns x the rank block's
//      ranks rounded up to 16, zero past the rank and outside the slice) are issued, then the
//      part waits for all parts' v, reads its first slice's v * scaling into registers as MMA
//      fragments (ranks permuted inside each k-step as common.cuh's global fragments; B read with
//      the same permutation; the next slice's at its first column block), and walks its steps: at
//      a column block's last, warp w adds rows of m-tile w % MT x its WK-th w / MT of the columns
//      into the y tile (fp32, rounded once; an element whose delta is exactly zero keeps its bits)
//      and writes them back. On sm_90 where y's pieces are whole the ring carries no y tile: y's
//      lines are sent towards L2 where it would have, and the warp writes its sums alone into the
//      tile, rounded (an exact zero as -0), and adds them into y at L2 by 16-byte reductions
//      (red_add8), so no step's copies wait on y and no y tile is read back.
//   3. each part counts its reads of v done (one slice: once its fragments hold v, before its
//      column blocks, so the count's release waits on no add into y; several slices: at its end);
//      the last part to count zeroes v (each slice's ranks rounded up to 16) and resets the chunk's
//      counts at its end; where items went by ticket, the last block to finish resets the ticket.
// Grid (1-D, 128 threads; 256 in chunks of 128, 2 blocks a multiprocessor): one wave of blocks
// (the plan's, a function of the capture bucket and the slot count only: graph-safe; as many as
// its shared memory leaves resident). Where the grid
// holds the step's items (chunk, part), block b takes item b (chunk-major) and no other, no block
// takes part in a done count, and the blocks past the items leave after counting the chunks.
// Where it does not (a step of more chunks than one wave takes), block b takes item b first, then
// items past the grid by ticket, in order, until the step's are gone. A part waits only for the
// other parts of its chunk: the first items all run at once, and past the grid every chunk but
// the last one handed out has all its parts handed out, so at most P - 1 blocks wait on items not
// yet taken while the others run on and take them (P is at most `splits`, far below the grid).
// With EARLY_READS the chunks' count and the first item's setup (addressing, ranks, scalings,
// offsets) run before the wait for the grid before (chunk_items). With or without it, every block
// lets the next grid start at once (lora_chunk's enter_grid<true>).
// Counters: [0] ticket, [1] done, [2, 2 + units) ready, [2 + units, 2 + 2 units) v readers done
// (units as Args::units(16) with chunked set: the most chunks of 16 a step can have, so taller
// chunks use the first of them). ws: v [bucket, n, rw] f32, zero before and after.
// RW: the pool's rank width (16; 64 for ranks 17-64; 128 for 65-128); stages sized for its rank
// block RB (16, or 64: a rank-128 pool's adapters above rank 64 take two), loops bounded by each
// slot's own rank, so a rank-128 pool's rank-16 adapters run as a rank-64 pool's do.
// SLICED: the instantiation for several slices with columns (a fused target served whole: the pass
// table, each column block's slice lookup, v reloaded at a slice change). The other serves one
// slice with columns (found by a ballot in the setup) with all of that compiled out, and at rank
// widths 16 and 64 (a rank fits one rank block) with one pass and one rank block a column block.
// WG (chunks of 64 and 128 at rank width 64, compiled for sm_90a: kernels.py builds for sm_90a on Hopper):
// each warpgroup (the 4 warps of a chunk of 64, 4 of the 8 of a chunk of 128) takes 64 rows and runs
// warpgroup MMAs (wgmma.m64n64k16): the shrink with x and A from shared memory, the expand with v from
// registers (its fragments in rank order, as wgmma reads B) and B from shared memory; the stage tiles it
// reads are laid out as wgmma's core matrices (Chunk::at), the 16-byte copies unchanged but for their
// addresses. The accumulators keep mma.sync's layout, so the adds into v and the y tiles' epilogue are the
// same code. Compiled for anything else (sm_90, sm_80, the host check), these chunks run on mma.sync.
#pragma once

// The wide and tall chunks' MMAs as warpgroup MMAs (wgmma, an sm_90a instruction): built where the
// compile targets sm_90a, else the same chunks run on mma.sync.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LORA_WGMMA 1
#else
#define LORA_WGMMA 0
#endif

namespace lora {

#if LORA_WGMMA
// A shared-memory operand of wgmma (no swizzle): 8 x 16-byte core matrices, `lbo` bytes apart along
// k, `sbo` bytes apart along m / n.
__device__ __forceinline__ unsigned long long wg_desc(const void* smem, unsigned lbo, unsigned sbo) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The accumulators pinned in place around the asynchronous MMAs.
__device__ __forceinline__ void wg_pin(float (&d)[8][4]) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[n][i])::"memory");
}
#define LORA_WG_D(d)                                                                                             \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),       \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),   \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),   \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),   \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define LORA_WG_REGS                                                                                             \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "   \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
template <typename M> struct WgBf16 { static constexpr bool value = false; };
template <> struct WgBf16<__nv_bfloat16> { static constexpr bool value = true; };
// d (64 x 64 of the warpgroup, the layout of 8 mma.sync n-tiles a warp) += A (smem) * B (smem)^T, k 16
template <typename M>
__device__ __forceinline__ void wg_mma_ss(float (&d)[8][4], unsigned long long da, unsigned long long db) {
  if constexpr (WgBf16<M>::value)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LORA_WG_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : LORA_WG_D(d) : "l"(da), "l"(db), "r"(1));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " LORA_WG_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : LORA_WG_D(d) : "l"(da), "l"(db), "r"(1));
}
// d += A (registers: the mma.sync A fragment of the warp's 16 rows) * B (smem)^T, k 16
template <typename M>
__device__ __forceinline__ void wg_mma_rs(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db) {
  if constexpr (WgBf16<M>::value)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LORA_WG_REGS
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : LORA_WG_D(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " LORA_WG_REGS
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : LORA_WG_D(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif

template <typename T, int RW, int BM_>
struct Chunk {
  static_assert(sizeof(T) == 2, "lora_chunk serves 16-bit types");
  static_assert(RW == 16 || RW == 64 || RW == 128, "lora_chunk is built for rank widths 16, 64 and 128");
  static_assert(BM_ == 16 || BM_ == 32 || ((BM_ == 64 || BM_ == 128) && RW > 16),
                "chunks of 16 or 32 positions, or 64 or 128 at rank widths above 16");
  static constexpr int STAGES = 3, CH = 8;           // 16-byte pieces of 8
  static constexpr int BM = BM_;                     // positions a chunk (A and B read once a chunk)
  // warps a block: 4, or 8 in chunks of 128 (a warp an m-tile, each warp's registers as in chunks of 64)
  static constexpr int WARPS = BM == 128 ? 8 : 4, NTHREADS = 32 * WARPS;
  static constexpr int BLOCKS_PER_SM = BM == 128 ? 2 : 4;  // the launch bounds: what the stages leave
  static constexpr int MT = BM / 16, WK = WARPS / MT;  // m-tiles; warps sharing one
  static constexpr int KC = RW <= 16 ? 128 : 64;     // features a shrink stage
  static constexpr int BN = RW <= 16 ? 128 : 64;     // columns an expand stage
  static constexpr int RB = RW <= 16 ? 16 : 64;      // ranks of an A or B tile: a rank block
  static constexpr int NT = BN / (8 * WK);           // n-tiles of a warp's share of a column block
  static constexpr int KSTEPS = KC / 16;             // k-steps of a shrink stage
  // rows padded by 8 elements (16 bytes): a warp's 4-byte fragment reads fall in distinct banks
  static constexpr int LDX = KC + 8, LDA = KC + 8, LDY = BN + 8, LDB = RB + 8;
  static constexpr int X_BYTES = BM * LDX * 2, A_BYTES = RB * LDA * 2;
  static constexpr int Y_BYTES = BM * LDY * 2, B_BYTES = BN * LDB * 2;
  static constexpr int S_STAGE = X_BYTES + A_BYTES, E_STAGE = Y_BYTES + B_BYTES;
  static constexpr int STAGE = S_STAGE > E_STAGE ? S_STAGE : E_STAGE;
  static constexpr int SMEM = STAGES * STAGE;
  // the ticket launch's sums of the warps sharing an m-tile (chunk_shrink), past the stages: the
  // WK - 1 warps but the first of each m-tile, RB / 8 n-tiles of 4 floats a lane each
  static constexpr int SUMS = WK > 1 ? MT * (WK - 1) * (RB / 8) * 4 * 32 * 4 : 0;
  // the shrink's rank split (one slice at rank width 64 in chunks of 32; chunk_shrink_rs): where a
  // chunk's parts are a multiple of RSPLIT, part q sums ranks (q % RSPLIT) * RBS + [0, RBS) of v over
  // RSPLIT times the share of `in` it would take, so each element of v takes 1 / RSPLIT of the adds
  static constexpr int RSPLIT = RW == 64 && BM_ == 32 ? 2 : 1, RBS = RB / RSPLIT;
  // chunks of 64 and 128 at rank width 64 on warpgroup MMAs (sm_90a): each warpgroup of 4 warps takes 64
  // rows (its warps' m-tiles, as on mma.sync) and every tile an MMA reads from shared memory (x, A, B) is
  // laid out as wgmma's core matrices (8 rows x 16 bytes), WG_LBO bytes apart along k (128 and 16 of
  // padding, so the 8 pieces of a row that 8 neighbouring threads copy fall in distinct banks) and WG_SBO
  // along rows: the padded rows' bytes
  static constexpr bool WG = LORA_WGMMA && BM_ >= 64 && RW == 64;
  static constexpr int WG_LBO = 144, WG_SBO = 8 * WG_LBO;
  // element (row, k) of a stage's tile: rows of ld elements, or (WG; k below 64) core matrices
  static __device__ __forceinline__ int at(int row, int k, int ld) {
    return WG ? (row >> 3) * (WG_SBO / 2) + (k >> 3) * (WG_LBO / 2) + (row & 7) * 8 + (k & 7) : row * ld + k;
  }
};

// The largest share of B a lora_chunk part reads through L1 (16-bit elements, its column blocks x the
// pool's rank width): a larger share goes through L2 only (cp_async16_l2). At rank width 64 that
// measured faster at 112 KB (4096->14336 at T = 1024) and 64 KB (chunks of 128 at T = 4096), slower
// at 16-32 KB (4096 outputs at T = 64-1024; NOTES.md, "Wide B through L2 only").
constexpr int CHUNK_B_L1_MAX = 48 * 1024;

// Every kernel's ready and reader counts are sized for chunks of 16 positions (the most a step can
// have); a step cut into taller chunks uses the first of them.
constexpr int CHUNK_UNIT_BM = 16;

// A block's chunk's token rows (64 entries up to chunks of 64: the static shared memory of every
// height up to 64 is one size).
template <int BM>
struct ChunkRows {
  int tok[BM > 64 ? BM : 64];
};

// One block's chunk: slot, first position and rows (from locate_chunk); each slice's rank,
// scaling and columns; the shrink's passes and the column blocks with columns.
struct ChunkWork {
  int slot, p0, m;
  int j;                            // the slice with columns (an instantiation of one slice: SLICED false)
  int r[MAX_SLICES];                // each slice's rank at this slot (0 for a slice without columns)
  float sc[MAX_SLICES];             // its scaling
  int lo[MAX_SLICES], hi[MAX_SLICES];  // its columns
  int cb_lo, cb_hi;                 // the column blocks with columns
  int passes, nrb;                  // shrink passes (slice, rank block); rank blocks of the widest slice
  int pass_j[2 * MAX_SLICES], pass_rb[2 * MAX_SLICES];  // each pass's slice and first rank
};

// Parts a chunk is cut into for a step of `chunks` chunks on a grid of `blocks`: as many as fill
// the grid, at most `splits`.
template <typename T>
__device__ __forceinline__ int chunk_parts(const Args<T>& g, int chunks, int blocks) {
  return max(1, min(g.splits, blocks / max(chunks, 1)));
}

// The slice with columns in column block cb: the only one where several slices have columns
// (their boundaries are multiples of BN, the plan's condition), else the one slice with columns.
template <int BN>
__device__ __forceinline__ int chunk_slice(const ChunkWork& cw, int n, int cb) {
  for (int k = 0; k < n; ++k)
    if (cw.lo[k] < (cb + 1) * BN && cw.hi[k] > cb * BN) return k;
  return 0;
}

// Chunk c of the step (c < cs.chunks, after count_chunks) and what its parts need of the weights:
// each slice's rank, scaling and columns (thread j reads slice j's), then the shrink's passes
// (one per rank block of each slice with columns and a rank) and the column blocks. Every thread
// calls.
template <typename T, int RW, int BM, bool SLICED>
__device__ void chunk_setup(const Args<T>& g, const int* s_indptr, ChunkRows<BM>& tr, ChunkScan& cs, ChunkWork& cw,
                            int c) {
  constexpr int BN = Chunk<T, RW, BM>::BN, RB = Chunk<T, RW, BM>::RB;
  locate_chunk<BM>(cs, s_indptr, g.num_slots, g.positions, c);
  const int tid = threadIdx.x, n = g.n_slices, s = cs.chunk[2];
  if (tid < BM) tr.tok[tid] = tid < cs.chunk[1] ? g.token_order[cs.chunk[0] + tid] : -1;
  if constexpr (!SLICED) {
    // one slice with columns: warp 0 finds it by ballot (slice 0 where none has, at rank 0), and
    // its thread writes everything the parts need; one barrier
    if (tid < 32) {
      const bool mine = tid < n;
      int lo = 0, hi = g.out_features, r = 0;
      float sc = 0.f;
      if (mine) {
        if (g.out_offsets != nullptr) {
          lo = g.out_offsets[tid];
          hi = min(g.out_offsets[tid + 1], g.out_features);
        }
        r = min(g.ranks[s * n + tid], g.rank_cap());
        sc = g.scaling[s * n + tid];
      }
      const unsigned live = __ballot_sync(0xffffffffu, mine && hi > lo);
      if (tid == (live ? __ffs(live) - 1 : 0)) {
        r = hi > lo ? r : 0;
        cw.j = tid;
        cw.lo[tid] = lo;
        cw.hi[tid] = hi;
        cw.r[tid] = r;
        cw.sc[tid] = sc;
        cw.slot = s;
        cw.p0 = cs.chunk[0];
        cw.m = cs.chunk[1];
        cw.passes = (r + RB - 1) / RB;
        cw.nrb = max(1, cw.passes);
        cw.cb_lo = hi > lo ? lo / BN : 0;
        cw.cb_hi = hi > lo ? (hi + BN - 1) / BN : 0;
      }
    }
    __syncthreads();
    return;
  }
  if (tid < n) {
    int lo = 0, hi = g.out_features;
    if (g.out_offsets != nullptr) {
      lo = g.out_offsets[tid];
      hi = min(g.out_offsets[tid + 1], g.out_features);
    }
    cw.lo[tid] = lo;
    cw.hi[tid] = hi;
    cw.r[tid] = hi > lo ? min(g.ranks[s * n + tid], g.rank_cap()) : 0;
    cw.sc[tid] = g.scaling[s * n + tid];
  }
  if (tid == 0) {
    cw.slot = s;
    cw.p0 = cs.chunk[0];
    cw.m = cs.chunk[1];
  }
  __syncthreads();
  if (tid == 0) {
    int passes = 0, nrb = 1, lo = g.out_features, hi = 0;
    for (int j = 0; j < n; ++j) {
      if (cw.hi[j] <= cw.lo[j]) continue;
      lo = min(lo, cw.lo[j]);
      hi = max(hi, cw.hi[j]);
      const int rb = (cw.r[j] + RB - 1) / RB;
      nrb = max(nrb, rb);
      for (int k = 0; k < rb; ++k, ++passes) {
        cw.pass_j[passes] = j;
        cw.pass_rb[passes] = k * RB;
      }
    }
    cw.passes = passes;
    cw.nrb = nrb;
    cw.cb_lo = hi > lo ? lo / BN : 0;
    cw.cb_hi = hi > lo ? (hi + BN - 1) / BN : 0;
  }
  __syncthreads();
}

// One stage of a shrink's ring: x's rows of the chunk's tokens ([0, m); zero past them) and A's rows
// [0, r16) (a rank block, or a part's window of one; zero past r), features f0 + [0, KC) (zero past
// `in`), into sx and sa: 16-byte copies where `vec`, element by element otherwise. Every thread of
// the block calls; the caller commits.
template <typename C, int AROWS, typename T, typename Rows>
__device__ __forceinline__ void chunk_copy_stage(const Args<T>& g, const Rows& tr, T* sx, T* sa, const T* A, int f0,
                                                 int m, int r, int r16, bool vec) {
  constexpr int BM = C::BM, KC = C::KC, CH = C::CH, NTH = C::NTHREADS;
  constexpr int XPR = KC / CH, XPT = BM * XPR / NTH, XROWS = NTH / XPR;  // x pieces
  constexpr int APT = (AROWS * XPR + NTH - 1) / NTH;                      // A pieces
  const int tid = threadIdx.x, in = g.in_features, pc = (tid % XPR) * CH, pr0 = tid / XPR;
  if (vec) {
    const int bytes = min(max(in - (f0 + pc), 0), CH) * 2;
#pragma unroll
    for (int i = 0; i < XPT; ++i) {  // token rows from shared memory: no registers held across stages
      const int row = pr0 + i * XROWS;
      const bool ok = row < m && bytes > 0;
      cp_async16(sx + C::at(row, pc, C::LDX), ok ? g.x + (size_t)tr.tok[row] * in + f0 + pc : g.x, ok ? bytes : 0);
    }
#pragma unroll
    for (int i = 0; i < APT; ++i) {
      const int row = pr0 + i * XROWS;
      if (row < r16) {
        const bool ok = row < r && bytes > 0;
        cp_async16(sa + C::at(row, pc, C::LDA), ok ? A + (size_t)row * in + f0 + pc : g.A, ok ? bytes : 0);
      }
    }
  } else {
    for (int e = tid; e < BM * KC; e += NTH) {
      const int row = e / KC, k = e % KC;
      sx[C::at(row, k, C::LDX)] = row < m && f0 + k < in ? g.x[(size_t)tr.tok[row] * in + f0 + k] : from_float<T>(0.f);
    }
    for (int e = tid; e < r16 * KC; e += NTH) {
      const int row = e / KC, k = e % KC;
      sa[C::at(row, k, C::LDA)] = row < r && f0 + k < in ? A[(size_t)row * in + f0 + k] : from_float<T>(0.f);
    }
  }
}

// A shrink stage's MMAs into a warp's sums: m-tile mt (none past the chunk's m rows), k-steps kq,
// kq + WK, ... of the stage, n-tiles below nts of its A rows.
template <typename C, int NTS, typename T>
__device__ __forceinline__ void chunk_stage_mmas(float (&acc)[NTS][4], const T* sx, const T* sa, int mt, int kq, int m,
                                                 int nts, int gq, int tq) {
  using M = typename Op<T>::type;
#pragma unroll
  for (int kk = kq; kk < C::KSTEPS; kk += C::WK) {
    if (mt * 16 >= m) break;  // an m-tile past the chunk's rows: nothing to sum
    Frags<M, false, T> fa;
    fa.load_a(sx, C::LDX, mt * 16, kk * 16, gq, tq, 1.f);
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) {
      if (nt < nts) {
        Frags<M, false, T> fb;
        fb.load_b(sa, C::LDA, nt * 8, kk * 16, gq, tq);
        mma_frags<M, false, false>(acc[nt], fa, fb);
      }
    }
  }
}

// A shrink stage on warpgroup MMAs (Chunk::WG): warpgroup warp / 4 sums its 64 rows (none where they
// all lie past the chunk's m rows) over the stage's KC features into acc, as 8 n-tiles of the warp's
// m-tile (the mma.sync layout). Every thread calls.
template <typename C, typename T>
__device__ __forceinline__ void chunk_stage_wg(float (&acc)[8][4], const T* sx, const T* sa, int warp, int m) {
#if LORA_WGMMA
  using M = typename Op<T>::type;
  const int w0 = (warp >> 2) * 64;
  if (w0 >= m) return;  // the same in the warpgroup's 4 warps
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < C::KSTEPS; ++kk)
    wg_mma_ss<M>(acc, wg_desc(sx + C::at(w0, 16 * kk, C::LDX), C::WG_LBO, C::WG_SBO),
                  wg_desc(sa + C::at(0, 16 * kk, C::LDA), C::WG_LBO, C::WG_SBO));
  wg_commit();
  wg_wait0();
  wg_pin(acc);
#endif
}

// The WK warps of m-tile mt meet: warps kq > 0 leave their sums in shared memory past the stages
// (C::SUMS bytes) and start again at zero; after one barrier warp kq = 0 adds them to its own.
// Every thread calls.
template <typename C, int NTS>
__device__ __forceinline__ void chunk_block_sum(float (&acc)[NTS][4], char* dsmem, int mt, int kq, int lane) {
  float* sum = reinterpret_cast<float*>(dsmem + C::SMEM) + mt * (C::WK - 1) * NTS * 4 * 32 + lane;
  if (kq > 0) {
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sum[((kq - 1) * NTS * 4 + nt * 4 + i) * 32] = acc[nt][i];
        acc[nt][i] = 0.f;
      }
  }
  __syncthreads();
  if (kq == 0) {
    for (int k = 0; k < C::WK - 1; ++k)
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] += sum[(k * NTS * 4 + nt * 4 + i) * 32];
  }
}

// A warp's sums of ranks [0, r) (n-tiles below nts; ranks below r only: 0 * inf stays out of v) of
// its m-tile's rows below m, added into vb (rows `stride` apart) with 8-byte reductions; then the
// sums start again at zero.
template <int NTS>
__device__ __forceinline__ void chunk_add_into_v(float (&acc)[NTS][4], float* vb, size_t stride, int mt, int m, int r,
                                                 int nts, int gq, int tq) {
#pragma unroll
  for (int nt = 0; nt < NTS; ++nt) {
    const int col = nt * 8 + 2 * tq;
    if (nt < nts && col < r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + gq + 8 * h;
        if (row >= m) continue;
        red_add2(vb + row * stride + col, acc[nt][2 * h], col + 1 < r ? acc[nt][2 * h + 1] : 0.f);
      }
    }
    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  }
}

// Part q of `parts` (a multiple of RSPLIT) of a one-slice chunk: ranks (q % RSPLIT) * RBS + [0, RBS)
// of v over stage share q / RSPLIT of `in` (the ring and stages of chunk_shrink, RBS rows of A a
// stage), then the part's count, as chunk_shrink. A part whose ranks all lie past the slot's rank
// copies and adds nothing. On an H100 0.4-0.9 us faster than chunk_shrink at 256 and 1024 positions
// (NOTES.md, "lora_chunk's ring and heights at rank 64"; a quarter of the ranks a part: slower).
template <typename T, int RW, int BM_, bool ALIGNED>
__device__ void chunk_shrink_rs(const Args<T>& g, char* dsmem, const ChunkRows<BM_>& tr, const ChunkWork& cw, int c,
                                int q, int parts) {
  using C = Chunk<T, RW, BM_>;
  constexpr int KCS = C::KC, STAGES = C::STAGES, RS = C::RSPLIT;
  constexpr int RBS = C::RBS, NTS = RBS / 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int in = g.in_features, nk = (in + KCS - 1) / KCS, kparts = parts / RS, rq = q % RS;
  const int per = (nk + kparts - 1) / kparts, k0 = (q / RS) * per, nkp = max(min(k0 + per, nk) - k0, 0);
  const int m = cw.m, j = cw.j, rlo = rq * RBS;
  const int rr = min(min(cw.r[j], C::RB) - rlo, RBS);        // this part's ranks below the slot's
  const int r16 = rr > 0 ? min((rr + 15) & ~15, RBS) : 0;    // rows of A copied (zero past rr)
  const int total = rr > 0 ? nkp : 0, nts = r16 / 8;
  const bool vec = ALIGNED || (g.flags & 1);
  const T* A = g.A + (((size_t)cw.slot * g.n_slices + j) * g.max_rank + rlo) * (size_t)in;
  auto x_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + st * C::STAGE); };
  auto a_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + st * C::STAGE + C::X_BYTES); };
  auto load = [&](int f, int st) {
    if (f < total) chunk_copy_stage<C, RBS>(g, tr, x_tile(st), a_tile(st), A, (k0 + f) * KCS, m, rr, r16, vec);
    cp_async_commit();
  };

  const int mt = warp % C::MT, kq = warp / C::MT;
  float acc[NTS][4];
#pragma unroll
  for (int nt = 0; nt < NTS; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) load(st, st);
  for (int f = 0; f < total; ++f) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage f has landed for every thread; stage f - 1 is free
    load(f + STAGES - 1, (f + STAGES - 1) % STAGES);
    chunk_stage_mmas<C>(acc, x_tile(f % STAGES), a_tile(f % STAGES), mt, kq, m, nts, gq, tq);
  }
  if (total > 0) {
    // the warps of an m-tile meet in shared memory past the stages; warp kq = 0 adds into v
    if constexpr (C::WK > 1) chunk_block_sum<C>(acc, dsmem, mt, kq, lane);
    if (kq == 0)
      chunk_add_into_v(acc, g.ws + ((size_t)cw.p0 * g.n_slices + j) * g.rw + rlo, (size_t)g.n_slices * g.rw, mt, m, rr,
                       nts, gq, tq);
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread's adds issued; one fence after it (as chunk_shrink above 16 ranks)
  if (tid == 0) {
    __threadfence();
    atomicAdd(g.counters + 2 + c, 1);
  }
}

// Part q of `parts`: its shrink into v, then its count into the chunk's ready count. Its stages
// run through the passes (slice, rank block) in one ring: pass p's share of `in`, then p + 1's, a
// pass's sums added into v as its last stage is done.
template <typename T, int RW, int BM_, bool ALIGNED, bool SLICED>
__device__ void chunk_shrink(const Args<T>& g, char* dsmem, const ChunkRows<BM_>& tr, const ChunkWork& cw, int c, int q,
                             int parts) {
  using C = Chunk<T, RW, BM_>;
  if constexpr (C::RSPLIT > 1 && !SLICED) {
    if (parts % C::RSPLIT == 0) {
      chunk_shrink_rs<T, RW, BM_, ALIGNED>(g, dsmem, tr, cw, c, q, parts);
      return;
    }
  }
  constexpr int KC = C::KC, STAGES = C::STAGES, NTS = C::RB / 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int in = g.in_features, nk = (in + KC - 1) / KC, per = (nk + parts - 1) / parts;
  const int k0 = q * per, nkp = max(min(k0 + per, nk) - k0, 0), total = nkp * cw.passes, m = cw.m;
  const bool vec = ALIGNED || (g.flags & 1);
  // one slice at rank widths 16 and 64: one pass (its rank fits one rank block), stage f is f
  constexpr bool ONE_PASS = !SLICED && RW <= C::RB;
  // warps sharing an m-tile: at a pass's end their sums meet in shared memory past the stages
  // (C::SUMS bytes), and one warp an m-tile adds them into v
  constexpr bool BLOCK_SUM = C::WK > 1;
  auto x_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + st * C::STAGE); };
  auto a_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + st * C::STAGE + C::X_BYTES); };
  // stage f: pass f / nkp (its rank block's ranks r below the slice's rank, rows up to r16 copied),
  // stage k0 + f % nkp of `in`
  auto load = [&](int f, int st) {
    if (f < total) {
      const int p = ONE_PASS ? 0 : f / nkp, j = SLICED ? cw.pass_j[p] : cw.j;
      const int rb0 = SLICED ? cw.pass_rb[p] : p * C::RB;
      const int r = min(cw.r[j] - rb0, C::RB), r16 = (r + 15) & ~15;
      const T* A = g.A + (((size_t)cw.slot * g.n_slices + j) * g.max_rank + rb0) * (size_t)in;
      chunk_copy_stage<C, C::RB>(g, tr, x_tile(st), a_tile(st), A, (k0 + (ONE_PASS ? f : f % nkp)) * KC, m, r, r16,
                                 vec);
    }
    cp_async_commit();
  };

  const int mt = warp % C::MT, kq = warp / C::MT;
  const size_t stride = (size_t)g.n_slices * g.rw;
  float acc[NTS][4];  // ranks rb0 + [0, RB) of this warp's m-tile, for the pass under way
#pragma unroll
  for (int nt = 0; nt < NTS; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  // this warp's partial sums of slice j's ranks rb0 + [0, r) into v, then the sums start again
  auto add_into_v = [&](int j, int rb0, int r, int nts) {
    chunk_add_into_v(acc, g.ws + ((size_t)cw.p0 * g.n_slices + j) * g.rw + rb0, stride, mt, m, r, nts, gq, tq);
  };
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) load(st, st);
  for (int f = 0; f < total; ++f) {
    cp_async_wait<STAGES - 2>();
#if LORA_WGMMA
    if constexpr (C::WG) fence_proxy_async();  // the stage's copies seen by the MMAs' reads
#endif
    __syncthreads();  // stage f has landed for every thread; stage f - 1 is free
    load(f + STAGES - 1, (f + STAGES - 1) % STAGES);
    const int p = ONE_PASS ? 0 : f / nkp, j = SLICED ? cw.pass_j[p] : cw.j;
    const int rb0 = SLICED ? cw.pass_rb[p] : p * C::RB;
    const int r = min(cw.r[j] - rb0, C::RB), nts = ((r + 15) & ~15) / 8;
    if constexpr (C::WG)
      chunk_stage_wg<C>(acc, x_tile(f % STAGES), a_tile(f % STAGES), warp, m);
    else
      chunk_stage_mmas<C>(acc, x_tile(f % STAGES), a_tile(f % STAGES), mt, kq, m, nts, gq, tq);
    if ((ONE_PASS ? f : f % nkp) != nkp - 1) continue;
    // the pass's last stage (the same f in every warp)
    if constexpr (BLOCK_SUM) {
      // warps kq > 0 of an m-tile leave their sums in shared memory; after one barrier warp kq = 0
      // adds them to its own and into v. The next pass's sums are written after the next
      // iteration's barrier, which warp kq = 0 reaches only once it has read these.
      chunk_block_sum<C>(acc, dsmem, mt, kq, lane);
      if (kq == 0) add_into_v(j, rb0, r, nts);
    } else {
      add_into_v(j, rb0, r, nts);
    }
  }
  cp_async_wait<0>();
  // every thread's sums issued (and fenced), and the stages free for the expand; then the count. At
  // rank widths above 16 (16 KB of adds a part in chunks of 64) only one thread fences, after the
  // barrier (which orders the other threads' adds before it: the release pattern of a grid
  // barrier), so the other warps go on to the expand's first loads; at rank width 16 every thread
  // fences before it. Each was faster where it is used, by 0.1-0.5 and 0.3-1.0 us on an H200
  // (NOTES.md, "One fence a part").
  constexpr bool ONE_FENCE = RW > 16;
  if constexpr (!ONE_FENCE) __threadfence();
  __syncthreads();
  if (tid == 0) {
    if constexpr (ONE_FENCE) __threadfence();
    atomicAdd(g.counters + 2 + c, 1);
  }
}

// Part q's expand of its column blocks, after all `parts` parts of chunk c have added into v;
// then the chunk's v released (the last part to finish zeroes it and resets the chunk's counts).
template <typename T, int RW, int BM_, bool ALIGNED, bool SLICED>
__device__ void chunk_expand(const Args<T>& g, char* dsmem, const ChunkRows<BM_>& tr, const ChunkWork& cw, int c, int q,
                             int parts) {
  using C = Chunk<T, RW, BM_>;
  using M = typename Op<T>::type;
  constexpr int BM = C::BM, BN = C::BN, STAGES = C::STAGES, CH = C::CH, NT = C::NT, RB = C::RB, NTH = C::NTHREADS;
  constexpr int KS = RW / 16, KPB = RB / 16;                                     // k-steps of v; of a rank block
  constexpr int YPR = BN / CH, YPT = BM * YPR / NTH, YROWS = NTH / YPR;  // y pieces
  constexpr int BPR = RB / CH, BPT = BN * BPR / NTH, BROWS = NTH / BPR;  // B pieces
  __shared__ int last_reader;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int out = g.out_features, n = g.n_slices, m = cw.m;
  const int cbA = cw.cb_lo, cbZ = cw.cb_hi, per = (cbZ - cbA + parts - 1) / parts;
  const int cb0 = cbA + q * per, cb1 = min(cb0 + per, cbZ);
  // steps: (column block, rank block), nrb rank blocks each (those past its slice's rank empty);
  // one slice at rank widths 16 and 64: one rank block, a step a column block
  constexpr bool ONE_RB = !SLICED && RW <= RB;
  const int nrb = ONE_RB ? 1 : cw.nrb, steps = max(cb1 - cb0, 0) * nrb;
  // the slice of column block cb: the one slice's, or (several) the one with columns there
  auto slice_of = [&](int cb) { return SLICED ? chunk_slice<BN>(cw, n, cb) : cw.j; };
  const bool vec_y = ALIGNED || (g.flags & 4), vec_b = ALIGNED || (g.flags & 2);
  // y's sums added into y at L2 (red_add8) where its 16-byte pieces are whole, so the ring carries no y
  // tile, only y's lines sent towards L2 where it would have (NOTES.md, "y added at L2 by lora_chunk")
  const bool red_y = RED_Y && vec_y;
  // y tiles in a ring of their own (a column block's tile lives through its rank blocks' steps),
  // slot (column block - cb0) % STAGES, beside the B ring's stage of the same index
  auto y_tile = [&](int vis) { return reinterpret_cast<T*>(dsmem + (vis % STAGES) * C::STAGE); };
  auto b_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + st * C::STAGE + C::Y_BYTES); };
  const int yc = (tid % YPR) * CH, yr0 = tid / YPR;
  const int bk = (tid % BPR) * CH, br0 = tid / BPR;
  const T* bs = g.B + (size_t)cw.slot * g.b_slot;
  // B through L2 only where the part's share of it (its column blocks at the pool's rank width)
  // passes CHUNK_B_L1_MAX: measured faster there, slower through L2 only below it
  const bool b_l2 = RW > 16 && (cb1 - cb0) * BN * RW * (int)sizeof(T) > CHUNK_B_L1_MAX;
  auto load = [&](int step, int st) {
    const int vis = ONE_RB ? step : step / nrb, rb0 = ONE_RB ? 0 : (step % nrb) * RB, c0 = (cb0 + vis) * BN;
    const int j = slice_of(cb0 + vis), r = cw.r[j];
    if (step < steps && rb0 < r) {  // else nothing to add: no y tile, no B
      const int rr = min(r - rb0, RB), rr16 = (rr + 15) & ~15;  // this rank block's ranks
      T* sy = y_tile(vis);
      T* sb = b_tile(st);
      if (rb0 > 0) {  // the column block's y tile came with its first rank block
      } else if (red_y) {  // y is added at L2 (below): its lines sent there now, STAGES - 1 steps ahead
        constexpr int LE = 128 / (int)sizeof(T), LINES = (BN + LE - 1) / LE;  // a row's 128-byte lines
        for (int e = tid; e < BM * LINES; e += NTH) {
          const int row = e / LINES, col = (e % LINES) * LE;
          if (row < m && c0 + col < out) prefetch_l2(g.y + (size_t)tr.tok[row] * out + c0 + col);
        }
      } else if (vec_y) {
        const bool in = c0 + yc < out;
#pragma unroll
        for (int i = 0; i < YPT; ++i) {  // token rows from shared memory: no registers held across steps
          const int row = yr0 + i * YROWS;
          if (row < m && in) cp_async16(sy + row * C::LDY + yc, g.y + (size_t)tr.tok[row] * out + c0 + yc, 16);
        }
      } else {
        for (int e = tid; e < BM * BN; e += NTH) {
          const int row = e / BN, col = e % BN;
          if (row < m && c0 + col < out) sy[row * C::LDY + col] = g.y[(size_t)tr.tok[row] * out + c0 + col];
        }
      }
      if (vec_b) {
        if (bk < rr16) {
          const int bytes = min(max(rr - bk, 0), CH) * 2;
#pragma unroll
          for (int i = 0; i < BPT; ++i) {
            const int row = br0 + i * BROWS, col = c0 + row;
            const bool ok = col >= cw.lo[j] && col < cw.hi[j] && bytes > 0;
            cp_async16_l2(sb + C::at(row, bk, C::LDB), ok ? bs + g.b_at(col, rb0 + bk) : g.B, ok ? bytes : 0, b_l2);
          }
        }
      } else {
        for (int e = tid; e < BN * rr16; e += NTH) {
          const int row = e / rr16, k = e % rr16, col = c0 + row;
          const bool ok = col >= cw.lo[j] && col < cw.hi[j] && k < rr;
          sb[C::at(row, k, C::LDB)] = ok ? bs[g.b_at(col, rb0 + k)] : from_float<T>(0.f);
        }
      }
    }
    cp_async_commit();
  };
  // y and B of the first steps do not depend on v: issue them before waiting for it
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) load(st, st);
  if (tid == 0) {
    const int* ready = g.counters + 2 + c;
    while (load_acquire(ready) < parts) __nanosleep(32);
  }
  __syncthreads();

  // this warp's rows of v * scaling as MMA fragments, one per k-step below the slice's rank
  // rounded up to 16: the first slice's now, another's at its first column block
  const int mt = warp % C::MT, half = warp / C::MT, row0 = mt * 16 + gq, row1 = row0 + 8;
  const size_t stride = (size_t)n * g.rw;
  Frags<M, false, float> vreg[KS];
  auto load_v = [&](int j) {
    const int kss = ((cw.r[j] + 15) & ~15) / 16;
    if constexpr (C::WG) {  // wgmma's B is read in rank order: the fragment's ranks 2 tq, 2 tq + 1, + 8, + 9
      const float* base = g.ws + ((size_t)cw.p0 * n + j) * g.rw + 2 * tq;
      const float2 z = make_float2(0.f, 0.f);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const bool ok0 = ks < kss && row0 < m, ok1 = ks < kss && row1 < m;
        const float* p0 = base + (size_t)row0 * stride + ks * 16;
        const float* p1 = base + (size_t)row1 * stride + ks * 16;
        const float2 a0 = ok0 ? *reinterpret_cast<const float2*>(p0) : z, a2 = ok0 ? *reinterpret_cast<const float2*>(p0 + 8) : z;
        const float2 a1 = ok1 ? *reinterpret_cast<const float2*>(p1) : z, a3 = ok1 ? *reinterpret_cast<const float2*>(p1 + 8) : z;
        pack_scaled<M, false>(a0.x, a0.y, cw.sc[j], vreg[ks].a[0], vreg[ks].al[0]);
        pack_scaled<M, false>(a1.x, a1.y, cw.sc[j], vreg[ks].a[1], vreg[ks].al[1]);
        pack_scaled<M, false>(a2.x, a2.y, cw.sc[j], vreg[ks].a[2], vreg[ks].al[2]);
        pack_scaled<M, false>(a3.x, a3.y, cw.sc[j], vreg[ks].a[3], vreg[ks].al[3]);
      }
      return;
    }
    const float* base = g.ws + ((size_t)cw.p0 * n + j) * g.rw + 4 * tq;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      load_frag_rows<M, false>(vreg[ks], base + ks * 16, stride, row0, ks < kss && row0 < m, ks < kss && row1 < m,
                               cw.sc[j]);
  };
  // the slice whose v the fragments hold: the first one's, in flight with the first stages
  int vj = SLICED ? (steps > 0 ? slice_of(cb0) : 0) : cw.j;
  load_v(vj);
  // One slice: every value of v this part reads is in its registers now (load_v converts each one it
  // loads), so the part counts its reads here, where the count's release waits on none of its adds into
  // y; several slices count at the end, after the last slice's fragments. Thread 0 keeps the count.
  int v_readers = 0;
  if constexpr (!SLICED) {
    __syncthreads();
    if (tid == 0) v_readers = atomic_add_acq_rel(g.counters + 2 + g.units(CHUNK_UNIT_BM) + c, 1);
  }

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  for (int f = 0; f < steps; ++f) {
    cp_async_wait<STAGES - 2>();
#if LORA_WGMMA
    if constexpr (C::WG) fence_proxy_async();  // the step's B seen by the MMAs' reads
#endif
    __syncthreads();  // step f has landed for every thread; stage f - 1 is free
    load(f + STAGES - 1, (f + STAGES - 1) % STAGES);
    const int vis = ONE_RB ? f : f / nrb, rb = ONE_RB ? 0 : f % nrb, j = slice_of(cb0 + vis), r = cw.r[j];
    if (rb * RB >= r) continue;  // a rank block past the slice's rank (or a slice of rank 0)
    const int kss = ((r + 15) & ~15) / 16;
    if (SLICED && j != vj) {  // a column block of the next slice
      vj = j;
      load_v(j);
    }
#if LORA_WGMMA
    if constexpr (C::WG) {  // one rank block: the warpgroup's 64 rows x the column block, kss k-steps
      if ((warp >> 2) * 64 < m) {
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
          if (ks < kss) wg_mma_rs<M>(acc, vreg[ks].a, wg_desc(b_tile(f % STAGES) + C::at(0, 16 * ks, C::LDB), C::WG_LBO, C::WG_SBO));
        wg_commit();
        wg_wait0();
        wg_pin(acc);
      }
    }
#endif
    const T* sb = b_tile(f % STAGES) + (half * (BN / C::WK) + gq) * C::LDB + 4 * tq;
#pragma unroll
    for (int ks = 0; ks < KS && !C::WG; ++ks) {  // the rank block's k-steps (a warp-uniform test, unrolled)
      if (ks / KPB == rb && ks < kss && mt * 16 < m) {  // not an m-tile past the chunk's rows
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          Frags<M, false, T> fb;
          const uint2 w = *reinterpret_cast<const uint2*>(sb + nt * 8 * C::LDB + (ks % KPB) * 16);
          fb.b[0] = w.x;
          fb.b[1] = w.y;
          mma_frags<M, false, false>(acc[nt], vreg[ks], fb);
        }
      }
    }
    if (rb < (r + RB - 1) / RB - 1) continue;  // the column block's sums go on into its next rank block
    // this warp's rows and columns of the y tile plus its sums, then back to y; or (red_y) its sums
    // alone in the tile, rounded, then added into y at L2 a 16-byte piece at a time
    T* sy = y_tile(vis);
    const int c0 = (cb0 + vis) * BN, cw0 = half * (BN / C::WK);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if ((h ? row1 : row0) < m) {
          unsigned* p = reinterpret_cast<unsigned*>(sy + (h ? row1 : row0) * C::LDY + cw0 + nt * 8 + 2 * tq);
          *p = red_y ? pack_delta2<T>(acc[nt][2 * h], acc[nt][2 * h + 1]) : add_word<T>(*p, acc[nt][2 * h], acc[nt][2 * h + 1]);
        }
        acc[nt][2 * h] = acc[nt][2 * h + 1] = 0.f;
      }
    }
    // the warp's sums in the tile before its lanes read them back (the tile's next write, a later
    // step's, comes after that step's __syncthreads())
    __syncwarp();
    if (vec_y) {
      constexpr int PPR = BN / C::WK / CH;  // pieces of a row of this warp's share
#pragma unroll
      for (int e = lane; e < 16 * PPR; e += 32) {
        const int row = mt * 16 + e / PPR, col = cw0 + (e % PPR) * CH;
        if (row < m && c0 + col < out) {
          T* dst = g.y + (size_t)tr.tok[row] * out + c0 + col;
          const uint4 w = *reinterpret_cast<const uint4*>(sy + row * C::LDY + col);
          if (red_y)
            red_add8<T>(dst, w);
          else
            *reinterpret_cast<uint4*>(dst) = w;
        }
      }
    } else {
      for (int e = lane; e < 16 * (BN / C::WK); e += 32) {
        const int row = mt * 16 + e / (BN / C::WK), col = cw0 + e % (BN / C::WK);
        if (row < m && c0 + col < out) g.y[(size_t)tr.tok[row] * out + c0 + col] = sy[row * C::LDY + col];
      }
    }
  }
  cp_async_wait<0>();

  // release v: the last part of the chunk to read it zeroes it (each slice's ranks below its rank
  // rounded up to 16) and resets the counts, ordered after every part's reads by thread 0's acquire
  // (the count's atomic) and the barrier
  __syncthreads();
  if (tid == 0) {
    if constexpr (SLICED) v_readers = atomic_add_acq_rel(g.counters + 2 + g.units(CHUNK_UNIT_BM) + c, 1);
    last_reader = v_readers == parts - 1;
  }
  __syncthreads();
  if (last_reader) {
    for (int j = SLICED ? 0 : cw.j; j < (SLICED ? n : cw.j + 1); ++j) {
      const int r4 = ((cw.r[j] + 15) & ~15) / 4;
      for (int e = tid; e < m * r4; e += NTH) {
        const int row = e / r4, c4 = (e % r4) * 4;
        __stcg(reinterpret_cast<float4*>(g.ws + ((size_t)(cw.p0 + row) * n + j) * g.rw + c4),
               make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
    if (tid == 0) {
      atomicExch(g.counters + 2 + c, 0);
      atomicExch(g.counters + 2 + g.units(CHUNK_UNIT_BM) + c, 0);
    }
  }
}

// The static shared memory of lora_chunk (ChunkRows, ChunkScan, ChunkWork and two ints) is at
// most this in chunks of up to 64 positions (with the stages and the slot table it must leave 4
// blocks a multiprocessor), and CHUNK_TALL_STATIC_SMEM in chunks of 128 (2 blocks).
constexpr int CHUNK_STATIC_SMEM = 768, CHUNK_TALL_STATIC_SMEM = 1024;

// A block's items (chunk, part) of a step cut into chunks of BM_ positions, `parts` each, `items` in
// all (what the step has for this grid): block b takes item b (part b % parts of chunk b / parts)
// first, and where the items outnumber the grid (a step of more chunks than one wave takes) the
// rest by ticket. Chunk-major, so a chunk's parts are neighbouring blocks: blocks start in about
// the order of their index, and a chunk whose blocks all run completes even where the grid is not
// all resident (a smaller device than the plan assumed, or another stream's kernels beside it);
// the chunk-minor order measured faster in chunks of 64 spreads every chunk over the whole grid
// and could then wait for ever (NOTES.md "Early reads in lora_chunk"). `early` (EARLY_READS): the
// first item's setup reads only the addressing, ranks, scalings and offsets, so it runs before
// the wait for the grid before; x, A, B, y, v and the counts after.
template <typename T, int RW, int BM_, bool ALIGNED, bool SLICED>
__device__ void chunk_items(const Args<T>& g, char* dsmem, int* s_indptr, ChunkRows<BM_>& tr, ChunkScan& cs,
                            ChunkWork& cw, int parts, int items, bool early) {
  __shared__ int ticket;
  const int grid = gridDim.x;
  for (int it = blockIdx.x; it < items;) {
    const int c = it / parts, q = it % parts;
    chunk_setup<T, RW, BM_, SLICED>(g, s_indptr, tr, cs, cw, c);
    if (early) {
      wait_prior_grid();
      early = false;
    }
    chunk_shrink<T, RW, BM_, ALIGNED, SLICED>(g, dsmem, tr, cw, c, q, parts);
    chunk_expand<T, RW, BM_, ALIGNED, SLICED>(g, dsmem, tr, cw, c, q, parts);
    if (items <= grid) break;  // no item past the grid: no ticket, no round trip at every block's end
    if (threadIdx.x == 0) ticket = grid + atomicAdd(g.counters, 1);
    __syncthreads();
    it = ticket;
    __syncthreads();  // every thread has read the ticket before the next is taken
  }
}

// One block of lora_chunk: the step's chunks of BM positions, counted (and with `early` the first
// item set up) before the wait for the grid before; the blocks past the step's items leave once
// the chunks are counted. Where items went by ticket, the last taker to finish resets the ticket
// and done counts.
template <typename T, int RW, int BM, bool ALIGNED, bool SLICED>
__device__ void chunk_task(const Args<T>& g, char* dsmem, int* s_indptr, ChunkRows<BM>& tr, ChunkScan& cs,
                           ChunkWork& cw, bool early) {
  const int grid = gridDim.x;
  count_chunks<BM, Chunk<T, RW, BM>::NTHREADS>(cs, s_indptr, g.slot_indptr, g.num_slots, g.positions);
  const int parts = chunk_parts(g, cs.chunks, grid), items = cs.chunks * parts;
  const int takers = min(grid, items);
  if ((int)blockIdx.x >= takers) {  // cs.chunks is the block's after count_chunks: uniform
    if (early && blockIdx.x == 0) wait_prior_grid();  // no grid finishes before the one before it
    return;
  }
  chunk_items<T, RW, BM, ALIGNED, SLICED>(g, dsmem, s_indptr, tr, cs, cw, parts, items, early);
  if (items <= grid) return;  // no ticket taken, so none to reset: no done count, no fence behind y's adds
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(g.counters + 1, 1) == takers - 1) {  // every other taker has finished
      g.counters[0] = 0;
      g.counters[1] = 0;
      __threadfence();
    }
  }
}

}  // namespace lora
