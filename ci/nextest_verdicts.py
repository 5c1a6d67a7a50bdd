#!/usr/bin/env python3
"""Compare the verdicts of one cargo-nextest run with those of its partitions.

    python3 ci/nextest_verdicts.py SINGLE.log PART1.log PART2.log ...

Each log is the output of `bash ci/nextest.sh --status-level all
--final-status-level none [--partition hash:K/N]`. nextest lists the other
partitions' tests as SKIP too, so a test's merged verdict is the one of the
partition that ran it (SKIP where none did). Exit 0 when the merged verdicts
are the single run's, trial for trial; 1 otherwise (what differs is printed).
"""
import re
import sys
from collections import Counter

LINE = re.compile(
    r"^\s+(PASS|FAIL|SKIP|SIGSEGV|SIGABRT|ABORT|TIMEOUT|LEAK)\s+\[[^\]]*\]\s+(?:\([^)]*\)\s+)?(\S+)\s+(.*\S)\s*$"
)


def read(path):
    verdicts = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                status, binary, name = m.groups()
                verdicts[(binary, name)] = status
    return verdicts


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    single = read(argv[1])
    merged, twice = {}, 0
    for path in argv[2:]:
        part = read(path)
        ran = {k for k, v in part.items() if v != "SKIP"}
        twice += len(ran & {k for k, v in merged.items() if v != "SKIP"})
        for k, v in part.items():
            if v != "SKIP" or k not in merged:
                merged[k] = v
    print(f"single: {len(single)} trials {dict(Counter(single.values()))}")
    print(f"merged: {len(merged)} trials {dict(Counter(merged.values()))}")
    only_single = sorted(set(single) - set(merged))
    only_merged = sorted(set(merged) - set(single))
    changed = sorted(k for k in single if k in merged and single[k] != merged[k])
    for what, keys in (("only in the single run", only_single), ("only in the partitions", only_merged)):
        for k in keys[:20]:
            print(f"{what}: {' '.join(k)}")
    for k in changed[:20]:
        print(f"different: {' '.join(k)}: single {single[k]}, partitions {merged[k]}")
    if twice:
        print(f"run in two partitions: {twice}")
    same = not (only_single or only_merged or changed or twice) and single
    print("IDENTICAL" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
