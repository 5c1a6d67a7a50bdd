//! The one step loop of the built-in engines. What a request means — validate
//! it, run the prompt as one prefill at positions 0..T, then each decode step
//! on one token (the forced one, or the one sampled at the step before) with
//! the KV cache of everything before it, record each step's positions and
//! sampled token, and capture `sample_probs` — is written here once; each
//! engine provides only its forward pass (`Forward`). So the CPU engine and
//! the CUDA engine cannot drift apart on a request's semantics.
//!
//! What an engine owes each step (`Forward::step`): append the step's keys and
//! values to its cache, write every tapped stage of the step into the captures
//! (canonical layout, tagged with its storage dtype), pick the step's token by
//! its own sampler (the CPU engine on the host, the CUDA engine on the device),
//! and hand back the last row of the step's logits when asked (`want_logits`):
//! the driver turns it into `sample_probs` with the sampling the engine applied.

use super::{Captures, RunOutput, RunRequest, TapSet};
use crate::error::Result;
use crate::sampling::{distribution, Sampling};
use crate::stage::{Stage, Step};
use crate::tensor::{DType, Tensor};

/// One step as the driver hands it to an engine.
pub struct StepIn<'a> {
    pub step: Step,
    /// The step's tokens: the prompt, or the one decode token.
    pub tokens: &'a [u32],
    /// The position of the first token (the cache holds exactly this many).
    pub pos0: usize,
    pub taps: &'a TapSet,
    pub caps: &'a mut Captures,
    /// Return the last row of the step's logits (`StepOut::logits`).
    pub want_logits: bool,
}

/// What an engine hands back after a step.
pub struct StepOut {
    /// The token its sampler picked from the step's last row of logits.
    pub token: u32,
    /// That row, on the host, when `StepIn::want_logits` asked for it.
    pub logits: Option<Vec<f32>>,
}

/// An engine's forward pass, as the driver runs it.
pub trait Forward {
    /// Per-run state: the KV cache, the sampler, device buffers.
    type Run;
    /// The engine's name in messages (`cpu`, `cuda-emu`).
    fn engine_name(&self) -> &str;
    fn vocab(&self) -> usize;
    /// The dtype every capture of a run is tagged with.
    fn storage(&self) -> DType;
    /// The state of a run of `req`, and the sampling the engine applies
    /// (what `sample_probs` is the distribution of).
    fn begin(&self, req: &RunRequest) -> Result<(Self::Run, Sampling)>;
    /// One forward pass (see the module comment).
    fn step(&self, run: &mut Self::Run, step: StepIn) -> Result<StepOut>;
    /// After the last step (a device waits for its queue here).
    fn end(&self, run: Self::Run) -> Result<()> {
        let _ = run;
        Ok(())
    }
}

/// Runs `req` on `engine`, capturing the stages in `taps` at every step.
pub fn run<F: Forward>(engine: &F, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
    req.validate(engine.engine_name(), engine.vocab())?;
    let (mut state, sampling) = engine.begin(req)?;
    let want_logits = taps.contains(Stage::SampleProbs) && matches!(sampling, Sampling::Random { .. });
    let mut captures = Captures::default();
    let mut sampled = Vec::with_capacity(req.decode_steps + 1);
    let mut positions: Vec<Vec<usize>> = Vec::with_capacity(req.decode_steps + 1);
    let mut tokens = req.prompt.clone();
    let mut pos0 = 0;
    for step in Step::sequence(req.decode_steps) {
        if let Step::Decode(n) = step {
            tokens = vec![req.decode_input(n, &sampled)];
        }
        let out = engine.step(
            &mut state,
            StepIn {
                step,
                tokens: &tokens,
                pos0,
                taps,
                caps: &mut captures,
                want_logits,
            },
        )?;
        if let Some(p) = out.logits.as_deref().and_then(|row| distribution(&sampling, row)) {
            let t = Tensor::new(vec![1, p.len()], p).with_dtype(engine.storage());
            captures.insert(step, Stage::SampleProbs, t);
        }
        sampled.push(out.token);
        positions.push((pos0..pos0 + tokens.len()).collect());
        pos0 += tokens.len();
    }
    engine.end(state)?;
    Ok(RunOutput {
        captures,
        sampled,
        positions,
        unmapped: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    //! The driver with a fake engine whose "logits" are a function of the
    //! step's tokens and positions: every assertion fails on a planted
    //! change of the loop (another forced index, positions, the probs rule).
    use super::*;

    /// Picks `(token + pos0 + 1) % vocab`; its logits row is one-hot there.
    struct Fake {
        vocab: usize,
        sampling: Sampling,
    }

    #[derive(Default)]
    struct Seen {
        inputs: Vec<(Step, Vec<u32>, usize)>,
    }

    impl Forward for Fake {
        type Run = Seen;
        fn engine_name(&self) -> &str {
            "fake"
        }
        fn vocab(&self) -> usize {
            self.vocab
        }
        fn storage(&self) -> DType {
            DType::BF16
        }
        fn begin(&self, _: &RunRequest) -> Result<(Seen, Sampling)> {
            Ok((Seen::default(), self.sampling.clone()))
        }
        fn step(&self, run: &mut Seen, s: StepIn) -> Result<StepOut> {
            run.inputs.push((s.step, s.tokens.to_vec(), s.pos0));
            let token = ((*s.tokens.last().unwrap() as usize + s.pos0 + 1) % self.vocab) as u32;
            let mut row = vec![0.0f32; self.vocab];
            row[token as usize] = 10.0;
            if s.taps.contains(Stage::Logits) {
                s.caps
                    .insert(s.step, Stage::Logits, Tensor::new(vec![1, self.vocab], row.clone()));
            }
            Ok(StepOut {
                token,
                logits: s.want_logits.then_some(row),
            })
        }
    }

    fn req(forced: Option<Vec<u32>>) -> RunRequest {
        RunRequest {
            prompt: vec![3, 1, 4],
            decode_steps: 3,
            sampling: Sampling::Greedy,
            seed: 0,
            forced,
            image: None,
        }
    }

    fn random() -> Sampling {
        Sampling::Random {
            temperature: 1.0,
            top_k: Some(2),
            top_p: None,
        }
    }

    #[test]
    fn free_running_steps_feed_the_previous_token_at_the_next_position() {
        let f = Fake {
            vocab: 50,
            sampling: Sampling::Greedy,
        };
        let out = run(&f, &req(None), &TapSet::none()).unwrap();
        // prefill: last token 4 at pos0 0 -> 5; decode1 feeds 5 at pos 3 -> 9; then 9 at 4 -> 14; 14 at 5 -> 20.
        assert_eq!(out.sampled, vec![5, 9, 14, 20]);
        assert_eq!(out.positions, vec![vec![0, 1, 2], vec![3], vec![4], vec![5]]);
        assert!(out.captures.is_empty());
    }

    #[test]
    fn teacher_forcing_feeds_the_forced_token_of_each_step() {
        let f = Fake {
            vocab: 50,
            sampling: Sampling::Greedy,
        };
        let out = run(&f, &req(Some(vec![40, 41, 42])), &TapSet::none()).unwrap();
        // decode n is fed forced[n-1] at position 2 + n.
        assert_eq!(out.sampled, vec![5, 44, 46, 48]);
        assert_eq!(out.positions[3], vec![5]);
    }

    #[test]
    fn sample_probs_are_captured_only_when_tapped_and_random() {
        let taps: TapSet = [Stage::SampleProbs].into_iter().collect();
        let greedy = Fake {
            vocab: 8,
            sampling: Sampling::Greedy,
        };
        assert!(run(&greedy, &req(None), &taps).unwrap().captures.is_empty());
        let rnd = Fake {
            vocab: 8,
            sampling: random(),
        };
        assert!(run(&rnd, &req(None), &TapSet::none()).unwrap().captures.is_empty());
        let out = run(&rnd, &req(None), &taps).unwrap();
        assert_eq!(out.captures.len(), 4, "one per step");
        let p = out.captures.get(Step::Decode(2), Stage::SampleProbs).unwrap();
        assert_eq!(p.shape(), &[1, 8]);
        assert_eq!(p.dtype(), DType::BF16, "tagged with the engine's storage");
        // The distribution of the engine's sampling over the step's row: top-2 of a one-hot row.
        let sum: f32 = p.data().iter().sum();
        assert!((sum - 1.0).abs() < 1e-6 && p.data().iter().filter(|x| **x > 0.0).count() == 2);
        let row_max = p.data().iter().cloned().fold(0.0f32, f32::max);
        assert_eq!(
            p.data().iter().position(|x| *x == row_max),
            Some(out.sampled[2] as usize)
        );
    }

    #[test]
    fn bad_requests_are_refused_before_any_step() {
        let f = Fake {
            vocab: 50,
            sampling: Sampling::Greedy,
        };
        let mut r = req(None);
        r.prompt.clear();
        assert!(run(&f, &r, &TapSet::none())
            .unwrap_err()
            .to_string()
            .contains("prompt is empty"));
        let mut r = req(None);
        r.prompt.push(50);
        assert!(run(&f, &r, &TapSet::none())
            .unwrap_err()
            .to_string()
            .contains("outside the vocabulary"));
        let r = req(Some(vec![1, 2]));
        assert!(run(&f, &r, &TapSet::none())
            .unwrap_err()
            .to_string()
            .contains("2 token(s) for 3 decode step(s)"));
    }
}
