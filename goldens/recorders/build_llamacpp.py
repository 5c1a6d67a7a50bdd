#!/usr/bin/env python3
"""Fetch the pinned llama-cpp-python sdist and build libllama from it.

usage: build_llamacpp.py [--cache-dir DIR] [--json] [--native | --mtmd]

The version comes from ONE line of requirements.txt (the single source of
truth; nothing else names it):

    # llama-cpp-python==X.Y.Z (sdist: ...)

It is a comment because the package is never pip-installed: pip would build
its own libllama (5 minutes, with whatever flags the wheel build picks).
Instead this script

  1. downloads the sdist with `pip download --no-deps --no-binary
     llama-cpp-python llama-cpp-python==X.Y.Z` into
     <cache>/sdist/ (skipped when present),
  2. extracts it to <cache>/src/llama_cpp_python-X.Y.Z/ (skipped when present),
  3. configures vendor/llama.cpp with the cmake of the PyPI `cmake` wheel
     (pinned in requirements.txt) and builds only the `llama` target:
     shared libraries, Release, GGML_NATIVE=OFF (a -march=native build
     differs by up to 3.8e-6 and would make the goldens depend on the CPU),
  4. prints the folder holding libllama.so and its ggml libraries.

A finished build is cached (<cache>/build-X.Y.Z/, marked by a stamp file that
records the flags) and reused. <cache> is $TOUCHSTONE_CACHE/llamacpp (TOUCHSTONE_CACHE defaults to
~/.cache/touchstone, the cache every touchstone tool shares, outside any
checkout). --cache-dir (or the environment variable
TOUCHSTONE_LLAMACPP_CACHE, which the other recorders honour too) puts sdist,
source and build somewhere else, e.g. a fresh folder to prove the build
reproduces.

--native builds the same source into <cache>/build-X.Y.Z-native/ with
llama.cpp's own defaults for speed instead: GGML_NATIVE=ON (-march=native:
AVX-512 here), GGML_OPENMP=ON, the llamafile sgemm (on by default either
way). It is for ci/bench.sh, where the peer must be llama.cpp at its best on
this machine; goldens never use it (they must not depend on the CPU).

The other recorders import this module: convert_gguf.py needs only the source
(`source_dir()`), record_llamacpp.py the library (`ensure_built()`).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REQS = os.path.join(HERE, "requirements.txt")


def touchstone_cache():
    """$TOUCHSTONE_CACHE, default ~/.cache/touchstone: one cache for every
    checkout (worktrees share one 17-minute libllama build) and never inside
    one, so nothing a recorder caches can end up in `git status`."""
    return os.path.abspath(os.environ.get("TOUCHSTONE_CACHE")
                           or os.path.join(os.path.expanduser("~"), ".cache", "touchstone"))


# TOUCHSTONE_LLAMACPP_CACHE moves sdist, source and build elsewhere for every
# recorder at once (regen.sh uses it to prove a fresh build reproduces).
DEFAULT_CACHE = os.path.abspath(os.environ.get("TOUCHSTONE_LLAMACPP_CACHE")
                                or os.path.join(touchstone_cache(), "llamacpp"))
PIN_RE = re.compile(r"^#\s*llama-cpp-python==([0-9A-Za-z.+-]+)\s*(\(|$)")

# Everything that decides the bits of libllama besides the source and the
# compiler. Recorded in the llama.cpp goldens' provenance.
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# --native: what differs from CMAKE_FLAGS (llama.cpp's defaults for a local
# build). Only for benchmarks: the goldens need the portable build above.
NATIVE_OVERRIDES = {"-DGGML_NATIVE=OFF": "-DGGML_NATIVE=ON", "-DGGML_OPENMP=OFF": "-DGGML_OPENMP=ON"}
TARGET = "llama"
LIBS = ["libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so"]
# --mtmd: llama.cpp's multimodal library (tools/mtmd: clip + mtmd + helper)
# for the vision-language goldens (record_llamacpp_vlm.py). Its own build
# folder build-X.Y.Z-mtmd/, configured with CMAKE_FLAGS plus these (the
# standalone libmtmd hook of llama.cpp's CMakeLists, no video: MTMD_VIDEO
# would shell out to ffmpeg), target `mtmd` (which builds ggml and llama
# too). libllama's build above is left exactly as it was; the libllama and
# ggml of the mtmd folder are compiled from the same source with the same
# flags (ensure_built(mtmd=True) can compare them byte for byte).
MTMD_FLAGS = ["-DLLAMA_BUILD_MTMD=ON", "-DMTMD_VIDEO=OFF"]
MTMD_TARGET = "mtmd"
MTMD_LIBS = LIBS + ["libmtmd.so"]


def pinned_version(reqs=REQS):
    found = []
    with open(reqs) as f:
        for line in f:
            m = PIN_RE.match(line.strip())
            if m:
                found.append(m.group(1))
    if len(found) != 1:
        sys.exit(f"build_llamacpp.py: expected exactly one '# llama-cpp-python==X' line in {reqs}, found {found}")
    return found[0]


def log(msg):
    print(f"build_llamacpp.py: {msg}", file=sys.stderr, flush=True)


def sdist_path(cache=DEFAULT_CACHE, version=None):
    """Download the pinned sdist (once) and return its path."""
    version = version or pinned_version()
    d = os.path.join(cache, "sdist")
    path = os.path.join(d, f"llama_cpp_python-{version}.tar.gz")
    if os.path.isfile(path):
        return path
    os.makedirs(d, exist_ok=True)
    log(f"downloading the llama-cpp-python {version} sdist into {d}")
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
                    "--no-deps", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={version}", "-d", d], check=True)
    if not os.path.isfile(path):
        sys.exit(f"build_llamacpp.py: pip download did not produce {path}")
    log(f"downloaded in {time.time() - t0:.1f} s")
    return path


def source_dir(cache=DEFAULT_CACHE, version=None):
    """The extracted sdist (llama_cpp/ package, vendor/llama.cpp/)."""
    version = version or pinned_version()
    src_root = os.path.join(cache, "src")
    src = os.path.join(src_root, f"llama_cpp_python-{version}")
    stamp = os.path.join(src, ".extracted")
    if os.path.isfile(stamp):
        return src
    tgz = sdist_path(cache, version)
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src_root, exist_ok=True)
    log(f"extracting {os.path.basename(tgz)}")
    with tarfile.open(tgz) as t:
        t.extractall(src_root, filter="data")
    assert os.path.isdir(os.path.join(src, "vendor", "llama.cpp")), "sdist without vendor/llama.cpp"
    open(stamp, "w").close()
    return src


def llama_cpp_commit(src):
    """The llama.cpp commit the sdist vendors, from its CHANGELOG: the newest
    'update llama.cpp to ggml-org/llama.cpp@<sha>' line at or below the
    section of this version (the vendored tree has no .git)."""
    version = os.path.basename(src).rsplit("-", 1)[1]
    in_section = False
    with open(os.path.join(src, "CHANGELOG.md")) as f:
        for line in f:
            if line.startswith("## ["):
                in_section = in_section or line.startswith(f"## [{version}]")
            elif in_section:
                m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", line)
                if m:
                    return m.group(1)
    return "unknown"


def ggml_version(src):
    txt = open(os.path.join(src, "vendor", "llama.cpp", "ggml", "CMakeLists.txt")).read()
    parts = [re.search(rf"set\(GGML_VERSION_{k} (\d+)\)", txt).group(1) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def info(src):
    return {
        "llama_cpp_python": os.path.basename(src).rsplit("-", 1)[1],
        "llama_cpp_commit": llama_cpp_commit(src),
        "ggml_version": ggml_version(src),
    }


def cmake_exe():
    # The PyPI cmake wheel installs its launcher next to the interpreter.
    c = os.path.join(os.path.dirname(sys.executable), "cmake")
    return c if os.path.isfile(c) else (shutil.which("cmake") or sys.exit("build_llamacpp.py: no cmake (pip install the cmake pin)"))


def cmake_version(cmake):
    out = subprocess.run([cmake, "--version"], check=True, capture_output=True, text=True).stdout
    return out.split()[2]


def flags(src, native=False, mtmd=False):
    # The vendored tree has no .git, so llama.cpp's build-info would ask git
    # about the enclosing repository (touchstone's own commit). Pin it.
    base = [NATIVE_OVERRIDES.get(f, f) for f in CMAKE_FLAGS] if native else CMAKE_FLAGS
    return base + [f"-DLLAMA_BUILD_COMMIT={llama_cpp_commit(src)}", "-DLLAMA_BUILD_NUMBER=0"] + \
        (MTMD_FLAGS if mtmd else [])


def build_dir(cache=DEFAULT_CACHE, version=None, native=False, mtmd=False):
    """Where ensure_built puts a build (a separate folder per variant, so the
    goldens' portable build, the benchmark's native one and the multimodal
    one coexist)."""
    version = version or pinned_version()
    return os.path.join(cache, f"build-{version}" + ("-native" if native else "") + ("-mtmd" if mtmd else ""))


def _cached(lib_dir, stamp, want, libs=LIBS):
    """(lib_dir, stamp dict) when a finished build with exactly `want` is there."""
    if os.path.isfile(stamp) and all(os.path.isfile(os.path.join(lib_dir, l)) for l in libs):
        with open(stamp) as f:
            have = json.load(f)
        if {k: have.get(k) for k in want} == want:
            return lib_dir, have
    return None


def find_built(cache=DEFAULT_CACHE, version=None, native=False):
    """ensure_built's answer when the build is already there, else None;
    never downloads or builds (for callers that must only report what is
    missing, such as ci/bench.sh without --setup)."""
    version = version or pinned_version()
    src = os.path.join(cache, "src", f"llama_cpp_python-{version}")
    if not os.path.isfile(os.path.join(src, ".extracted")):
        return None
    build = build_dir(cache, version, native)
    want = {"flags": flags(src, native), "target": TARGET, "cmake": cmake_version(cmake_exe()), **info(src)}
    return _cached(os.path.join(build, "bin"), os.path.join(build, "touchstone-build.json"), want)


def ensure_built(cache=DEFAULT_CACHE, version=None, jobs=None, native=False, mtmd=False):
    """Build libllama once; return (lib_dir, info dict). native: the
    benchmark variant (NATIVE_OVERRIDES), in its own folder. mtmd: the
    multimodal variant (MTMD_FLAGS, target mtmd: libmtmd.so next to its
    libllama and ggml), in its own folder."""
    assert not (native and mtmd), "no native multimodal build"
    version = version or pinned_version()
    src = source_dir(cache, version)
    build = build_dir(cache, version, native, mtmd)
    lib_dir = os.path.join(build, "bin")
    stamp = os.path.join(build, "touchstone-build.json")
    cmake = cmake_exe()
    target, libs = (MTMD_TARGET, MTMD_LIBS) if mtmd else (TARGET, LIBS)
    want = {"flags": flags(src, native, mtmd), "target": target, "cmake": cmake_version(cmake), **info(src)}
    found = _cached(lib_dir, stamp, want, libs)
    if found:
        return found
    if os.path.isfile(stamp):
        log("cached build has other flags or versions; rebuilding")
    shutil.rmtree(build, ignore_errors=True)
    llama_dir = os.path.join(src, "vendor", "llama.cpp")
    jobs = jobs or os.cpu_count() or 1
    t0 = time.time()
    log(f"configuring {llama_dir} -> {build}")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(llama_dir))
    subprocess.run([cmake, "-S", llama_dir, "-B", build, *want["flags"]], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    t1 = time.time()
    log(f"building target '{target}' with {jobs} jobs")
    subprocess.run([cmake, "--build", build, "--target", target, "-j", str(jobs)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    t2 = time.time()
    missing = [l for l in libs if not os.path.isfile(os.path.join(lib_dir, l))]
    if missing:
        sys.exit(f"build_llamacpp.py: build finished without {missing} in {lib_dir}")
    cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()
    have = dict(want, compiler=cc[0] if cc else "unknown",
                configure_s=round(t1 - t0, 1), build_s=round(t2 - t1, 1))
    with open(stamp, "w") as f:
        json.dump(have, f, indent=1, sort_keys=True)
    log(f"built in {t2 - t0:.0f} s (configure {t1 - t0:.0f} s, compile {t2 - t1:.0f} s)")
    return lib_dir, have


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE,
                    help="sdist, source and build folder (default $TOUCHSTONE_CACHE/llamacpp, i.e. ~/.cache/touchstone/llamacpp)")
    ap.add_argument("--json", action="store_true", help="print lib_dir, source dir and build info as JSON")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--native", action="store_true",
                    help="the benchmark build: GGML_NATIVE=ON and OpenMP, into build-X.Y.Z-native/ (never for goldens)")
    ap.add_argument("--mtmd", action="store_true",
                    help="the multimodal build: also libmtmd.so (LLAMA_BUILD_MTMD=ON, MTMD_VIDEO=OFF, target mtmd), "
                         "into build-X.Y.Z-mtmd/ (for record_llamacpp_vlm.py)")
    args = ap.parse_args()
    if args.native and args.mtmd:
        ap.error("--native and --mtmd do not go together")
    cache = os.path.abspath(args.cache_dir)
    lib_dir, have = ensure_built(cache, jobs=args.jobs, native=args.native, mtmd=args.mtmd)
    if args.json:
        print(json.dumps({"lib_dir": lib_dir, "source_dir": source_dir(cache), **have}, sort_keys=True))
    else:
        print(lib_dir)


if __name__ == "__main__":
    sys.exit(main())
