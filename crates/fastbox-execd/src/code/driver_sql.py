# fastbox-execd sql code-context driver (embedded in execd, run with `python3 -u -c`).
# The sandbox's database is one SQLite file (FASTBOX_SQL_DATABASE, default
# /var/lib/fastbox/sandbox.db), shared by every sql context and kept between runs. Each
# execution is one statement. A SELECT's result is `{"columns": [...], "rows": [[...]]}`
# (values as text, NULL as null); any other statement's is
# `{"columns": ["affected_rows"], "rows": [[n]]}`: the shapes the reference execd returns.
# Its requests come through `driver_loop.py`, put in front of it.
import json
import os
import signal
import sqlite3

DATABASE = os.environ.get("FASTBOX_SQL_DATABASE") or "/var/lib/fastbox/sandbox.db"


def _connect():
    os.makedirs(os.path.dirname(DATABASE) or ".", exist_ok=True)
    return sqlite3.connect(DATABASE, isolation_level=None)


def _shape(columns, rows):
    # As the reference: empty parts are left out.
    out = {}
    if columns:
        out["columns"] = columns
    if rows:
        out["rows"] = rows
    return json.dumps(out, separators=(",", ":"))


def _run(db, code, out):
    words = code.split()
    select = bool(words) and words[0].upper() == "SELECT"
    try:
        cursor = db.execute(code)
        if select:
            columns = [d[0] for d in cursor.description or []]
            rows = [[None if v is None else str(v) for v in row] for row in cursor.fetchall()]
            out["result"] = _shape(columns, rows)
        else:
            out["result"] = _shape(["affected_rows"], [[max(cursor.rowcount, 0)]])
    except (sqlite3.Error, sqlite3.Warning, ValueError) as e:
        name = "DBQueryError" if select else "DBExecError"
        out["error"] = {"ename": name, "evalue": str(e), "traceback": []}


_db = []


def _cell(code, out):
    try:
        if not _db:
            _db.append(_connect())
        _run(_db[0], code, out)
    except (sqlite3.Error, OSError) as e:
        out["error"] = {"ename": "DBInitError", "evalue": str(e), "traceback": []}


_serve(_cell)
