//! Keys a spec could write before and that were replaced: each is refused
//! with the exact text that replaces it, located at the old key, so a spec
//! written for an earlier touchstone says what to write now instead of only
//! `unknown field`. (Refused rather than read: the new keys say more than the
//! old ones did, and guessing that part would be silent.)

use serde_yaml::Value;

/// One replaced key: where it was (`section.key`) and the text replacing it.
struct Replaced {
    section: &'static str,
    key: &'static str,
    /// The replacement for the old value.
    replacement: fn(&Value) -> String,
}

const REPLACED: &[Replaced] = &[Replaced {
    section: "scaled",
    key: "unit_roundoff",
    replacement: unit_roundoff,
}];

/// The first replaced key `spec` holds: (`section.key`, the message).
pub(super) fn find(spec: &Value) -> Option<(&'static str, String)> {
    REPLACED.iter().find_map(|r| {
        let old = spec.get(r.section)?.get(r.key)?;
        Some((r.key, format!("{}.{}: {}", r.section, r.key, (r.replacement)(old))))
    })
}

/// `scaled.unit_roundoff: {SOURCE: U}` → `scaled.arithmetic: {SOURCE: NAME}`:
/// the unit roundoff a source's floor was built from is now the source's
/// whole arithmetic (storage, activations, KV cache).
fn unit_roundoff(old: &Value) -> String {
    let Some(map) = old.as_mapping() else {
        return "this key was replaced by `scaled.arithmetic: {SOURCE: ARITHMETIC}` (f32, f16, bf16, q8_0, q8_k, or \
                {storage, activations, kv})"
            .into();
    };
    let mut pairs = Vec::new();
    let mut notes = Vec::new();
    for (k, v) in map {
        let source = k.as_str().unwrap_or("?").to_string();
        let u = v.as_f64().unwrap_or(f64::NAN);
        let name = if (u - 2f64.powi(-24)).abs() <= 1e-3 * 2f64.powi(-24) {
            "f32".to_string()
        } else if (u - 2f64.powi(-11)).abs() <= 1e-3 * 2f64.powi(-11) {
            "f16".to_string()
        } else if (u - 2f64.powi(-8)).abs() <= 1e-3 * 2f64.powi(-8) {
            notes.push(format!(
                "`{source}`'s 2^-8 meant 8-bit activations (Q8_0 blocks of 32); write `q8_k` for a K-quant model's \
                 blocks of 256, `{{storage: f32, activations: q8_k, kv: f16}}` for llama.cpp's default f16 KV cache, \
                 or `bf16` if you meant bf16 storage"
            ));
            "q8_0".to_string()
        } else {
            notes.push(format!(
                "`{source}`'s {u:e} is no arithmetic's unit roundoff (f32 2^-24, f16 2^-11, 8-bit activations 2^-8)"
            ));
            "ARITHMETIC".to_string()
        };
        pairs.push(format!("{source}: {name}"));
    }
    format!(
        "replaced by `scaled.arithmetic` (a source's whole arithmetic, not one unit roundoff): write `arithmetic: \
         {{{}}}` instead{}",
        pairs.join(", "),
        notes.iter().map(|n| format!("; {n}")).collect::<String>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(yaml: &str) -> Option<String> {
        find(&serde_yaml::from_str(yaml).unwrap()).map(|(_, m)| m)
    }

    #[test]
    fn the_old_unit_roundoff_gives_the_exact_arithmetic_to_write() {
        let m = msg("scaled: {unit_roundoff: {llama.cpp: 3.90625e-3}}").unwrap();
        assert!(m.contains("write `arithmetic: {llama.cpp: q8_0}` instead"), "{m}");
        assert!(m.contains("q8_k") && m.contains("kv: f16"), "{m}");
        let m = msg("scaled: {unit_roundoff: {hf: 5.9604644775390625e-8, x: 4.8828125e-4}}").unwrap();
        assert!(m.contains("arithmetic: {hf: f32, x: f16}"), "{m}");
        assert!(msg("scaled: {unit_roundoff: {a: 0.1}}")
            .unwrap()
            .contains("no arithmetic's unit roundoff"));
        assert_eq!(msg("scaled: {arithmetic: {llama.cpp: q8_0}}"), None);
    }
}
