//! `run --shard K/N` and `merge`: shards of a selection merged back give, byte
//! for byte, the JSON report of one run of the whole selection; a merge that
//! is not exactly one selection's shards is refused (exit 2) with the reason.

mod common;
use common::*;

const SPECS: [&str; 2] = ["specs/qwen2-tiny.yaml", "specs/qwen3-tiny.yaml"];

fn run_json(dir: &std::path::Path, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let j = dir.join(name);
    let mut args = vec!["run"];
    args.extend(SPECS);
    args.extend(["-q", "--json", j.to_str().unwrap()]);
    args.extend(extra);
    let o = touchstone(&args);
    assert_eq!(o.code, 0, "{args:?}: {}", o.all());
    j
}

#[test]
fn three_shards_merge_into_the_single_runs_report() {
    let d = tempfile::tempdir().unwrap();
    let single = run_json(d.path(), "single.json", &[]);
    // Two runs over three shards: the third shard has none, and says so.
    let shards: Vec<_> = (1..=3)
        .map(|k| run_json(d.path(), &format!("s{k}.json"), &["--shard", &format!("{k}/3")]))
        .collect();
    let s1 = std::fs::read_to_string(&shards[0]).unwrap();
    assert!(s1.contains("\"shard\"") && s1.contains("qwen2-tiny") && !s1.contains("\"spec\": \"qwen3-tiny\""));
    let merged = d.path().join("merged.json");
    let s: Vec<&str> = shards.iter().rev().map(|p| p.to_str().unwrap()).collect();
    let o = touchstone(&["merge", s[0], s[1], s[2], "-q", "--json", merged.to_str().unwrap()]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("touchstone: PASSED"), "{}", o.stdout);
    let (a, b) = (std::fs::read(&single).unwrap(), std::fs::read(&merged).unwrap());
    assert!(a == b, "the merged report differs from the single run's");
    let diff = touchstone(&["diff", single.to_str().unwrap(), merged.to_str().unwrap(), "--changed"]);
    assert_eq!(diff.code, 0, "{}", diff.all());
}

#[test]
fn a_merge_that_is_not_one_selections_shards_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let s1 = run_json(d.path(), "s1.json", &["--shard", "1/2"]);
    let s2 = run_json(d.path(), "s2.json", &["--shard", "2/2"]);
    let plain = run_json(d.path(), "plain.json", &[]);
    let p = |x: &std::path::PathBuf| x.to_str().unwrap().to_string();
    let cases: [(Vec<String>, &str); 3] = [
        (vec![p(&s1)], "shard(s) 2/2 missing"),
        (vec![p(&s1), p(&s1), p(&s2)], "shard 1/2 is given twice"),
        (vec![p(&s1), p(&plain)], "not a shard's report"),
    ];
    for (files, want) in cases {
        let mut args = vec!["merge"];
        args.extend(files.iter().map(String::as_str));
        let o = touchstone(&args);
        assert_eq!(o.code, 2, "{args:?}: {}", o.all());
        assert!(o.stderr.contains(want), "{args:?}: expected {want:?} in {}", o.stderr);
    }
    let bad = touchstone(&["run", "--shard", "3/2"]);
    assert_eq!(bad.code, 2, "{}", bad.all());
}
