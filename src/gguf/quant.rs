//! Tensor data to f32: the float types widened, the ggml block-quantised types
//! dequantised. Compute stays f32; a quantised tensor is dequantised once, at
//! load.
//!
//! Why hand-written: the block formats are small, fixed bit layouts, and what
//! matters is that every value equals llama.cpp's reference dequantisation bit
//! for bit. The crates that implement them are a whole tensor framework
//! (candle-core's `quantized` module) or at version 0.1 (`ggml-quants`), and
//! either way bit-exactness with llama.cpp would have to be proven here; each
//! format is a dozen lines. Each function below
//! mirrors `dequantize_row_*` in ggml's `ggml-quants.c` and the numpy
//! `dequantize_blocks` in gguf-py's `quants.py` (gguf 0.19.0, vendored by
//! llama-cpp-python 0.3.36), with the f32 operations in the same order:
//! `(d·sc)·q − dmin·m`, two roundings (Rust never fuses a multiply-add).
//! The order is in fact not critical: an f16 scale has 11 significant bits,
//! so every product of scales and quants is exact in f32 except Q6_K's
//! d·sc·q (up to 25 bits), which is rounded once however it is grouped, and
//! Q6_K has no min to subtract. `tests/quant_fixtures.rs` checks the result
//! with `to_bits()` (NaN payloads included) on blocks gguf-py dequantised
//! (`goldens/recorders/make_quant_fixtures.py`).
//!
//! Every block starts or ends with f16 scales, read as little-endian IEEE
//! half floats and widened exactly (subnormals included). "q" below is the
//! integer quant of one element, "element e" counts from 0 within the block.
//!
//! Speed: the blocks of a tensor are independent, so they are dequantised in
//! parallel with rayon. The real Qwen2.5-Coder-0.5B Q4_K_M (~490 MB of blocks,
//! 630 M values, 2.5 GB of f32) loads in about 4 s on 2 cores, most of it the
//! kernel handing out fresh pages (`tests/real_model.rs` prints the figures).

use half::{bf16, f16};
use rayon::prelude::*;

use super::GgmlType;

/// Elements per K-quant super-block (`QK_K`).
const QK_K: usize = 256;
/// Blocks per rayon task: a task of a few thousand values amortises the
/// scheduling without starving the threads on small tensors.
const MIN_BLOCKS_PER_TASK: usize = 64;

/// The types [`to_f32`] reads, in `ggml_type` id order.
pub const READABLE: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::BF16,
];

/// `READABLE` as a list of names, for messages.
pub fn readable_names() -> String {
    READABLE.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// The values of `bytes` of type `ty`, in order; `None` when `ty` has no
/// reader here (it is not in [`READABLE`]). A trailing partial block is
/// ignored: callers pass whole blocks (the GGUF reader checked the sizes).
pub fn to_f32(ty: GgmlType, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match ty {
        GgmlType::F32 => per_block::<1, 4, _>(bytes, |b, o| o[0] = f32::from_le_bytes(*b)),
        GgmlType::F16 => per_block::<1, 2, _>(bytes, |b, o| o[0] = f16::from_le_bytes(*b).to_f32()),
        GgmlType::BF16 => per_block::<1, 2, _>(bytes, |b, o| o[0] = bf16::from_le_bytes(*b).to_f32()),
        GgmlType::Q4_0 => per_block(bytes, q4_0),
        GgmlType::Q4_1 => per_block(bytes, q4_1),
        GgmlType::Q5_0 => per_block(bytes, q5_0),
        GgmlType::Q5_1 => per_block(bytes, q5_1),
        GgmlType::Q8_0 => per_block(bytes, q8_0),
        GgmlType::Q2_K => per_block(bytes, q2_k),
        GgmlType::Q3_K => per_block(bytes, q3_k),
        GgmlType::Q4_K => per_block(bytes, q4_k),
        GgmlType::Q5_K => per_block(bytes, q5_k),
        GgmlType::Q6_K => per_block(bytes, q6_k),
        _ => return None,
    })
}

/// Applies `f` to every block of `B` bytes, writing `QK` values each, in
/// parallel (`f` is generic, not a `fn` pointer, so it is inlined).
fn per_block<const QK: usize, const B: usize, F>(bytes: &[u8], f: F) -> Vec<f32>
where
    F: Fn(&[u8; B], &mut [f32; QK]) + Sync + Send,
{
    let (blocks, _) = bytes.as_chunks::<B>();
    let mut out = vec![0f32; blocks.len() * QK];
    let (outs, _) = out.as_chunks_mut::<QK>();
    // Single-value "blocks" (the float types) need bigger tasks to pay for themselves.
    let min_len = MIN_BLOCKS_PER_TASK * (QK_K / QK).max(1);
    outs.par_iter_mut()
        .zip(blocks.par_iter())
        .with_min_len(min_len)
        .for_each(|(o, b)| f(b, o));
    out
}

/// The little-endian f16 at `b[at..at + 2]`, widened.
#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_0, 32 elements in 18 bytes: `d: f16 @0, qs: [u8; 16] @2`.
/// Element j < 16 is the low nibble of `qs[j]`, element j + 16 its high nibble;
/// value = (q − 8)·d.
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = half(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1, 32 elements in 20 bytes: `d: f16 @0, m: f16 @2, qs: [u8; 16] @4`;
/// nibbles as Q4_0; value = q·d + m (two roundings).
fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = (q & 0x0F) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// The 5-bit quants of Q5_0 / Q5_1: `qh` is a little-endian u32 whose bit e is
/// bit 4 of element e; the low 4 bits are the nibbles of `qs` as in Q4_0.
#[inline(always)]
fn q5_quants(qh: [u8; 4], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4) as u8;
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
    }
    q
}

/// Q5_0, 32 elements in 22 bytes: `d: f16 @0, qh: [u8; 4] @2, qs: [u8; 16] @6`;
/// value = (q − 16)·d.
fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = half(b, 0);
    let q = q5_quants([b[2], b[3], b[4], b[5]], &b[6..]);
    for (y, &q) in y.iter_mut().zip(&q) {
        *y = (q as i32 - 16) as f32 * d;
    }
}

/// Q5_1, 32 elements in 24 bytes: `d: f16 @0, m: f16 @2, qh: [u8; 4] @4,
/// qs: [u8; 16] @8`; value = q·d + m.
fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let q = q5_quants([b[4], b[5], b[6], b[7]], &b[8..]);
    for (y, &q) in y.iter_mut().zip(&q) {
        *y = q as f32 * d + m;
    }
}

/// Q8_0, 32 elements in 34 bytes: `d: f16 @0, qs: [i8; 32] @2`; value = q·d.
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = half(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..]) {
        *y = (q as i8) as f32 * d;
    }
}

/// Q2_K, 256 elements in 84 bytes: `scales: [u8; 16] @0, qs: [u8; 64] @16,
/// d: f16 @80, dmin: f16 @82`. Element e = 128·h + 32·s + l (h < 2, s < 4,
/// l < 32): q = (qs[32·h + l] >> 2s) & 3. Its group of 16 is g = e / 16 with
/// `scales[g]` = scale (low nibble) | min (high nibble);
/// value = (d·scale)·q − dmin·min.
fn q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half(b, 80), half(b, 82));
    for (e, y) in y.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let q = (qs[32 * h + l] >> (2 * s)) & 3;
        let sc = scales[e / 16];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        *y = dl * q as f32 - ml;
    }
}

/// Q3_K, 256 elements in 110 bytes: `hmask: [u8; 32] @0, qs: [u8; 64] @32,
/// scales: [u8; 12] @96, d: f16 @108`. Element e = 128·h + 32·s + l: the low
/// two bits are (qs[32·h + l] >> 2s) & 3, and bit (4h + s) of `hmask[l]` set
/// means no offset, clear means −4: q = low − (bit ? 0 : 4), in −4..=3.
/// Group g = e / 16 has a 6-bit scale: low 4 bits from nibble (g / 8) of
/// `scales[g % 8]`, high 2 bits from bits 2·(g / 4) of `scales[8 + g % 4]`;
/// value = (d·(scale − 32))·q.
fn q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half(b, 108);
    let mut dl = [0f32; 16];
    for (g, dl) in dl.iter_mut().enumerate() {
        let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
        let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
        *dl = d * ((low | (high << 4)) as i32 - 32) as f32;
    }
    for (e, y) in y.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
        let offset = if (hmask[l] >> (4 * h + s)) & 1 == 1 { 0 } else { 4 };
        *y = dl[e / 16] * (low - offset) as f32;
    }
}

/// The 6-bit (scale, min) of sub-block j < 8 of Q4_K / Q5_K from their 12
/// packed bytes (`get_scale_min_k4` in ggml-quants.c): for j < 4 the low six
/// bits of bytes j and j + 4; for j ≥ 4 the nibbles of byte j + 4 with the top
/// two bits of bytes j − 4 and j as bits 4..5.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K, 256 elements in 144 bytes: `d: f16 @0, dmin: f16 @2,
/// scales: [u8; 12] @4, qs: [u8; 128] @16`. Element e = 64·c + 32·t + l
/// (c < 4, t < 2, l < 32): q is the low (t = 0) or high (t = 1) nibble of
/// `qs[32·c + l]`. Sub-block j = e / 32 has (scale, min) = `scale_min_k4(j)`;
/// value = (d·scale)·q − dmin·min.
fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (j, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let (c, shift) = (j / 2, 4 * (j % 2));
        for (l, y) in y.iter_mut().enumerate() {
            let q = (qs[32 * c + l] >> shift) & 0x0F;
            *y = d1 * q as f32 - m1;
        }
    }
}

/// Q5_K, 256 elements in 176 bytes: `d: f16 @0, dmin: f16 @2,
/// scales: [u8; 12] @4, qh: [u8; 32] @16, qs: [u8; 128] @48`. As Q4_K, plus
/// bit j = e / 32 of `qh[l]` as bit 4 of q (q in 0..=31);
/// value = (d·scale)·q − dmin·min.
fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let (c, shift) = (j / 2, 4 * (j % 2));
        for (l, y) in y.iter_mut().enumerate() {
            let q = ((qs[32 * c + l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
            *y = d1 * q as f32 - m1;
        }
    }
}

/// Q6_K, 256 elements in 210 bytes: `ql: [u8; 128] @0, qh: [u8; 64] @128,
/// scales: [i8; 16] @192, d: f16 @208`. Element e = 128·h + 32·k + l
/// (h < 2, k < 4, l < 32): the low 4 bits are the low (k < 2) or high (k ≥ 2)
/// nibble of `ql[64·h + 32·(k % 2) + l]`, the high 2 bits are
/// (qh[32·h + l] >> 2k) & 3; q = that − 32, in −32..=31.
/// value = (d·scales[e / 16])·q.
fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for (e, y) in y.iter_mut().enumerate() {
        let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
        let high = (qh[32 * h + l] >> (2 * k)) & 0x03;
        let q = (low | (high << 4)) as i32 - 32;
        let dl = d * (scales[e / 16] as i8) as f32;
        *y = dl * q as f32;
    }
}
