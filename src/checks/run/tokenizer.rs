//! `tokenizer`: an engine that ships its own tokenizer (and chat template)
//! gives the model's token ids. Engines tokenise for themselves in
//! production, and a wrong BOS rule or a special token split as text changes
//! every id after it while every stage check, fed touchstone's ids, passes.
//! The ids are judged against touchstone's tokenizer of the model file, which
//! `tests/tokenizer.rs` checks against HF and llama.cpp on fixtures: the
//! spec's prompt as text, probe texts (spaces, digits, punctuation), a text
//! with each chat marker the vocabulary has as one token, and, where the
//! model has a chat template, one user message rendered by it. Not
//! applicable to an engine without a tokenizer (the built-in engines).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::kind::{Kind, RuleEnv, RunCheck, RunRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::engine::Engine;
use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerCheck;

impl Kind for TokenizerCheck {
    const NAME: &'static str = "tokenizer";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "an engine's own tokenizer (protocol `tokenize`) gives the model's ids: the prompt, probe \
                                 texts, each chat marker as one token, and its chat template; not applicable to an \
                                 engine without one";
    fn bare() -> Self {
        TokenizerCheck
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| TokenizerCheck)
    }
}

impl RunRule for TokenizerCheck {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, _: &RuleEnv) -> Arc<dyn RunCheck> {
        Arc::new(self.clone())
    }
}

/// Texts every tokenizer must agree on: a sentence, runs of spaces, tabs and
/// newlines, digits and punctuation.
const PROBES: [&str; 3] = [
    "Golden tensors check every stage.",
    "  two leading spaces,\ttabs and\n\nnew lines  ",
    "digits 1234567, punctuation!? and (brackets)",
];

/// Chat markers some vocabulary has as one token (ChatML, Llama 3, Gemma,
/// Phi-3, SentencePiece's BOS/EOS).
const MARKERS: [&str; 9] = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|user|>",
    "<|end|>",
    "</s>",
];

impl RunCheck for TokenizerCheck {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        let tok = match Tokenizer::load(facts.model) {
            Ok(t) => t,
            Err(e) => return Verdict::skip(format!("skipped: the model's tokenizer cannot be read: {e}")),
        };
        let mut cases: Vec<(String, bool)> = PROBES.iter().map(|t| (t.to_string(), false)).collect();
        let prompt = tok.decode(facts.prompt);
        cases.push((prompt, false));
        // The model's own additions to any text (a BOS).
        let bare = tok.encode("").unwrap_or_default().len();
        for m in MARKERS {
            // A marker the vocabulary holds as one token (beyond any BOS).
            if tok.encode(m).is_ok_and(|ids| ids.len() == bare + 1) {
                cases.push((format!("{m}user\nhi{m}"), false));
            }
        }
        if tok.render_chat("hi").is_ok() {
            cases.push(("hi".into(), true));
        }
        let mut checked = 0;
        for (text, chat) in &cases {
            let want = if *chat { tok.encode_chat(text) } else { tok.encode(text) };
            let Ok(want) = want else { continue };
            let got = match engine.tokenize(text, *chat) {
                Some(Ok(ids)) => ids,
                Some(Err(e)) => return Verdict::fail(format!("the engine's tokenize failed on {text:?}: {e}")),
                // Asked first, so an engine without a tokenizer costs no request.
                None if checked == 0 => {
                    return Verdict::not_applicable(format!(
                        "not applicable: the engine `{}` has no tokenizer of its own (a protocol engine offers one \
                         with `\"tokenize\": true` in its load answer)",
                        engine.name()
                    ))
                }
                None => return Verdict::fail("the engine stopped offering tokenize"),
            };
            if got != want {
                let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
                let hint = if at == 0 && got.len() + 1 == want.len() && want.get(1..) == Some(&got[..]) {
                    " (the model's BOS is missing: the BOS rule?)"
                } else if at == 0 && want.len() + 1 == got.len() && got.get(1..) == Some(&want[..]) {
                    " (a BOS the model does not add: the BOS rule?)"
                } else if got.len() > want.len() {
                    " (more ids: a special token split as text?)"
                } else {
                    ""
                };
                return Verdict::fail(format!(
                    "the engine's ids for {}{text:?} differ from the model's from index {at}{hint}: engine {got:?}, \
                     model {want:?} (touchstone's tokenizer of {}, checked against HF and llama.cpp)",
                    if *chat { "the chat template with " } else { "" },
                    tok.source().display()
                ));
            }
            checked += 1;
        }
        Verdict::pass(format!(
            "the engine's tokenizer gives the model's ids on {checked} text(s) (prompt, probes, chat markers{})",
            if cases.iter().any(|c| c.1) { ", chat template" } else { "" }
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::{RunOutput, RunRequest, TapSet};
    use crate::model::ModelConfig;
    use crate::plan::Plan;
    use crate::spec::Spec;
    use std::path::Path;

    /// The CPU engine with a tokenizer of its own: touchstone's, or one with a
    /// planted bug.
    struct WithTokenizer {
        inner: CpuEngine,
        tok: Tokenizer,
        bug: Option<&'static str>,
    }

    impl Engine for WithTokenizer {
        fn name(&self) -> &str {
            "tok"
        }
        fn config(&self) -> &ModelConfig {
            self.inner.config()
        }
        fn run(&self, req: &RunRequest, taps: &TapSet) -> crate::Result<RunOutput> {
            self.inner.run(req, taps)
        }
        fn tokenize(&self, text: &str, chat: bool) -> Option<crate::Result<Vec<u32>>> {
            let ids = if chat { self.tok.encode_chat(text) } else { self.tok.encode(text) };
            Some(ids.map(|mut ids| {
                match self.bug {
                    Some("no_bos") => {
                        let bare = self.tok.encode("").unwrap_or_default();
                        ids.drain(..bare.len());
                    }
                    Some("split_specials") => {
                        // Specials as text: each marker's bytes tokenised as plain text.
                        let plain = text.replace('<', "< ");
                        ids = self.tok.encode(&plain).unwrap();
                    }
                    _ => {}
                }
                ids
            }))
        }
    }

    /// The check on `spec`'s model, from its GGUF (whose tokenizer adds the
    /// BOS llama.cpp's rules add) when `gguf`.
    fn verdict(spec: &str, gguf: bool, bug: Option<&'static str>) -> Verdict {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let plan = Plan::build(Spec::load(&root.join("specs").join(spec)).unwrap(), None).unwrap();
        let model = if gguf {
            plan.model.parent().unwrap().join("model.gguf")
        } else {
            plan.model.clone()
        };
        let engine = WithTokenizer {
            inner: CpuEngine::load(&model).unwrap(),
            tok: Tokenizer::load(&model).unwrap(),
            bug,
        };
        let mut facts = plan.facts();
        facts.model = &model;
        TokenizerCheck.evaluate(&facts, &engine)
    }

    #[test]
    fn a_right_tokenizer_passes_and_a_dropped_bos_or_a_split_special_fails() {
        for (spec, gguf) in [("qwen2-tiny.yaml", false), ("llama-tiny.yaml", false), ("llama-tiny.yaml", true)] {
            let v = verdict(spec, gguf, None);
            assert!(v.passed(), "{spec}: {}", v.message);
        }
        // llama-tiny's GGUF (llama.cpp's llama-bpe rules) adds <|begin_of_text|>.
        let v = verdict("llama-tiny.yaml", true, Some("no_bos"));
        assert!(v.failed() && v.message.contains("BOS is missing"), "{}", v.message);
        // qwen2-tiny has <|im_start|> as one token.
        let v = verdict("qwen2-tiny.yaml", false, Some("split_specials"));
        assert!(v.failed() && v.message.contains("<|im_start|>"), "{}", v.message);
        // The built-in engines have no tokenizer: not applicable.
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let plan = Plan::build(Spec::load(&root.join("specs/qwen2-tiny.yaml")).unwrap(), None).unwrap();
        let cpu = CpuEngine::load(&plan.model).unwrap();
        let v = TokenizerCheck.evaluate(&plan.facts(), &cpu);
        assert_eq!(v.status, crate::checks::verdict::Status::NotApplicable, "{}", v.message);
    }
}
