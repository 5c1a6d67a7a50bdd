//! (being written) The CPU reference engine.
use std::path::Path;
use crate::error::Result;
use crate::model::ModelConfig;
use super::{Engine, RunOutput, RunRequest, TapSet};
pub struct CpuEngine { cfg: ModelConfig }
impl CpuEngine { pub fn load(model: &Path) -> Result<CpuEngine> { Ok(CpuEngine { cfg: ModelConfig::from_hf_dir(model)? }) } }
impl Engine for CpuEngine {
    fn name(&self) -> &'static str { "cpu" }
    fn config(&self) -> &ModelConfig { &self.cfg }
    fn run(&self, _req: &RunRequest, _taps: &TapSet) -> Result<RunOutput> { Err(crate::Error::engine("cpu", "not written yet")) }
}
