// Multi-head latent attention (DeepSeek; src/engine/cuda/mla.rs), the CPU
// engine's arithmetic (src/engine/cpu/mla.rs): copies, and RoPE on each
// head's last `rope` values.
//
// - mla_split_kv: from kv_b's output [rows, H, nope + dv] and kv_a's
//   [rows, lora + rope], k [rows, H, nope + rope] = (the head's nope keys,
//   the shared RoPE key), v [rows, H, dv], and v padded with zeros to
//   [rows, H, nope + rope] (what the cache and the attention kernel read).
// - rope_mla: out = x with each head's values at + 0 .. at + rope rotated
//   (at = nope): interleaved pairs (2j, 2j + 1) read, written de-interleaved
//   to (j, j + rope/2) (HF's apply_rotary_pos_emb_interleave), or
//   rotate-half pairs (j, j + rope/2); out_a = a*cos - b*sin, out_b =
//   b*cos + a*sin (each product rounded: --fmad=false). cos/sin tables
//   [positions, rope/2] from the CPU engine's Rope::cos_sin.
// Launch: 1-D grid-stride.

template <typename T>
__device__ __forceinline__ void mla_split_kv(const T* kvb, const T* kva, T* k, T* v, T* v_pad, int rows,
                                             int heads, int nope, int dv, int rope, int lora) {
    const int d = nope + rope;
    const long long n = (long long)rows * heads * d;
    TS_GRID_LOOP(i, n) {
        const int c = (int)(i % d);
        const long long rh = i / d;  // row * heads + head
        const long long r = rh / heads;
        const T* head = kvb + rh * (nope + dv);
        k[i] = c < nope ? head[c] : kva[r * (lora + rope) + lora + (c - nope)];
        if (c < dv) {
            v[rh * dv + c] = head[nope + c];
            v_pad[i] = head[nope + c];
        } else {
            v_pad[i] = from_f32<T>(0.0f);
        }
    }
}

template <typename T>
__device__ __forceinline__ void rope_mla(const T* x, T* out, const float* cos_tab, const float* sin_tab, int rows,
                                         int heads, int d, int at, int rope, int interleave, int pos0) {
    const long long n = (long long)rows * heads * d;
    const int half = rope / 2;
    TS_GRID_LOOP(i, n) {
        const int c = (int)(i % d);
        const long long base = i - c;
        const long long t = (i / d) / heads;
        if (c < at || c >= at + rope) {
            out[i] = x[i];
            continue;
        }
        const int j = (c - at) % half;
        const bool second = (c - at) >= half;
        const float a = to_f32(x[base + at + (interleave ? 2 * j : j)]);
        const float b = to_f32(x[base + at + (interleave ? 2 * j + 1 : j + half)]);
        const float cs = cos_tab[(pos0 + t) * half + j];
        const float sn = sin_tab[(pos0 + t) * half + j];
        out[i] = from_f32<T>(second ? b * cs + a * sn : a * cs - b * sn);
    }
}

#define MLA_OPS(SUFFIX, T)                                                                              \
    extern "C" __global__ void mla_split_kv_##SUFFIX(const T* kvb, const T* kva, T* k, T* v, T* v_pad,   \
                                                     int rows, int heads, int nope, int dv, int rope,    \
                                                     int lora) {                                         \
        mla_split_kv<T>(kvb, kva, k, v, v_pad, rows, heads, nope, dv, rope, lora);                       \
    }                                                                                                   \
    extern "C" __global__ void rope_mla_##SUFFIX(const T* x, T* out, const float* cos_tab,              \
                                                 const float* sin_tab, int rows, int heads, int d,      \
                                                 int at, int rope, int interleave, int pos0) {          \
        rope_mla<T>(x, out, cos_tab, sin_tab, rows, heads, d, at, rope, interleave, pos0);              \
    }
MLA_OPS(f32, float)
MLA_OPS(f16, f16_t)
MLA_OPS(bf16, bf16_t)
