# fastbox-execd python code-context driver (embedded in execd, run with `python3 -u -c`).
# Reads one JSON request per line from the original stdin: {"code": str, "sentinel": str}.
# Executes the code in one persistent namespace; the value of a trailing expression is the
# result (its repr). After each execution it writes `<sentinel> <json>` to stdout and
# `<sentinel>` to stderr so execd knows all output of that execution has been read.
import ast
import json
import os
import signal
import sys
import traceback


def _run(code, ns, out):
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), ns)
            if value is not None:
                ns["_"] = value
                out["result"] = repr(value)
    except BaseException as e:  # noqa: B902 - user code may raise anything, SystemExit too
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        lines = traceback.format_exception(type(e), e, tb)
        out["error"] = {
            "ename": type(e).__name__,
            "evalue": str(e),
            "traceback": [l.rstrip("\n") for l in lines],
        }


def _main():
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
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
        count += 1
        out = {"execution_count": count}
        try:
            _run(msg.get("code", ""), ns, out)
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


_main()
