//! `/code`: python and javascript contexts keep state and report results and errors; sql
//! contexts against the sandbox's database; bash contexts; default contexts; context
//! management; interrupt.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{Value, json};

/// Whether one of `programs` is on `PATH` (a test without it says it is skipped).
fn have(programs: &[&str]) -> bool {
    let found = programs.iter().any(|p| {
        std::env::var("PATH")
            .unwrap_or_default()
            .split(':')
            .any(|d| std::path::Path::new(d).join(p).exists())
    });
    if !found {
        eprintln!("skipped: {} is not installed on this machine", programs[0]);
    }
    found
}

fn have_python() -> bool {
    have(&["python3", "python"])
}

async fn run(app: &TestApp, body: Value) -> Vec<Value> {
    let r = app.post_json("/code", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    r.events()
}

#[tokio::test]
async fn python_context_keeps_state_and_reports_results() {
    if !have_python() {
        return;
    }
    let app = test_app();
    let r = app
        .post_json("/code/context", json!({"language": "python"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let ctx = r.json();
    assert_eq!(ctx["language"], "python");
    let id = ctx["id"].as_str().unwrap().to_string();
    let context = json!({"id": id, "language": "python"});

    let ev = run(
        &app,
        json!({"code": "x = 40\nprint('hello')\nprint()\nx + 2", "context": context}),
    )
    .await;
    assert_eq!(
        types(&ev),
        [
            "init",
            "stdout",
            "stdout",
            "execution_count",
            "result",
            "execution_complete"
        ]
    );
    assert_eq!(ev[0]["text"], id);
    assert_eq!(texts(&ev, "stdout"), ["hello\n", "\n"]);
    assert_eq!(ev[3]["execution_count"], 1);
    assert_eq!(ev[4]["results"]["text"], "42");

    let ev = run(
        &app,
        json!({"code": "import sys\nprint('warn', file=sys.stderr)\n'x' * x", "context": context}),
    )
    .await;
    assert_eq!(texts(&ev, "stderr"), ["warn\n"]);
    let result = ev.iter().find(|e| e["type"] == "result").unwrap();
    assert_eq!(result["results"]["text"], format!("'{}'", "x".repeat(40)));
    assert_eq!(
        ev.iter().find(|e| e["type"] == "execution_count").unwrap()["execution_count"],
        2
    );

    let ev = run(
        &app,
        json!({"code": "print('before')\n1/0", "context": context}),
    )
    .await;
    assert_eq!(types(&ev).last().unwrap(), "error");
    assert!(!types(&ev).contains(&"execution_complete".to_string()));
    let err = &ev.last().unwrap()["error"];
    assert_eq!(err["ename"], "ZeroDivisionError");
    assert_eq!(err["evalue"], "division by zero");
    assert!(
        err["traceback"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("ZeroDivisionError"))
    );

    let ev = run(&app, json!({"code": "def f(:\n  pass", "context": context})).await;
    assert_eq!(ev.last().unwrap()["error"]["ename"], "SyntaxError");

    // input() sees EOF rather than the protocol.
    let ev = run(
        &app,
        json!({"code": "try:\n  input()\nexcept EOFError:\n  print('eof')", "context": context}),
    )
    .await;
    assert_eq!(texts(&ev, "stdout"), ["eof\n"]);

    let got = app.get(&format!("/code/contexts/{id}")).await;
    assert_eq!(got.json()["id"], id);
    let list = app.get("/code/contexts?language=python").await.json();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(
        app.delete(&format!("/code/contexts/{id}")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        app.get(&format!("/code/contexts/{id}")).await.status,
        StatusCode::NOT_FOUND
    );
    let r = app
        .post_json("/code", json!({"code": "1", "context": context}))
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["code"], "CONTEXT_NOT_FOUND");
}

#[tokio::test]
async fn default_context_per_language_and_interrupt() {
    if !have_python() {
        return;
    }
    let app = std::sync::Arc::new(test_app());
    let ev = run(
        &app,
        json!({"code": "counter = 1", "context": {"language": "python"}}),
    )
    .await;
    let default_id = ev[0]["text"].as_str().unwrap().to_string();
    let ev = run(
        &app,
        json!({"code": "counter + 1", "context": {"language": "python"}}),
    )
    .await;
    assert_eq!(ev[0]["text"], default_id);
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "2"
    );

    let app2 = std::sync::Arc::clone(&app);
    let id = default_id.clone();
    let interrupter = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        app2.delete(&format!("/code?id={id}")).await.status
    });
    let ev = run(&app, json!({"code": "import time\ntime.sleep(30)", "context": {"id": default_id, "language": "python"}})).await;
    assert_eq!(interrupter.await.unwrap(), StatusCode::OK);
    assert_eq!(ev.last().unwrap()["error"]["ename"], "KeyboardInterrupt");
    let ev = run(
        &app,
        json!({"code": "counter", "context": {"id": default_id, "language": "python"}}),
    )
    .await;
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "1",
        "state survives"
    );

    assert_eq!(
        app.delete("/code/contexts?language=python").await.status,
        StatusCode::OK
    );
    assert!(
        app.get("/code/contexts?language=python")
            .await
            .json()
            .as_array()
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn bash_context_keeps_state() {
    let app = test_app();
    let r = app
        .post_json("/code/context", json!({"language": "bash"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let context = json!({"id": id, "language": "bash"});
    run(
        &app,
        json!({"code": "export N=7; cd /", "context": context}),
    )
    .await;
    let ev = run(&app, json!({"code": "echo $N; pwd", "context": context})).await;
    assert_eq!(
        types(&ev),
        [
            "init",
            "stdout",
            "stdout",
            "execution_count",
            "execution_complete"
        ]
    );
    assert_eq!(texts(&ev, "stdout"), ["7\n", "/\n"]);
    let ev = run(&app, json!({"code": "false", "context": context})).await;
    assert_eq!(ev.last().unwrap()["error"]["evalue"], "1");
}

#[tokio::test]
async fn no_context_runs_a_command_and_unknown_languages_are_refused() {
    let app = test_app();
    let ev = run(&app, json!({"code": "echo plain"})).await;
    assert_eq!(texts(&ev, "stdout"), ["plain"]);
    assert_eq!(types(&ev).last().unwrap(), "execution_complete");
    let r = app
        .post_json("/code/context", json!({"language": "cobol"}))
        .await;
    assert_eq!(r.status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(r.json()["code"], "NOT_SUPPORTED");
    assert_eq!(
        app.delete("/code?id=nope").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn javascript_context_keeps_state_reports_results_and_is_interrupted() {
    if !have(&["node", "nodejs"]) {
        return;
    }
    let app = std::sync::Arc::new(test_app());
    let r = app
        .post_json("/code/context", json!({"language": "javascript"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let ctx = r.json();
    assert_eq!(ctx["language"], "javascript");
    let id = ctx["id"].as_str().unwrap().to_string();
    let context = json!({"id": id, "language": "javascript"});

    let ev = run(
        &app,
        json!({"code": "let x = 40\nconsole.log('hello')\nx + 2", "context": context}),
    )
    .await;
    assert_eq!(
        types(&ev),
        [
            "init",
            "stdout",
            "execution_count",
            "result",
            "execution_complete"
        ]
    );
    assert_eq!(texts(&ev, "stdout"), ["hello\n"]);
    assert_eq!(ev[2]["execution_count"], 1);
    assert_eq!(ev[3]["results"]["text"], "42");

    // Declarations stay; stderr streams; a string result reads as the REPL shows it.
    let ev = run(
        &app,
        json!({"code": "function twice(s) { return s + s }\nconsole.error('warn')\ntwice('ab') + x", "context": context}),
    )
    .await;
    assert_eq!(texts(&ev, "stderr"), ["warn\n"]);
    let result = ev.iter().find(|e| e["type"] == "result").unwrap();
    assert_eq!(result["results"]["text"], "'abab40'");

    let ev = run(
        &app,
        json!({"code": "function boom() { throw new TypeError('bad input') }\nboom()", "context": context}),
    )
    .await;
    assert!(!types(&ev).contains(&"execution_complete".to_string()));
    let err = &ev.last().unwrap()["error"];
    assert_eq!(err["ename"], "TypeError");
    assert_eq!(err["evalue"], "bad input");
    let traceback: Vec<&str> = err["traceback"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        traceback.iter().any(|l| l.contains("at boom (<cell>")),
        "{traceback:?}"
    );
    assert!(
        !traceback.iter().any(|l| l.contains("node:vm")),
        "the driver's frames are not the cell's: {traceback:?}"
    );

    // A promise is awaited; top-level await runs the cell as an async function.
    let ev = run(
        &app,
        json!({"code": "Promise.resolve(x * 2)", "context": context}),
    )
    .await;
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "80"
    );
    let ev = run(
        &app,
        json!({"code": "const v = await new Promise(r => setTimeout(() => r(x), 10))\nreturn v + 1", "context": context}),
    )
    .await;
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "41"
    );

    // An endless loop is interrupted, and the context's state survives it.
    let app2 = std::sync::Arc::clone(&app);
    let interrupted = id.clone();
    let interrupter = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        app2.delete(&format!("/code?id={interrupted}")).await.status
    });
    let ev = run(&app, json!({"code": "while (true) {}", "context": context})).await;
    assert_eq!(interrupter.await.unwrap(), StatusCode::OK);
    let err = &ev.last().unwrap()["error"];
    assert!(
        err["evalue"].as_str().unwrap().contains("interrupted"),
        "{err}"
    );
    let ev = run(&app, json!({"code": "x", "context": context})).await;
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "40",
        "state survives"
    );
    let ev = run(&app, json!({"code": "x", "context": context})).await;
    assert_eq!(ev[1]["execution_count"], 8, "{ev:?}");
}

#[tokio::test]
async fn sql_contexts_share_the_sandboxs_database() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("db/sandbox.db");
    // Contexts start with execd's environment.
    let app = test_app_with(|c| {
        c.daemon_env.push((
            "FASTBOX_SQL_DATABASE".into(),
            database.display().to_string(),
        ))
    });
    let result = |ev: &[Value]| -> Value {
        let text = ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"]
            .as_str()
            .unwrap()
            .to_string();
        serde_json::from_str(&text).unwrap()
    };
    let ev = run(
        &app,
        json!({"code": "CREATE TABLE fbt (n INTEGER, s TEXT)", "context": {"language": "sql"}}),
    )
    .await;
    assert_eq!(types(&ev).last().unwrap(), "execution_complete", "{ev:?}");
    assert_eq!(
        result(&ev),
        json!({"columns": ["affected_rows"], "rows": [[0]]})
    );
    let ev = run(
        &app,
        json!({"code": "INSERT INTO fbt VALUES (1, 'one'), (2, NULL)", "context": {"language": "sql"}}),
    )
    .await;
    assert_eq!(
        result(&ev),
        json!({"columns": ["affected_rows"], "rows": [[2]]})
    );

    // Another context sees the same database.
    let r = app
        .post_json("/code/context", json!({"language": "sql"}))
        .await;
    assert_eq!(r.json()["language"], "sql");
    let other = json!({"id": r.json()["id"], "language": "sql"});
    let ev = run(
        &app,
        json!({"code": "SELECT n, s FROM fbt ORDER BY n", "context": other}),
    )
    .await;
    assert_eq!(
        result(&ev),
        json!({"columns": ["n", "s"], "rows": [["1", "one"], ["2", null]]})
    );
    let ev = run(
        &app,
        json!({"code": "SELECT * FROM missing", "context": other}),
    )
    .await;
    let err = &ev.last().unwrap()["error"];
    assert_eq!(err["ename"], "DBQueryError");
    assert!(err["evalue"].as_str().unwrap().contains("missing"), "{err}");
    let ev = run(
        &app,
        json!({"code": "DROP TABLE missing", "context": other}),
    )
    .await;
    assert_eq!(ev.last().unwrap()["error"]["ename"], "DBExecError");
    assert!(database.exists(), "the database is the file named");
}

#[tokio::test]
async fn typescript_contexts_transpile_each_cell_or_say_what_is_missing() {
    if !have(&["node", "nodejs"]) {
        return;
    }
    let app = test_app();
    let ev = run(
        &app,
        json!({"code": "let n: number = 40\nconst add = (a: number, b: number): number => a + b\nadd(n, 2)", "context": {"language": "typescript"}}),
    )
    .await;
    let has_typescript = std::process::Command::new("node")
        .args(["-e", "require('typescript')"])
        .status()
        .is_ok_and(|s| s.success());
    if has_typescript {
        assert_eq!(
            ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
            "42",
            "{ev:?}"
        );
        let ev = run(
            &app,
            json!({"code": "interface P { n: number }\nconst p: P = { n }\np.n * 2", "context": {"language": "typescript"}}),
        )
        .await;
        assert_eq!(
            ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
            "80",
            "state survives: {ev:?}"
        );
    } else {
        // Without the package (this machine), the context says what it needs.
        let err = &ev.last().unwrap()["error"];
        assert_eq!(err["ename"], "ModuleNotFoundError", "{ev:?}");
        assert!(
            err["evalue"]
                .as_str()
                .unwrap()
                .contains("typescript package"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn go_contexts_run_each_cell_as_a_program_or_say_what_is_missing() {
    if !have_python() {
        return;
    }
    let app = test_app();
    let context = json!({"language": "go"});
    let ev = run(
        &app,
        json!({"code": "n := 6 * 7\nfmt.Println(strings.Repeat(\"go\", 2), n)", "context": context}),
    )
    .await;
    if have(&["go"]) {
        assert_eq!(texts(&ev, "stdout"), ["gogo 42\n"], "{ev:?}");
        assert_eq!(types(&ev).last().unwrap(), "execution_complete");
        // A whole program; nothing carried over (`n` is gone); a failing one is an error.
        let ev = run(
            &app,
            json!({"code": "package main\nimport \"os\"\nfunc main() { os.Exit(3) }", "context": context}),
        )
        .await;
        assert_eq!(ev.last().unwrap()["error"]["evalue"], "exit status 3");
        let ev = run(&app, json!({"code": "fmt.Println(n)", "context": context})).await;
        assert_eq!(ev.last().unwrap()["error"]["ename"], "ExitError");
        assert!(
            texts(&ev, "stderr").concat().contains("undefined: n"),
            "{ev:?}"
        );
    } else {
        // Without the toolchain (this machine), the context says what it needs.
        let err = &ev.last().unwrap()["error"];
        assert_eq!(err["ename"], "ModuleNotFoundError", "{ev:?}");
        assert!(
            err["evalue"].as_str().unwrap().contains("go toolchain"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn java_context_keeps_state_in_jshell_and_is_interrupted() {
    if !have(&["java"]) {
        return;
    }
    let app = std::sync::Arc::new(test_app());
    let r = app
        .post_json("/code/context", json!({"language": "java"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let context = json!({"id": id, "language": "java"});
    let ev = run(
        &app,
        json!({"code": "int x = 40;\nSystem.out.println(\"hello\");\nx + 2", "context": context}),
    )
    .await;
    assert_eq!(texts(&ev, "stdout"), ["hello\n"], "{ev:?}");
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "42"
    );
    let ev = run(
        &app,
        json!({"code": "String twice(String s) { return s + s; }\ntwice(\"ab\") + x", "context": context}),
    )
    .await;
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "\"abab40\""
    );
    let ev = run(
        &app,
        json!({"code": "Integer.parseInt(\"nope\")", "context": context}),
    )
    .await;
    let err = &ev.last().unwrap()["error"];
    assert_eq!(err["ename"], "java.lang.NumberFormatException", "{ev:?}");
    let ev = run(&app, json!({"code": "int y = ;", "context": context})).await;
    assert_eq!(ev.last().unwrap()["error"]["ename"], "CompilationError");

    let app2 = std::sync::Arc::clone(&app);
    let interrupted = id.clone();
    let interrupter = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(800)).await;
        app2.delete(&format!("/code?id={interrupted}")).await.status
    });
    let ev = run(
        &app,
        json!({"code": "while (true) { }", "context": context}),
    )
    .await;
    assert_eq!(interrupter.await.unwrap(), StatusCode::OK);
    assert_eq!(
        ev.last().unwrap()["error"]["ename"],
        "InterruptedException",
        "{ev:?}"
    );
    let ev = run(&app, json!({"code": "x", "context": context})).await;
    assert_eq!(
        ev.iter().find(|e| e["type"] == "result").unwrap()["results"]["text"],
        "40",
        "state survives: {ev:?}"
    );
    // The driver's source file went as it started.
    let leftovers: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("fastbox-java-driver-")
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn python_rich_results_carry_their_mime_types() {
    if !have_python() {
        return;
    }
    let app = test_app();
    let context = json!({"language": "python"});
    let code = "class Page:\n    def _repr_html_(self): return '<b>bold</b>'\n    def _repr_png_(self): return b'\\x89PNG'\n    def __repr__(self): return 'Page()'\ndisplay(Page(), 7)\nprint('between')\nPage()";
    let ev = run(&app, json!({"code": code, "context": context})).await;
    let results: Vec<&Value> = ev
        .iter()
        .filter(|e| e["type"] == "result")
        .map(|e| &e["results"])
        .collect();
    assert_eq!(results.len(), 3, "two displays, then the value: {ev:?}");
    assert_eq!(results[0]["text"], "Page()");
    assert_eq!(results[0]["text/html"], "<b>bold</b>");
    assert_eq!(results[0]["image/png"], "iVBORw==", "PNG bytes as base64");
    assert_eq!(results[1], &json!({"text": "7"}));
    assert_eq!(results[2]["text/html"], "<b>bold</b>");
    assert_eq!(texts(&ev, "stdout"), ["between\n"]);
    assert_eq!(types(&ev).last().unwrap(), "execution_complete");
}

/// Seconds the context's interpreter has been running, by its own `/proc/self/stat`.
async fn interpreter_age(app: &TestApp, language: &str) -> f64 {
    let r = app
        .post_json("/code/context", json!({"language": language}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let context = json!({"id": r.json()["id"], "language": language});
    let code = match language {
        "python" => {
            "import os\nstart = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / os.sysconf('SC_CLK_TCK')\nprint(float(open('/proc/uptime').read().split()[0]) - start)"
        }
        _ => {
            "const fs = require('fs'); console.log(Number(fs.readFileSync('/proc/uptime', 'utf8').split(' ')[0]) - Number(fs.readFileSync('/proc/self/stat', 'utf8').split(')').pop().trim().split(' ')[19]) / 100)"
        }
    };
    let ev = run(app, json!({"code": code, "context": context})).await;
    let out: String = ev
        .iter()
        .filter(|e| e["type"] == "stdout")
        .filter_map(|e| e["text"].as_str())
        .collect();
    out.trim().parse().unwrap_or_else(|_| panic!("{ev:?}"))
}

/// With `FASTBOX_WARM_CODE`, a new context gets the spare that was running before it: python's
/// starts with execd (here: `Spares::start`), javascript's when the code interpreter is
/// wanted. Without it, contexts start cold.
#[tokio::test]
async fn warm_spares_serve_the_next_context() {
    if !have_python() || !have(&["node"]) {
        return;
    }
    let warm = test_app_with(|c| {
        c.daemon_env
            .push(("FASTBOX_WARM_CODE".into(), "python,javascript".into()))
    });
    warm.state.code.spares.start(&warm.state).await;
    warm.state.code.spares.wanted(&warm.state);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    for language in ["python", "javascript"] {
        let age = interpreter_age(&warm, language).await;
        assert!(
            age > 1.2,
            "{language}: the context's interpreter is {age} s old"
        );
    }
    let cold = test_app();
    cold.state.code.spares.start(&cold.state).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let age = interpreter_age(&cold, "python").await;
    assert!(age < 1.2, "a cold context's interpreter is {age} s old");
}
