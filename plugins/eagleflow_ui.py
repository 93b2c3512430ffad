"""The eagleflow pages inside the Airflow UI: a FastAPI app the API server mounts at ``/eagleflow``.

Routes (relative to the mount point):

``/``                                  the runs under the output root: each one's DAG run state and headline figures
``/runs/{run}``                        one run: its DAG run(s) in Airflow, shard table, charts, latest training metrics;
                                       for a run of several drafters (``drafters/<name>/``), each drafter's
``/runs/{run}/files/{path}``           a chart or log of that run (only regular files under the output root),
                                       with headers that let no script in it run (:data:`FILE_HEADERS`)
``/api/runs/{run}``                    the same facts as JSON
``/dag-runs/{dag_id}/{run_id}``         the page of the run folder a DAG run writes (a redirect to ``/runs/{run}``): the
                                       "eagleflow run" tab of each DAG run's page in Airflow (:mod:`eagleflow_plugin`)

A run folder is matched to the DAG runs that write it (:func:`dag_runs_by_folder`, read from
Airflow's metadata database): each page links to its DAG run in Airflow's UI and shows its state; a running
run's drafters are counted by its drafter plan. A DAG run that failed before its first task wrote its folder is
listed too, with the reason its first failed task gave (:func:`first_failure`), and its run page says so.

Airflow 3.3 shows these pages (Browse → eagleflow runs, the route ``/plugin/eagleflow/*``) in an
``<iframe sandbox="allow-scripts allow-same-origin allow-forms allow-downloads">`` (its UI bundle,
``airflow/ui/dist/assets/index-*.js``), which refuses ``target="_top"`` and ``target="_blank"`` links.
The links to Airflow's own pages are followed by a script of ``templates/base.html`` instead, which says why.

Every route needs a logged-in Airflow user: the request is authenticated by the API server's
own ``get_user`` (the ``_token`` cookie the UI sets at login, or an ``Authorization: Bearer``
token), so the pages are exactly as private as the rest of the UI. Errors of every kind go
through :func:`error_response`, which answers HTML to a browser and JSON to anything else.

Every file is opened through :class:`eagleflow.report.run_page.RunFiles`, the pages' and the file route's
alike: a path is resolved, symlinks followed, and refused when it lands outside the output root, is not
a regular file (``/dev/zero``, a FIFO) or is over its kind's bound; a refused file is named on the page.

The routes only gather facts from the core (:mod:`eagleflow.report.run_page`) and render the Jinja2
templates in ``templates/`` beside this file. Settings are read when :func:`create_app` is
called: the output root comes from the argument, else ``$EAGLEFLOW_OUTPUT_ROOT``, else Airflow's
``[eagleflow] output_root`` option.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagleflow.deploy import DAG_ID, OUTPUT_ROOT_ENV
from eagleflow.errors import UserError
from eagleflow.files import RefusedFile, resolve_under
from eagleflow.layout import RunLayout, run_name_of
from eagleflow.report import MetricsCache, RunFiles, list_runs, run_summary

try:
    from plugins.eagleflow_dag_runs import (
        UNFINISHED_DAG_RUN_STATES, dag_run_conf, dag_run_url, dag_runs_by_folder, dag_runs_list_url, newest_plan, without_folder,
    )
    from plugins.page_filters import FILTERS
    from plugins.readme_page import add_readme_route
except ImportError:  # only the plugins folder is on sys.path (Airflow adds it)
    from eagleflow_dag_runs import (  # type: ignore[no-redef]
        UNFINISHED_DAG_RUN_STATES, dag_run_conf, dag_run_url, dag_runs_by_folder, dag_runs_list_url, newest_plan, without_folder,
    )
    from page_filters import FILTERS  # type: ignore[no-redef]
    from readme_page import add_readme_route  # type: ignore[no-redef]

CONFIG_SECTION, CONFIG_KEY = "eagleflow", "output_root"
# What the file route serves: charts, manifests, metrics and logs; never hidden states or weights. Only the
# charts are served as what they are; everything else as plain text, which a browser shows and never runs
# (JSON too: clicked on the run page it reads as text, a download per click would not; `requests` parses it alike).
TEXT = "text/plain; charset=utf-8"
SERVED_SUFFIXES = {".png": "image/png", ".svg": "image/svg+xml", ".json": TEXT, ".jsonl": TEXT, ".log": TEXT,
                   ".txt": TEXT, ".yaml": TEXT}
# A run folder's files are written by tasks, engines and whoever can write there, and are served in Airflow's
# origin, where a script would act as the logged-in user (Airflow's API, its cookies, its frame's parent). So no
# file runs anything: `sandbox` (no allow-scripts) gives the document an opaque origin without scripts, forms or
# popups, and `default-src 'none'` fetches nothing; an SVG opened on its own still draws, as matplotlib's need
# only inline styles and data: images. An <img> never runs an SVG's scripts anyway: the run page's charts are
# unaffected. nosniff: the type said is the type used, never sniffed into HTML.
FILE_HEADERS = {
    "content-security-policy": "default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; sandbox",
    "x-content-type-options": "nosniff",
}
CHUNK_BYTES = 1 << 16  # a served file is streamed, never held whole in memory
REFRESH_SECONDS = 30
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"

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
# templates and their filters


def make_templates() -> Jinja2Templates:
    """The page templates (autoescaped HTML) with eagleflow's number filters."""
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
    templates.env.filters.update(FILTERS, urlquote=lambda s: quote(str(s)))
    templates.env.globals.update(refresh_seconds=REFRESH_SECONDS)
    return templates


# ---------------------------------------------------------------------------------------
# errors: one shape for all of them


def list_href(request: Request) -> str:
    """The list of runs (the app's ``/``) relative to the page ``request`` asked for, so any mount point
    or base URL works: ``/runs/demo`` -> ``../``."""
    path, mount = request.url.path, request.scope.get("root_path", "")
    if mount and path.startswith(mount):
        path = path[len(mount):]
    return "../" * (path.count("/") - 1) or "./"


def error_response(request: Request, status: int, message: str) -> Response:
    """The one error response: an HTML page for browsers, ``{"detail", "status"}`` JSON otherwise."""
    if "text/html" in request.headers.get("accept", ""):
        context = {"title": f"eagleflow: error {status}", "status": status, "message": message, "runs": list_href(request)}
        return request.app.state.templates.TemplateResponse(request, "error.html", context, status_code=status)
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
    app.state.templates = templates = make_templates()
    _install_error_handlers(app)

    def run_layout(run_name: str) -> RunLayout:
        if root is None:
            raise PageError(
                503,
                f"eagleflow's output root is not configured: set ${OUTPUT_ROOT_ENV} or "
                f"[{CONFIG_SECTION}] {CONFIG_KEY} for the Airflow API server",
            )
        layout = RunLayout.of(root, run_name)  # UserError (-> 400) for anything but a plain folder name
        try:
            real = resolve_under(layout.root, root)
        except RefusedFile as exc:
            raise PageError(404, f"run {run_name!r} is not under the output root {root}: its folder {exc.reason}") from exc
        if not real.is_dir():
            raise NoRunFolder(404, f"no run {run_name!r} under the output root {root}")
        return layout

    def summary_with_dag_runs(run_name: str) -> dict[str, Any]:
        layout = run_layout(run_name)
        dag_runs = dag_runs_by_folder(root)  # type: ignore[arg-type]  (run_layout checked it)
        found = None if dag_runs is None else dag_runs.get(layout.root.name, [])
        return {**run_summary(layout, metrics, newest_plan(found)), "dag_runs": found}

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> Response:
        dag_runs = dag_runs_by_folder(root) if root else {}
        planned = {name: newest_plan(found) for name, found in (dag_runs or {}).items()}
        runs = list_runs(root, metrics, planned) if root else []
        for run in runs:
            run["dag_run"] = (dag_runs.get(run["name"]) or [None])[0] if dag_runs is not None else None
        listed = {run["name"] for run in runs}
        runs += [without_folder(root, name, found) for name, found in (dag_runs or {}).items() if name not in listed]
        runs.sort(key=lambda run: -(run["modified"] or 0))
        context = {"title": "eagleflow runs", "root": root, "runs": runs, "dag_runs_unreadable": dag_runs is None,
                   "dag_runs_list": dag_runs_list_url()}
        return templates.TemplateResponse(request, "index.html", context)

    add_readme_route(app, error_response)

    @app.get("/runs/{run_name}", response_class=HTMLResponse)
    def run_page(request: Request, run_name: str) -> Response:
        try:
            summary = summary_with_dag_runs(run_name)
        except NoRunFolder:  # a DAG run that failed before its first task wrote the folder still has a page
            found = (dag_runs_by_folder(root) or {}).get(run_name)  # type: ignore[arg-type]  (run_layout checked it)
            if not found:
                raise
            context = {"title": f"eagleflow: {run_name}", "run": without_folder(root, run_name, found),  # type: ignore[arg-type]
                       "dag_runs": found, "root": root, "refresh": found[0]["state"] in UNFINISHED_DAG_RUN_STATES}
            return templates.TemplateResponse(request, "run_unwritten.html", context)
        latest = (summary["dag_runs"] or [{}])[0]
        drafters = summary["drafters"]  # a run of several drafters: until each has its charts
        running = (
            any(s["state"] == "running" for s in summary["shards"])
            or (not all(d["charts"] for d in drafters) if drafters else not summary["charts"])
            or latest.get("state") in UNFINISHED_DAG_RUN_STATES
        )
        context = {"title": f"eagleflow: {summary['run']}", "summary": summary, "refresh": running}
        return templates.TemplateResponse(request, "run.html", context)

    @app.get("/api/runs/{run_name}")
    def run_json(run_name: str) -> JSONResponse:
        return JSONResponse(summary_with_dag_runs(run_name))

    @app.get("/dag-runs/{dag_id}/{run_id:path}")
    def dag_run_page(request: Request, dag_id: str, run_id: str) -> Response:
        # Airflow shows a plugin's DAG-run view on the page of every DAG's runs: only the eagleflow DAG's have a folder.
        if dag_id != DAG_ID:
            raise PageError(404, f"DAG {dag_id!r} is not eagleflow's ({DAG_ID!r}): its runs have no eagleflow run folder")
        conf = dag_run_conf(run_id)
        if conf is None:
            raise PageError(404, f"no DAG run {run_id!r} of the {DAG_ID} DAG")
        if root is not None and conf.get("output_root") and Path(str(conf["output_root"])).resolve() != root:
            raise PageError(404, f"DAG run {run_id!r} writes its run folder under {conf['output_root']}; these pages show "
                                 f"the runs under {root}")
        name = run_name_of(conf, run_id)
        return RedirectResponse(f"{list_href(request)}runs/{quote(name, safe='')}", status_code=303)

    @app.get("/runs/{run_name}/files/{file_path:path}")
    def run_file(run_name: str, file_path: str) -> StreamingResponse:
        layout = run_layout(run_name)
        handle = open_run_file(layout, file_path)
        size = os.fstat(handle.fileno()).st_size
        media_type = SERVED_SUFFIXES[PurePosixPath(file_path).suffix.lower()]
        headers = {"content-length": str(size), **FILE_HEADERS}
        return StreamingResponse(_chunks(handle, size), media_type=media_type, headers=headers)

    return app


class NoRunFolder(PageError):
    """The run's folder does not exist (a 404, unless a DAG run of that name failed before writing it)."""


def open_run_file(layout: RunLayout, relative: str) -> BinaryIO:
    """``relative`` in the run opened for serving, if it is a servable file there (:class:`RunFiles`' checks).

    A path that leaves the run by its own ``..`` or is absolute, a file that does not exist, one that
    resolves outside the output root or is not a regular file, and a kind of file that is never
    served (weights, hidden states): all 404, with nothing said about what lies outside.
    """
    if "\x00" in relative:
        raise PageError(400, "file path contains a NUL byte")
    missing = PageError(404, f"no file {relative!r} in run {layout.root.name!r}")
    path = PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts or not path.parts or path.suffix.lower() not in SERVED_SUFFIXES:
        raise missing
    try:
        return RunFiles(layout).open(layout.root / path)
    except RefusedFile as exc:
        raise PageError(404, f"no file {relative!r} in run {layout.root.name!r}: it {exc.reason}") from exc
    except OSError as exc:
        raise missing from exc


def _chunks(handle: BinaryIO, size: int) -> Iterator[bytes]:
    """The first ``size`` bytes of ``handle`` (its size when opened: a log still being written ends there), in chunks."""
    with handle:
        while size > 0 and (chunk := handle.read(min(CHUNK_BYTES, size))):
            size -= len(chunk)
            yield chunk


__all__: list[str] = [
    "create_app", "dag_run_url", "dag_runs_by_folder", "dag_runs_list_url", "error_response", "list_href", "open_run_file",
    "require_airflow_user",
]
