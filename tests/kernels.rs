//! One trial per CUDA kernel per architecture, named
//! `kernels::<file>::<kernel>::<arch>`: it compiles the kernel's file with NVRTC
//! (the engine's pinned options and cache) and checks the entry is in the PTX.
//! Without a loadable NVRTC (a plain `cargo test` on a machine without the
//! CUDA wheels) every trial is reported as ignored with the reason, never as
//! passed; `bash ci/kernels.sh` runs them with NVRTC present.

use libtest_mimic::{Arguments, Completion, Trial};
use touchstone::cmd::kernels::DEFAULT_ARCHS;
use touchstone::engine::cuda::compile::{self, FILES};

fn main() {
    let args = Arguments::from_args();
    let nvrtc = compile::nvrtc_present();
    let mut trials = Vec::new();
    for file in FILES {
        for kernel in file.kernels {
            for arch in DEFAULT_ARCHS {
                let name = format!("kernels::{}::{kernel}::{arch}", file.name.trim_end_matches(".cu"));
                if !nvrtc {
                    let reason = "NVRTC (libnvrtc.so.13) not loadable; run `bash ci/kernels.sh` to compile the kernels";
                    trials.push(Trial::ignorable_test(name, move || {
                        Ok(Completion::ignored_with(reason))
                    }));
                    continue;
                }
                trials.push(Trial::test(name, move || {
                    let ptx = compile::ptx(file, arch).map_err(|e| e.to_string())?;
                    if !compile::has_entry(&ptx, kernel) {
                        return Err(
                            format!("{kernel} is not an entry of the PTX of cuda/{} for {arch}", file.name).into(),
                        );
                    }
                    Ok(())
                }));
            }
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
