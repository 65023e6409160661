# fastbox-execd go code-context driver (embedded in execd, run with `python3 -u -c`).
# Go has no REPL: each execution is a program of its own, built and run with `go run`, and
# nothing carries over to the next. A cell that starts with `package` is the whole program;
# any other cell is the body of `func main()`, and the standard packages it names
# (`fmt.`, `strings.`, ...) are imported for it. Output streams as the program writes it; a
# program that fails to build or exits non-zero is an error (its compiler or runtime
# messages are on stderr).
# Its requests come through `driver_loop.py`, put in front of it.
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile

# Standard packages a body cell may use without importing them.
STANDARD = [
    "bufio", "bytes", "context", "encoding/base64", "encoding/hex", "encoding/json", "errors",
    "fmt", "io", "math", "math/rand", "net/http", "os", "path/filepath", "regexp", "sort",
    "strconv", "strings", "sync", "time", "unicode",
]


def _program(code):
    if re.match(r"\s*(//[^\n]*\n\s*)*package\s", code):
        return code
    used = [p for p in STANDARD if re.search(r"\b%s\." % re.escape(p.rsplit("/", 1)[-1]), code)]
    imports = "".join('import "%s"\n' % p for p in used)
    return "package main\n\n%s\nfunc main() {\n%s\n}\n" % (imports, code)


def _environment():
    # go keeps its build cache under HOME: the user's home when the sandbox names none.
    env = dict(os.environ)
    if not env.get("HOME"):
        try:
            env["HOME"] = pwd.getpwuid(os.getuid()).pw_dir or "/root"
        except KeyError:
            env["HOME"] = "/root"
    return env


def _run(code, out):
    workdir = tempfile.mkdtemp(prefix="fastbox-go-")
    try:
        source = os.path.join(workdir, "main.go")
        with open(source, "w", encoding="utf-8") as f:
            f.write(_program(code))
        # Its own process group: an interrupt ends `go run` and the program it started.
        child = subprocess.Popen(
            ["go", "run", source],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=_environment(),
        )
        try:
            status = child.wait()
        except KeyboardInterrupt:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        if status != 0:
            out["error"] = {
                "ename": "ExitError",
                "evalue": "exit status %d" % status,
                "traceback": ["the program (built and run with go run) exited with %d" % status],
            }
    except FileNotFoundError:
        out["error"] = {
            "ename": "ModuleNotFoundError",
            "evalue": "go contexts need the go toolchain in the sandbox (the code-interpreter image has it)",
            "traceback": [],
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_serve(_run)
