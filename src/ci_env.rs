//! Whether this process runs on CI: where goldens are never written and a
//! missing prerequisite fails instead of being skipped.

/// True when the environment says this is CI (`CI=true`, or `CI=1`, as CI services set it).
pub fn on_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| {
        let v = v.trim().to_ascii_lowercase();
        !v.is_empty() && v != "false" && v != "0"
    })
}
