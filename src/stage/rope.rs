//! How a RoPE implementation pairs a head's dimensions for rotation: part of
//! the vocabulary because a spec names it (`rope: {style: interleaved}`), the
//! rope invariant checks it, and engines document which one they compute.

/// How a head's D dims are paired for rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// GPT-NeoX / HF "rotate_half": pairs (j, j + D/2).
    Neox,
    /// GPT-J / llama.cpp "normal" mode: pairs (2j, 2j + 1).
    Interleaved,
}

impl RopeStyle {
    pub fn pair(self, j: usize, d: usize) -> (usize, usize) {
        match self {
            RopeStyle::Neox => (j, j + d / 2),
            RopeStyle::Interleaved => (2 * j, 2 * j + 1),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            RopeStyle::Neox => "neox",
            RopeStyle::Interleaved => "interleaved",
        }
    }
}
