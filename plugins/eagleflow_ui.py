"""The eagleflow pages inside the Airflow UI: a FastAPI app the API server mounts at ``/eagleflow``.

Routes (relative to the mount point):

``/``                                  the runs under the output root
``/runs/{run}``                        one run: shard table, charts, latest training metrics
``/runs/{run}/files/{path}``           a chart or log of that run (only inside the output root)
``/api/runs/{run}``                    the same facts as JSON

Every route needs a logged-in Airflow user: the request is authenticated by the API server's
own ``get_user`` (the ``_token`` cookie the UI sets at login, or an ``Authorization: Bearer``
token), so the pages are exactly as private as the rest of the UI. Errors of every kind go
through :func:`error_response`, which answers HTML to a browser and JSON to anything else.

Settings are read when :func:`create_app` is called: the output root comes from the argument,
else ``$EAGLEFLOW_OUTPUT_ROOT``, else Airflow's ``[eagleflow] output_root`` option.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagleflow.errors import UserError
from eagleflow.layout import RunLayout
from eagleflow.manifest import ShardManifest

URL_PREFIX = "/eagleflow"
OUTPUT_ROOT_ENV = "EAGLEFLOW_OUTPUT_ROOT"
CONFIG_SECTION, CONFIG_KEY = "eagleflow", "output_root"
CHARTS = (("loss", "Loss per TTT step"), ("acc", "Accuracy per TTT step"))
# What the file route serves: charts, manifests, metrics and logs; never hidden states or weights.
SERVED_SUFFIXES = {".png": "image/png", ".svg": "image/svg+xml", ".json": "application/json",
                   ".jsonl": "text/plain; charset=utf-8", ".log": "text/plain; charset=utf-8",
                   ".txt": "text/plain; charset=utf-8", ".yaml": "text/plain; charset=utf-8"}
LOG_FILES = ("train/train.log", "server/server.log", "train/metrics.jsonl")
REFRESH_SECONDS = 30

_bearer = HTTPBearer(auto_error=False)


class PageError(Exception):
    """An error a route reports to the user: ``status`` and a plain-language ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# ---------------------------------------------------------------------------------------
# settings and authentication


def configured_output_root() -> Path | None:
    """``$EAGLEFLOW_OUTPUT_ROOT``, else Airflow's ``[eagleflow] output_root``, else None."""
    value = os.environ.get(OUTPUT_ROOT_ENV, "").strip()
    if not value:
        try:
            from airflow.configuration import conf

            value = (conf.get(CONFIG_SECTION, CONFIG_KEY, fallback="") or "").strip()
        except ImportError:  # the app also runs without Airflow (tests, a bare uvicorn)
            value = ""
    return Path(value) if value else None


async def require_airflow_user(
    request: Request, bearer: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> Any:
    """The logged-in Airflow user, as the API server's own ``get_user`` resolves it.

    Imported on the first request, not at plugin load: the security module pulls in most of
    the API server, and the scheduler and workers load plugins too.
    """
    from airflow.api_fastapi.core_api.security import get_user

    return await get_user(request, _oauth_token=None, bearer_credentials=bearer)


# ---------------------------------------------------------------------------------------
# errors: one shape for all of them


def error_response(request: Request, status: int, message: str) -> Response:
    """The one error response: an HTML page for browsers, ``{"detail", "status"}`` JSON otherwise."""
    if "text/html" in request.headers.get("accept", ""):
        hint = ""
        if status in (401, 403):
            hint = '<p><a href="/">Log in to Airflow</a>, then open this page again.</p>'
        body = f"<h1>{status}</h1><p class=\"error\">{html.escape(message)}</p>{hint}"
        return HTMLResponse(_page(f"eagleflow: error {status}", body), status_code=status)
    return JSONResponse({"detail": message, "status": status}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(request, exc.status_code, detail)

    async def on_page_error(request: Request, exc: PageError) -> Response:
        return error_response(request, exc.status, exc.message)

    async def on_user_error(request: Request, exc: UserError) -> Response:
        return error_response(request, 400, str(exc))

    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(request, 400, f"bad request: {problems}")

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(PageError, on_page_error)
    app.add_exception_handler(UserError, on_user_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_unexpected)


# ---------------------------------------------------------------------------------------
# reading a run folder


@dataclass
class Shard(ShardManifest):
    """One shard manifest (the extractor's own class) with what the page derives from it."""

    @property
    def rows(self) -> int:
        return max(self.end - self.start, 0)

    @property
    def complete(self) -> int:
        return self.done + self.skipped

    @property
    def rows_per_s(self) -> float | None:
        return self.done / self.seconds if self.seconds > 0 and self.done else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens else None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "start": self.start, "end": self.end, "state": self.state, "rows": self.rows,
            "done": self.done, "skipped": self.skipped, "failed": len(self.failed), "failed_rows": self.failed[:50],
            "tokens": self.tokens, "bytes": self.bytes, "gb": self.bytes / 1e9, "seconds": self.seconds,
            "rows_per_s": self.rows_per_s, "tokens_per_s": self.tokens_per_s, "updated": self.updated,
            "error": self.error,
        }


def read_shards(layout: RunLayout) -> list[Shard]:
    """Every ``shards/*.json`` manifest, ordered by first row; an unreadable one is shown as such."""
    shards: list[Shard] = []
    if not layout.shards.is_dir():
        return shards
    for path in layout.shards.glob("*.json"):
        try:
            shards.append(Shard.read(path))
        except (OSError, ValueError, TypeError) as exc:
            shards.append(Shard(name=path.stem, state="unreadable", error=f"{path.name}: {exc}"))
    return sorted(shards, key=lambda s: (s.start, s.name))


class MetricsCache:
    """``latest_metrics`` of a metrics file, re-read only when the file changes (it can be MBs)."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}

    def latest(self, path: Path) -> dict[str, Any] | None:
        from eagleflow.metrics import latest_metrics, read_metrics

        try:
            stat = path.stat()
        except OSError:
            return None
        key = (stat.st_mtime_ns, stat.st_size)
        cached = self._entries.get(path)
        if cached and cached[0] == key:
            return cached[1]
        try:
            latest = latest_metrics(read_metrics(path))
        except UserError as exc:
            latest = {"error": str(exc), "records": 0, "train": None, "val": None, "ttt": []}
        self._entries[path] = (key, latest)
        return latest


def run_summary(layout: RunLayout, metrics: MetricsCache) -> dict[str, Any]:
    """Everything the run page shows, as plain JSON."""
    shards = read_shards(layout)
    charts = {}
    for name, _ in CHARTS:
        png = layout.charts / f"{name}.png"
        if png.is_file():
            charts[name] = {
                "png": f"train-progress/{name}.png",
                "svg": f"train-progress/{name}.svg" if (layout.charts / f"{name}.svg").is_file() else None,
                "mtime": int(png.stat().st_mtime),
            }
    totals = {
        "shards": len(shards),
        "shards_done": sum(1 for s in shards if s.state == "success"),
        "rows": sum(s.rows for s in shards),
        "rows_complete": sum(s.complete for s in shards),
        "rows_failed": sum(len(s.failed) for s in shards),
        "tokens": sum(s.tokens for s in shards),
        "gb": sum(s.bytes for s in shards) / 1e9,
    }
    return {
        "run": layout.root.name,
        "shards": [s.as_json() for s in shards],
        "totals": totals,
        "metrics": metrics.latest(layout.metrics),
        "charts": charts,
        "files": [name for name in LOG_FILES if (layout.root / name).is_file()],
    }


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Folders under the output root that look like runs (they have shards/ or train/)."""
    runs = []
    if not root.is_dir():
        return runs
    for child in root.iterdir():
        try:
            layout = RunLayout.of(root, child.name)
        except UserError:
            continue
        if child.is_dir() and (layout.shards.is_dir() or layout.train.is_dir()):
            runs.append({"name": child.name, "modified": child.stat().st_mtime})
    return sorted(runs, key=lambda r: -r["modified"])


# ---------------------------------------------------------------------------------------
# HTML

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1f2933;background:#f7f9fb}
main{padding:16px 24px;max-width:1500px}
h1{font-size:20px;margin:4px 0 12px} h2{font-size:16px;margin:22px 0 8px}
a{color:#0b63c5} .muted{color:#667085} .error{color:#b42318}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #e4e7ec;border-radius:8px;padding:10px 14px;min-width:150px}
.card b{display:block;font-size:18px}
table{border-collapse:collapse;background:#fff;border:1px solid #e4e7ec}
th,td{padding:5px 10px;border-bottom:1px solid #eef0f3;text-align:right;white-space:nowrap}
th{background:#f2f4f7;font-weight:600} td:first-child,th:first-child{text-align:left}
.state{border-radius:10px;padding:1px 8px;font-size:12px;font-weight:600}
.success{background:#d1fadf;color:#05603a}.running{background:#d1e9ff;color:#175cd3}
.failed,.unreadable{background:#fee4e2;color:#b42318}.unknown{background:#eaecf0;color:#344054}
.charts{display:flex;flex-wrap:wrap;gap:16px}
.charts figure{margin:0;background:#fff;border:1px solid #e4e7ec;border-radius:8px;padding:8px;flex:0 1 auto}
.charts img{display:block;max-width:100%;height:auto}
.bar{background:#eaecf0;border-radius:4px;height:8px;width:90px;display:inline-block;vertical-align:middle}
.bar span{display:block;height:8px;border-radius:4px;background:#12b76a}
details{margin-top:4px}
"""


def _page(title: str, body: str, refresh: bool = False) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if refresh else ""
    return (
        f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">{meta}"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body><main>{body}</main></body></html>"
    )


def _num(value: Any, digits: int = 3, percent: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if percent:
        return f"{100 * value:.1f}%"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}g}" if abs(value) < 1e-2 else f"{value:.{digits}f}"
    return f"{int(value):,}"


def _age(timestamp: float | None) -> str:
    if not timestamp:
        return "–"
    seconds = max(0, time.time() - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _shard_rows(summary: dict[str, Any]) -> str:
    rows = []
    for s in summary["shards"]:
        complete = (s["done"] + s["skipped"]) / s["rows"] if s["rows"] else 0.0
        failed_detail = ""
        if s["failed_rows"]:
            items = "".join(
                f"<li>row {html.escape(str(f.get('row', '?')))}: {html.escape(str(f.get('reason', '')))}</li>"
                for f in s["failed_rows"][:10]
            )
            failed_detail = f"<details><summary>why</summary><ul>{items}</ul></details>"
        rate = f"{s['rows_per_s']:.2f} rows/s" if s["rows_per_s"] else "–"
        if s["tokens_per_s"]:
            rate += f"<br><span class=muted>{s['tokens_per_s']:,.0f} tok/s</span>"
        state = html.escape(s["state"])
        error = f"<br><span class=error>{html.escape(s['error'][:200])}</span>" if s["error"] else ""
        rows.append(
            "<tr>"
            f"<td>{html.escape(s['name'])}{error}</td>"
            f"<td><span class=\"state {state}\">{state}</span></td>"
            f"<td><span class=bar><span style=\"width:{100 * min(complete, 1):.0f}%\"></span></span> "
            f"{s['done'] + s['skipped']:,} / {s['rows']:,}</td>"
            f"<td>{s['skipped']:,}</td>"
            f"<td>{s['failed']:,}{failed_detail}</td>"
            f"<td>{s['tokens']:,}</td>"
            f"<td>{s['gb']:.3f}</td>"
            f"<td>{rate}</td>"
            f"<td>{s['seconds']:.0f} s</td>"
            f"<td class=muted>{_age(s['updated'])}</td>"
            "</tr>"
        )
    if not rows:
        return "<p class=muted>No shard manifests yet (<code>shards/*.json</code>).</p>"
    t = summary["totals"]
    total = (
        f"<tr><th>total</th><th>{t['shards_done']}/{t['shards']} done</th><th>{t['rows_complete']:,} / {t['rows']:,}</th>"
        f"<th></th><th>{t['rows_failed']:,}</th><th>{t['tokens']:,}</th><th>{t['gb']:.3f}</th><th></th><th></th><th></th></tr>"
    )
    head = (
        "<tr><th>shard</th><th>state</th><th>rows done</th><th>skipped</th><th>failed</th><th>tokens</th>"
        "<th>GB</th><th>rate</th><th>time</th><th>updated</th></tr>"
    )
    return f"<table>{head}{''.join(rows)}{total}</table>"


def _metrics_html(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return "<p class=muted>No training metrics yet (<code>train/metrics.jsonl</code>).</p>"
    if metrics.get("error"):
        return f"<p class=error>{html.escape(metrics['error'])}</p>"
    train, val = metrics.get("train") or {}, metrics.get("val") or {}
    cards = [
        ("step", _num(train.get("step"))), ("epoch", _num(train.get("epoch"))),
        ("learning rate", f"{train['lr']:.2e}" if train.get("lr") is not None else "–"),
        ("train loss, all steps", _num(train.get("loss"))), ("val loss, all steps", _num(val.get("loss"))),
        ("tokens/s", _num(train.get("tokens_per_s"), 0) if train.get("tokens_per_s") else "–"),
        ("records", _num(metrics.get("records"))),
    ]
    card_html = "".join(f"<div class=card><span class=muted>{k}</span><b>{v}</b></div>" for k, v in cards)
    rows = "".join(
        f"<tr><td>TTT step {e['ttt_step']}</td><td>{_num(e['train_loss'])}</td>"
        f"<td>{_num(e['train_full_acc'], percent=True)}</td><td>{_num(e['train_cond_acc'], percent=True)}</td>"
        f"<td>{_num(e['val_loss'])}</td><td>{_num(e['val_full_acc'], percent=True)}</td>"
        f"<td>{_num(e['val_cond_acc'], percent=True)}</td></tr>"
        for e in metrics.get("ttt", [])
    )
    val_note = f" (validation: epoch {_num(val.get('epoch'))})" if val else " (no validation epoch yet)"
    table = (
        "<table><tr><th></th><th>train loss</th><th>train full acc</th><th>train cond acc</th>"
        f"<th>val loss</th><th>val full acc</th><th>val cond acc</th></tr>{rows}</table>"
        f"<p class=muted>Latest logged step{html.escape(val_note)}; updated {_age(train.get('time'))}.</p>"
    )
    return f"<div class=cards>{card_html}</div><h2>Latest metrics per TTT step</h2>{table}"


def _charts_html(summary: dict[str, Any], base: str) -> str:
    figures = []
    for name, title in CHARTS:
        chart = summary["charts"].get(name)
        if not chart:
            continue
        src = f"{base}/files/{chart['png']}?v={chart['mtime']}"
        svg = f' · <a href="{base}/files/{chart["svg"]}?v={chart["mtime"]}">SVG</a>' if chart["svg"] else ""
        figures.append(
            f'<figure><a href="{src}"><img src="{src}" alt="{html.escape(title)}"></a>'
            f"<figcaption class=muted>{html.escape(title)}{svg}</figcaption></figure>"
        )
    if not figures:
        return "<p class=muted>No charts yet (<code>train-progress/*.png</code>, written by the plot step).</p>"
    return f"<div class=charts>{''.join(figures)}</div>"


def render_run_page(summary: dict[str, Any]) -> str:
    """The run page's HTML. Links are relative, so it works under any prefix or base URL."""
    name = summary["run"]
    base = quote(name)  # relative to .../runs/, the folder of this page's URL
    t = summary["totals"]
    files = " · ".join(f'<a href="{base}/files/{quote(f)}">{html.escape(f)}</a>' for f in summary["files"])
    running = any(s["state"] == "running" for s in summary["shards"]) or not summary["charts"]
    body = (
        f'<p class=muted><a href="../">eagleflow runs</a> / {html.escape(name)}</p>'
        f"<h1>eagleflow run <code>{html.escape(name)}</code></h1>"
        f"<div class=cards><div class=card><span class=muted>shards done</span><b>{t['shards_done']} / {t['shards']}</b></div>"
        f"<div class=card><span class=muted>rows</span><b>{t['rows_complete']:,} / {t['rows']:,}</b></div>"
        f"<div class=card><span class=muted>failed rows</span><b>{t['rows_failed']:,}</b></div>"
        f"<div class=card><span class=muted>tokens</span><b>{t['tokens']:,}</b></div>"
        f"<div class=card><span class=muted>hidden states</span><b>{t['gb']:.3f} GB</b></div></div>"
        f"<h2>Training</h2>{_metrics_html(summary['metrics'])}"
        f"<h2>Charts</h2>{_charts_html(summary, base)}"
        f"<h2>Shards</h2>{_shard_rows(summary)}"
        + (f"<h2>Files</h2><p>{files}</p>" if files else "")
        + (f"<p class=muted>This page reloads every {REFRESH_SECONDS} s while work is in progress.</p>" if running else "")
    )
    return _page(f"eagleflow: {name}", body, refresh=running)


def render_index(root: Path | None, runs: list[dict[str, Any]]) -> str:
    items = "".join(
        f'<tr><td><a href="runs/{quote(r["name"])}">{html.escape(r["name"])}</a></td>'
        f"<td class=muted>{_age(r['modified'])}</td></tr>"
        for r in runs
    )
    table = (
        f"<table><tr><th>run</th><th>last change</th></tr>{items}</table>"
        if items
        else "<p class=muted>No runs yet.</p>"
    )
    body = f"<h1>eagleflow runs</h1><p class=muted>Output root: <code>{html.escape(str(root))}</code></p>{table}"
    return _page("eagleflow runs", body)


# ---------------------------------------------------------------------------------------
# the app


def create_app(output_root: str | os.PathLike[str] | None = None) -> FastAPI:
    """The FastAPI app the plugin mounts; reads its settings now (see the module docstring)."""
    root = Path(output_root) if output_root is not None else configured_output_root()
    root = root.resolve() if root is not None else None
    metrics = MetricsCache()

    app = FastAPI(
        title="eagleflow",
        description="Shards, charts and training metrics of eagleflow runs",
        dependencies=[Depends(require_airflow_user)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.output_root = root
    _install_error_handlers(app)

    def run_layout(run_name: str) -> RunLayout:
        if root is None:
            raise PageError(
                503,
                f"eagleflow's output root is not configured: set ${OUTPUT_ROOT_ENV} or "
                f"[{CONFIG_SECTION}] {CONFIG_KEY} for the Airflow API server",
            )
        layout = RunLayout.of(root, run_name)  # UserError (-> 400) for anything but a plain folder name
        if not layout.root.is_dir():
            raise PageError(404, f"no run {run_name!r} under the output root {root}")
        return layout

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(render_index(root, list_runs(root) if root else []))

    @app.get("/runs/{run_name}", response_class=HTMLResponse)
    def run_page(run_name: str) -> HTMLResponse:
        return HTMLResponse(render_run_page(run_summary(run_layout(run_name), metrics)))

    @app.get("/api/runs/{run_name}")
    def run_json(run_name: str) -> JSONResponse:
        return JSONResponse(run_summary(run_layout(run_name), metrics))

    @app.get("/runs/{run_name}/files/{file_path:path}")
    def run_file(run_name: str, file_path: str) -> FileResponse:
        layout = run_layout(run_name)
        target = safe_file(layout.root, file_path, root)  # type: ignore[arg-type]
        return FileResponse(target, media_type=SERVED_SUFFIXES[target.suffix.lower()])

    return app


def safe_file(run_root: Path, relative: str, output_root: Path) -> Path:
    """``run_root / relative`` if it is a servable file inside both the run and the output root.

    Resolving first means ``..``, absolute paths and symlinks that lead outside are all caught
    the same way: 404, as for a file that does not exist (nothing is revealed about what is
    outside). A file of a kind that is never served (weights, hidden states) is 404 too.
    """
    if "\x00" in relative:
        raise PageError(400, "file path contains a NUL byte")
    try:
        target = (run_root / relative).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise PageError(400, f"bad file path {relative!r}: {exc}") from exc
    run_real = run_root.resolve()
    if not (target.is_relative_to(output_root) and target.is_relative_to(run_real)) or target == run_real:
        raise PageError(404, f"no file {relative!r} in run {run_root.name!r}")
    if not target.is_file() or target.suffix.lower() not in SERVED_SUFFIXES:
        raise PageError(404, f"no file {relative!r} in run {run_root.name!r}")
    return target


def link_path(run_name: str) -> str:
    """Path of a run's page under the API server (what the operator extra link points at)."""
    return f"{URL_PREFIX}/runs/{quote(run_name, safe='')}"


__all__: list[str] = [
    "URL_PREFIX", "create_app", "error_response", "link_path", "read_shards", "render_run_page",
    "require_airflow_user", "run_summary", "safe_file",
]
