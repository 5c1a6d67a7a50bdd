// Embedding gather: out[t, :] = table[tokens[t], :]   (stage `embed`, [T, E]).
// Token ids are checked < vocab on the host before upload.
// Launch: 1-D grid-stride over T*E elements.

template <typename T>
__device__ __forceinline__ void embedding(const T* table, const unsigned int* tokens, T* out,
                                          int rows, int width) {
    const long long n = (long long)rows * width;
    TS_GRID_LOOP(i, n) {
        const long long r = i / width, c = i % width;
        out[i] = table[(long long)tokens[r] * width + c];
    }
}

#define EMBEDDING_OP(NAME, T)                                                              \
    extern "C" __global__ void NAME(const T* table, const unsigned int* tokens, T* out,     \
                                    int rows, int width) {                                 \
        embedding<T>(table, tokens, out, rows, width);                                     \
    }
EMBEDDING_OP(embedding_f32, float)
EMBEDDING_OP(embedding_f16, f16_t)
EMBEDDING_OP(embedding_bf16, bf16_t)
