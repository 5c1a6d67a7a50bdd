//! "Did you mean" for names a user typed (stages, checks, golden sources,
//! engines): the known name at the smallest edit distance (`strsim`), if it
//! is close enough to be a likely typo.

/// The known name closest to `typed`, if it is close enough to be a likely typo.
pub fn closest<'a>(typed: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (typed.chars().count() / 3).max(2);
    known
        .into_iter()
        .map(|k| (strsim::levenshtein(typed, k), k))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_near_names_only() {
        let known = ["softmax_rows", "causal", "finite"];
        assert_eq!(closest("softmax_row", known), Some("softmax_rows"));
        assert_eq!(closest("casual", known), Some("causal"));
        assert_eq!(closest("determinism", known), None);
    }
}
