#!/usr/bin/env python
"""Screenshot a running Airflow's eagleflow pages in headless Chromium: the trigger form, a DAG run's
grid, the run page and the list of runs (for ``docs/``).

Needs an Airflow started with this repo's ``dags/`` and ``plugins/`` (``make airflow``) that holds a
finished eagleflow DAG run. Logs in as ``admin`` with the password Airflow generated in its home,
then, each step bounded by a timeout:

1. ``/dags/eagleflow``: clicks "Trigger", waits for the form's sections, opens ``--open-section``
   and saves the dialog (``docs/trigger-form.png``);
2. ``/dags/eagleflow/runs/<run id>``: the grid of that DAG run (``docs/dag-grid.png``);
3. ``/eagleflow/runs/<run name>``: the run page on its own (``docs/eagleflow-run-page.png``); then the same
   page inside Airflow (Browse → eagleflow runs, ``/plugin/eagleflow/eagleflow/runs/<run name>``, in Airflow's
   sandboxed frame), clicking its link to the DAG run there, which must land on Airflow's page of that DAG run;
4. ``/plugin/eagleflow``: the list of runs inside Airflow, at the window's size (``docs/eagleflow-runs.png``).

``--shots`` takes some of them only (``run-page runs``: the eagleflow pages, e.g. after changing the plugin).
Run: ``.venv/bin/python scripts/screenshot_ui.py --base http://127.0.0.1:8080 --home .airflow --run-id RUN_ID``.
Chromium (``apt-get install chromium``) and the Chromium class come from ``screenshot_plugin.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshot_plugin import USER, Chromium, say, shrink_png  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def log_in(browser: Chromium, base: str, password: str) -> None:
    """Airflow's own login form, then its home page."""
    browser.navigate(f"{base}/auth/login/")
    browser.wait_for("document.querySelector('input[name=username]') !== null", "the login form")
    browser.type_into("input[name=username]", USER)
    browser.type_into("input[name=password]", password)
    browser.evaluate("document.querySelector('button[type=submit]').click()")
    browser.wait_for("!location.pathname.startsWith('/auth/') && document.readyState === 'complete'", "the UI after login")


def click_text(browser: Chromium, text: str) -> None:
    """Click, as a mouse does (the UI's accordions ignore a scripted ``.click()``), the first button whose text is ``text``."""
    box = browser.evaluate(
        f"(() => {{ const b = Array.from(document.querySelectorAll('button')).find(e => e.innerText.trim() === {json.dumps(text)});"
        " if (!b) return null; b.scrollIntoView({block: 'center'}); const r = b.getBoundingClientRect();"
        " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
    )
    if not box:
        raise SystemExit(f"no button {text!r} on {browser.evaluate('location.href')}")
    for kind in ("mousePressed", "mouseReleased"):
        browser.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


def trigger_form(browser: Chromium, base: str, section: str) -> bytes:
    """The DAG's trigger dialog with ``section`` opened and scrolled to, as a user sees it after clicking "Trigger"."""
    browser.navigate(f"{base}/dags/eagleflow")
    browser.wait_for("Array.from(document.querySelectorAll('button')).some(b => b.innerText.trim() === 'Trigger')", "the Trigger button")
    click_text(browser, "Trigger")
    browser.wait_for("document.body.innerText.includes('Run Parameters')", "the trigger form", timeout=90)
    browser.wait_for(f"document.body.innerText.includes({json.dumps(section)})", f"the {section} section")
    click_text(browser, section)
    browser.wait_for("document.body.innerText.includes('Re-extract complete shards')", f"the {section} section's fields")
    browser.evaluate(  # the section's header at the top of the dialog's scrolled view
        f"Array.from(document.querySelectorAll('button')).find(e => e.innerText.trim() === {json.dumps(section)})"
        ".scrollIntoView({block: 'start'})"
    )
    time.sleep(1)  # the accordion's opening animation
    return browser.screenshot()


SHOTS = {"trigger-form": "trigger-form.png", "dag-grid": "dag-grid.png", "run-page": "eagleflow-run-page.png",
         "runs": "eagleflow-runs.png"}
FRAME = "document.querySelector('iframe[title=\\'eagleflow runs\\']')"


def in_frame(expression: str) -> str:
    """``expression`` evaluated in the eagleflow frame of Airflow's page (same origin), null until it has loaded."""
    return (f"(() => {{ const f = {FRAME}; const doc = f && f.contentDocument;"
            f" return doc && doc.body ? (document => ({expression}))(doc) : null; }})()")


def follow_dag_run_link_in_airflow(browser: Chromium, base: str, run_name: str, run_id: str) -> None:
    """The run page inside Airflow's frame; its DAG run link, clicked there, must open Airflow's page of ``run_id``."""
    browser.navigate(f"{base}/plugin/eagleflow/eagleflow/runs/{run_name}")
    href = browser.wait_for(in_frame("document.querySelector('.dagrun a') && document.querySelector('.dagrun a').href"),
                            "the run page's DAG run link in Airflow's frame")
    if f"/dags/eagleflow/runs/{quote(run_id, safe='')}" not in href:
        raise SystemExit(f"the run page does not link to DAG run {run_id}: {href!r}")
    browser.evaluate(in_frame("document.querySelector('.dagrun a').click()"))
    browser.wait_for(f"location.href === {json.dumps(href)} && document.body.innerText.includes('extract_shard')",
                     "Airflow's DAG run page, reached from the link in its frame", timeout=90)
    say(f"the run page's link, clicked in Airflow's frame, opened {href}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="Airflow's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--home", type=Path, required=True, help="its AIRFLOW_HOME (for the generated admin password)")
    parser.add_argument("--run-id", required=True, help="a finished eagleflow DAG run")
    parser.add_argument("--run-name", default="demo", help="its run folder")
    parser.add_argument("--open-section", default="Extraction", help="the form section shown open")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs")
    parser.add_argument("--shots", nargs="+", choices=sorted(SHOTS), default=list(SHOTS), help="which screenshots (default: all)")
    parser.add_argument("--width", type=int, default=1440, help="window width in CSS pixels")
    parser.add_argument("--height", type=int, default=1200, help="window height in CSS pixels")
    args = parser.parse_args()

    password = json.loads((args.home / "simple_auth_manager_passwords.json.generated").read_text())[USER]
    shots: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        browser = Chromium(Path(profile), width=args.width, height=args.height)
        try:
            log_in(browser, args.base, password)
            if "trigger-form" in args.shots:
                shots[SHOTS["trigger-form"]] = trigger_form(browser, args.base, args.open_section)
                say("trigger form captured")

            if "dag-grid" in args.shots:
                browser.navigate(f"{args.base}/dags/eagleflow/runs/{args.run_id}")
                browser.wait_for("document.body.innerText.includes('extract_shard')", "the grid's task names", timeout=90)
                shots[SHOTS["dag-grid"]] = browser.screenshot()
                say("grid captured")

            if "run-page" in args.shots:
                browser.navigate(f"{args.base}/eagleflow/runs/{args.run_name}")
                browser.wait_for("Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)", "the run page's charts")
                shots[SHOTS["run-page"]] = browser.screenshot()
                follow_dag_run_link_in_airflow(browser, args.base, args.run_name, args.run_id)

            if "runs" in args.shots:
                browser.navigate(f"{args.base}/plugin/eagleflow")
                browser.wait_for(in_frame(f"document.body.innerText.includes({json.dumps(args.run_id)})"),
                                 "the runs list with its DAG run, in Airflow's frame")
                browser.wait_for("document.readyState === 'complete'", "Airflow's page")
                time.sleep(1)  # Airflow's navigation icons
                shots[SHOTS["runs"]] = browser.screenshot()
        finally:
            browser.close()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, png in shots.items():
        small = shrink_png(png)
        (args.out / name).write_bytes(small)
        say(f"wrote {args.out / name} ({len(small) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
