//! What a verdict may depend on besides the engine's run: the model, the
//! prompt and its steps, the references (goldens and the float64 oracle) and
//! the tolerance policy. A plain borrowed view, so that every judge can be
//! unit-tested on synthetic goldens without building a plan; the plan lends
//! one (`Plan::facts`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::params::TolSpec;
use super::scaled::ScaledSpec;
use crate::arithmetic::Arithmetic;
use crate::engine::RunOutput;
use crate::golden::{GoldenSet, ORACLE};
use crate::model::file_tensors::FileTensors;
use crate::model::ModelConfig;
use crate::sampling::Sampling;
use crate::stage::shape::canonical_shape;
use crate::stage::{Stage, Step};
use crate::tensor::{DType, Tensor};

#[derive(Clone, Copy)]
pub struct Facts<'a> {
    /// The model file or folder the engine loaded.
    pub model: &'a Path,
    pub config: &'a ModelConfig,
    /// The model file's tensors, read on first use (`rms_norm`, `linear`).
    pub file: &'a FileTensors,
    pub prompt: &'a [u32],
    /// A VLM run's image (its grid shapes the vision stages).
    pub image: Option<&'a std::sync::Arc<crate::engine::ImageInput>>,
    /// Decode steps of the main run.
    pub decode_steps: usize,
    /// Tokens fed at decode steps (teacher forcing), when the prompt comes from a golden.
    pub forced: Option<&'a [u32]>,
    pub seed: u64,
    /// How the main run picks tokens (`sampler` recomputes the distribution).
    pub sampling: &'a Sampling,
    /// The storage dtype the engine runs in.
    pub storage: DType,
    /// The engine's arithmetic: what it declared, else plain arithmetic at
    /// its storage dtype (the runner sets it per engine).
    pub arithmetic: Arithmetic,
    pub goldens: &'a BTreeMap<String, Arc<GoldenSet>>,
    pub oracle: Option<&'a GoldenSet>,
    /// The spec's per-dtype golden tolerances (`tolerance:`).
    pub tolerance: &'a BTreeMap<DType, TolSpec>,
    /// The scaled policy's parameters (`scaled:`).
    pub scaled: &'a ScaledSpec,
    /// What one run's checks share (the runner's; None: each computed afresh).
    pub memo: Option<&'a super::memo::Memo>,
    /// What every run of the plan shares: values computed from the model
    /// file and the goldens alone (a reference's floor, a projection's
    /// oracle-only terms), the same whichever engine runs and however often
    /// (`touchstone power` judges one run at sixteen δ; a conformance run
    /// judges cpu and cuda-emu against the same references). Keyed by
    /// `goldens_key`, so a golden loaded in another's place is never served
    /// the other's values. None: each computed afresh.
    pub shared: Option<&'a super::memo::Memo>,
}

impl<'a> Facts<'a> {
    /// Which golden loads (`GoldenSet::uid`) the plan's shared values were
    /// computed from: part of every key of `shared`.
    pub fn goldens_key(&self) -> String {
        let mut k = format!("oracle {:?}", self.oracle.map(GoldenSet::uid));
        for (name, g) in self.goldens {
            k.push_str(&format!(" {name} {}", g.uid()));
        }
        k
    }

    /// A golden source by name, the oracle included.
    pub fn source(&self, name: &str) -> Option<&'a GoldenSet> {
        match name {
            ORACLE => self.oracle,
            _ => self.goldens.get(name).map(|g| g.as_ref()),
        }
    }

    /// The token rows the references kept of (step, stage) (`record.rows`),
    /// or None where they hold every row. Every source that kept a subset
    /// kept the same one (the plan refuses goldens that differ).
    pub fn rows_at(&self, step: Step, stage: Stage) -> Option<&'a [usize]> {
        self.oracle
            .into_iter()
            .chain(self.goldens.values().map(|g| g.as_ref()))
            .find_map(|g| g.rows_at(step, stage))
    }

    /// `t` on the references' rows of (step, stage): where they kept only
    /// some token rows and `t` holds every row of the step (an engine's
    /// capture), those rows; else `t` as it is (so a wrong shape still fails
    /// the shape comparison).
    pub fn on_recorded_rows<'t>(&self, t: &'t Tensor, step: Step, stage: Stage) -> Cow<'t, Tensor> {
        let (Some(rows), Some(axis)) = (self.rows_at(step, stage), stage.row_axis()) else {
            return Cow::Borrowed(t);
        };
        let n = self.step_dims(step).0;
        if t.shape().get(axis) == Some(&n) && rows.len() < n && rows.iter().all(|&r| r < n) {
            Cow::Owned(t.select_rows(axis, rows))
        } else {
            Cow::Borrowed(t)
        }
    }

    /// Tokens in a step and KV positions after it: (T, S).
    pub fn step_dims(&self, step: Step) -> (usize, usize) {
        let p = self.prompt.len();
        match step {
            Step::Prefill => (p, p),
            Step::Decode(n) => (1, p + n),
        }
    }

    /// A VLM step's M-RoPE positions `[3][T]` as a correct engine computes
    /// them from the prompt and the image grid (`model::vision::step_positions`);
    /// an error when the prompt does not fit the image or the model has no
    /// vision tower.
    pub fn mrope_positions(&self, step: Step) -> Result<[Vec<i64>; 3], String> {
        let vc = self.config.vision.as_ref().ok_or("the model has no M-RoPE")?;
        let grids: Vec<_> = self.image.iter().map(|i| i.grid).collect();
        let (p, delta) = crate::model::vision::mrope_positions(self.prompt, vc.image_token, &grids, vc.merge)?;
        match step {
            Step::Prefill => Ok(p),
            Step::Decode(n) => {
                let pos0 = self.prompt.len() + n - 1;
                let (t, m) = (vc.image_token, vc.merge);
                crate::model::vision::step_positions(&[0], pos0, t, &grids, m, delta).map(|(p, _)| p)
            }
        }
    }

    /// The canonical shape of a stage at a step.
    pub fn expected_shape(&self, step: Step, stage: Stage) -> Vec<usize> {
        let (t, s) = self.step_dims(step);
        canonical_shape(self.config, stage, t, s, self.image.map(|i| i.dims()))
    }

    /// Tokens the engine was fed at `step`: the prompt, or the decode token
    /// (forced from the golden, or sampled at the previous step).
    pub fn fed(&self, run: &RunOutput, step: Step) -> Vec<u32> {
        match step {
            Step::Prefill => self.prompt.to_vec(),
            Step::Decode(n) => match self.forced {
                Some(f) => vec![f[n - 1]],
                None => vec![run.sampled[n - 1]],
            },
        }
    }
}
