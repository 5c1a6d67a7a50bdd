//! The protocol's request bodies, apart from the process plumbing of
//! `exec`: how sampling and a sequence of a `run_batch` request are
//! written, and how touchstone reads a protocol engine's resident set for
//! the `repeat` check.

use std::path::Path;

use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::sampling::Sampling;

pub(super) fn sampling_json(s: &Sampling) -> Value {
    match s {
        Sampling::Greedy => json!("greedy"),
        Sampling::Random {
            temperature,
            top_k,
            top_p,
        } => json!({"temperature": temperature, "top_k": top_k, "top_p": top_p}),
    }
}

/// A sequence of a batch as the protocol sends it.
pub(super) fn seq_json(s: &super::batch::SeqRequest, out: &Path) -> Value {
    let r = &s.run;
    let forced = r.forced.as_ref().map(|f| f[..r.decode_steps.min(f.len())].to_vec());
    json!({
        "prompt": r.prompt,
        "decode_steps": r.decode_steps,
        "sampling": sampling_json(&r.sampling),
        "seed": r.seed,
        "forced": forced,
        "chunks": (!s.chunks.is_empty()).then_some(&s.chunks),
        "prefix": s.prefix.map(|p| json!({"from": p.from, "len": p.len})),
        "out": out,
    })
}

/// The resident set of process `pid` (Linux: VmRSS of /proc/PID/status).
pub(super) fn resident_bytes(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Usage(format!("cannot read {path}: {e}")))?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| Error::Usage(format!("{path} has no VmRSS line")))
}
