#!/usr/bin/env python3
"""The house rules a newcomer can rely on, checked in CI (ci/test.sh):

1. every Rust file in src/ is at most 600 lines and opens with a `//!`
   comment saying why it exists; every Python file under goldens/recorders/,
   examples/ and ci/ is at most 600 lines and opens with a module docstring
   saying why it exists;
2. one module style: a module with children is `name/mod.rs`, never
   `name.rs` beside a `name/` folder;
3. every repository path the code, the scripts and the docs mention
   (`src/...`, `docs/...`, `ci/...`, `tests/...`, `specs/...`, `goldens/...`,
   `examples/...`, `cuda/...`, `.ci/...`) and every `*.md` file they name
   exists (at the repository root, or under one of its crates, or beside the
   file), and every relative link in a Markdown file resolves. Test files
   (tests/, `tests.rs`) are left out of this rule: they name missing files
   on purpose.

Exit 1 naming each breach (file:line), 0 with a one-line summary."""
import ast
import os
import re
import sys

MAX_LINES = 600
# The Python of the repository: the golden recorders, the examples, CI's scripts.
PY_ROOTS = ("goldens/recorders", "examples", "ci")
ROOTS = ("src", "docs", "ci", "tests", "specs", "goldens", "examples", "cuda", ".ci")
SCANNED_EXT = (".rs", ".md", ".py", ".sh", ".yaml", ".toml", ".cuh", ".cu", ".hpp", ".cpp")
# Paths that are examples of what a user writes, not files of this repository.
PLACEHOLDER = re.compile(r"[A-Z]{2,}|\{|\*|<|\.\.\.|…")


def tracked_files(root):
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", "target", ".cache", "node_modules") and not x.startswith(".venv")]
        for f in files:
            out.append(os.path.relpath(os.path.join(d, f), root))
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    os.chdir(root)
    files = tracked_files(".")
    problems = []
    md_names = {os.path.basename(f) for f in files if f.endswith(".md")}
    crates = sorted({os.path.dirname(f) for f in files if os.path.basename(f) == "Cargo.toml"})

    def exists(p, mentioned_in):
        bases = ["."] + crates
        d = os.path.dirname(mentioned_in)
        while d:
            bases.append(d)
            d = os.path.dirname(d)
        return any(os.path.exists(os.path.join(b, p)) for b in bases)

    # 1 and 2: the Rust files of src/.
    rust = sorted(f for f in files if f.startswith("src" + os.sep) and f.endswith(".rs"))
    for f in rust:
        lines = open(f, encoding="utf-8").read().split("\n")
        n = len(lines) - (1 if lines and lines[-1] == "" else 0)
        if n > MAX_LINES:
            problems.append(f"{f}: {n} lines (at most {MAX_LINES}): split it along a seam")
        if not lines or not lines[0].startswith("//!"):
            problems.append(f"{f}:1: does not open with a `//!` comment saying why it exists")
        stem = f[:-3]
        if not f.endswith("mod.rs") and os.path.isdir(stem) and os.path.basename(f) not in ("lib.rs", "main.rs"):
            problems.append(f"{f}: both {f} and {stem}/ exist: use {stem}/mod.rs (one module style)")

    # 1, for Python: the recorders', the examples' and CI's scripts.
    python = sorted(f for f in files if f.endswith(".py") and f.startswith(tuple(r + os.sep for r in PY_ROOTS)))
    for f in python:
        text = open(f, encoding="utf-8").read()
        lines = text.split("\n")
        n = len(lines) - (1 if lines and lines[-1] == "" else 0)
        if n > MAX_LINES:
            problems.append(f"{f}: {n} lines (at most {MAX_LINES}): split it along a seam")
        try:
            doc = ast.get_docstring(ast.parse(text, filename=f))
        except SyntaxError as e:
            problems.append(f"{f}:{e.lineno}: does not parse as Python ({e.msg})")
            continue
        if not doc:
            problems.append(f"{f}:1: does not open with a module docstring saying why it exists")

    # 3: paths mentioned in code, scripts and docs.
    path_re = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*[\w-])" % "|".join(re.escape(r) for r in ROOTS))
    md_re = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
    link_re = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
    for f in sorted(files):
        if not f.endswith(SCANNED_EXT) or f.startswith(("target", ".git")):
            continue
        if f.startswith("tests" + os.sep) or os.path.basename(f) == "tests.rs":
            continue
        text = open(f, encoding="utf-8", errors="replace").read()
        for i, line in enumerate(text.split("\n"), 1):
            for m in path_re.finditer(line):
                p = m.group(1).rstrip(".")
                follows = line[m.end(): m.end() + 1]
                if PLACEHOLDER.search(p) or p.endswith("/") or (follows and follows in "*{<"):
                    continue
                if not exists(p, f):
                    problems.append(f"{f}:{i}: mentions `{p}`, which the repository does not have")
            for m in md_re.finditer(line):
                quoted = line[: m.start()].count('"') % 2 == 1
                if m.group(1) not in md_names and not quoted:
                    problems.append(f"{f}:{i}: names `{m.group(1)}`, which the repository does not have")
            if f.endswith(".md"):
                for m in link_re.finditer(line):
                    target = m.group(1)
                    if re.match(r"^[a-z]+:", target):
                        continue
                    resolved = os.path.normpath(os.path.join(os.path.dirname(f), target))
                    if not os.path.exists(resolved):
                        problems.append(f"{f}:{i}: link to `{target}` does not resolve ({resolved})")
    if problems:
        for p in problems:
            print(p)
        print(f"house_rules: {len(problems)} problem(s)")
        return 1
    print(f"house_rules: {len(rust)} Rust files in src/ within {MAX_LINES} lines, each with a `//!` header, one "
          f"module style; {len(python)} Python files in {', '.join(r + '/' for r in PY_ROOTS)} within {MAX_LINES} "
          f"lines, each with a module docstring; every mentioned path and link exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
