//! `--only` (and libtest's filter): which check instances run, matched
//! against `<engine>::<spec>::<id>` as a substring or a glob.

/// Which check instances to run: `None` runs all; otherwise an id must contain
/// one of the filters (matched against `<engine>::<spec>::<id>`).
#[derive(Clone, Debug, Default)]
pub struct Filter(pub Option<Vec<String>>);

impl Filter {
    /// A filter without `*` or `?` matches ids containing it; with them it is
    /// a glob that may match any part of the id (`decode2/blk.1.*`).
    pub fn accepts(&self, full_id: &str) -> bool {
        self.0.as_ref().is_none_or(|fs| {
            fs.iter().any(|f| {
                if f.contains(['*', '?']) {
                    glob_within(f.as_bytes(), full_id.as_bytes())
                } else {
                    full_id.contains(f.as_str())
                }
            })
        })
    }
}

/// Whether `pat` (`*` any run, `?` one byte) matches some substring of `text`:
/// the pattern with an implicit `*` at both ends. Iterative, with the usual
/// single backtrack point, so O(|pat|·|text|) at worst.
fn glob_within(pat: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0usize, 0usize);
    // Implicit leading `*`: the star at "position -1" with backtrack start 0.
    let (mut star, mut mark) = (Some(0usize), 0usize);
    let mut star_p = 0usize;
    loop {
        if p == pat.len() {
            return true; // implicit trailing `*`
        }
        if t < text.len() && (pat[p] == b'?' || pat[p] == text[t]) {
            p += 1;
            t += 1;
        } else if pat[p] == b'*' {
            star = Some(p);
            star_p = p + 1;
            mark = t;
            p += 1;
        } else if let Some(s) = star {
            let _ = s;
            mark += 1;
            if mark > text.len() {
                return false;
            }
            t = mark;
            p = star_p;
        } else {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_filters_are_substrings_and_globs_match_within_the_id() {
        let id = "cpu::qwen2-tiny::decode2/blk.1.q::golden:hf";
        let f = |s: &str| Filter(Some(vec![s.to_string()])).accepts(id);
        assert!(f("blk.1.q::golden"));
        assert!(f("decode2/blk.1.*"));
        assert!(f("decode?/blk.*.q::*hf"));
        assert!(f("*"));
        assert!(!f("decode1/blk.1.*"));
        assert!(!f("decode2/blk.0.*"));
        assert!(!f("blk.1.q::golden:llama*"));
        assert!(Filter(None).accepts(id));
        // Matching is linear-ish: a pathological glob returns at once.
        let long = "a".repeat(10_000);
        assert!(!Filter(Some(vec!["*a*a*a*a*a*b".into()])).accepts(&long));
    }
}
