//! Run checks: properties of whole runs of the engine (it runs again as each
//! needs). The table below is the whole vocabulary; each kind's file holds
//! its parameters and its evaluation.

super::registry::table!(RunRule;
    determinism::Determinism,
    kv_cache::KvCache,
    tap_invariance::TapInvariance,
    tokenizer::TokenizerCheck,
    greedy_tokens::GreedyTokens,
    next_token::NextToken,
    weights::Weights,
    batch_invariance::BatchInvariance,
    order_invariance::OrderInvariance,
    chunked_prefill::ChunkedPrefill,
    prefix_reuse::PrefixReuse,
    poisoned_memory::PoisonedMemory,
    repeat::Repeat,
);

mod serving;
pub mod reference_rule;

/// The serving checks (engines that take batches), in table order: what is
/// not applicable to an engine that declares no batches.
pub const SERVING: [&str; 6] = [
    <BatchInvariance as super::kind::Kind>::NAME,
    <OrderInvariance as super::kind::Kind>::NAME,
    <ChunkedPrefill as super::kind::Kind>::NAME,
    <PrefixReuse as super::kind::Kind>::NAME,
    <PoisonedMemory as super::kind::Kind>::NAME,
    <Repeat as super::kind::Kind>::NAME,
];

/// The next-token goldens' reader, for `goldens regen` and `accept`.
pub(crate) use next_token::set as next_token_set;

use super::facts::Facts;
use super::kind::RunCheck;
use super::verdict::Verdict;
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};

/// Evaluates `check` on `engine`; a check that needs a second run is skipped,
/// with the engine's reason, on an engine that can run only once (dumps).
pub fn evaluate(check: &dyn RunCheck, facts: &Facts, engine: &dyn Engine) -> Verdict {
    if check.reruns() {
        if let Some(why) = engine.reruns() {
            return Verdict::skip(format!("skipped: {why}"));
        }
    }
    check.evaluate(facts, engine)
}

/// One engine run, its error as text for a message.
fn run_engine(engine: &dyn Engine, req: &RunRequest, taps: &TapSet) -> Result<RunOutput, String> {
    engine.run(req, taps).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests;
