// LayerNorm of each row (the vision tower's norm1/norm2, the mergers' norms):
//   mean = sum(x) / width;  var = sum((x - mean)^2) / width   (biased, as torch)
//   out = (x - (float)mean) * (float)(1 / sqrt(var + eps)) * w + b
// as the CPU engine's `vision::LayerNorm::forward`: the two moments are
// accumulated in f64 (two passes over the row) and rounded to f32 once; the
// output is then f32 arithmetic in that order, each product and sum rounded
// (--fmad=false). Only the order of the f64 sums differs from the CPU (a block
// tree here, a sequential sum there), which moves the f32 moments only when
// an f64 sum lands within 2^-29 relative of an f32 rounding boundary.
// eps is the config's f64 value. Launch: one block per row, blockDim a
// multiple of 32 (<= 1024), no dynamic smem.

// Block sum of doubles with block_sum's combination order (common.cuh).
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T>
__device__ __forceinline__ void layernorm(const T* x, const T* w, const T* b, T* out, int width,
                                          double eps) {
    __shared__ double scratch[32];
    const T* row = x + (long long)blockIdx.x * width;
    T* o = out + (long long)blockIdx.x * width;
    double acc = 0.0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) acc += (double)to_f32(row[i]);
    const double mean = block_sum_f64(acc, scratch) / (double)width;
    double sq = 0.0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const double d = (double)to_f32(row[i]) - mean;
        sq += d * d;
    }
    const double var = block_sum_f64(sq, scratch) / (double)width;
    const float m = (float)mean;
    const float rstd = (float)(1.0 / sqrt(var + eps));
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = to_f32(row[i]);
        o[i] = from_f32<T>((v - m) * rstd * to_f32(w[i]) + to_f32(b[i]));
    }
}

#define LAYERNORM_OP(NAME, T)                                                                \
    extern "C" __global__ void NAME(const T* x, const T* w, const T* b, T* out, int width,   \
                                    double eps) {                                            \
        layernorm<T>(x, w, b, out, width, eps);                                              \
    }
LAYERNORM_OP(layernorm_f32, float)
LAYERNORM_OP(layernorm_f16, f16_t)
LAYERNORM_OP(layernorm_bf16, bf16_t)
