//! Every check of touchstone's default spec as a `cargo test` trial of this
//! crate: `cargo test -p tiny-engine --test touchstone -- --list` lists them,
//! `-- blk.0` filters, `-- --exact 'tiny-rs::qwen2-tiny::prefill/blk.0.q::golden:hf'`
//! reruns one.

use std::path::Path;

fn main() {
    let specs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs");
    touchstone::harness::Harness::new("tiny-rs", tiny_engine::TinyEngine::load)
        .spec(specs.join("qwen2-tiny.yaml"))
        .spec(specs.join("llama-tiny.yaml"))
        .run();
}
