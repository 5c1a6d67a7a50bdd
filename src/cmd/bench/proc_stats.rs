//! What the process itself costs: peak resident memory, from Linux's
//! `/proc/self/status`. Elsewhere there is no such file and the figure is
//! reported as absent (null in the JSON), never guessed.

/// The process's peak resident set size in bytes (`VmHWM`, the high-water
/// mark of VmRSS: anonymous memory plus the mapped file pages touched), or
/// `None` where `/proc` does not say.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_hwm(&status)
}

/// `VmHWM:   123456 kB` → 123456 × 1024 bytes (the kernel's "kB" is KiB).
fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut parts = line["VmHWM:".len()..].split_whitespace();
    let kib: u64 = parts.next()?.parse().ok()?;
    (parts.next() == Some("kB")).then_some(kib * 1024)
}

/// The bytes a model occupies on disk: the `.gguf` file, or every
/// `*.safetensors` of an HF folder (config and tokenizer files are noise).
pub fn model_file_bytes(path: &std::path::Path) -> crate::error::Result<u64> {
    use crate::error::Error;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_dir() {
        return Ok(meta.len());
    }
    let mut total = 0;
    for entry in std::fs::read_dir(path).map_err(|e| Error::io(path, e))? {
        let p = entry.map_err(|e| Error::io(path, e))?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            total += std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?.len();
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_high_water_mark() {
        let s = "Name:\ttouchstone\nVmPeak:\t  999 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(parse_vm_hwm(s), Some(2048 * 1024));
    }

    #[test]
    fn absent_or_malformed_is_none() {
        assert_eq!(parse_vm_hwm("VmRSS:\t1 kB\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\tlots kB\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\t12 pages\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_a_peak() {
        assert!(peak_rss_bytes().is_some_and(|b| b > 0));
    }
}
