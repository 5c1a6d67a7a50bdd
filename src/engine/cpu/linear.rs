//! The CPU engine's projections: an HF `nn.Linear` as the engine holds and
//! applies it (storage rounding, 8-bit activations), and the gated MLP built
//! of three of them (a dense layer's, an expert's, a shared expert's).

use crate::error::Result;
use crate::model::Weights;
use crate::tensor::{DType, Tensor};

use super::matmul::{matmul_wt, matmul_wt_many};

/// An HF `nn.Linear`: `weight` `[out, in]`, optional `bias` `[out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out, in]`; f32 weights stay in the file's memory map (no copy), see
    /// `Tensor::mapped`.
    pub w: Tensor,
    pub bias: Option<Vec<f32>>,
    pub out_f: usize,
    pub in_f: usize,
    /// Quantise each input row to 8 bits in blocks of this many values
    /// before the GEMM (llama.cpp's Q8_0 = 32, Q8_K = 256); None: exact.
    pub q8_block: Option<usize>,
}

/// `x` rounded to 8-bit integers with one scale per block of `block` values
/// along each row of `in_f` (scale amax/127, round to nearest), as llama.cpp
/// quantises activations for its quantised matmuls.
/// `x` as a matmul reads it: quantised when `block` is set, else as it is.
pub fn matmul_input(x: &[f32], in_f: usize, block: Option<usize>) -> std::borrow::Cow<'_, [f32]> {
    match block {
        Some(b) => std::borrow::Cow::Owned(quantise_q8(x, in_f, b)),
        None => std::borrow::Cow::Borrowed(x),
    }
}

pub fn quantise_q8(x: &[f32], in_f: usize, block: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    for row in out.chunks_mut(in_f) {
        for b in row.chunks_mut(block) {
            let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                continue;
            }
            let d = amax / 127.0;
            for v in b.iter_mut() {
                *v = (*v / d).round() * d;
            }
        }
    }
    out
}

impl Linear {
    /// A linear from its parts (a reshaped kernel: the vision patch embedding).
    pub(crate) fn from_parts(w: Tensor, bias: Option<Vec<f32>>, out_f: usize, in_f: usize) -> Linear {
        Linear {
            w,
            bias,
            out_f,
            in_f,
            q8_block: None,
        }
    }

    pub(crate) fn load(ws: &mut Weights, prefix: &str, out_f: usize, in_f: usize) -> Result<Linear> {
        let w = ws.take(&format!("{prefix}.weight"), &[out_f, in_f])?;
        let bias = ws.take_opt(&format!("{prefix}.bias"), &[out_f])?.map(|t| t.into_data());
        Ok(Linear {
            w,
            bias,
            out_f,
            in_f,
            q8_block: None,
        })
    }

    /// `x[rows, in] → [rows, out]` with outputs held in `storage`: the GEMM in
    /// f32, then the bias added (as torch's addmm result is `bias + x·wᵀ`).
    /// With f16/bf16 storage the GEMM result is rounded to storage, and with a
    /// bias `round(round(x·wᵀ) + bias)`, as the CUDA engine stores the GEMM
    /// output and adds the bias in a second kernel. With f32 storage nothing is
    /// rounded.
    pub fn forward(&self, x: &[f32], rows: usize, storage: DType) -> Vec<f32> {
        self.forward_bias(x, rows, storage, true)
    }

    /// `forward`, adding the bias only if `with_bias` (false only for a
    /// planted bug in tests).
    pub fn forward_bias(&self, x: &[f32], rows: usize, storage: DType, with_bias: bool) -> Vec<f32> {
        let x = matmul_input(x, self.in_f, self.q8_block);
        let y = matmul_wt(&x, rows, self.in_f, self.w.data(), self.out_f);
        self.finish(y, storage, with_bias)
    }

    /// `forward` of several projections of the same input (q, k, v; gate,
    /// up) in one parallel pass: the same values as one `forward` each.
    pub fn forward_many<const N: usize>(
        lins: [&Linear; N],
        x: &[f32],
        rows: usize,
        storage: DType,
        with_bias: bool,
    ) -> [Vec<f32>; N] {
        let in_f = lins[0].in_f;
        assert!(lins.iter().all(|l| l.in_f == in_f), "projections of one input");
        let x = matmul_input(x, in_f, lins[0].q8_block);
        let ws: Vec<(&[f32], usize)> = lins.iter().map(|l| (l.w.data(), l.out_f)).collect();
        let mut ys = matmul_wt_many(&x, rows, in_f, &ws).into_iter();
        lins.map(|l| l.finish(ys.next().expect("one output per projection"), storage, with_bias))
    }

    /// The GEMM output rounded to storage, then the bias added and rounded.
    fn finish(&self, mut y: Vec<f32>, storage: DType, with_bias: bool) -> Vec<f32> {
        storage.round_slice(&mut y);
        if let Some(b) = self.bias.as_ref().filter(|_| with_bias) {
            for row in y.chunks_exact_mut(self.out_f) {
                for (v, &bb) in row.iter_mut().zip(b) {
                    *v = storage.round(*v + bb);
                }
            }
        }
        y
    }

    pub(crate) fn round_to(&mut self, storage: DType) {
        storage.round_slice(self.w.data_mut());
        if let Some(b) = &mut self.bias {
            storage.round_slice(b);
        }
    }
}

/// A gated MLP, `down(act(gate(x))·up(x))`: a dense layer's, an expert's, a
/// shared expert's.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    /// The MLP under HF prefix `p` (`….mlp`, `….mlp.experts.3`), intermediate size `f`.
    pub(crate) fn load(ws: &mut Weights, p: &str, f: usize, e: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate: Linear::load(ws, &format!("{p}.gate_proj"), f, e)?,
            up: Linear::load(ws, &format!("{p}.up_proj"), f, e)?,
            down: Linear::load(ws, &format!("{p}.down_proj"), e, f)?,
        })
    }
    pub(crate) fn visit(&self, p: &str, f: &mut crate::engine::WeightVisitor) {
        visit_linear(f, &format!("{p}.gate_proj"), &self.gate);
        visit_linear(f, &format!("{p}.up_proj"), &self.up);
        visit_linear(f, &format!("{p}.down_proj"), &self.down);
    }
    pub(crate) fn linears_mut(&mut self) -> [&mut Linear; 3] {
        [&mut self.gate, &mut self.up, &mut self.down]
    }
}

/// Visits a linear's weight and bias under HF name `name` (`….q_proj`).
pub(crate) fn visit_linear(f: &mut crate::engine::WeightVisitor, name: &str, l: &Linear) {
    f(&format!("{name}.weight"), &[l.out_f, l.in_f], l.w.data());
    if let Some(b) = &l.bias {
        f(&format!("{name}.bias"), &[l.out_f], b);
    }
}
