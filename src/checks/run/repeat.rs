//! `repeat`: the same request `runs` times on one loaded engine gives the
//! same numbers every time, and the engine's memory does not grow across
//! requests. What it catches: a KV cache not cleared between requests (the
//! second request reads the first's keys: "repeated tokens"), state that
//! drifts, one buffer leaked per request ("1.5 GB initially, 3.0 GB after
//! 100 generations").
//!
//! Memory, read by touchstone itself after each request: an in-process
//! engine's live heap (`heap::Meter`: exact bytes allocated by the threads
//! it ran on and not freed), and what `Engine::memory` reads from outside
//! (a protocol engine's resident set, the CUDA engine's device bytes). A
//! leak grows memory at every request; a cache filling once does not. So
//! the check fails when a reading grows at every one of the last `runs − 2`
//! requests (the first two warm up) by more than `max_growth` in all:
//! default 0 bytes for an exact count, 1 MiB for a resident set (pages and
//! the allocator's caches move it by whole pages).

use super::serving::{self, serving_kind, Rule};
use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::engine::batch::Serving;
use crate::engine::{Engine, RunOutput};

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Repeat {
    /// Requests (>= 4: two to warm up, then at least two to see a trend).
    #[serde(default = "default_runs")]
    pub runs: usize,
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
    /// Bytes memory may grow over the measured requests (default: 0 for an
    /// exact count, 1 MiB for a resident set).
    pub max_growth: Option<u64>,
}

fn default_runs() -> usize {
    5
}
fn default_steps() -> usize {
    2
}

serving_kind!(
    Repeat,
    "repeat",
    "runs (5, >= 4), decode_steps (2), max_growth (bytes; 0 for counted heap or device bytes, 1 MiB for a resident set)",
    "one request repeated on one loaded engine gives the same numbers, and memory does not grow with requests"
);

/// A series of memory readings, one per request.
struct Series {
    what: String,
    exact: bool,
    bytes: Vec<i64>,
}

impl Series {
    /// Why it shows a leak, if it does.
    fn leak(&self, bound: Option<u64>) -> Option<String> {
        let bound = bound.unwrap_or(if self.exact { 0 } else { 1 << 20 }) as i64;
        let measured = &self.bytes[1..];
        let every = measured.windows(2).all(|w| w[1] > w[0]);
        let growth = measured.last()? - measured.first()?;
        (every && growth > bound).then(|| {
            format!(
                "{} grew at every request after the second: {:?} bytes after each request, +{growth} bytes over the \
                 last {} (bound {bound})",
                self.what,
                self.bytes,
                measured.len() - 1
            )
        })
    }
}

impl Repeat {
    fn check(&self) -> Result<(), String> {
        if self.runs < 4 {
            return Err(format!("repeat needs runs >= 4, got {}", self.runs));
        }
        Ok(())
    }

    fn evaluate_mode(&self, facts: &Facts, engine: &dyn Engine, sv: &Serving) -> Result<Verdict, String> {
        let forced = serving::forced_tokens(engine, facts, self.decode_steps)?;
        let taps = serving::taps(engine, facts);
        let req = serving::batch(vec![serving::target(facts, self.decode_steps, &forced)]);
        let rule = Rule::of(sv, facts);
        let meter = crate::heap::Meter::new(rayon::current_num_threads())?;
        let mut heap = Series {
            what: "the engine's live heap (counted by touchstone's allocator)".into(),
            exact: true,
            bytes: Vec::new(),
        };
        let mut outside: Vec<Series> = Vec::new();
        let mut first: Option<RunOutput> = None;
        for r in 1..=self.runs {
            // Run and compare on the meter's threads, dropping the output
            // there: what stays counted is what the engine keeps.
            let diff = meter.run(|| -> Result<Option<String>, String> {
                let mut out = serving::run_batch(engine, &req, &taps)?;
                let out = out.remove(0);
                Ok(match &first {
                    None => {
                        first = Some(out);
                        None
                    }
                    Some(f) => serving::first_difference(f, &out, 0, &rule),
                })
            })?;
            if let Some(d) = diff {
                return Ok(Verdict::fail(format!(
                    "repeat: request {r} on the same loaded engine differs from request 1 ({}): first at {d}",
                    rule.describe()
                )));
            }
            heap.bytes.push(meter.live());
            let readings = engine.memory().map_err(|e| format!("reading the engine's memory: {e}"))?;
            for m in readings {
                let at = match outside.iter().position(|s| s.what == m.what) {
                    Some(i) => i,
                    None => {
                        outside.push(Series {
                            what: m.what.clone(),
                            exact: m.exact,
                            bytes: Vec::new(),
                        });
                        outside.len() - 1
                    }
                };
                outside[at].bytes.push(m.bytes as i64);
            }
        }
        let mut read = Vec::new();
        let inside = Some(&heap).filter(|_| crate::heap::Meter::installed() && engine.in_process());
        for s in inside.into_iter().chain(&outside) {
            if let Some(why) = s.leak(self.max_growth) {
                return Ok(Verdict::fail(format!("repeat: memory grows with requests: {why}")));
            }
            read.push(format!("{}: {:?} bytes", s.what, s.bytes));
        }
        if engine.in_process() && !crate::heap::Meter::installed() {
            read.push(
                "the in-process heap is not measured (touchstone was built without its `heap-meter` feature)".into(),
            );
        }
        Ok(Verdict::pass(format!(
            "repeat: {} requests on one loaded engine give the same numbers, {}; memory after each request: {}",
            self.runs,
            rule.describe(),
            read.join("; ")
        ))
        .metric("runs", self.runs as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::Series;

    #[test]
    fn growth_at_every_request_is_a_leak_and_a_cache_filling_once_is_not() {
        let s = |bytes: Vec<i64>, exact| Series {
            what: "x".into(),
            exact,
            bytes,
        };
        assert!(s(vec![100, 200, 300, 400, 500], true).leak(None).is_some());
        assert!(s(vec![100, 900, 900, 900, 900], true).leak(None).is_none());
        assert!(s(vec![100, 200, 300, 300, 400], true).leak(None).is_none());
        // A resident set creeping by a page a request stays under 1 MiB.
        assert!(s(vec![0, 4096, 8192, 12288, 16384], false).leak(None).is_none());
        assert!(s(vec![0, 4096, 8192, 12288, 16384], false).leak(Some(0)).is_some());
    }
}
