//! Compiles the CUDA kernels in `cuda/` for the host (the device emulation of
//! `src/engine/cuda/emu/mod.rs`; see `cuda/emu/emu.hpp`): one C++ translation unit
//! per kernel file listed in `src/engine/cuda/compile.rs` (the list NVRTC
//! compiles, so both paths build the same kernels), one per planted-bug
//! variant (a copy of a kernel file with one exact substitution, for the tests
//! that show the emulator catches it), the launcher (`cuda/emu/runtime.cpp`)
//! and the table of every kernel.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Planted bugs: (variant, kernel file, [(exact text, replacement)]). Each
/// text must occur exactly once in the file (so a change to the kernel that
/// removes it fails the build here rather than silently testing nothing).
/// The variant's kernels are registered as `<variant>/<kernel>`.
/// (variant name, kernel file, exact (from, to) substitutions).
type Planted = (&'static str, &'static str, &'static [(&'static str, &'static str)]);
const PLANTED: &[Planted] = &[
    // The softmax max reduced over the warp only, not the block: rows whose
    // visible keys span more than one warp get inconsistent exponents.
    (
        "planted_softmax_max",
        "attention.cu",
        &[("mx = block_max(mx, scratch);", "mx = warp_max(mx);")],
    ),
    // GQA: query head h reads KV head h % KV instead of h / (H / KV).
    (
        "planted_gqa_modulo",
        "attention.cu",
        &[(
            "const int kvh = h / (heads / kv_heads);",
            "const int kvh = h % kv_heads;",
        )],
    ),
    // A local layer's window ignored: every past key stays visible (a kernel
    // that treats Gemma 3's sliding layers as global ones).
    (
        "planted_window_ignored",
        "attention.cu",
        &[(
            "const int first = window > 0 && visible > window ? visible - window : 0;",
            "const int first = 0;",
        )],
    ),
    // RoPE pairs: the NEOX kernel rotates the interleaved pairs (2j, 2j+1)
    // instead of (j, j + D/2), and the interleaved one the NEOX pairs.
    (
        "planted_rope_pair",
        "rope.cu",
        &[
            (
                "const long long ia = NEOX ? base + j : base + 2 * j;",
                "const long long ia = !NEOX ? base + j : base + 2 * j;",
            ),
            (
                "const long long ib = NEOX ? base + j + half : base + 2 * j + 1;",
                "const long long ib = !NEOX ? base + j + half : base + 2 * j + 1;",
            ),
        ],
    ),
    // A thread that returns before the block's reductions, in blocks 5 and
    // up: its warp's shuffle never completes, so those blocks deadlock (the
    // report must name block 5, the lowest, however the blocks are split).
    (
        "planted_deadlock",
        "rmsnorm.cu",
        &[(
            "float acc = 0.0f;",
            "if (blockIdx.x >= 5 && threadIdx.x == 40) return;\n    float acc = 0.0f;",
        )],
    ),
    // The causal flag ignored: the vision tower's bidirectional attention
    // masked as the LM's causal one (each patch sees only those before it).
    (
        "planted_attention_causal_ignored",
        "attention.cu",
        &[(
            "const int visible = causal ? pos0 + t + 1 : s;",
            "const int visible = pos0 + t + 1;",
        )],
    ),
    // M-RoPE collapsed to 1-D: every frequency turns by the first axis's
    // position (t), whatever axis `axes[j]` names.
    (
        "planted_mrope_one_axis",
        "rope.cu",
        &[(
            "inv_freq[j] * (float)pos[(long long)axes[j] * rows + t]",
            "inv_freq[j] * (float)pos[t]",
        )],
    ),
    // Off by one on the store: element i is written to out[i + 1], so the
    // last thread writes one element past the end of the output.
    (
        "planted_oob_store",
        "embedding.cu",
        &[("out[i] = table[", "out[i + 1] = table[")],
    ),
    // Off by one the other way: thread 0 writes one element before the output.
    (
        "planted_oob_underflow",
        "embedding.cu",
        &[("out[i] = table[", "out[i - 1] = table[")],
    ),
];

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cuda = root.join("cuda");
    let compile_rs = root.join("src/engine/cuda/compile.rs");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", compile_rs.display());
    println!("cargo:rerun-if-changed={}", cuda.display());
    println!("cargo:rerun-if-changed={}", cuda.join("emu").display());
    for f in ["common.cuh", "emu/emu.hpp", "emu/runtime.cpp"] {
        println!("cargo:rerun-if-changed={}", cuda.join(f).display());
    }

    let files = kernel_files(&std::fs::read_to_string(&compile_rs).unwrap());
    assert!(
        !files.is_empty(),
        "build.rs: no kernel_file! entries found in {}",
        compile_rs.display()
    );
    let common = std::fs::read_to_string(cuda.join("common.cuh")).unwrap();

    // (unit id, source path, kernel-name prefix, kernels)
    let mut units: Vec<(String, PathBuf, String, Vec<String>)> = Vec::new();
    for (file, kernels) in &files {
        println!("cargo:rerun-if-changed={}", cuda.join(file).display());
        let id = file.trim_end_matches(".cu").to_string();
        units.push((id, cuda.join(file), String::new(), kernels.clone()));
    }
    for (variant, file, subs) in PLANTED {
        let (_, kernels) = files
            .iter()
            .find(|(f, _)| f == file)
            .unwrap_or_else(|| panic!("build.rs: planted bug {variant}: {file} is not a kernel file"));
        let mut src = std::fs::read_to_string(cuda.join(file)).unwrap();
        for (from, to) in *subs {
            let n = src.matches(from).count();
            assert!(
                n == 1,
                "build.rs: planted bug {variant}: `{from}` occurs {n} times in cuda/{file} (expected once)"
            );
            src = src.replacen(from, to, 1);
        }
        let path = out.join(format!("{variant}_{file}"));
        write_if_changed(&path, &src);
        units.push((variant.to_string(), path, format!("{variant}/"), kernels.clone()));
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .debug(false)
        // The device code is compiled with --fmad=false and without fast math.
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        // Linked into executables only: the cheapest TLS access for threadIdx and __shared__.
        .flag("-ftls-model=initial-exec")
        // `extern __shared__` is an extern thread_local: without this flag the
        // compiler calls a weak TLS init function, which lld resolves in a PIE
        // to a stub that jumps to address 0.
        .flag("-fno-extern-tls-init")
        .flag("-Wno-unknown-pragmas")
        .flag("-Wno-unused-parameter")
        .include(cuda.join("emu"));
    let mut master = String::from("// generated by build.rs\n#define TS_EMU_RUNTIME 1\n#include \"emu.hpp\"\n");
    let mut tables = Vec::new();
    for (id, path, prefix, kernels) in &units {
        let src = std::fs::read_to_string(path).unwrap();
        let dynamic = dynamic_shared(&format!("{common}\n{src}"), path);
        let mut w = String::new();
        writeln!(w, "// generated by build.rs: {} for the host emulation", path.display()).unwrap();
        writeln!(w, "#include \"emu.hpp\"").unwrap();
        for k in kernels {
            // The kernels have C linkage: each unit's get their own symbol
            // names (a variant's kernels are copies of the production ones).
            writeln!(w, "#define {k} ts_emu_{id}__{k}").unwrap();
        }
        writeln!(w, "namespace ts_emu_{id} {{").unwrap();
        writeln!(w, "#include \"{}\"", cuda.join("common.cuh").display()).unwrap();
        // The dynamic shared array (defined before the kernels declare it
        // `extern`; its TLS has no dynamic initialiser: -fno-extern-tls-init).
        let dyn_fn = match &dynamic {
            Some((ty, name)) => {
                writeln!(
                    w,
                    "alignas(16) thread_local {ty} {name}[TS_EMU_DYN_SMEM_CAP / sizeof({ty})];"
                )
                .unwrap();
                writeln!(w, "static void* ts_emu_dyn_smem() {{ return (void*){name}; }}").unwrap();
                format!("&ts_emu_{id}::ts_emu_dyn_smem")
            }
            None => "nullptr".to_string(),
        };
        writeln!(w, "#include \"{}\"", path.display()).unwrap();
        writeln!(w, "}}").unwrap();
        writeln!(w, "namespace emu {{").unwrap();
        writeln!(
            w,
            "template <> struct TypeName<ts_emu_{id}::f16_t> {{ static constexpr const char* name = \"f16\"; }};"
        )
        .unwrap();
        writeln!(
            w,
            "template <> struct TypeName<ts_emu_{id}::bf16_t> {{ static constexpr const char* name = \"bf16\"; }};"
        )
        .unwrap();
        writeln!(w, "}}").unwrap();
        writeln!(w, "extern \"C\" const ts_emu_kernel ts_emu_table_{id}[] = {{").unwrap();
        for k in kernels {
            let f = format!("ts_emu_{id}::{k}");
            writeln!(
                w,
                "    {{\"{prefix}{k}\", reinterpret_cast<void*>(&{f}), &emu::Invoker<decltype(&{f})>::invoke, \
                 &emu::Invoker<decltype(&{f})>::signature, {dyn_fn}}},"
            )
            .unwrap();
        }
        writeln!(w, "}};").unwrap();
        let cpp = out.join(format!("emu_{id}.cpp"));
        write_if_changed(&cpp, &w);
        build.file(&cpp);
        writeln!(master, "extern \"C\" const ts_emu_kernel ts_emu_table_{id}[];").unwrap();
        tables.push((format!("ts_emu_table_{id}"), kernels.len()));
    }
    let names: Vec<_> = tables.iter().map(|(n, _)| n.clone()).collect();
    let sizes: Vec<_> = tables.iter().map(|(_, k)| k.to_string()).collect();
    writeln!(
        master,
        "extern \"C\" const ts_emu_kernel* const ts_emu_tables[] = {{{}}};",
        names.join(", ")
    )
    .unwrap();
    writeln!(
        master,
        "extern \"C\" const int ts_emu_table_sizes[] = {{{}}};",
        sizes.join(", ")
    )
    .unwrap();
    writeln!(master, "extern \"C\" const int ts_emu_ntables = {};", tables.len()).unwrap();
    let master_cpp = out.join("emu_tables.cpp");
    write_if_changed(&master_cpp, &master);
    build.file(&master_cpp).file(cuda.join("emu/runtime.cpp"));
    build.compile("ts_cuda_emu");
}

/// The `kernel_file!("x.cu", ["k1", ...])` entries of compile.rs.
fn kernel_files(src: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(at) = rest.find("kernel_file!(") {
        rest = &rest[at + "kernel_file!(".len()..];
        if !rest.trim_start().starts_with('"') {
            continue;
        }
        let end = rest.find(')').expect("build.rs: unclosed kernel_file!(");
        let mut strings = rest[..end].split('"').skip(1).step_by(2).map(str::to_string);
        let file = strings.next().unwrap();
        out.push((file, strings.collect()));
        rest = &rest[end..];
    }
    out
}

/// The `extern __shared__ T name[];` array of a translation unit, if any.
fn dynamic_shared(src: &str, path: &Path) -> Option<(String, String)> {
    let mut found: Option<(String, String)> = None;
    for (at, _) in src.match_indices("extern __shared__") {
        let decl = &src[at + "extern __shared__".len()..];
        let decl = &decl[..decl.find(';').unwrap()];
        let open = decl
            .find('[')
            .unwrap_or_else(|| panic!("build.rs: {}: extern __shared__ without []", path.display()));
        let words: Vec<&str> = decl[..open].split_whitespace().collect();
        let (name, ty) = words.split_last().unwrap();
        let this = (ty.join(" "), name.to_string());
        if let Some(prev) = &found {
            assert!(
                prev == &this,
                "build.rs: {}: two extern __shared__ arrays ({prev:?}, {this:?}); the emulation gives each one \
                 array, where the device aliases them: not emulated",
                path.display()
            );
        }
        found = Some(this);
    }
    found
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap();
    }
}
