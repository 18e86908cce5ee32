// Slot-grouped LoRA delta, SIMT version (the plain fallback and a second opinion in tests):
//   y[t, cols_j] += scaling[s, j] * (x[t] @ A[s, j, :r].T) @ B[s, cols_j, :r].T
// for every position p < slot_indptr[S] with t = token_order[p], s its slot (s >= 1), r = ranks[s, j].
//
// shrink: grid (ceil(bucket / SHRINK_ROWS), n_slices), block (32, SHRINK_ROWS): one warp per position,
//         lanes split `in`; v[p, j, k] in the float32 workspace [bucket, n, rw].
// expand: grid (ceil(out / 128), ceil(bucket / rows_per_block)), block 128: one thread per column.
// Shapes: x [rows, in], y [rows, out], A [S, n, R, in], B [S, out, R] or rank-blocked (b_ld, b_blk: lora_mma.cu's
// Args::b_at), scaling [S, n] f32, ranks [S, n] i32,
// out_offsets [n + 1] i32 (null: one slice). The grid depends on the bucket, never on this step's counts.
#include "common.cuh"

template <typename T>
__global__ void lora_shrink_simt(float* __restrict__ v, const T* __restrict__ x, const T* __restrict__ A,
                                 const int* __restrict__ ranks, const int* __restrict__ token_order,
                                 const int* __restrict__ slot_indptr, int num_slots, int n_slices,
                                 int max_rank, int in_features, int bucket, int rw) {
  const int p = blockIdx.x * blockDim.y + threadIdx.y;
  const int j = blockIdx.y;
  if (p >= bucket) return;
  const int s = lora::slot_of_position(slot_indptr, num_slots, p);
  if (s <= 0) return;
  const int r = min(ranks[s * n_slices + j], min(max_rank, rw));
  const long long t = token_order[p];
  const T* xr = x + t * in_features;
  for (int k = 0; k < r; ++k) {
    const T* a = A + (((long long)s * n_slices + j) * max_rank + k) * in_features;
    float acc = 0.f;
    for (int i = threadIdx.x; i < in_features; i += 32) acc += lora::to_float(xr[i]) * lora::to_float(a[i]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) v[((long long)p * n_slices + j) * rw + k] = acc;
  }
}

template <typename T>
__global__ void lora_expand_simt(T* __restrict__ y, const float* __restrict__ v, const T* __restrict__ B,
                                 const float* __restrict__ scaling, const int* __restrict__ ranks,
                                 const int* __restrict__ out_offsets, const int* __restrict__ token_order,
                                 const int* __restrict__ slot_indptr, int num_slots, int n_slices,
                                 int max_rank, int out_features, int bucket, int rw, int rows_per_block,
                                 long long b_slot, int b_ld, long long b_blk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= out_features) return;
  int j = 0;
  if (out_offsets != nullptr)
    while (j + 1 < n_slices && c >= out_offsets[j + 1]) ++j;
  const int p0 = blockIdx.y * rows_per_block;
  for (int p = p0; p < p0 + rows_per_block && p < bucket; ++p) {
    const int s = lora::slot_of_position(slot_indptr, num_slots, p);
    if (s <= 0) continue;
    const int r = min(ranks[s * n_slices + j], min(max_rank, rw));
    if (r == 0) continue;
    const float* vp = v + ((long long)p * n_slices + j) * rw;
    const T* b = B + (long long)s * b_slot + (long long)c * b_ld;  // (lora_mma.cu's Args::b_at)
    float acc = 0.f;
    for (int k = 0; k < r; ++k) acc += vp[k] * lora::to_float(b[(k >> 4) * b_blk + (k & 15)]);
    const long long t = token_order[p];
    T* yp = y + t * out_features + c;
    *yp = lora::from_float<T>(lora::to_float(*yp) + scaling[s * n_slices + j] * acc);
  }
}
