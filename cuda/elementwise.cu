// Elementwise kernels: bias add (projections with a bias, e.g. Qwen2 q/k/v),
// SwiGLU activation (`ffn_act` = silu(gate) * up, SiLU as torch: x / (1 + exp(-x))),
// GeGLU activation (Gemma: gelu_tanh(gate) * up, as torch's `gelu_pytorch_tanh`:
// inner = beta * (x + kappa * (x*x*x)), 0.5 * x * (1 + tanh(inner))), residual add
// (`ffn_inp`, `out`), an in-place scale (Gemma's embedding times sqrt(hidden)),
// and the sentinel fill of guard regions.
// Vision-language models: the tower's activations (`act`: quick_gelu,
// gelu_tanh, exact erf GELU), the split of the fused qkv projection into
// q/k/v (`copy_cols`), and the fusion of image features into the LM's rows
// (`scatter_rows`: the merger rows into the image-pad rows, or Qwen3-VL's
// deepstack features added to them).
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

// The vision tower's activations, out[i] = f(x[i]), in the CPU engine's f32
// order of operations (`vision::quick_gelu`, `ops::gelu_tanh`, `vision::gelu_erf`):
//   kind 0 quick_gelu: x * (1 / (1 + exp(-(1.702 * x))))        (HF quick_gelu)
//   kind 1 gelu_tanh:  0.5 * x * (1 + tanh(beta * (x + kappa * x*x*x)))
//   kind 2 gelu_erf:   x * 0.5 * (1 + erf(x * (1/sqrt(2))))      (torch nn.GELU)
template <typename T>
__device__ __forceinline__ void act(const T* x, T* out, long long n, int kind) {
    const float beta = 0.7978845608028654f;
    const float kappa = 0.044715f;
    const float rsqrt2 = 0.7071067811865476f;
    TS_GRID_LOOP(i, n) {
        const float v = to_f32(x[i]);
        float y;
        if (kind == 0) {
            y = v * (1.0f / (1.0f + expf(-(1.702f * v))));
        } else if (kind == 1) {
            const float inner = beta * (v + kappa * (v * v * v));
            y = 0.5f * v * (1.0f + tanhf(inner));
        } else {
            y = v * 0.5f * (1.0f + erff(v * rsqrt2));
        }
        out[i] = from_f32<T>(y);
    }
}

// dst[r, c] = src[r, col0 + c] for r < rows, c < cols: columns of a row-major
// [rows, src_cols] matrix (q, k, v out of the fused qkv projection).
template <typename T>
__device__ __forceinline__ void copy_cols(const T* src, T* dst, int rows, int src_cols, int col0,
                                          int cols) {
    const long long n = (long long)rows * cols;
    TS_GRID_LOOP(i, n) {
        const long long r = i / cols, c = i % cols;
        dst[i] = src[r * src_cols + col0 + c];
    }
}

// Row r of src [n, width] into row idx[r] of dst (idx distinct, < dst's rows):
// replaced (accumulate = 0: HF's masked_scatter of the merger rows into the
// image-pad rows) or added, one f32 add rounded once (accumulate = 1:
// Qwen3-VL's deepstack features added to the image rows after a layer).
template <typename T>
__device__ __forceinline__ void scatter_rows(const T* src, T* dst, const int* idx, int n, int width,
                                             int accumulate) {
    const long long total = (long long)n * width;
    TS_GRID_LOOP(i, total) {
        const long long r = i / width, c = i % width;
        T* d = dst + (long long)idx[r] * width + c;
        *d = accumulate ? from_f32<T>(to_f32(*d) + to_f32(src[i])) : src[i];
    }
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
    }                                                                                         \
    extern "C" __global__ void act_##SUFFIX(const T* x, T* out, long long n, int kind) {      \
        act<T>(x, out, n, kind);                                                              \
    }                                                                                         \
    extern "C" __global__ void copy_cols_##SUFFIX(const T* src, T* dst, int rows,             \
                                                  int src_cols, int col0, int cols) {         \
        copy_cols<T>(src, dst, rows, src_cols, col0, cols);                                   \
    }                                                                                         \
    extern "C" __global__ void scatter_rows_##SUFFIX(const T* src, T* dst, const int* idx,    \
                                                     int n, int width, int accumulate) {      \
        scatter_rows<T>(src, dst, idx, n, width, accumulate);                                 \
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
