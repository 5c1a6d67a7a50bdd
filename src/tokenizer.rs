//! Text prompts: turning a spec's `prompt.text` into token ids with the
//! model's own tokenizer. (Being built: see issue 9; the tokenizer lands in
//! the next commit of this series.)
use std::path::Path;

use crate::error::{Error, Result};

/// Token ids of `text` for the model at `model` (`chat`: wrapped in the
/// model's chat template as one user message plus the generation prompt).
pub fn encode_prompt(model: &Path, _text: &str, _chat: bool) -> Result<Vec<u32>> {
    Err(Error::model(model, "text prompts are not supported yet"))
}
