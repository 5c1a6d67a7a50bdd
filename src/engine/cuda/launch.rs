//! Launch configurations of every kernel, as plain arithmetic on the shapes so
//! they are tested without a GPU: enough threads to cover every element (or a
//! grid-stride loop that does), block sizes the block reductions accept
//! (multiples of 32, at most 1024), and the dynamic shared memory attention
//! needs, refused up front when it exceeds the default 48 KiB.

/// Threads per block of the 1-D elementwise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Grid cap of the 1-D kernels: they loop with a grid stride past it.
pub const MAX_GRID: u64 = 65_535;
/// Threads per block of the attention kernels (one block per (query row, head)).
pub const ATTENTION_THREADS: u32 = 128;
/// Threads of the single argmax block.
pub const ARGMAX_THREADS: u32 = 1024;
/// Dynamic shared memory a kernel may use without opting in.
pub const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;

/// (grid, block, dynamic shared bytes), mirroring cudarc's `LaunchConfig`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
}

/// 1-D grid-stride launch over `n` elements (n = 0 still launches one block,
/// which does nothing).
pub fn elementwise(n: usize) -> Launch {
    let blocks = (n as u64).div_ceil(ELEMENTWISE_THREADS as u64).clamp(1, MAX_GRID);
    Launch {
        grid: (blocks as u32, 1, 1),
        block: ELEMENTWISE_THREADS,
        smem: 0,
    }
}

/// One block per row for row reductions (RMSNorm): a multiple of 32 threads,
/// no more than the row needs, at most 256.
pub fn per_row(rows: usize, width: usize) -> Launch {
    let block = (width.div_ceil(32) * 32).clamp(32, 256) as u32;
    Launch {
        grid: (rows as u32, 1, 1),
        block,
        smem: 0,
    }
}

/// Dynamic shared memory of attention: the query row (D floats) then S scores.
pub fn attention_smem_bytes(head_dim: usize, s: usize) -> usize {
    (head_dim + s) * std::mem::size_of::<f32>()
}

/// Static shared memory of the attention kernels (`scratch[32]` of the block
/// reductions): the driver's 48 KiB without opt-in covers static and dynamic
/// together.
pub const ATTENTION_STATIC_SMEM: usize = 32 * std::mem::size_of::<f32>();

/// Attention over S cached positions: grid (T, H) (decode: T = 1).
pub fn attention(t: usize, heads: usize, head_dim: usize, s: usize) -> Result<Launch, String> {
    let smem = attention_smem_bytes(head_dim, s);
    if smem + ATTENTION_STATIC_SMEM > DEFAULT_SMEM_LIMIT {
        return Err(format!(
            "attention over {s} positions with head_dim {head_dim} needs {smem} bytes of shared memory \
             (plus {ATTENTION_STATIC_SMEM} static), more than the {DEFAULT_SMEM_LIMIT} this kernel uses \
             (at most {} positions)",
            (DEFAULT_SMEM_LIMIT - ATTENTION_STATIC_SMEM) / 4 - head_dim
        ));
    }
    Ok(Launch {
        grid: (t as u32, heads as u32, 1),
        block: ATTENTION_THREADS,
        smem: smem as u32,
    })
}

pub fn argmax() -> Launch {
    Launch {
        grid: (1, 1, 1),
        block: ARGMAX_THREADS,
        smem: 0,
    }
}

/// The single block of the seeded sampling kernel (block reductions, so a
/// multiple of 32 threads; one block because every step of its threshold
/// searches needs the whole row's sum).
pub fn sample() -> Launch {
    argmax()
}

/// The largest block each kernel is launched with, by name (the kernel check
/// verifies that its registers fit that block on one SM).
pub fn max_block_threads(kernel: &str) -> u32 {
    if kernel.starts_with("attention_") {
        ATTENTION_THREADS
    } else if kernel.starts_with("argmax_") || kernel.starts_with("sample_") {
        ARGMAX_THREADS
    } else {
        // Elementwise kernels, and RMSNorm's per-row block (at most 256).
        ELEMENTWISE_THREADS
    }
}

/// Registers per SM on sm_80 and sm_90 (64 K), allocated per warp in units of
/// 256, i.e. per thread rounded up to a multiple of 8.
pub const REGISTERS_PER_SM: u32 = 65_536;

/// Whether a block of `threads` threads using `regs` registers each can be
/// resident at all (otherwise the launch fails with "too many resources").
pub fn registers_fit(regs: u32, threads: u32) -> bool {
    regs.div_ceil(8) * 8 * threads.div_ceil(32) * 32 <= REGISTERS_PER_SM
}

/// Column-major cuBLAS arguments for the row-major `y[rows, out] = x[rows, in] · wᵀ`
/// with `w` `[out, in]` (HF Linear): `C = op(A)·op(B)` with C = yᵀ as `[out, rows]`
/// (ldc = out), A = w read transposed (lda = in), B = xᵀ untransposed (ldb = in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

pub fn linear_gemm(rows: usize, in_f: usize, out_f: usize) -> GemmShape {
    GemmShape {
        transa: true,
        transb: false,
        m: out_f,
        n: rows,
        k: in_f,
        lda: in_f,
        ldb: in_f,
        ldc: out_f,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column-major GEMM on the host with the given arguments: what cuBLAS
    /// computes, for checking the argument mapping.
    fn colmajor_gemm(g: GemmShape, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut c = vec![0.0f32; g.ldc * g.n];
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = 0.0f32;
                for p in 0..g.k {
                    let av = if g.transa { a[p + i * g.lda] } else { a[i + p * g.lda] };
                    let bv = if g.transb { b[j + p * g.ldb] } else { b[p + j * g.ldb] };
                    acc += av * bv;
                }
                c[i + j * g.ldc] = acc;
            }
        }
        c
    }

    #[test]
    fn linear_gemm_is_the_row_major_x_times_w_transposed() {
        let (rows, in_f, out_f) = (3, 5, 4);
        let x: Vec<f32> = (0..rows * in_f).map(|i| i as f32 * 0.5 - 3.0).collect();
        let w: Vec<f32> = (0..out_f * in_f).map(|i| (i % 7) as f32 - 2.0).collect();
        let got = colmajor_gemm(linear_gemm(rows, in_f, out_f), &w, &x);
        for r in 0..rows {
            for o in 0..out_f {
                let want: f32 = (0..in_f).map(|p| x[r * in_f + p] * w[o * in_f + p]).sum();
                assert_eq!(got[r * out_f + o], want, "y[{r},{o}]");
            }
        }
    }

    #[test]
    fn register_budget_of_a_full_block() {
        assert!(registers_fit(64, 1024));
        assert!(!registers_fit(65, 1024));
        assert!(registers_fit(255, 256));
        assert_eq!(max_block_threads("sample_f32"), 1024);
        assert_eq!(max_block_threads("attention_decode_bf16"), ATTENTION_THREADS);
        assert_eq!(max_block_threads("rmsnorm_f16"), 256);
        assert!(per_row(1, 1 << 20).block <= max_block_threads("rmsnorm_f32"));
    }

    #[test]
    fn elementwise_covers_every_element() {
        for n in [0usize, 1, 255, 256, 257, 1 << 20, 100_000_000] {
            let l = elementwise(n);
            assert_eq!(l.block % 32, 0);
            let threads = l.grid.0 as u64 * l.block as u64;
            // Either one thread per element, or the grid-stride loop covers the rest.
            assert!(threads >= n as u64 || l.grid.0 as u64 == MAX_GRID, "n={n}");
            assert!(l.grid.0 >= 1);
        }
    }

    #[test]
    fn per_row_blocks_suit_the_block_reduction() {
        for width in [1usize, 31, 32, 33, 64, 896, 4096] {
            let l = per_row(7, width);
            assert_eq!(l.grid, (7, 1, 1));
            assert!(
                l.block.is_multiple_of(32) && l.block <= 1024 && l.block >= 32,
                "width {width}"
            );
        }
        assert_eq!(per_row(1, 40).block, 64);
    }

    #[test]
    fn attention_launch_and_smem_limit() {
        let l = attention(5, 14, 64, 9).unwrap();
        assert_eq!(l.grid, (5, 14, 1));
        assert_eq!(l.block % 32, 0);
        assert_eq!(l.smem as usize, (64 + 9) * 4);
        // S not a multiple of the block size is fine (strided loops), and the
        // largest S that fits is accepted while one more is refused.
        let max_s = (DEFAULT_SMEM_LIMIT - ATTENTION_STATIC_SMEM) / 4 - 64;
        assert!(attention(1, 1, 64, max_s).is_ok());
        assert!(attention(1, 1, 64, max_s + 1).unwrap_err().contains("shared memory"));
    }

    #[test]
    fn argmax_is_one_block_of_whole_warps() {
        let l = argmax();
        assert_eq!(l.grid, (1, 1, 1));
        assert!(l.block.is_multiple_of(32) && l.block <= 1024);
    }
}
