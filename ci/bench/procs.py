"""Running one measured process for ci/bench.sh: its JSON lines, wall time,
peak RSS (the kernel's own per-child figure, from wait4), and how much of
the machine OTHER processes used meanwhile.

That last figure is there because the machine may be shared: every peer
here spins worker threads (llama.cpp's OpenMP, torch's and OpenBLAS's
pools), and when another process takes a core they do not slow down in
proportion, they collapse (measured here while another engineer's cargo
builds held about half the CPUs: llama.cpp decode 0.97 tok/s against
14.4-15.0 quiet, torch's 2-thread comparator 0.014 GB/s against 0.40-0.71).
The report leaves such measurements out of its medians (report.QUIET).
The share is counted in /proc/stat jiffies (10 ms): coarse for a process
of under a second (--quick's), exact enough for the real model's runs.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NCPU = os.cpu_count() or 1


def cpu_jiffies():
    """(busy, total) jiffies of the whole machine from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - idle, total


class Result:
    def __init__(self, name, cmd):
        self.name, self.cmd = name, cmd
        self.rc = None
        self.wall_s = None
        self.peak_rss_bytes = None
        self.cpu_s = None
        self.others_frac = None
        self.records = []
        self.stderr = ""
        self.error = None

    def summary(self):
        return next((r for r in self.records if r.get("summary")), None)

    def reps(self):
        return [r for r in self.records if "rep" in r and not r.get("summary")]

    def to_json(self):
        return {k: getattr(self, k) for k in ("name", "cmd", "rc", "wall_s", "peak_rss_bytes", "cpu_s",
                                               "others_frac", "records", "error")}


def run(name, cmd, env=None, ok_codes=(0,), timeout_s=1800, echo=True):
    """Runs cmd to completion; its stdout's JSON lines become records. A
    non-zero exit outside ok_codes, a timeout, or no output is an error
    recorded in the result (the caller carries on with the other peers)."""
    res = Result(name, [str(c) for c in cmd])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        j0 = cpu_jiffies()
        t0 = time.perf_counter()
        try:
            p = subprocess.Popen(res.cmd, stdout=out, stderr=err, env=env)
        except OSError as e:
            res.error = f"cannot start {res.cmd[0]}: {e}"
            return res
        timer = threading.Timer(timeout_s, p.kill)
        timer.start()
        try:
            # wait4 rather than p.wait(): it also gives this child's own rusage.
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = res.rc = os.waitstatus_to_exitcode(status)
        res.wall_s = time.perf_counter() - t0
        j1 = cpu_jiffies()
        res.peak_rss_bytes = ru.ru_maxrss * 1024  # KiB on Linux
        res.cpu_s = ru.ru_utime + ru.ru_stime
        if j0 and j1 and j1[1] > j0[1]:
            busy = (j1[0] - j0[0]) / CLK_TCK
            res.others_frac = max(0.0, (busy - res.cpu_s) / (res.wall_s * NCPU))
        out.seek(0)
        err.seek(0)
        res.stderr = err.read()
        for line in out.read().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    res.records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    if res.rc not in ok_codes:
        why = "timed out" if res.rc == -9 and res.wall_s >= timeout_s else f"exit status {res.rc}"
        tail = "\n".join(res.stderr.strip().splitlines()[-6:])
        res.error = f"{why}: {tail}" if tail else why
    if echo:
        for line in res.stderr.strip().splitlines()[-4:]:
            print(f"    {line}", file=sys.stderr)
        if res.others_frac is not None and res.others_frac > 0.05:
            print(f"    (other processes used {100 * res.others_frac:.0f}% of the machine during this run)",
                  file=sys.stderr)
    return res
