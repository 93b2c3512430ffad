#!/usr/bin/env python
"""Screenshot a running Airflow's eagleflow pages in headless Chromium: the trigger form, a DAG run's
grid, the run page and the list of runs (for ``docs/``).

Needs an Airflow started with this repo's ``dags/`` and ``plugins/`` (``make airflow``) that holds a
finished eagleflow DAG run. Logs in as ``admin`` with the password Airflow generated in its home,
then, each step bounded by a timeout:

1. ``/dags/eagleflow``: clicks "Trigger", waits for the form's sections, opens ``--open-section``
   and saves the dialog (``docs/trigger-form.png``);
2. ``/dags/eagleflow/runs/<run id>``: the grid of that DAG run (``docs/dag-grid.png``);
3. ``/eagleflow/runs/<run name>``: the run page, checking its link back to the DAG run
   (``docs/eagleflow-run-page.png``), and ``/eagleflow/`` (``docs/eagleflow-runs.png``).

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="Airflow's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--home", type=Path, required=True, help="its AIRFLOW_HOME (for the generated admin password)")
    parser.add_argument("--run-id", required=True, help="a finished eagleflow DAG run")
    parser.add_argument("--run-name", default="demo", help="its run folder")
    parser.add_argument("--open-section", default="Extraction", help="the form section shown open")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs")
    args = parser.parse_args()

    password = json.loads((args.home / "simple_auth_manager_passwords.json.generated").read_text())[USER]
    shots: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        browser = Chromium(Path(profile), width=1440, height=1200)
        try:
            log_in(browser, args.base, password)
            shots["trigger-form.png"] = trigger_form(browser, args.base, args.open_section)
            say("trigger form captured")

            browser.navigate(f"{args.base}/dags/eagleflow/runs/{args.run_id}")
            browser.wait_for("document.body.innerText.includes('extract_shard')", "the grid's task names", timeout=90)
            shots["dag-grid.png"] = browser.screenshot()
            say("grid captured")

            page = f"{args.base}/eagleflow/runs/{args.run_name}"
            browser.navigate(page)
            browser.wait_for("Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)", "the run page's charts")
            back = browser.evaluate("document.querySelector('.dagrun a') && document.querySelector('.dagrun a').href")
            if not back or f"/dags/eagleflow/runs/{args.run_id}" not in back:
                raise SystemExit(f"the run page does not link back to DAG run {args.run_id}: {back!r}")
            shots["eagleflow-run-page.png"] = browser.screenshot()
            browser.navigate(back)  # the link leads to the DAG run in Airflow's UI
            browser.wait_for("document.body.innerText.includes('extract_shard')", "the DAG run the run page links to", timeout=90)
            say(f"the run page links back to {back}")

            browser.navigate(f"{args.base}/eagleflow/")
            browser.wait_for(f"document.body.innerText.includes({json.dumps(args.run_id)})", "the runs list with its DAG run")
            shots["eagleflow-runs.png"] = browser.screenshot()
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
