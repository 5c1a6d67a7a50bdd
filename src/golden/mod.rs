//! Golden sets: the tensors one reference (HF transformers, llama.cpp, ...)
//! recorded for every (step, stage), the token ids it fed at each step, and its
//! provenance. A golden is validated when loaded — unknown keys, NaN/Inf values
//! and missing provenance are errors naming the file — so a check never compares
//! against a broken reference.

pub mod provenance;
mod routes;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::stage::{parse_key, Stage, Step};
use crate::tensor::io::read_safetensors;
use crate::tensor::Tensor;

/// The source name of a spec's `oracle:` in check ids and messages.
pub const ORACLE: &str = "oracle";

/// The format tag the recorders write into the safetensors metadata.
pub const FORMAT: &str = "touchstone-golden/1";

/// A question `GoldenSet` keeps the answers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Asked {
    Records,
    Aux,
}

/// The next `GoldenSet::uid`.
static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[derive(Debug)]
pub struct GoldenSet {
    pub source: String,
    pub path: PathBuf,
    tensors: BTreeMap<(Step, Stage), Tensor>,
    /// Token ids fed at each step (`<step>/tokens`).
    pub tokens: BTreeMap<Step, Vec<u32>>,
    /// The recorder's provenance JSON (library versions, prompt, model hash, ...).
    pub provenance: Value,
    /// Token rows kept of each step (`record.rows`), where only some were.
    rows: BTreeMap<Step, Vec<usize>>,
    /// `record.aux`: stages recorded at a step for the floors alone, every
    /// token row, never checked (patterns per step).
    aux: BTreeMap<Step, Vec<crate::stage::pattern::StagePattern>>,
    /// `overflow`: where the recorder's forward first went non-finite; it
    /// recorded nothing from there on.
    overflow: Option<(Step, Stage)>,
    /// A VLM golden's image grid (`prefill/vision.grid`, `image_grid_thw`).
    pub grid: Option<crate::model::ImageGrid>,
    /// `records` and `is_aux` as answered so far.
    answers: std::sync::Mutex<std::collections::HashMap<(Step, Stage, Asked), bool>>,
    /// This load's number, unique in the process: what a plan's memo keys
    /// values computed from this set by (`uid`).
    uid: u64,
    /// A spec's `reference_rules`: from this position on the reference
    /// computes by another rule than the config's (llama.cpp without a
    /// sliding window, ...), so no step reaching it is judged against it.
    departs_from: Option<usize>,
}

impl GoldenSet {
    pub fn load(source: &str, path: &Path) -> Result<GoldenSet> {
        let file = read_safetensors(path)?;
        let bad = |msg: String| Error::golden(path, msg);
        match file.metadata.get("format").map(String::as_str) {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(bad(format!(
                    "golden format `{other}` is not supported (expected `{FORMAT}`)"
                )))
            }
            None => {
                return Err(bad(format!(
                    "no `format` metadata: not a touchstone golden (expected `{FORMAT}`)"
                )))
            }
        }
        let provenance: Value = file
            .metadata
            .get("provenance")
            .ok_or_else(|| bad("no `provenance` metadata: every golden must say how it was recorded".into()))
            .and_then(|p| {
                serde_json::from_str(p).map_err(|e| bad(format!("`provenance` metadata is not JSON: {e}")))
            })?;

        let mut tensors = BTreeMap::new();
        for (key, t) in file.floats {
            let Some((step, stage)) = parse_key(&key) else {
                return Err(bad(format!(
                    "tensor `{key}` is not a `<step>/<stage>` key of the canonical vocabulary"
                )));
            };
            if let Some(i) = t.data().iter().position(|x| !x.is_finite()) {
                return Err(bad(format!(
                    "tensor `{key}` holds {} at index {:?}: a golden must be finite",
                    t.data()[i],
                    t.unravel(i)
                )));
            }
            tensors.insert((step, stage), t);
        }
        let mut tokens = BTreeMap::new();
        let mut grid = None;
        for (key, (shape, values)) in file.ints {
            let (step, what) = key
                .split_once('/')
                .and_then(|(s, w)| Some((Step::parse(s)?, w)))
                .ok_or_else(|| {
                    bad(format!(
                        "integer tensor `{key}` is not `<step>/tokens`, `<step>/positions` or `prefill/vision.grid`"
                    ))
                })?;
            match what {
                "tokens" => {
                    let ids = values
                        .iter()
                        .map(|&v| u32::try_from(v).map_err(|_| bad(format!("`{key}` holds token id {v}"))))
                        .collect::<Result<Vec<u32>>>()?;
                    tokens.insert(step, ids);
                }
                // A VLM's M-RoPE positions [3, T] are the `positions` stage;
                // a text golden's [T] are its steps' plain positions.
                "positions" if shape.len() == 2 && shape[0] == 3 => {
                    let t = Tensor::new(shape.clone(), values.iter().map(|&v| v as f32).collect());
                    tensors.insert((step, Stage::Positions), t);
                }
                "positions" => {}
                "vision.grid" if step == Step::Prefill => {
                    if shape != [1, 3] || values.iter().any(|&v| v <= 0) {
                        return Err(bad(format!(
                            "`{key}` has shape {shape:?} and values {values:?}: expected one positive (t, h, w) row [1, 3]"
                        )));
                    }
                    grid = Some(crate::model::ImageGrid {
                        t: values[0] as usize,
                        h: values[1] as usize,
                        w: values[2] as usize,
                    });
                }
                _ => {
                    return Err(bad(format!(
                        "integer tensor `{key}` is not `<step>/tokens`, `<step>/positions` or `prefill/vision.grid`"
                    )))
                }
            }
        }
        routes::canonicalise(&mut tensors);
        let rows = recorded_rows(&provenance, &tokens).map_err(bad)?;
        let aux = aux_patterns(&provenance).map_err(bad)?;
        let overflow = overflow_at(&provenance).map_err(bad)?;
        let is_aux = |step: &Step, stage: &Stage| aux.get(step).is_some_and(|ps| ps.iter().any(|p| p.matches(*stage)));
        for ((step, stage), t) in &tensors {
            let (Some(r), Some(axis)) = (rows.get(step), stage.row_axis()) else {
                continue;
            };
            // An auxiliary stage holds every row of its step.
            if is_aux(step, stage) {
                continue;
            }
            let last_logits =
                *stage == Stage::Logits && provenance.pointer("/record/logits").and_then(Value::as_str) == Some("last");
            if !last_logits && t.shape().get(axis) != Some(&r.len()) {
                return Err(bad(format!(
                    "tensor `{step}/{stage}` has shape {:?}, but the provenance says rows {r:?} of {step} were kept \
                     (axis {axis} should have {})",
                    t.shape(),
                    r.len()
                )));
            }
        }
        if !tokens.contains_key(&Step::Prefill) {
            return Err(bad(
                "no `prefill/tokens`: the golden does not say which prompt it was recorded with".into(),
            ));
        }
        Ok(GoldenSet {
            source: source.to_string(),
            path: path.to_path_buf(),
            tensors,
            tokens,
            provenance,
            rows,
            aux,
            overflow,
            grid,
            answers: Default::default(),
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            departs_from: None,
        })
    }

    /// Declares that this reference follows another rule from position
    /// `from` on (a spec's `reference_rules`): `records` is false for every
    /// step whose rows reach it.
    pub fn departing_from(mut self, from: usize) -> GoldenSet {
        self.departs_from = Some(from);
        self
    }

    /// The position this reference follows another rule from, if declared.
    pub fn departs_from(&self) -> Option<usize> {
        self.departs_from
    }

    /// The last position `step`'s rows reach (the prompt's last at the
    /// prefill, p + n − 1 at decode n).
    pub fn last_position(&self, step: Step) -> usize {
        let p = self.prompt().len();
        match step {
            Step::Prefill => p.saturating_sub(1),
            Step::Decode(n) => p + n - 1,
        }
    }

    /// Unique to this load in the process. Its tensors never change after
    /// loading, so a value computed from them may be kept under this number
    /// for as long as the process lives (a plan's `memo`); a damaged copy
    /// loaded in its place has a number of its own.
    pub fn uid(&self) -> u64 {
        self.uid
    }

    /// Where the recorder's forward first went non-finite (provenance
    /// `overflow`): it holds nothing from that (step, stage) on.
    pub fn overflow(&self) -> Option<(Step, Stage)> {
        self.overflow
    }

    /// Whether `stage` at `step` was recorded for the floors alone
    /// (`record.aux`): every token row, no check planned on it.
    pub fn is_aux(&self, step: Step, stage: Stage) -> bool {
        self.answered(step, stage, Asked::Aux, || {
            self.aux
                .get(&step)
                .is_some_and(|ps| ps.iter().any(|p| p.matches(stage)))
        })
    }

    /// The answer to `what` at (step, stage): kept, or `f`'s (the tensors and
    /// provenance never change after loading, so neither does the answer).
    fn answered(&self, step: Step, stage: Stage, what: Asked, f: impl FnOnce() -> bool) -> bool {
        let lock = || self.answers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = lock().get(&(step, stage, what)) {
            return *a;
        }
        let a = f();
        lock().insert((step, stage, what), a);
        a
    }

    /// Every step where this golden kept only some token rows, with those rows.
    pub fn row_subsets(&self) -> &BTreeMap<Step, Vec<usize>> {
        &self.rows
    }

    /// The token rows this golden kept of `stage` at `step` (`record.rows`),
    /// or None where it holds every row (the logits of a last-row golden are
    /// [`GoldenSet::logits_last_row`]'s).
    pub fn rows_at(&self, step: Step, stage: Stage) -> Option<&[usize]> {
        stage.row_axis()?;
        if self.is_aux(step, stage) {
            return None;
        }
        if stage == Stage::Logits && self.logits_last_row() {
            return None;
        }
        self.rows.get(&step).map(Vec::as_slice)
    }

    /// Whether this golden set out to record `step/stage`: its provenance's
    /// `record` (written by the recorders from a spec's `record:`) lists the
    /// steps and stage patterns recorded; absent, everything was. Checks are
    /// planned only where this holds, so a compact golden plans fewer checks
    /// rather than failing the rest, while a tensor it claims but lacks still
    /// fails its check.
    pub fn records(&self, step: Step, stage: Stage) -> bool {
        self.answered(step, stage, Asked::Records, || self.records_afresh(step, stage))
    }

    /// `records` read off the provenance: patterns parsed and stage names
    /// written at every call, which a run asks hundreds of thousands of times
    /// (every floor asks of every input), hence the answers kept.
    fn records_afresh(&self, step: Step, stage: Stage) -> bool {
        // Nothing where it follows another rule than the config's.
        if self.departs_from.is_some_and(|from| self.last_position(step) >= from) {
            return false;
        }
        // Nothing from where its forward overflowed on.
        if self.overflow.is_some_and(|o| (step, stage) >= o) {
            return false;
        }
        let rec = self.provenance.get("record");
        let listed = |k: &str, hit: &dyn Fn(&str) -> bool| match rec.and_then(|r| r.get(k)).and_then(Value::as_array) {
            None => true,
            Some(items) => items.iter().filter_map(Value::as_str).any(hit),
        };
        let step_name = step.to_string();
        let pattern_hit = |p: &str| crate::stage::pattern::StagePattern::parse(p).is_ok_and(|p| p.matches(stage));
        // `record.stages_at`: extra stage patterns recorded at one step only
        // (`record_hf.py --stages-at decode2=blk.*.attn_scores`).
        let extra = rec
            .and_then(|r| r.get("stages_at"))
            .and_then(|m| m.get(&step_name))
            .and_then(Value::as_array)
            .is_some_and(|items| items.iter().filter_map(Value::as_str).any(pattern_hit));
        extra || (listed("steps", &|s| s == step_name) && listed("stages", &pattern_hit))
    }

    /// True when the recorder kept only the last row of each step's logits
    /// (`record.logits: last`): a `[1, V]` tensor compared with the last row.
    pub fn logits_last_row(&self) -> bool {
        self.provenance.pointer("/record/logits").and_then(Value::as_str) == Some("last")
    }

    /// The (step, stage) of every tensor held.
    pub fn keys(&self) -> impl Iterator<Item = &(Step, Stage)> {
        self.tensors.keys()
    }

    pub fn get(&self, step: Step, stage: Stage) -> Option<&Tensor> {
        self.tensors.get(&(step, stage))
    }

    /// Decode steps recorded (`decode1` .. `decodeN` all present in `tokens`).
    pub fn decode_steps(&self) -> usize {
        (1..)
            .take_while(|n| self.tokens.contains_key(&Step::Decode(*n)))
            .count()
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[&Step::Prefill]
    }

    /// Tokens fed at decode steps 1..=n (teacher forcing), if recorded.
    pub fn forced(&self, n: usize) -> Option<Vec<u32>> {
        (1..=n)
            .map(|i| self.tokens.get(&Step::Decode(i)).and_then(|t| t.first().copied()))
            .collect()
    }

    /// `greedy_ids` from the provenance: the token the reference picked at each step.
    pub fn greedy_ids(&self) -> Result<Vec<u32>> {
        self.provenance
            .get("greedy_ids")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect()
            })
            .ok_or_else(|| Error::golden(&self.path, "provenance has no `greedy_ids` list"))
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

/// `record.aux` of a provenance ({step: [pattern, ...]}, written by the
/// recorders' `--aux`).
fn aux_patterns(prov: &Value) -> std::result::Result<BTreeMap<Step, Vec<crate::stage::pattern::StagePattern>>, String> {
    let mut out = BTreeMap::new();
    let Some(map) = prov.pointer("/record/aux") else {
        return Ok(out);
    };
    let map = map
        .as_object()
        .ok_or("provenance `record.aux` is not a map of step -> stage patterns")?;
    for (name, pats) in map {
        let step = Step::parse(name).ok_or(format!("provenance `record.aux`: `{name}` is not a step"))?;
        let pats = pats
            .as_array()
            .ok_or(format!(
                "provenance `record.aux.{name}` is not a list of stage patterns"
            ))?
            .iter()
            .map(|p| {
                p.as_str()
                    .ok_or(format!("provenance `record.aux.{name}` holds a non-string"))
                    .and_then(|p| {
                        crate::stage::pattern::StagePattern::parse(p)
                            .map_err(|e| format!("provenance `record.aux.{name}`: {e}"))
                    })
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        out.insert(step, pats);
    }
    Ok(out)
}

/// `overflow` of a provenance (`{step, stage, ...}`): where the recorder's
/// forward first went non-finite.
fn overflow_at(prov: &Value) -> std::result::Result<Option<(Step, Stage)>, String> {
    let Some(o) = prov.get("overflow") else { return Ok(None) };
    let field = |k: &str| o.get(k).and_then(Value::as_str);
    match (field("step"), field("stage")) {
        (Some(step), Some(stage)) => parse_key(&format!("{step}/{stage}")).map(Some).ok_or(format!(
            "provenance `overflow` names `{step}/{stage}`, not a step and stage"
        )),
        _ => Err("provenance `overflow` has no `step` and `stage`".into()),
    }
}

/// `record.rows` of a provenance ({step: [row, ...]}, written by the
/// recorders' `--rows`): ascending rows inside each step's tokens. A step
/// that kept every row is left out of the map.
fn recorded_rows(
    prov: &Value,
    tokens: &BTreeMap<Step, Vec<u32>>,
) -> std::result::Result<BTreeMap<Step, Vec<usize>>, String> {
    let mut out = BTreeMap::new();
    let Some(map) = prov.pointer("/record/rows") else {
        return Ok(out);
    };
    let map = map
        .as_object()
        .ok_or("provenance `record.rows` is not a map of step -> rows")?;
    for (name, rows) in map {
        let step = Step::parse(name).ok_or(format!("provenance `record.rows`: `{name}` is not a step"))?;
        let rows: Vec<usize> = rows
            .as_array()
            .and_then(|a| a.iter().map(|v| v.as_u64().map(|r| r as usize)).collect())
            .ok_or(format!("provenance `record.rows.{name}` is not a list of row indices"))?;
        let t = tokens.get(&step).map_or(0, Vec::len);
        if rows.is_empty() || rows.windows(2).any(|w| w[0] >= w[1]) || rows.iter().any(|&r| r >= t) {
            return Err(format!(
                "provenance `record.rows.{name}` is {rows:?}: expected ascending rows of the step's {t} tokens"
            ));
        }
        if rows.len() < t {
            out.insert(step, rows);
        }
    }
    Ok(out)
}
