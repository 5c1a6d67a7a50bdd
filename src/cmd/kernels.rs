//! `touchstone kernels`: proves without a GPU that every CUDA kernel compiles.
//! Each file of `cuda/` is compiled with NVRTC (the same pinned options and
//! cache the engine uses) for every requested architecture, its PTX is checked
//! for every kernel entry and for an ISA the R580 driver loads, and, where
//! `ptxas` is on PATH, assembled with `ptxas -v` to report registers, shared
//! memory, stack frame and spills per kernel. Any compile error, missing entry,
//! ptxas failure, spill, or register count too large for the block the engine
//! launches the kernel with makes the command fail.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use super::Outcome;
use crate::engine::cuda::compile::{self, KernelError, FILES};
use crate::engine::cuda::launch;
use crate::error::{Error, Result};

/// Architectures checked when none is given (H100 and A100).
pub const DEFAULT_ARCHS: &[&str] = &["sm_90", "sm_80"];

/// What `ptxas -v` reports for one kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    pub smem: u32,
    pub stack: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Parses `ptxas -v` output (stderr) into per-kernel resources.
pub fn parse_ptxas(text: &str) -> BTreeMap<String, Resources> {
    let mut out: BTreeMap<String, Resources> = BTreeMap::new();
    let mut current: Option<String> = None;
    let num_before = |s: &str, unit: &str| -> Option<u32> {
        let i = s.find(unit)?;
        s[..i].split_whitespace().last()?.parse().ok()
    };
    for line in text.lines() {
        if let Some(rest) = line
            .split("Compiling entry function '")
            .nth(1)
            .or_else(|| line.split("Function properties for ").nth(1))
        {
            let name = rest.split('\'').next().unwrap_or(rest).trim().to_string();
            out.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let Some(name) = &current else { continue };
        let r = out.get_mut(name).expect("inserted above");
        if line.contains("stack frame") {
            r.stack = num_before(line, "bytes stack frame").unwrap_or(0);
            r.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
            r.spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used ") && line.contains("registers") {
            r.registers = num_before(line, "registers").unwrap_or(0);
            r.smem = num_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// `ptxas` on PATH, if any.
pub fn find_ptxas() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

fn ptxas(ptxas: &PathBuf, ptx: &str, arch: &str, file: &str) -> std::result::Result<String, String> {
    let dir = std::env::temp_dir().join(format!("touchstone-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = dir.join(format!("{}.{arch}.ptx", file.trim_end_matches(".cu")));
    std::fs::write(&src, ptx).map_err(|e| format!("{}: {e}", src.display()))?;
    let out = Command::new(ptxas)
        .args(["-v", "--gpu-name", arch, "-o", "/dev/null"])
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let _ = std::fs::remove_file(&src);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("ptxas failed on cuda/{file} for {arch}:\n{text}"))
    }
}

/// Runs the check and prints the table. `Err` (exit 2) when NVRTC cannot be
/// loaded or an architecture is malformed; `Outcome::Failed` on any compile
/// error, missing kernel, ptxas failure or spill.
///
/// Without ptxas on PATH the registers, shared memory and spills are not
/// checked: that is a failure (never "kernels: ok") unless `ptx_only` says
/// compiling to PTX is all that was asked for.
pub fn run(archs: &[String], ptx_only: bool) -> Result<Outcome> {
    let archs: Vec<String> = if archs.is_empty() {
        DEFAULT_ARCHS.iter().map(|s| s.to_string()).collect()
    } else {
        archs.to_vec()
    };
    let mut archs_sm = Vec::new();
    for a in &archs {
        let n = compile::arch_number(a).map_err(|e| Error::Usage(e.to_string()))?;
        archs_sm.push(format!("sm_{n}"));
    }
    if !compile::nvrtc_present() {
        return Err(Error::Usage(format!("kernels: {}", KernelError::NvrtcMissing)));
    }
    let ptxas_bin = find_ptxas();
    let mut problems: Vec<String> = Vec::new();
    let mut table = String::new();
    let _ = writeln!(
        table,
        "{:<16} {:<24} {:<6} {:>5} {:>6} {:>6} {:>7} {:>7}",
        "file", "kernel", "arch", "regs", "smem", "stack", "spill_st", "spill_ld"
    );
    let mut ptx_versions = BTreeMap::new();
    for arch in &archs_sm {
        for file in FILES {
            let ptx = match compile::ptx(file, arch) {
                Ok(p) => p,
                Err(e) => {
                    problems.push(e.to_string());
                    continue;
                }
            };
            if let Some(v) = compile::ptx_version(&ptx) {
                ptx_versions.insert(format!("{}.{}", v.0, v.1), ());
            }
            let res = match &ptxas_bin {
                Some(bin) => match ptxas(bin, &ptx, arch, file.name) {
                    Ok(text) => Some(parse_ptxas(&text)),
                    Err(e) => {
                        problems.push(e);
                        None
                    }
                },
                None => None,
            };
            for k in file.kernels {
                if !compile::has_entry(&ptx, k) {
                    problems.push(format!(
                        "cuda/{}: kernel {k} is missing from the PTX for {arch}",
                        file.name
                    ));
                    continue;
                }
                match res.as_ref().map(|m| m.get(*k)) {
                    Some(Some(r)) => {
                        let _ = writeln!(
                            table,
                            "{:<16} {:<24} {:<6} {:>5} {:>6} {:>6} {:>7} {:>7}",
                            file.name, k, arch, r.registers, r.smem, r.stack, r.spill_stores, r.spill_loads
                        );
                        let threads = launch::max_block_threads(k);
                        if !launch::registers_fit(r.registers, threads) {
                            problems.push(format!(
                                "{k} ({arch}) uses {} registers per thread: a block of {threads} threads, \
                                 as the engine launches it, does not fit in one SM's {} registers",
                                r.registers,
                                launch::REGISTERS_PER_SM
                            ));
                        }
                        if k.starts_with("attention_") && r.smem as usize != launch::ATTENTION_STATIC_SMEM {
                            problems.push(format!(
                                "{k} ({arch}) has {} bytes of static shared memory; the launch limit in \
                                 launch::attention assumes {}",
                                r.smem,
                                launch::ATTENTION_STATIC_SMEM
                            ));
                        }
                        if r.spill_stores > 0 || r.spill_loads > 0 {
                            problems.push(format!(
                                "{k} ({arch}) spills: {} bytes stored, {} bytes loaded",
                                r.spill_stores, r.spill_loads
                            ));
                        }
                    }
                    Some(None) => problems.push(format!("ptxas -v reported nothing for {k} ({arch})")),
                    None => {
                        let _ = writeln!(
                            table,
                            "{:<16} {:<24} {:<6} {:>5} {:>6} {:>6} {:>7} {:>7}",
                            file.name, k, arch, "-", "-", "-", "-", "-"
                        );
                    }
                }
            }
        }
    }
    print!("{table}");
    let n_kernels: usize = FILES.iter().map(|f| f.kernels.len()).sum();
    println!(
        "\n{} kernel(s) in {} file(s) x {} arch(s); NVRTC options {:?}; PTX ISA {}",
        n_kernels,
        FILES.len(),
        archs_sm.len(),
        compile::options(90).iter().skip(1).collect::<Vec<_>>(),
        ptx_versions.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    match &ptxas_bin {
        Some(p) => println!(
            "ptxas: {} (smem = static shared memory; attention's dynamic (D+S)*4 bytes are not included)",
            p.display()
        ),
        None if ptx_only => {
            println!("ptxas not on PATH: compiled to PTX only (--ptx-only); registers, shared memory and spills were NOT checked")
        }
        None => problems.push(
            "ptxas is not on PATH, so registers, shared memory, stack and spills were NOT checked (put ptxas on \
             PATH, e.g. `bash ci/kernels.sh`, or pass --ptx-only to check only that every kernel compiles)"
                .into(),
        ),
    }
    if problems.is_empty() {
        println!("kernels: ok");
        Ok(Outcome::Passed)
    } else {
        for p in &problems {
            eprintln!("kernels: FAIL: {p}");
        }
        println!("kernels: {} problem(s)", problems.len());
        Ok(Outcome::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_output() {
        let text = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'rmsnorm_f32' for 'sm_90'\n\
ptxas info    : Function properties for rmsnorm_f32\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 18 registers, used 1 barriers, 128 bytes smem, 380 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'rope_neox_f32' for 'sm_90'\n\
ptxas info    : Function properties for rope_neox_f32\n\
    32 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 30 registers, 400 bytes cmem[0]\n";
        let m = parse_ptxas(text);
        assert_eq!(
            m["rmsnorm_f32"],
            Resources {
                registers: 18,
                smem: 128,
                stack: 0,
                spill_stores: 0,
                spill_loads: 0
            }
        );
        assert_eq!(
            m["rope_neox_f32"],
            Resources {
                registers: 30,
                smem: 0,
                stack: 32,
                spill_stores: 8,
                spill_loads: 4
            }
        );
    }
}
