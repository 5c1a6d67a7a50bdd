// Elementwise kernels: bias add (projections with a bias, e.g. Qwen2 q/k/v),
// SwiGLU activation (`ffn_act` = silu(gate) * up, SiLU as torch: x / (1 + exp(-x))),
// GeGLU activation (Gemma: gelu_tanh(gate) * up, as torch's `gelu_pytorch_tanh`:
// inner = beta * (x + kappa * (x*x*x)), 0.5 * x * (1 + tanh(inner))), residual add
// (`ffn_inp`, `out`), an in-place scale (Gemma's embedding times sqrt(hidden)),
// and the sentinel fill of guard regions.
// Launch: 1-D grid-stride over the element count.

// y[r, c] += b[c] for y [rows, cols], in place (after the GEMM, as the CPU's
// Linear::forward: the bias is added to the product, not fused into it).
template <typename T>
__device__ __forceinline__ void bias_add(T* y, const T* b, int rows, int cols) {
    const long long n = (long long)rows * cols;
    TS_GRID_LOOP(i, n) { y[i] = from_f32<T>(to_f32(y[i]) + to_f32(b[i % cols])); }
}

template <typename T>
__device__ __forceinline__ void silu_mul(const T* gate, const T* up, T* out, long long n) {
    TS_GRID_LOOP(i, n) {
        const float g = to_f32(gate[i]);
        out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up[i]));
    }
}

template <typename T>
__device__ __forceinline__ void gelu_mul(const T* gate, const T* up, T* out, long long n) {
    // sqrt(2/pi) rounded to f32, as the CPU engine's `ops::gelu_tanh`.
    const float beta = 0.7978845608028654f;
    const float kappa = 0.044715f;
    TS_GRID_LOOP(i, n) {
        const float g = to_f32(gate[i]);
        const float inner = beta * (g + kappa * (g * g * g));
        out[i] = from_f32<T>(0.5f * g * (1.0f + tanhf(inner)) * to_f32(up[i]));
    }
}

template <typename T>
__device__ __forceinline__ void scale(T* x, float s, long long n) {
    TS_GRID_LOOP(i, n) { x[i] = from_f32<T>(to_f32(x[i]) * s); }
}

template <typename T>
__device__ __forceinline__ void add(const T* a, const T* b, T* out, long long n) {
    TS_GRID_LOOP(i, n) { out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i])); }
}

#define ELEMENTWISE_OPS(SUFFIX, T)                                                            \
    extern "C" __global__ void bias_add_##SUFFIX(T* y, const T* b, int rows, int cols) {      \
        bias_add<T>(y, b, rows, cols);                                                        \
    }                                                                                         \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* gate, const T* up, T* out,          \
                                                 long long n) {                               \
        silu_mul<T>(gate, up, out, n);                                                        \
    }                                                                                         \
    extern "C" __global__ void gelu_mul_##SUFFIX(const T* gate, const T* up, T* out,          \
                                                 long long n) {                               \
        gelu_mul<T>(gate, up, out, n);                                                        \
    }                                                                                         \
    extern "C" __global__ void scale_##SUFFIX(T* x, float s, long long n) {                   \
        scale<T>(x, s, n);                                                                    \
    }                                                                                         \
    extern "C" __global__ void add_##SUFFIX(const T* a, const T* b, T* out, long long n) {    \
        add<T>(a, b, out, n);                                                                 \
    }
ELEMENTWISE_OPS(f32, float)
ELEMENTWISE_OPS(f16, f16_t)
ELEMENTWISE_OPS(bf16, bf16_t)

// Fills n 32-bit (or 16-bit) words with a bit pattern: the guard sentinels
// around every device output (a NaN payload no arithmetic produces).
extern "C" __global__ void fill_u32(unsigned int* x, unsigned int bits, long long n) {
    TS_GRID_LOOP(i, n) { x[i] = bits; }
}
extern "C" __global__ void fill_u16(unsigned short* x, unsigned short bits, long long n) {
    TS_GRID_LOOP(i, n) { x[i] = bits; }
}
