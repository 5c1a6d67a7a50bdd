//! A vision-language spec on an engine that takes no image: the run is
//! skipped once with the engine's reason (every check skipped with it, none
//! failed), and the same engine still runs a text spec; LLaVA's golden-free
//! checks fail on their planted bugs.

use crate::checks::Status;
use crate::engine::capabilities::Capabilities;
use crate::engine::cpu::CpuEngine;
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};
use crate::model::ModelConfig;
use crate::plan::Plan;
use crate::runner::{run_on, Filter};
use crate::spec::Spec;

/// The CPU engine, saying it runs text-only models.
struct TextOnly(CpuEngine);

impl Engine for TextOnly {
    fn name(&self) -> &str {
        "text-only"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            no_images: Some("it has no vision tower".into()),
            ..Capabilities::all()
        }
    }
    fn config(&self) -> &ModelConfig {
        self.0.config()
    }
    fn run(&self, req: &RunRequest, taps: &TapSet) -> crate::error::Result<RunOutput> {
        self.0.run(req, taps)
    }
}

fn plan(spec: &str) -> Plan {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    Plan::build(Spec::load(&root.join("specs").join(spec)).unwrap(), None).unwrap()
}

#[test]
fn a_vlm_spec_on_a_text_only_engine_is_skipped_once_with_its_reason() {
    for spec in ["qwen2-vl-tiny.yaml", "llava-tiny.yaml", "llava-next-tiny.yaml"] {
        let p = plan(spec);
        let eng = TextOnly(CpuEngine::load(&p.model).unwrap());
        let r = run_on(&p, &eng, &Filter::default(), &|id| id.to_string());
        let why = r.skipped.clone().expect("the run is skipped as a whole");
        assert!(
            why.contains("cannot run this vision-language spec") && why.contains("no vision tower"),
            "{spec}: {why}"
        );
        assert!(!r.outcomes.is_empty(), "{spec}");
        assert!(r.outcomes.iter().all(|o| o.status == Status::Skip && o.message == why), "{spec}");
    }
}

#[test]
fn a_text_spec_on_a_text_only_engine_runs() {
    let p = plan("qwen2-tiny.yaml");
    let eng = TextOnly(CpuEngine::load(&p.model).unwrap());
    let r = run_on(&p, &eng, &Filter::default(), &|id| id.to_string());
    assert!(r.skipped.is_none());
    assert!(r.outcomes.iter().any(|o| o.status == Status::Pass));
}

/// LLaVA's golden-free checks each fail on their planted bugs (and pass
/// on the correct engine): the tower's activation is quick_gelu, the
/// features are hidden state −2 without CLS, the image-token rows are
/// the projector's in NeXT's packed order.
#[test]
fn each_llava_invariant_fails_on_its_planted_bug() {
    use crate::engine::cpu::mutants::Mutant;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (spec, cases) in [
        (
            "llava-tiny.yaml",
            vec![
                (Mutant::LlavaTowerErfGelu, "prefill/vision.blk.0.mlp_act::activation"),
                (Mutant::LlavaFeatureLastLayer, "prefill/vision.features::feature_select"),
                (Mutant::LlavaClsKept, "prefill/vision.features::feature_select"),
                (Mutant::LlavaImageTokenShort, "prefill/vision.merger::image_tokens"),
                (Mutant::LlavaImageTokenShort, "prefill/vision.merger::packing"),
            ],
        ),
        (
            "llava-next-tiny.yaml",
            vec![
                (Mutant::NextNewlineMissing, "prefill/vision.merger::packing"),
                (Mutant::NextNewlineMissing, "prefill/vision.merger::image_tokens"),
                (Mutant::NextUnpadRoundedOther, "prefill/vision.merger::packing"),
            ],
        ),
    ] {
        let filter = Filter(Some(
            ["prefill/vision.blk.0.mlp_act::", "prefill/vision.features::", "prefill/vision.merger::"]
                .map(String::from)
                .to_vec(),
        ));
        let plan = Plan::build(Spec::load(&root.join("specs").join(spec)).unwrap(), None).unwrap();
        let status = |m: Option<Mutant>, id: &str| {
            let eng = CpuEngine::load(&plan.model).unwrap();
            let eng = match m {
                Some(m) => eng.mutated(m),
                None => eng,
            };
            let r = run_on(&plan, &eng, &filter, &|id| id.to_string());
            let o = r.outcomes.iter().find(|o| o.id == id).unwrap_or_else(|| panic!("no check {id}"));
            (o.status, o.message.clone())
        };
        for (m, id) in cases {
            let (ok, msg) = status(None, id);
            assert_eq!(ok, Status::Pass, "{spec}: {id} on the correct engine: {msg}");
            let (bad, msg) = status(Some(m), id);
            assert_eq!(bad, Status::Fail, "{spec}: {m:?} must fail {id}: {msg}");
            println!("{m:?}: {id}: {msg}");
        }
    }
}
