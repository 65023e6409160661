# fastbox-execd: the request loop of its Python-run drivers (python, sql, go), put in front
# of each driver's own code (`driver.rs`). Reads one JSON request per line from the original
# stdin: {"code": str, "sentinel": str}; the code itself gets no stdin. {"adopt": {"env",
# "cwd"}, "sentinel"} hands a warm interpreter (started before the sandbox was claimed) to
# a new context: its environment and directory become the context's, nothing runs and
# nothing is counted. Each request is
# `run_cell(code, out)`, `out` holding the execution count, and the result or error the
# cell adds. After each execution it writes `<sentinel> <json>` to stdout and `<sentinel>`
# to stderr so execd knows all output of that execution has been read.
import json
import os
import signal
import sys


# Variables a driver sets for itself (python: MPLBACKEND), kept when a context's environment
# replaces the interpreter's.
_ENV_DEFAULTS = {}


def _adopt(adopt):
    """Takes the context's environment and directory; returns why not, or None."""
    # This interpreter may have been checkpointed and cloned: draw its random state again
    # (its hash() seed cannot be).
    for name in ("random", "numpy.random"):
        module = sys.modules.get(name)
        if module is not None:
            try:
                module.seed()
            except Exception:
                pass
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None
    env = adopt.get("env")
    if isinstance(env, dict):
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    cwd = adopt.get("cwd")
    if cwd:
        try:
            os.chdir(cwd)
        except OSError as e:
            return f"cwd {cwd}: {e.strerror}"
    return None


def _serve(run_cell):
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    count = 0
    while True:
        try:
            line = requests.readline()
        except KeyboardInterrupt:
            continue
        if not line:
            return
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        adopt = msg.get("adopt")
        if isinstance(adopt, dict):
            refused = _adopt(adopt)
            sentinel = msg.get("sentinel", "")
            reply = {"error": refused} if refused else {}
            os.write(1, (sentinel + " " + json.dumps(reply) + "\n").encode())
            os.write(2, (sentinel + "\n").encode())
            continue
        count += 1
        out = {"execution_count": count}
        try:
            run_cell(msg.get("code", ""), out)
        except KeyboardInterrupt:
            out["error"] = {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []}
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        sentinel = msg.get("sentinel", "")
        os.write(1, (sentinel + " " + json.dumps(out) + "\n").encode())
        os.write(2, (sentinel + "\n").encode())
