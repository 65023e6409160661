# fastbox-execd python code-context driver (embedded in execd after `driver_loop.py`, run
# with `python3 -u -c`).
# Executes the code in one persistent namespace; the value of a trailing expression is the
# result (its repr, and its rich representations as Jupyter has them: `_repr_html_`,
# `_repr_png_`, ...). `display(obj)` shows an object's representations as the run goes, and
# matplotlib figures still open at the end of a run are shown as PNG images and closed (as
# Jupyter's inline backend does).
import ast
import base64
import io
import json
import os
import signal
import sys
import traceback

# Figures render off-screen (there is no display in a sandbox), in adopted environments too.
_ENV_DEFAULTS["MPLBACKEND"] = "Agg"
os.environ.setdefault("MPLBACKEND", "Agg")

_REPRS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/json", "_repr_json_"),
    ("text/latex", "_repr_latex_"),
]


def _bundle(obj):
    """The MIME bundle of `obj`: `text/plain` always, the others it offers."""
    bundle = {"text/plain": repr(obj)}
    for mime, method in _REPRS:
        fn = getattr(obj, method, None)
        if not callable(fn):
            continue
        try:
            data = fn()
        except Exception:
            continue
        if isinstance(data, tuple):
            data = data[0]
        if data is None:
            continue
        if isinstance(data, bytes):
            data = base64.b64encode(data).decode()
        elif not isinstance(data, str):
            data = json.dumps(data)
        bundle[mime] = data
    figure = _figure_png(obj)
    if figure is not None:
        bundle["image/png"] = figure
    return bundle


def _figure_png(obj):
    """A matplotlib figure as base64 PNG (None for anything else)."""
    if type(obj).__name__ != "Figure" or not hasattr(obj, "savefig"):
        return None
    out = io.BytesIO()
    obj.savefig(out, format="png", bbox_inches="tight")
    return base64.b64encode(out.getvalue()).decode()


_displays = []


def display(*objs, **_):
    """Shows each object's representations in the run's results."""
    for obj in objs:
        _displays.append(_bundle(obj))


def _open_figures():
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in pyplot.get_fignums():
        figure = pyplot.figure(number)
        _displays.append(_bundle(figure))
    pyplot.close("all")


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
                bundle = _bundle(value)
                out["result"] = bundle["text/plain"]
                if len(bundle) > 1:
                    out["result_bundle"] = bundle
    except BaseException as e:  # noqa: B902 - user code may raise anything, SystemExit too
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        lines = traceback.format_exception(type(e), e, tb)
        out["error"] = {
            "ename": type(e).__name__,
            "evalue": str(e),
            "traceback": [l.rstrip("\n") for l in lines],
        }


def _cell(ns):
    def run_cell(code, out):
        del _displays[:]
        try:
            _run(code, ns, out)
            _open_figures()
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a figure that fails to render
            out["error"] = {"ename": type(e).__name__, "evalue": str(e), "traceback": []}
        if _displays:
            out["displays"] = list(_displays)

    return run_cell


_serve(_cell({"__name__": "__main__", "__builtins__": __builtins__, "display": display}))
