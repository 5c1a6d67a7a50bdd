//! Bounds on what a spec may ask for, checked before anything runs: input
//! size and nesting (so no spec of n bytes costs more than O(n) to parse) and
//! every count (so no spec allocates or loops without bound). Where the model
//! says how long its context is, steps and positions are checked against it in
//! `Plan::build`.

/// The largest spec file accepted (bytes). Real specs are a few KB.
pub const MAX_SPEC_BYTES: usize = 1 << 20;
/// The deepest nesting accepted, flow (`[`, `{`) or block (indentation and
/// `- ` sequence entries). Real specs nest 4 deep.
pub const MAX_NESTING: usize = 64;
/// The most runs a determinism check may ask for.
pub const MAX_RUNS: usize = 100;
/// The most decode steps any part of a spec may ask for, whatever the model
/// (each step is a forward pass; a model's context length bounds it further).
pub const MAX_DECODE_STEPS: usize = 8192;
/// The most prompt tokens a spec may list.
pub const MAX_PROMPT_TOKENS: usize = 1 << 16;

/// `Err((line, col, message))` when the text is too large or nests too deep.
/// One pass over the bytes: counts flow brackets outside quotes and comments,
/// and per line the indentation plus any chain of `- ` entries.
pub fn check_text(text: &str) -> Result<(), (usize, usize, String)> {
    if text.len() > MAX_SPEC_BYTES {
        return Err((
            1,
            1,
            format!(
                "the spec is {} bytes; at most {MAX_SPEC_BYTES} are accepted",
                text.len()
            ),
        ));
    }
    let mut flow = 0usize;
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let mut dashes = 0;
        let mut rest = &line[indent..];
        while let Some(r) = rest.strip_prefix("- ") {
            dashes += 1;
            rest = r.trim_start_matches(' ');
        }
        // Two columns of indentation per level is YAML's usual step; one is the
        // least a level can take, so the column is an upper bound on depth.
        if indent / 2 + dashes > MAX_NESTING {
            return Err((
                i + 1,
                1,
                format!("nesting deeper than {MAX_NESTING} levels (indentation {indent}, {dashes} `- ` entries)"),
            ));
        }
        let (mut quote, mut prev_space) = (None::<char>, true);
        for (c_i, c) in line.char_indices() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '#') if prev_space => break,
                (None, '"' | '\'') => quote = Some(c),
                (None, '[' | '{') => {
                    flow += 1;
                    if flow > MAX_NESTING {
                        return Err((
                            i + 1,
                            c_i + 1,
                            format!("brackets nested deeper than {MAX_NESTING} levels"),
                        ));
                    }
                }
                (None, ']' | '}') => flow = flow.saturating_sub(1),
                _ => {}
            }
            prev_space = c.is_whitespace();
        }
    }
    Ok(())
}

/// `Err(message)` when `n` (the value of `what`) exceeds `max`.
pub fn count(what: &str, n: usize, max: usize) -> Result<(), String> {
    if n > max {
        Err(format!("{what} is {n}; at most {max} is accepted"))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_or_huge_text_is_refused_in_linear_time() {
        let t = std::time::Instant::now();
        let deep = "[".repeat(32_000);
        let (line, col, msg) = check_text(&deep).unwrap_err();
        assert_eq!((line, col), (1, MAX_NESTING + 1));
        assert!(msg.contains("nested deeper"), "{msg}");
        let dashes = "- ".repeat(1000) + "x";
        assert!(check_text(&dashes).unwrap_err().2.contains("`- ` entries"));
        let indented: String = (0..200).map(|i| format!("{}k{i}:\n", " ".repeat(i * 2))).collect();
        assert!(check_text(&indented).is_err());
        assert!(check_text(&"a".repeat(MAX_SPEC_BYTES + 1))
            .unwrap_err()
            .2
            .contains("bytes"));
        assert!(t.elapsed().as_secs_f64() < 1.0);
    }

    #[test]
    fn quoted_and_commented_brackets_do_not_count() {
        let t = format!("a: \"{}\" # {}\nb: [[1], {{c: 2}}]\n", "[".repeat(100), "{".repeat(100));
        assert!(check_text(&t).is_ok());
    }
}
