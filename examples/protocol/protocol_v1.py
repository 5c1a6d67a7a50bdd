"""touchstone's subprocess protocol, version 1, served the way every Python
engine of this repository serves it: the reference engines here
(numpy_engine.py and its variants) and the third-party engines built from
the golden recorders (goldens/recorders/engine_protocol.py, engine_hf.py,
engine_llamacpp.py). Standard library only.

- serve(engine, log) reads one JSON request per line on stdin and writes
  exactly one JSON response per line on stdout, flushed at once. The real
  stdout (fd 1) is kept for protocol lines only: fd 1 itself is pointed at
  stderr, and so is sys.stdout, so anything a library prints, from Python or
  from C, lands in the log, never in a response.
- A refused request (EngineError) is {"ok": false, "error": ...} with its
  sentence, and the engine keeps serving; so is a line that is not a JSON
  object. A bug in the engine is reported as an internal error with its
  traceback in the log, and the engine keeps serving.
- Dispatcher.handle() routes a request by its `op` to the engine's method;
  an op the engine does not know is refused, naming the ones it knows.
  `shutdown` answers {"ok": true}; serve() then returns 0, as it does at the
  end of stdin.
"""
import json
import os
import sys
import traceback

PROTOCOL = 1
OUT_FORMAT = "touchstone-engine-out/1"


class EngineError(Exception):
    """A refused request: its message is the response's `error`."""


def int_list(v, what):
    """`v` as a list of integer token ids, or EngineError naming `what`."""
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise EngineError(f"{what} must be a list of integer token ids")
    return v


def logger(name):
    """log(msg): one `[name] msg` line on stderr, the engine's log."""
    def log(msg):
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)
    return log


class Dispatcher:
    """Routes a request to the method its op names (OPS, in the order the
    refusal lists them); subclasses set `ops` to the ops they serve."""

    name = "engine"
    ops = ("load", "run", "shutdown")
    OPS = {"load": "load", "run": "run", "run_batch": "run_batch", "tokenize": "tokenize_req"}

    def handle(self, req):
        if not isinstance(req, dict):
            raise EngineError("a request must be a JSON object")
        op = req.get("op")
        if op == "shutdown":
            return {"ok": True}
        if op in self.ops:
            return getattr(self, self.OPS[op])(req)
        raise EngineError(f"unknown op {op!r} (this engine knows {', '.join(self.ops)})")


def serve(engine, log):
    """Serves requests from stdin until `shutdown` or end of input; returns
    the exit status (0)."""
    # Keep the real stdout for protocol lines; point fd 1 (C libraries'
    # printf) and sys.stdout (Python's print) at stderr.
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj, separators=(",", ":")) + "\n")
        proto.flush()

    for line in sys.stdin.buffer:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            log(f"bad request line: {e}")
            reply({"ok": False, "error": f"the request is not a JSON object on one line: {e}"})
            continue
        op = req.get("op") if isinstance(req, dict) else None
        try:
            resp = engine.handle(req)
        except EngineError as e:
            log(f"{op}: refused: {e}")
            resp = {"ok": False, "error": str(e)}
        except Exception as e:  # a bug here: say so, keep serving
            log(f"{op}: internal error\n{traceback.format_exc()}")
            resp = {"ok": False, "error": f"internal error in {engine.name} during {op}: {type(e).__name__}: {e}"}
        reply(resp)
        if op == "shutdown":
            log("shutdown")
            return 0
    log("end of input; exiting")
    return 0
