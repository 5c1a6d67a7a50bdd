// RMSNorm of each row (stages `attn_norm`, `ffn_norm`, `output_norm`):
//   var = sum(x*x) / width;  r = 1 / sqrt(var + eps);  out = w * (x * r)
// as the CPU engine's `ops::rmsnorm` (HF's LlamaRMSNorm in f32): squares rounded
// to f32 before summing (--fmad=false), sum / width, 1/sqrt in two IEEE roundings,
// then w * (x * r) in that order. Only the summation order differs from the CPU
// (a block tree here, ATen's 8-lane cascade there).
// plus_one (Gemma): the weight multiplies as 1 + w, formed in f32 (HF's
// `1.0 + weight.float()`), i.e. out = (1 + w) * (x * r).
// Launch: one block per row, blockDim a multiple of 32 (<= 1024), no dynamic smem.

template <typename T>
__device__ __forceinline__ void rmsnorm(const T* x, const T* w, T* out, int width, float eps,
                                        int plus_one) {
    __shared__ float scratch[32];
    const T* row = x + (long long)blockIdx.x * width;
    T* o = out + (long long)blockIdx.x * width;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = to_f32(row[i]);
        acc += v * v;
    }
    const float sum = block_sum(acc, scratch);
    const float var = sum / (float)width;
    const float r = 1.0f / sqrtf(var + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = to_f32(row[i]);
        const float wi = plus_one ? 1.0f + to_f32(w[i]) : to_f32(w[i]);
        o[i] = from_f32<T>(wi * (v * r));
    }
}

#define RMSNORM_OP(NAME, T)                                                                 \
    extern "C" __global__ void NAME(const T* x, const T* w, T* out, int width, float eps,   \
                                    int plus_one) {                                         \
        rmsnorm<T>(x, w, out, width, eps, plus_one);                                        \
    }
RMSNORM_OP(rmsnorm_f32, float)
RMSNORM_OP(rmsnorm_f16, f16_t)
RMSNORM_OP(rmsnorm_bf16, bf16_t)
