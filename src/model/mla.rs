//! Multi-head latent attention (DeepSeek-V2/V3), read from an HF config.
//!
//! Each token's query comes from a low-rank latent (`q_a_proj`, its RMSNorm
//! `q_a_layernorm`, then `q_b_proj`; or a plain `q_proj` without
//! `q_lora_rank`), and its keys and values from one compressed latent shared
//! by every head: `kv_a_proj_with_mqa` gives `kv_lora_rank` latent values
//! and `qk_rope_head_dim` values of a decoupled RoPE key shared by all heads;
//! the latent is RMS-normed (`kv_a_layernorm`) and `kv_b_proj` expands it
//! into each head's `qk_nope_head_dim` key and `v_head_dim` value. Only the
//! last `qk_rope_head_dim` values of each head's q and k are rotated. The
//! stages keep the Llama names: `q`/`k` `[T, H, nope + rope]` before RoPE
//! (k = the head's expanded key, then the shared RoPE key), `v` `[T, H,
//! v_head_dim]`, `q_rope`/`k_rope` with the RoPE part rotated.
//!
//! HF's `rope_interleave` (the default, and what DeepSeek-V3 ships): the
//! RoPE part is read as interleaved pairs (x0, x1), (x2, x3), … and written
//! back de-interleaved, `[x_even·cos − x_odd·sin, x_odd·cos + x_even·sin]`
//! (`apply_rotary_pos_emb_interleave`): `q_rope` holds that layout.

use serde_json::Value;

/// A model's latent attention.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Mla {
    /// The query's latent rank; None: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// Each head's key dims without RoPE…
    pub nope: usize,
    /// …and with it (the shared RoPE key's width, HF's `head_dim`).
    pub rope: usize,
    pub v_head_dim: usize,
    /// RoPE reads interleaved pairs and writes them de-interleaved (HF's
    /// `rope_interleave`); false: rotate-half on the RoPE part.
    pub interleave: bool,
}

fn usize_of(v: &Value, k: &str) -> Result<usize, String> {
    v.get(k)
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .filter(|&n| n > 0 && n <= 1 << 16)
        .ok_or_else(|| format!("missing, non-integer or out-of-range key `{k}`"))
}

impl Mla {
    /// The latent attention of a DeepSeek-V3 config.
    pub fn from_config(v: &Value) -> Result<Mla, String> {
        let q_lora_rank = match v.get("q_lora_rank") {
            None | Some(Value::Null) => None,
            Some(_) => Some(usize_of(v, "q_lora_rank")?),
        };
        let interleave = match v.get("rope_interleave") {
            None | Some(Value::Null) => true,
            Some(x) => x.as_bool().ok_or_else(|| format!("`rope_interleave` is {x}, expected true or false"))?,
        };
        if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(
                "`attention_bias` is true: biases in the latent attention's projections are not implemented by \
                 touchstone's engines (refusing rather than checking a different model)"
                    .into(),
            );
        }
        let m = Mla {
            q_lora_rank,
            kv_lora_rank: usize_of(v, "kv_lora_rank")?,
            nope: usize_of(v, "qk_nope_head_dim")?,
            rope: usize_of(v, "qk_rope_head_dim")?,
            v_head_dim: usize_of(v, "v_head_dim")?,
            interleave,
        };
        if !m.rope.is_multiple_of(2) {
            return Err(format!("`qk_rope_head_dim` ({}) must be even for RoPE", m.rope));
        }
        Ok(m)
    }

    /// Each head's q/k width: nope + rope.
    pub fn qk_head_dim(&self) -> usize {
        self.nope + self.rope
    }
}
