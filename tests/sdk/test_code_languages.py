"""Code contexts in each language the code-interpreter image offers (javascript, typescript,
java, go, python, bash, sql), through the official code-interpreter SDK 1.1.1, on a sandbox of
`opensandbox/code-interpreter:latest` (the offline recipe with Python, Node.js,
TypeScript, Go and a JDK). Prints
each language's first-run latency in a fresh sandbox.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Iterator
from datetime import timedelta

import fastbox_server as fb
import httpx
import pytest
from code_interpreter.models.code_sync import SupportedLanguageSync
from code_interpreter.sync.code_interpreter import CodeInterpreterSync
from opensandbox.exceptions import SandboxException

lines = fb.lines

CODE_INTERPRETER_IMAGE = "opensandbox/code-interpreter:latest"


@pytest.fixture(scope="module")
def interpreter(fastbox: fb.FastboxServer) -> Iterator[CodeInterpreterSync]:
    # The first create builds the image (debootstrap, a few minutes once per cache).
    sb = fastbox.create_sandbox(
        image=CODE_INTERPRETER_IMAGE,
        metadata={"fbt-suite": "code-languages"},
        ready_timeout=timedelta(minutes=15),
    )
    ci = CodeInterpreterSync.create(sb, ready_timeout=timedelta(seconds=60))
    yield ci
    ci.close()
    with contextlib.suppress(SandboxException):
        sb.kill()
    sb.close()


def first_run(ci: CodeInterpreterSync, language: str, code: str) -> float:
    """Seconds from a new context of `language` to the end of its first run of `code`."""
    t0 = time.monotonic()
    ctx = ci.codes.create_context(language)
    r = ci.codes.run(code, context=ctx)
    took = time.monotonic() - t0
    assert r.error is None, r.error
    print(f"[fastbox] first run in a new {language} context: {took * 1000:.1f} ms", flush=True)
    return took


def test_javascript_context_keeps_state_and_reports_errors(
    interpreter: CodeInterpreterSync,
) -> None:
    codes = interpreter.codes
    first_run(interpreter, SupportedLanguageSync.JAVASCRIPT, "1 + 1")
    ctx = codes.create_context(SupportedLanguageSync.JAVASCRIPT)
    assert ctx.language == "javascript"

    r1 = codes.run("let fbtX = 20 + 1\nconsole.log('x is set')", context=ctx)
    assert r1.error is None, r1.error
    assert lines(r1.logs.stdout) == ["x is set"]
    r2 = codes.run("fbtX * 2", context=ctx)
    assert r2.error is None, r2.error
    assert [r.text for r in r2.result] == ["42"]
    r3 = codes.run("const sq = (n) => n * n\nconsole.log(sq(fbtX))", context=ctx)
    assert lines(r3.logs.stdout) == ["441"]
    r4 = codes.run("require('os').platform()", context=ctx)
    assert [r.text for r in r4.result] == ["'linux'"]

    r5 = codes.run("null.boom", context=ctx)
    assert r5.error is not None and r5.error.name == "TypeError", r5.error
    assert "null" in r5.error.value
    assert any("<cell>" in line for line in r5.error.traceback), r5.error.traceback

    # Contexts do not share state.
    other = codes.create_context(SupportedLanguageSync.JAVASCRIPT)
    r6 = codes.run("typeof fbtX", context=other)
    assert [r.text for r in r6.result] == ["'undefined'"]
    listed = {c.id for c in codes.list_contexts(SupportedLanguageSync.JAVASCRIPT)}
    assert {ctx.id, other.id} <= listed
    codes.delete_contexts(SupportedLanguageSync.JAVASCRIPT)
    assert codes.list_contexts(SupportedLanguageSync.JAVASCRIPT) == []


def test_typescript_context_transpiles_and_keeps_state(interpreter: CodeInterpreterSync) -> None:
    first_run(interpreter, SupportedLanguageSync.TYPESCRIPT, "const one: number = 1\none")
    codes = interpreter.codes
    ctx = codes.create_context(SupportedLanguageSync.TYPESCRIPT)
    assert ctx.language == "typescript"
    r1 = codes.run(
        "interface Point { x: number; y: number }\n"
        "const p: Point = { x: 3, y: 4 }\n"
        "function norm(q: Point): number { return Math.hypot(q.x, q.y) }\n"
        "console.log(`norm ${norm(p)}`)",
        context=ctx,
    )
    assert r1.error is None, r1.error
    assert lines(r1.logs.stdout) == ["norm 5"]
    r2 = codes.run("norm({ x: 6, y: 8 } as Point) * 2", context=ctx)
    assert [r.text for r in r2.result] == ["20"]
    r3 = codes.run("const broken: number = (", context=ctx)
    assert r3.error is not None and r3.error.name == "SyntaxError", r3.error


def test_java_context_keeps_state_in_jshell(interpreter: CodeInterpreterSync) -> None:
    first_run(interpreter, SupportedLanguageSync.JAVA, "1 + 1")
    codes = interpreter.codes
    ctx = codes.create_context(SupportedLanguageSync.JAVA)
    assert ctx.language == "java"
    r1 = codes.run(
        "import java.util.*;\nList<Integer> xs = new ArrayList<>(List.of(3, 1, 2));\n"
        "Collections.sort(xs);\nSystem.out.println(xs);",
        context=ctx,
    )
    assert r1.error is None, r1.error
    assert lines(r1.logs.stdout) == ["[1, 2, 3]"]
    r2 = codes.run("xs.stream().mapToInt(Integer::intValue).sum() * 7", context=ctx)
    assert [r.text for r in r2.result] == ["42"]
    r3 = codes.run("Object o = null; o.toString()", context=ctx)
    assert r3.error is not None and r3.error.name == "java.lang.NullPointerException", r3.error


def test_go_runs_each_cell_as_a_program(interpreter: CodeInterpreterSync) -> None:
    first_run(interpreter, SupportedLanguageSync.GO, 'fmt.Println("warm")')
    codes = interpreter.codes
    ctx = codes.create_context(SupportedLanguageSync.GO)
    assert ctx.language == "go"
    r1 = codes.run('n := 6 * 7\nfmt.Println(strings.ToUpper("go"), n)', context=ctx)
    assert r1.error is None, r1.error
    assert lines(r1.logs.stdout) == ["GO 42"]
    r2 = codes.run(
        'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("whole program") }',
        context=ctx,
    )
    assert lines(r2.logs.stdout) == ["whole program"]
    # Nothing carries over: each cell is a program of its own.
    r3 = codes.run("fmt.Println(n)", context=ctx)
    assert r3.error is not None and r3.error.name == "ExitError", r3.error


def raw_code_events(sb, code: str, language: str) -> list[dict]:
    """The events of one `/code` run, straight from execd (the SDK keeps only `text`)."""
    ep = sb.get_endpoint(fb.EXECD_PORT)
    with httpx.Client(timeout=120, trust_env=False) as client:
        r = client.post(
            f"http://{ep.endpoint}/code",
            json={"code": code, "context": {"language": language}},
            headers=ep.headers,
        )
    assert r.status_code == 200, r.text
    return [json.loads(part) for part in r.text.split("\n\n") if part.strip()]


def test_a_matplotlib_figure_is_a_png_result(interpreter: CodeInterpreterSync) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\n"
        "ax.plot([1, 2, 3], [1, 4, 9])\n"
        "ax.set_title('squares')"
    )
    # Through the SDK: the run succeeds, the figure's text is among the results.
    r = interpreter.codes.run(code, language=SupportedLanguageSync.PYTHON)
    assert r.error is None, r.error
    assert any((x.text or "").startswith("<Figure size") for x in r.result), r.result
    # On the wire, as Jupyter has it: the figure as a base64 PNG, and HTML from a display.
    events = raw_code_events(
        interpreter.sandbox,
        code + "\nclass Table:\n    def _repr_html_(self): return '<table><tr><td>1</td></tr></table>'\n"
        "display(Table())",
        "python",
    )
    results = [e["results"] for e in events if e["type"] == "result"]
    pngs = [base64.b64decode(x["image/png"]) for x in results if "image/png" in x]
    assert len(pngs) == 1, results
    assert pngs[0].startswith(b"\x89PNG\r\n\x1a\n") and len(pngs[0]) > 1000
    assert any(x.get("text/html", "").startswith("<table>") for x in results), results
    assert events[-1]["type"] == "execution_complete", events[-1]


def test_python_and_bash_run_in_the_same_image(interpreter: CodeInterpreterSync) -> None:
    first_run(interpreter, SupportedLanguageSync.PYTHON, "1 + 1")
    first_run(interpreter, SupportedLanguageSync.BASH, "true")
    codes = interpreter.codes
    py = codes.create_context(SupportedLanguageSync.PYTHON)
    r = codes.run("import subprocess\nsubprocess.check_output(['node', '-p', '6 * 7']).decode().strip()", context=py)
    assert r.error is None, r.error
    assert [x.text for x in r.result] == ["'42'"]


def test_sql_runs_against_the_sandboxs_database(interpreter: CodeInterpreterSync) -> None:
    first_run(interpreter, "sql", "SELECT 1")
    codes = interpreter.codes
    ctx = codes.create_context("sql")
    assert ctx.language == "sql"
    created = codes.run("CREATE TABLE fbt_langs (name TEXT, year INTEGER)", context=ctx)
    assert created.error is None, created.error
    inserted = codes.run(
        "INSERT INTO fbt_langs VALUES ('python', 1991), ('javascript', 1995)", context=ctx
    )
    assert json.loads(inserted.result[0].text) == {"columns": ["affected_rows"], "rows": [[2]]}
    # Another context, the same database.
    other = codes.create_context("sql")
    selected = codes.run("SELECT name, year FROM fbt_langs ORDER BY year", context=other)
    assert selected.error is None, selected.error
    assert json.loads(selected.result[0].text) == {
        "columns": ["name", "year"],
        "rows": [["python", "1991"], ["javascript", "1995"]],
    }
    bad = codes.run("SELECT * FROM fbt_nowhere", context=other)
    assert bad.error is not None and bad.error.name == "DBQueryError", bad.error


def test_an_unsupported_language_is_refused(interpreter: CodeInterpreterSync) -> None:
    with pytest.raises(SandboxException):
        interpreter.codes.create_context("cobol")


PROCESS_AGE = {
    "python": (
        "import os\n"
        "hz = os.sysconf('SC_CLK_TCK')\n"
        "start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / hz\n"
        "print(round(float(open('/proc/uptime').read().split()[0]) - start, 2), os.environ.get('FB_WARM'))"
    ),
    "javascript": (
        "const fs = require('fs');\n"
        "const start = Number(fs.readFileSync('/proc/self/stat', 'utf8').split(')').pop().trim().split(' ')[19]) / 100;\n"
        "console.log((Number(fs.readFileSync('/proc/uptime', 'utf8').split(' ')[0]) - start).toFixed(2), process.env.FB_WARM)"
    ),
}


RANDOM_STATE = {
    "python": "import random; print(random.getrandbits(64))",
    "javascript": "console.log(require('crypto').randomBytes(8).toString('hex'), Math.random())",
}


def test_python_and_javascript_contexts_start_warm(fastbox: fb.FastboxServer) -> None:
    """A new python or javascript context is an interpreter that was running before it (the
    golden checkpoint's python, a javascript started at the claim), and it takes the
    sandbox's environment. Two sandboxes of the template never draw the same random numbers
    in them: python's state is drawn again, javascript's is its own."""
    drawn: dict[str, list[str]] = {"python": [], "javascript": []}
    for _ in range(2):
        sb = fastbox.create_sandbox(
            image=CODE_INTERPRETER_IMAGE,
            metadata={"fbt-suite": "code-languages"},
            env={"FB_WARM": "yes"},
            ready_timeout=timedelta(minutes=15),
        )
        ci = CodeInterpreterSync.create(sb, ready_timeout=timedelta(seconds=60))
        try:
            time.sleep(1.5)
            for language, code in PROCESS_AGE.items():
                t0 = time.monotonic()
                ctx = ci.codes.create_context(language)
                r = ci.codes.run(code, context=ctx)
                took = time.monotonic() - t0
                assert r.error is None, r.error
                age, env = lines(r.logs.stdout)[-1].split()
                print(
                    f"[fastbox] {language}: context and first run {took * 1000:.1f} ms, "
                    f"its interpreter {age} s old"
                )
                # Started before the context (at least the 1.5 s slept), not for it.
                assert float(age) > 1.4, (language, age, took)
                assert env == "yes", (language, env)
                r = ci.codes.run(RANDOM_STATE[language], context=ctx)
                assert r.error is None, r.error
                drawn[language].append(lines(r.logs.stdout)[-1])
        finally:
            ci.close()
            with contextlib.suppress(SandboxException):
                sb.kill()
            sb.close()
    for language, values in drawn.items():
        assert values[0] != values[1], (language, values)
