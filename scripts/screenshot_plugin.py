#!/usr/bin/env python
"""Screenshot the eagleflow run page as a logged-in user sees it in a real ``airflow standalone``.

1. Builds an output root from real artefacts: a finished run folder (``--source``: a
   ``make demo`` run, or the one ``scripts/make_metrics_fixture.py`` made) copied without its
   hidden states and weights (shard manifests, train log and metrics, the capture check and
   the evaluation when the run has them, the engines' logs), with charts drawn by the real
   ``python -m eagleflow plot`` step.
2. Starts ``airflow standalone`` (SQLite, 127.0.0.1, a free port, AIRFLOW_HOME under
   ``.cache/plugin-shot/``, the repo's ``plugins/`` folder) in its own session.
3. Drives headless Chromium over the DevTools protocol: opens the page, is sent to Airflow's
   login form, types the user name and password, and lands back on the page.
4. Checks the page rendered (the chart images loaded, one table row per shard), saves a
   full-page screenshot (shrunk below 300 KB), checks Airflow's own UI shows the plugin's view
   (Browse > eagleflow runs, in a frame), and stops Airflow and Chromium.

Run: ``.venv/bin/python scripts/screenshot_plugin.py [--out docs/eagleflow-run-page.png]``.
Needs ``chromium`` (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagleflow.engine.process import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
DEFAULT_SOURCE = CACHE / "metrics-fixture" / "runs" / "fixture"
DEFAULT_HOME = CACHE / "plugin-shot"
DEFAULT_OUT = REPO / "docs" / "eagleflow-run-page.png"
RUN_NAME = "tiny-cpu-demo"
MAX_BYTES = 300_000
USER = "admin"


def say(message: str) -> None:
    print(f"[screenshot_plugin] {message}", flush=True)


def wait_http(url: str, timeout: float, process: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    """Poll ``url`` until it answers < 500; fail early with the log tail if ``process`` died."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise SystemExit(f"process exited with {process.returncode} while waiting for {url}\n{tail}")
        try:
            if requests.get(url, timeout=10).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} did not answer within {timeout:.0f}s")


# ---------------------------------------------------------------------------------------
# 1. the run folder


def prepare_output_root(source: Path, root: Path) -> Path:
    """``root/<RUN_NAME>`` from the real run folder ``source``, charts drawn by the plot step."""
    if not (source / "shards").is_dir() or not (source / "train" / "metrics.jsonl").is_file():
        raise SystemExit(f"{source} is not a finished run folder: run scripts/make_metrics_fixture.py first")
    run = root / RUN_NAME
    shutil.rmtree(run, ignore_errors=True)
    # Everything the page reads (shards, logs, the capture check, the evaluation), not the bulk.
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt", "*.npy", "hidden_states",
                                                               "train-progress"))
    subprocess.run(
        [sys.executable, "-m", "eagleflow", "plot", "--metrics", str(run / "train" / "metrics.jsonl"),
         "--out", str(run / "train-progress")],
        cwd=REPO, check=True,
    )
    return run


# ---------------------------------------------------------------------------------------
# 2. Airflow


@contextlib.contextmanager
def airflow_standalone(home: Path, output_root: Path, port: int, password: str) -> Iterator[str]:
    """``airflow standalone`` on 127.0.0.1:``port``; yields its base URL; stops its process group."""
    home.mkdir(parents=True, exist_ok=True)
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps({USER: password}))
    passwords.chmod(0o600)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "EAGLEFLOW_OUTPUT_ROOT": str(output_root),
        "PYTHONUNBUFFERED": "1",
        # standalone starts its components as `airflow …` found on PATH: this environment's.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    log = home / "standalone.log"
    say(f"starting airflow standalone on 127.0.0.1:{port} (log: {log})")
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "airflow", "standalone"], env=env, cwd=home, stdout=handle,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/api/v2/monitor/health", timeout=600, process=process, log=log)
        say("airflow is up")
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# ---------------------------------------------------------------------------------------
# 3. Chromium over the DevTools protocol


class Chromium:
    """Headless Chromium and one page target, driven with DevTools protocol commands."""

    def __init__(self, profile: Path, width: int, height: int) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if not binary:
            raise SystemExit("chromium not found (Debian: apt-get install chromium)")
        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit("chromium did not start its DevTools endpoint")
            time.sleep(0.2)
        import requests
        from websockets.sync.client import connect

        devtools = int(port_file.read_text().split()[0])
        pages = [t for t in requests.get(f"http://127.0.0.1:{devtools}/json/list", timeout=10).json() if t["type"] == "page"]
        self._stack = contextlib.ExitStack()
        self.socket = self._stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=None))
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self.ids)
        self.socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=120))
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_event(self, method: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, event in enumerate(self.events):
                if event.get("method") == method:
                    del self.events[: index + 1]
                    return
            with contextlib.suppress(TimeoutError):
                self.events.append(json.loads(self.socket.recv(timeout=1)))
        raise SystemExit(f"no {method} within {timeout:.0f}s")

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                value = self.evaluate(expression)
                if value:
                    return value
            time.sleep(0.5)
        raise SystemExit(f"timed out waiting for {what}; page: {self.evaluate('location.href')}")

    def navigate(self, url: str) -> None:
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def type_into(self, selector: str, text: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def screenshot(self) -> bytes:
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def log_in_and_open(browser: Chromium, base: str, page_url: str, password: str) -> None:
    """Open the page, follow Airflow's redirect to its login form, log in, come back."""
    browser.navigate(page_url)
    status = browser.evaluate("document.body.innerText")
    say(f"before login the page says: {status[:80]!r}")
    browser.navigate(f"{base}/auth/login/?next={page_url}")
    browser.wait_for("document.querySelector('input[name=username]') !== null", "the login form")
    browser.type_into("input[name=username]", USER)
    browser.type_into("input[name=password]", password)
    browser.evaluate("document.querySelector('button[type=submit]').click()")
    browser.wait_for(f"location.href === {json.dumps(page_url)} && document.readyState === 'complete'", "the page after login")
    browser.wait_for(
        "Array.from(document.images).length >= 2 && Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)",
        "both charts to load",
    )


def shrink_png(data: bytes, limit: int = MAX_BYTES) -> bytes:
    """A palette PNG (and, if still too big, a narrower one) under ``limit`` bytes."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    for scale in (1.0, 0.85, 0.7, 0.6):
        resized = image if scale == 1.0 else image.resize((int(image.width * scale), int(image.height * scale)), Image.LANCZOS)
        buffer = io.BytesIO()
        resized.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(buffer, format="PNG", optimize=True)
        if buffer.tell() <= limit:
            return buffer.getvalue()
    raise SystemExit(f"could not get the screenshot under {limit} bytes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="finished run folder to show")
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME, help="scratch: AIRFLOW_HOME and output root")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="screenshot file (PNG)")
    parser.add_argument("--width", type=int, default=1360, help="browser window width in CSS pixels")
    args = parser.parse_args()

    home = args.home.absolute()
    output_root = home / "runs"
    run = prepare_output_root(args.source.absolute(), output_root)
    shutil.rmtree(home / "airflow", ignore_errors=True)
    password = secrets.token_urlsafe(12)
    port = free_port()
    with airflow_standalone(home / "airflow", output_root, port, password) as base, \
            tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        page_url = f"{base}/eagleflow/runs/{RUN_NAME}"
        browser = Chromium(Path(profile), width=args.width, height=900)
        try:
            log_in_and_open(browser, base, page_url, password)
            shards = browser.evaluate("document.querySelectorAll('td:first-child').length")
            rows = browser.evaluate(
                "Array.from(document.querySelectorAll('tr')).filter(r => /^rows_\\d+-\\d+/.test(r.innerText)).length"
            )
            expected = len(list((run / "shards").glob("*.json")))
            charts = browser.evaluate("Array.from(document.images).map(i => [i.alt, i.naturalWidth, i.naturalHeight])")
            say(f"page rendered: charts {charts}, shard rows {rows} of {expected} manifests ({shards} table rows)")
            if rows != expected or len(charts) < 2 or any(w == 0 for _, w, _ in charts):
                raise SystemExit("the page did not render its charts and every shard")
            png = shrink_png(browser.screenshot())
            # The Browse menu entry: Airflow's UI shows the plugin's index in a frame.
            browser.navigate(f"{base}/plugin/eagleflow")
            listed = browser.wait_for(
                "(() => { const f = document.querySelector('iframe');"
                " return f && f.contentDocument && f.contentDocument.body.innerText; })()",
                "the eagleflow frame in Airflow's UI",
            )
            if RUN_NAME not in listed:
                raise SystemExit(f"Airflow's eagleflow view does not list {RUN_NAME}: {listed[:300]!r}")
            say(f"Airflow's Browse > eagleflow runs view lists {RUN_NAME}")
        finally:
            browser.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(png)
    say(f"wrote {args.out} ({len(png) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
