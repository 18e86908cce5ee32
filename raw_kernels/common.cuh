// Shared helpers of the lora-cupy kernels: element conversions, the slot lookup, cp.async,
// and the m16n8k16 tensor-core step with its operand packing (inline PTX, no header needed).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace lora {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The slot whose range of token_order holds position p: the s with
// slot_indptr[s] <= p < slot_indptr[s + 1], or -1 past every range (a bucket's padding).
__device__ __forceinline__ int slot_of_position(const int* __restrict__ slot_indptr, int num_slots, int p) {
  if (p >= slot_indptr[num_slots]) return -1;
  int lo = 0, hi = num_slots;  // invariant: indptr[lo] <= p < indptr[hi]
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (slot_indptr[mid] <= p) lo = mid; else hi = mid;
  }
  return lo;
}

// Slots with positions (s >= 1, slot_indptr[s + 1] > slot_indptr[s]), counted by one warp (every
// lane calls, lane its lane index; the result is the same in every lane), 32 slots a round:
// how many of them come before slot s, and which is the k-th of them (-1: fewer than k + 1).
__device__ __forceinline__ int active_slots_before(const int* __restrict__ slot_indptr, int s, int lane) {
  int count = 0;
  for (int base = 1; base < s; base += 32) {
    const int t = base + lane;
    const bool on = t < s && slot_indptr[t + 1] > slot_indptr[t];
    count += __popc(__ballot_sync(0xffffffffu, on));
  }
  return count;
}
__device__ __forceinline__ int nth_active_slot(const int* __restrict__ slot_indptr, int num_slots, int k, int lane) {
  for (int base = 1; base < num_slots; base += 32) {
    const int t = base + lane;
    const bool on = t < num_slots && slot_indptr[t + 1] > slot_indptr[t];
    const unsigned m = __ballot_sync(0xffffffffu, on);
    const int c = __popc(m);
    if (k < c) {  // the (k+1)-th set bit of m
      unsigned left = m;
      for (int i = 0; i < k; ++i) left &= left - 1;
      return base + __ffs(left) - 1;
    }
    k -= c;
  }
  return -1;
}

// ---- cp.async: 16-byte global -> shared copies; bytes past src_bytes (0..16) are zero-filled.
// cp_async16 goes through L1 (.ca), for what no block of the running grid writes (x, A, B, and y
// tiles read and written back by their one owner): a warp's copies are coalesced there, and the
// blocks of a multiprocessor that read the same A and B rows share them. Bypassing L1 (.cg), a
// lora_chunk call at T = 1024 asked L2 for 1.8x the sectors in 3.8x the requests and ran 1.3-11 us
// slower (NOTES.md, "cp.async through L1"). cp_async16_cg bypasses L1, for data other blocks of the
// grid write (lora_fused's v), which a line L1 kept could show stale, and where it measured faster
// (cp_async16_l2).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16_cg(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
// cp_async16_l2: through L2 only where `l2_only` (a block-uniform choice made at run time), through L1
// otherwise. Through L2 only where that measured faster or no slower: every copy of the unfused
// kernels (lora_shrink, lora_expand, lora_expand_ring, lora_fused) at rank widths above 16, and
// lora_chunk's B where a part's share of it passes CHUNK_B_L1_MAX (NOTES.md, "Wide B through L2 only").
__device__ __forceinline__ void cp_async16_l2(void* smem, const void* gmem, int src_bytes, bool l2_only) {
  if (l2_only) cp_async16_cg(smem, gmem, src_bytes);
  else cp_async16(smem, gmem, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90+): wait until the grid queued before this one on the
// stream has finished and its writes are visible. Returns at once for a kernel launched without
// the attribute, and compiles to nothing below sm_90 (where no launch takes the attribute).
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Programmatic dependent launch (sm_90+): let the grid queued after this one on the stream, where
// it was launched with the attribute, start now (without this call it starts as this grid's blocks
// exit); its blocks still wait (wait_prior_grid) for this grid to finish before they touch what it
// writes. A no-op without such a grid, and below sm_90.
__device__ __forceinline__ void release_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Access flag (Args::flags): the caller's word that the kernel queued just before this launch
// writes neither the step's addressing nor the pool's weights, scalings, ranks and offsets, so a
// kernel may read them before wait_prior_grid (lora_one and lora_chunk do; the backend sets it
// where its owner says so: CupyBackend(early_reads=True)).
constexpr int EARLY_READS = 8;

// How every kernel of a packed launch starts (the backend launches them with PDL where the device
// has it): wait for the grid before it (later where `early`: the kernel then waits itself after
// reading only what EARLY_READS allows), then, where RELEASE, let the next grid start at once.
// RELEASE where it was measured to pay (NOTES.md "Programmatic dependent launch of every kernel",
// "Early reads in lora_chunk"): lora_one, lora_chunk and the tile kernels.
template <bool RELEASE>
__device__ __forceinline__ void enter_grid(bool early = false) {
  if (!early) wait_prior_grid();
  if (RELEASE) release_next_grid();
}

// Bytes of dynamic shared memory this launch was given (a launch given too few traps).
__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void require_smem(unsigned bytes) {
  if (dynamic_smem_size() < bytes) __trap();
}

// p[0..3] += v in one 16-byte reduction at L2 (sm_90; four scalar ones before), p 16-byte aligned.
__device__ __forceinline__ void red_add4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
#else
  atomicAdd(p, v.x);
  atomicAdd(p + 1, v.y);
  atomicAdd(p + 2, v.z);
  atomicAdd(p + 3, v.w);
#endif
}

// p[0] += a, p[1] += b in one 8-byte reduction at L2 (sm_90; two scalar ones before), p 8-byte aligned.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// The line of p sent towards L2 (a hint: L2 is where every write lands, so a line the grid before
// has yet to write is read again after the wait; what this saves is the trip to DRAM).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// ---- acquire / release flags between blocks of one launch (the fused kernel's ready counts).
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// *p += v at GPU scope as a release (every earlier access of the thread, and through a barrier of its
// block, is performed first) and an acquire (every later one after it); the old value.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// ---- tensor-core operands. Op<T>::type is the MMA element type for inputs of type T; fp32
// inputs run as bfloat16 pairs hi + lo (x*a ~ xh*ah + xh*al + xl*ah: about 16 mantissa bits).
template <typename T> struct Op;
template <> struct Op<__half> { using type = __half; static constexpr bool SPLIT = false; };
template <> struct Op<__nv_bfloat16> { using type = __nv_bfloat16; static constexpr bool SPLIT = false; };
template <> struct Op<float> { using type = __nv_bfloat16; static constexpr bool SPLIT = true; };

// Two values as one MMA register: the lower k index in the lower half.
template <typename M> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}
template <typename M> __device__ __forceinline__ float round_to(float a) { return to_float(from_float<M>(a)); }

// Two consecutive 16-bit elements held in one 32-bit word (the lower one in the lower half) as floats.
template <typename T> __device__ __forceinline__ float2 unpack2(unsigned w);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(unsigned w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(unsigned w) {
  return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                     __half2float(__ushort_as_half((unsigned short)(w >> 16))));
}

// ---- y's deltas added at L2 (lora_pair's expand, lora_chunk's). A 16-bit type's pair of deltas as one
// word for a packed reduction: rounded to T, an exact zero as -0, the identity of a round-to-nearest add
// (-0 + -0 = -0, +0 + -0 = +0), so y keeps every bit where its delta is zero.
template <typename T> __device__ __forceinline__ unsigned pack_delta2(float a, float b) {
  return pack2<T>(a == 0.f ? -0.f : a, b == 0.f ? -0.f : b);
}
// Where y's reductions exist: sm_90 (`red.add.noftz` on bf16x2 / f16x2 words), and the host emulation,
// which adds element by element. Before sm_90 callers load y, add and store.
#if defined(LORA_HOST_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
constexpr bool RED_Y = true;
#else
constexpr bool RED_Y = false;
#endif
// y[0..1] at p (4-byte aligned) += the pair packed in w, and y[0..7] at p (16-byte aligned) += the 8
// deltas packed in w (pack_delta2's words): one reduction at L2 (`red.add.noftz{.v4}.bf16x2` / `.f16x2`),
// so the block never reads y.
template <typename T> __device__ __forceinline__ void red_add_pair(T* p, unsigned w);
template <typename T> __device__ __forceinline__ void red_add8(T* p, uint4 w);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(LORA_HOST_EMULATION)
template <> __device__ __forceinline__ void red_add_pair<__nv_bfloat16>(__nv_bfloat16* p, unsigned w) {
  asm volatile("red.global.add.noftz.bf16x2 [%0], %1;\n" ::"l"(p), "r"(w) : "memory");
}
template <> __device__ __forceinline__ void red_add_pair<__half>(__half* p, unsigned w) {
  asm volatile("red.global.add.noftz.f16x2 [%0], %1;\n" ::"l"(p), "r"(w) : "memory");
}
template <> __device__ __forceinline__ void red_add8<__nv_bfloat16>(__nv_bfloat16* p, uint4 w) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z),
               "r"(w.w) : "memory");
}
template <> __device__ __forceinline__ void red_add8<__half>(__half* p, uint4 w) {
  asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z),
               "r"(w.w) : "memory");
}
#else
template <typename T> __device__ __forceinline__ void red_add_elems(T* p, const T* d, int count) {
  for (int i = 0; i < count; ++i) p[i] = from_float<T>(to_float(p[i]) + to_float(d[i]));
}
template <typename T> __device__ __forceinline__ void red_add_pair(T* p, unsigned w) {
  red_add_elems(p, reinterpret_cast<const T*>(&w), 2);
}
template <typename T> __device__ __forceinline__ void red_add8(T* p, uint4 w) {
  red_add_elems(p, reinterpret_cast<const T*>(&w), 8);
}
#endif

// a * scale and b * scale as one MMA register (hi) and, for split operands, their rounding residue (lo).
template <typename M, bool SPLIT>
__device__ __forceinline__ void pack_scaled(float a, float b, float scale, unsigned& hi, unsigned& lo) {
  a *= scale;
  b *= scale;
  hi = pack2<M>(a, b);
  if constexpr (SPLIT) lo = pack2<M>(a - round_to<M>(a), b - round_to<M>(b));
}

// One MMA register (hi) and, for split operands, the rounding residue (lo) of two consecutive
// shared-memory elements; fp32 elements are multiplied by scale first.
template <typename M, bool SPLIT>
__device__ __forceinline__ void pair(const __half* p, float, unsigned& hi, unsigned&) {
  hi = *reinterpret_cast<const unsigned*>(p);
}
template <typename M, bool SPLIT>
__device__ __forceinline__ void pair(const __nv_bfloat16* p, float, unsigned& hi, unsigned&) {
  hi = *reinterpret_cast<const unsigned*>(p);
}
template <typename M, bool SPLIT>
__device__ __forceinline__ void pair(const float* p, float scale, unsigned& hi, unsigned& lo) {
  const float2 f = *reinterpret_cast<const float2*>(p);
  const float a = f.x * scale, b = f.y * scale;
  hi = pack2<M>(a, b);
  if constexpr (SPLIT) lo = pack2<M>(a - round_to<M>(a), b - round_to<M>(b));
}

// d += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators.
template <typename M> __device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4],
                                                               const unsigned (&b)[2]);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                                    const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<__half>(float (&d)[4], const unsigned (&a)[4],
                                                             const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Fragments of one 16x16 A tile (rows m0.., k0..) and one 16x8 B tile (rows n0.. of a [n][k]
// array, k0..) from shared memory with row strides lda / ldb elements. lane = 4 * g + tq.
template <typename M, bool SPLIT, typename E>
struct Frags {
  unsigned a[4], al[4], b[2], bl[2];
  __device__ __forceinline__ void load_a(const E* s, int lda, int m0, int k0, int g, int tq, float scale) {
    const E* p = s + (m0 + g) * lda + k0 + 2 * tq;
    pair<M, SPLIT>(p, scale, a[0], al[0]);
    pair<M, SPLIT>(p + 8 * lda, scale, a[1], al[1]);
    pair<M, SPLIT>(p + 8, scale, a[2], al[2]);
    pair<M, SPLIT>(p + 8 * lda + 8, scale, a[3], al[3]);
  }
  __device__ __forceinline__ void load_b(const E* s, int ldb, int n0, int k0, int g, int tq) {
    const E* p = s + (n0 + g) * ldb + k0 + 2 * tq;
    pair<M, SPLIT>(p, 1.f, b[0], bl[0]);
    pair<M, SPLIT>(p + 8, 1.f, b[1], bl[1]);
  }
};

// d += A * B for the fragments held; split operands add the two cross terms of hi and lo.
template <typename M, bool SA, bool SB, typename EA, typename EB>
__device__ __forceinline__ void mma_frags(float (&d)[4], const Frags<M, SA, EA>& fa, const Frags<M, SB, EB>& fb) {
  mma16816<M>(d, fa.a, fb.b);
  if constexpr (SA) mma16816<M>(d, fa.al, fb.b);
  if constexpr (SB) mma16816<M>(d, fa.a, fb.bl);
}

// ---- fragments read straight from global memory with k permuted inside each k-step: logical
// ranks / features {2 tq, 2 tq + 1, 8 + 2 tq, 9 + 2 tq} of a 16-wide k-step are the consecutive
// elements 4 tq .. 4 tq + 3, so a lane's share of a row is one 8-byte (fp32: 16-byte) load. A
// product stays exact as long as both operands use the same permutation.

// A fragment (rows row0 and row0 + 8) of fp32 rows: base points at row 0, element 4 tq of the
// k-step; stride is floats per row; a row that is not ok reads as zero; values times scale.
template <typename M, bool SPLIT>
__device__ __forceinline__ void load_frag_rows(Frags<M, SPLIT, float>& fa, const float* base, size_t stride,
                                               int row0, bool ok0, bool ok1, float scale) {
  const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4 f0 = ok0 ? *reinterpret_cast<const float4*>(base + (size_t)row0 * stride) : z;
  const float4 f1 = ok1 ? *reinterpret_cast<const float4*>(base + (size_t)(row0 + 8) * stride) : z;
  pack_scaled<M, SPLIT>(f0.x, f0.y, scale, fa.a[0], fa.al[0]);
  pack_scaled<M, SPLIT>(f1.x, f1.y, scale, fa.a[1], fa.al[1]);
  pack_scaled<M, SPLIT>(f0.z, f0.w, scale, fa.a[2], fa.al[2]);
  pack_scaled<M, SPLIT>(f1.z, f1.w, scale, fa.a[3], fa.al[3]);
}

// B fragment of one row of a [rows][stride] array: elements k0 .. k0 + 3 of row `row`, zero from
// kmax on and everywhere when !ok; vec: the row start is 16-byte aligned and stride % 4 == 0.
// ALIGNED (vec known true, stride a multiple of 16 bytes, kmax <= stride, k0 % 4 == 0): one vector
// load whenever k0 < kmax (k0 + 3 is then inside the row), the elements from kmax on selected to
// zero (they may hold anything, NaN included): no element-wise path at all.
template <typename T, typename M, bool SPLIT, bool ALIGNED>
__device__ __forceinline__ void load_frag_col(Frags<M, SPLIT, T>& fb, const T* base, size_t stride, int row, bool ok,
                                              int k0, int kmax, bool vec) {
  const T* p = base + (size_t)row * stride + k0;
  if constexpr (ALIGNED) {
    const int n = ok ? kmax - k0 : 0;  // elements of the four that are real
    if constexpr (sizeof(T) == 2) {
      uint2 q = make_uint2(0u, 0u);
      if (n > 0) q = __ldg(reinterpret_cast<const uint2*>(p));
      fb.b[0] = q.x & (n >= 2 ? 0xffffffffu : 0x0000ffffu);
      fb.b[1] = n >= 4 ? q.y : n == 3 ? q.y & 0x0000ffffu : 0u;
    } else {
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
      if (n > 0) f = __ldg(reinterpret_cast<const float4*>(p));
      pack_scaled<M, SPLIT>(f.x, n >= 2 ? f.y : 0.f, 1.f, fb.b[0], fb.bl[0]);
      pack_scaled<M, SPLIT>(n >= 3 ? f.z : 0.f, n >= 4 ? f.w : 0.f, 1.f, fb.b[1], fb.bl[1]);
    }
    return;
  } else {
    if constexpr (sizeof(T) == 2) {
      if (ok && vec && k0 + 4 <= kmax) {
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
        fb.b[0] = q.x;
        fb.b[1] = q.y;
        return;
      }
    } else {
      if (ok && vec && k0 + 4 <= kmax) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p));
        pack_scaled<M, SPLIT>(f.x, f.y, 1.f, fb.b[0], fb.bl[0]);
        pack_scaled<M, SPLIT>(f.z, f.w, 1.f, fb.b[1], fb.bl[1]);
        return;
      }
    }
    float f[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) f[c] = ok && k0 + c < kmax ? to_float(p[c]) : 0.f;
    pack_scaled<M, SPLIT>(f[0], f[1], 1.f, fb.b[0], fb.bl[0]);
    pack_scaled<M, SPLIT>(f[2], f[3], 1.f, fb.b[1], fb.bl[1]);
  }
}

}  // namespace lora
