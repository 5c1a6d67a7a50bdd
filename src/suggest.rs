//! "Did you mean" for names a user typed (stages, checks, golden sources).
//! Levenshtein distance is written out here: it is ten lines, and the crates
//! that provide it bring more than we need.

/// The known name closest to `typed`, if it is close enough to be a likely typo.
pub fn closest<'a>(typed: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (typed.chars().count() / 3).max(2);
    known
        .into_iter()
        .map(|k| (levenshtein(typed, k), k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// ` (did you mean `x`?)` or an empty string.
pub fn hint<'a>(typed: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    closest(typed, known)
        .map(|k| format!("; did you mean `{k}`?"))
        .unwrap_or_default()
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_near_names_only() {
        let known = ["softmax_rows", "causal", "finite"];
        assert_eq!(closest("softmax_row", known), Some("softmax_rows"));
        assert_eq!(closest("casual", known), Some("causal"));
        assert_eq!(closest("determinism", known), None);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
    }
}
