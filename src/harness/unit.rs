//! What one trial judges: one check, every check of one stage at one step,
//! or every check of one layer at one step.
//!
//! Under `cargo test` a trial is one check (`prefill/blk.0.q::golden:hf`):
//! trials are closures in one process and cost microseconds. Under
//! cargo-nextest every trial is a process of its own, and on a 2-core
//! machine a process costs about 6 ms however little it does (10 to 30 ms
//! while the machine is busy): the ~40,000 checks of the shipped specs
//! would take 2.4x `cargo test`'s wall time in process starts alone, and
//! even one trial per stage (~9,800 run) added a tenth to the suite. So
//! under nextest a trial is a layer at a step (`prefill/blk.11`: every check
//! of every stage of block 11; `prefill/embed`, `decode1/logits` and the
//! other stages outside the blocks are their own), and a run check stays
//! its own trial. The first failing trial of a run names the layer; its
//! message holds every failing check's full message and rerun command, so
//! nothing a per-check trial says is lost.
//! `TOUCHSTONE_TRIALS=check`, `=stage` or `=layer` chooses under any runner.

use std::collections::BTreeMap;

/// What one trial reports.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Pass,
    Ignored(String),
    Fail(String),
}

/// Whether trials run one per process under cargo-nextest.
pub fn under_nextest() -> bool {
    std::env::var_os("NEXTEST_RUN_ID").is_some() || std::env::var_os("NEXTEST").is_some_and(|v| v == "1")
}

/// The environment variable that chooses the granularity.
pub const VAR: &str = "TOUCHSTONE_TRIALS";

/// How many checks one trial judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    Check,
    Stage,
    Layer,
}

impl Granularity {
    /// `TOUCHSTONE_TRIALS`, else layer under nextest and check otherwise.
    /// Listing and running read the same environment, so a trial's name is
    /// the same in both.
    pub fn from_env() -> Granularity {
        match std::env::var(VAR).as_deref() {
            Ok("check") => Granularity::Check,
            Ok("stage") => Granularity::Stage,
            Ok("layer") => Granularity::Layer,
            _ if under_nextest() => Granularity::Layer,
            _ => Granularity::Check,
        }
    }

    /// The trial a check id belongs to: the id itself, its `<step>/<stage>`,
    /// or its `<step>/blk.<i>` (a stage outside the blocks is its own layer;
    /// run checks, `run::…`, are always their own).
    pub fn unit<'a>(&self, id: &'a str) -> &'a str {
        if *self == Granularity::Check || id.starts_with("run::") {
            return id;
        }
        let stage = id.split_once("::").map_or(id, |(stage, _)| stage);
        if *self == Granularity::Stage {
            return stage;
        }
        // `<step>/blk.<i>.<name>` → `<step>/blk.<i>`.
        match stage.find("/blk.") {
            Some(at) => {
                let layer = at + "/blk.".len();
                let end = stage[layer..].find('.').map_or(stage.len(), |dot| layer + dot);
                &stage[..end]
            }
            None => stage,
        }
    }
}

/// The checks' verdicts grouped into their trials' verdicts, in the order
/// of the checks: a trial fails when any of its checks fails (every failing
/// message, in order, under a line counting them), is ignored when all of
/// them are (every reason), and passes otherwise.
pub fn combine(g: Granularity, checks: &[(String, Verdict)]) -> BTreeMap<String, Verdict> {
    let mut units: BTreeMap<String, Vec<(&str, &Verdict)>> = BTreeMap::new();
    for (id, v) in checks {
        units.entry(g.unit(id).to_string()).or_default().push((id, v));
    }
    units
        .into_iter()
        .map(|(unit, members)| {
            let v = if members.len() == 1 && members[0].0 == unit {
                members[0].1.clone()
            } else {
                combined(&members)
            };
            (unit, v)
        })
        .collect()
}

/// One verdict for several: failed when any failed (every failing message
/// under its id), ignored when all were (every reason), else passed.
pub fn combined(members: &[(&str, &Verdict)]) -> Verdict {
    let failed: Vec<String> = members
        .iter()
        .filter_map(|(id, v)| match v {
            Verdict::Fail(msg) => Some(format!("--- {id}: FAILED\n{msg}")),
            _ => None,
        })
        .collect();
    if !failed.is_empty() {
        return Verdict::Fail(format!(
            "{} of {} checks failed\n{}",
            failed.len(),
            members.len(),
            failed.join("\n")
        ));
    }
    let ignored: Vec<String> = members
        .iter()
        .filter_map(|(id, v)| match v {
            Verdict::Ignored(r) => Some(format!("{id}: {r}")),
            _ => None,
        })
        .collect();
    if ignored.len() == members.len() {
        Verdict::Ignored(ignored.join("; "))
    } else {
        Verdict::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_units_group_a_stages_checks_and_keep_run_checks() {
        let g = Granularity::Stage;
        assert_eq!(g.unit("prefill/blk.0.q::golden:hf"), "prefill/blk.0.q");
        assert_eq!(g.unit("run::kv_cache"), "run::kv_cache");
        assert_eq!(g.unit("run::greedy_tokens:hf"), "run::greedy_tokens:hf");
        assert_eq!(
            Granularity::Check.unit("prefill/blk.0.q::golden:hf"),
            "prefill/blk.0.q::golden:hf"
        );
        let l = Granularity::Layer;
        assert_eq!(l.unit("prefill/blk.11.attn_out::golden:hf"), "prefill/blk.11");
        assert_eq!(l.unit("decode4/blk.0.q_rope::rotates"), "decode4/blk.0");
        assert_eq!(l.unit("prefill/embed::finite"), "prefill/embed");
        assert_eq!(l.unit("decode1/logits::golden:hf"), "decode1/logits");
        assert_eq!(l.unit("run::kv_cache"), "run::kv_cache");
    }

    #[test]
    fn a_stage_fails_with_every_failing_message_and_passes_otherwise() {
        let checks = vec![
            ("prefill/embed::finite".to_string(), Verdict::Pass),
            (
                "prefill/embed::golden:hf".to_string(),
                Verdict::Fail("max abs 1\nrerun: a".into()),
            ),
            (
                "prefill/embed::golden:llama.cpp".to_string(),
                Verdict::Fail("max abs 2".into()),
            ),
            ("prefill/blk.0.q::finite".to_string(), Verdict::Pass),
            (
                "prefill/blk.0.q::golden:x".to_string(),
                Verdict::Ignored("no golden".into()),
            ),
            (
                "decode1/embed::golden:x".to_string(),
                Verdict::Ignored("no golden".into()),
            ),
            ("run::kv_cache".to_string(), Verdict::Fail("kv".into())),
        ];
        let u = combine(Granularity::Stage, &checks);
        assert_eq!(u.len(), 4);
        let Verdict::Fail(msg) = &u["prefill/embed"] else {
            panic!("{:?}", u["prefill/embed"])
        };
        assert!(msg.starts_with("2 of 3 checks failed\n--- prefill/embed::golden:hf: FAILED\nmax abs 1\nrerun: a"));
        assert!(msg.contains("--- prefill/embed::golden:llama.cpp: FAILED\nmax abs 2"));
        assert_eq!(u["prefill/blk.0.q"], Verdict::Pass);
        assert_eq!(
            u["decode1/embed"],
            Verdict::Ignored("decode1/embed::golden:x: no golden".into())
        );
        assert_eq!(u["run::kv_cache"], Verdict::Fail("kv".into()));
        // Per check, nothing is grouped.
        assert_eq!(combine(Granularity::Check, &checks).len(), checks.len());
    }
}
