// Rotary position embedding, out of place (stages `q` -> `q_rope`, `k` -> `k_rope`),
// x and out laid out [T, heads, D]; row t is at position pos0 + t.
// cos/sin come from tables [positions, D/2] computed on the host by the CPU
// engine's own `Rope::cos_sin` (f32 inv_freq, f32 angle, cos/sin evaluated in
// f64 and rounded), so the device applies bit-identical angles.
//   NEOX (rotate-half, HF Llama/Qwen2): pair (j, j + D/2)
//   interleaved (GPT-J / llama.cpp "normal"): pair (2j, 2j + 1)
//   out_a = a*cos - b*sin;  out_b = b*cos + a*sin   (each product rounded: --fmad=false)
// Launch: 1-D grid-stride over T*heads*(D/2) pairs.
//
// rope_axes (NEOX pairs): the angle of row t's frequency j is computed here
// from a position table, so one kernel serves the LM's M-RoPE (Qwen2-VL,
// Qwen3-VL) and the vision tower's 2-D rotary:
//   a = inv_freq[j] * (float)pos[axes[j] * rows + t]   (one f32 product)
//   c = (float)cos((double)a), s = (float)sin((double)a)
// as the CPU engine's `Rope::apply_axes` and `vision::vision_rotary` (cos/sin
// of the f32 angle evaluated in f64 and rounded). inv_freq [D/2] is per
// frequency (the vision rotary's D/4 frequencies repeated for its h and w
// halves), axes [D/2] names the position axis each frequency turns by, pos is
// [naxes, rows] (M-RoPE: t, h, w; vision: h, w).

template <typename T, bool NEOX>
__device__ __forceinline__ void rope(const T* x, T* out, const float* cos_tab, const float* sin_tab,
                                     int rows, int heads, int head_dim, int pos0) {
    const int half = head_dim / 2;
    const long long n = (long long)rows * heads * half;
    TS_GRID_LOOP(i, n) {
        const int j = (int)(i % half);
        const long long rh = i / half;  // row * heads + head
        const long long t = rh / heads;
        const long long base = rh * head_dim;
        const long long ia = NEOX ? base + j : base + 2 * j;
        const long long ib = NEOX ? base + j + half : base + 2 * j + 1;
        const float c = cos_tab[(pos0 + t) * half + j];
        const float s = sin_tab[(pos0 + t) * half + j];
        const float a = to_f32(x[ia]), b = to_f32(x[ib]);
        out[ia] = from_f32<T>(a * c - b * s);
        out[ib] = from_f32<T>(b * c + a * s);
    }
}

#define ROPE_OP(NAME, T, NEOX)                                                                \
    extern "C" __global__ void NAME(const T* x, T* out, const float* cos_tab,                  \
                                    const float* sin_tab, int rows, int heads, int head_dim,   \
                                    int pos0) {                                                \
        rope<T, NEOX>(x, out, cos_tab, sin_tab, rows, heads, head_dim, pos0);                  \
    }
ROPE_OP(rope_neox_f32, float, true)
ROPE_OP(rope_neox_f16, f16_t, true)
ROPE_OP(rope_neox_bf16, bf16_t, true)
ROPE_OP(rope_interleaved_f32, float, false)
ROPE_OP(rope_interleaved_f16, f16_t, false)
ROPE_OP(rope_interleaved_bf16, bf16_t, false)

template <typename T>
__device__ __forceinline__ void rope_axes(const T* x, T* out, const float* inv_freq, const int* pos,
                                          const int* axes, int rows, int heads, int head_dim) {
    const int half = head_dim / 2;
    const long long n = (long long)rows * heads * half;
    TS_GRID_LOOP(i, n) {
        const int j = (int)(i % half);
        const long long rh = i / half;  // row * heads + head
        const long long t = rh / heads;
        const long long ia = rh * head_dim + j;
        const long long ib = ia + half;
        const float ang = inv_freq[j] * (float)pos[(long long)axes[j] * rows + t];
        const float c = (float)cos((double)ang);
        const float s = (float)sin((double)ang);
        const float a = to_f32(x[ia]), b = to_f32(x[ib]);
        out[ia] = from_f32<T>(a * c - b * s);
        out[ib] = from_f32<T>(b * c + a * s);
    }
}

#define ROPE_AXES_OP(NAME, T)                                                                 \
    extern "C" __global__ void NAME(const T* x, T* out, const float* inv_freq, const int* pos, \
                                    const int* axes, int rows, int heads, int head_dim) {      \
        rope_axes<T>(x, out, inv_freq, pos, axes, rows, heads, head_dim);                      \
    }
ROPE_AXES_OP(rope_axes_f32, float)
ROPE_AXES_OP(rope_axes_f16, f16_t)
ROPE_AXES_OP(rope_axes_bf16, bf16_t)
