"""The eagleflow pages inside a real Airflow, in headless Chromium: Browse → eagleflow runs shows them in Airflow's
sandboxed frame, and their links to a DAG run land on Airflow's own DAG run page (the frame's sandbox refuses
``target="_top"``: ``templates/base.html`` says how the links get out of it). Also: the list of runs fits that
frame at 1600×900, a DAG run that failed before writing its folder has a page there, and a script in a run
folder's SVG never runs, in the frame or on its own, while the run page still shows its charts. And what a user
meets around a run: the trigger form says why it refuses an out-of-range Param; a run triggered from the form
given two families and nothing else succeeds (through a scheduler crash and restart mid-extraction) and opens
with their comparison, in each DAG run's "eagleflow run" tab too; and a run whose first task failed before
writing its folder is listed with that task's reason.

Airflow is the real-scheduler tests' stack (``tests/dags/conftest.py``'s ``airflow_stack``: scheduler,
dag-processor, triggerer and api-server, all-admins, no login), the eagleflow DAG paused so the DAG runs
this test triggers stay as they are; the api-server's output root and the form's defaults
(``EAGLEFLOW_FORM_DEFAULTS``) are this module's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "eagleflow"
RUN_ID = "manual__2026-12-03T23:19:16.409337+00:00"  # triggered from the form: no run_name, the folder named after it
FAILED_RUN_ID = "manual__failed-at-once"
NOT_WRITTEN = "never-written"
FORM_ROWS, FORM_SHARD_SIZE = 16, 8  # conversations of the run triggered from the form, and its shards' rows
FAMILIES = ["eagle3", "dflash"]  # what that run's form is given: the families, nothing else
BAD_MODEL_RUN_ID, BAD_MODEL = "manual__bad-model", "bad-model"  # a run whose first task refuses its verifier folder
WIDTH, HEIGHT = 1600, 900


def _dags_conftest() -> Any:
    """``tests/dags/conftest.py`` as a module of its own name (its Airflow stack, reused, not copied)."""
    name = "eagleflow_tests_dags_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "dags" / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


airflow_stack = _dags_conftest().airflow_stack  # the fixture, module-scoped: one Airflow for this module
run_inputs = _dags_conftest().run_inputs


@pytest.fixture(scope="module", autouse=True)
def ui_output_root(tmp_path_factory: pytest.TempPathFactory, fill_output_root: Any, run_inputs: Any) -> Iterator[Path]:
    """The api-server's output root (``$EAGLEFLOW_OUTPUT_ROOT``, which the stack's components inherit; autouse:
    set before the stack starts) with the run folder of :data:`RUN_ID`; and the deployment's form defaults
    (``$EAGLEFLOW_FORM_DEFAULTS``): this machine's run of the untrained tiny verifier, as a deployment puts its own
    model folder and sizes there, so a run from the form needs no edit but its drafters."""
    from eagleflow.files import atomic_write_json
    from eagleflow.layout import run_name_from_run_id

    home = tmp_path_factory.mktemp("ui-in-airflow")
    root = fill_output_root(home / "runs")
    (root / "demo").rename(root / run_name_from_run_id(RUN_ID))
    defaults = {k: v for k, v in run_inputs(FORM_ROWS).conf(root, "", shard_size=FORM_SHARD_SIZE).items() if k != "run_name"}
    atomic_write_json(home / "form-defaults.json", defaults)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLEFLOW_OUTPUT_ROOT", str(root))
        patch.setenv("EAGLEFLOW_FORM_DEFAULTS", str(home / "form-defaults.json"))
        yield root


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium at 1600×900 through chromedriver (``.ci/run`` installs both)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are not installed - CI must install them")
        pytest.skip("chromium or chromedriver not installed (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def wait(browser: Any, condition: Any, what: str, timeout: float = 60) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, timeout).until(lambda b: condition(b))
    except TimeoutException:
        from selenium.webdriver.common.by import By

        shown = " ".join(e.text for e in browser.find_elements(By.TAG_NAME, "body"))[:1500]
        raise AssertionError(f"no {what} within {timeout:.0f}s; at {browser.current_url}, showing:\n{shown}") from None


def into_the_frame(browser: Any, url: str) -> None:
    """Open ``url`` of Airflow's UI and switch into the plugin's frame once it shows an eagleflow page."""
    from selenium.webdriver.common.by import By

    browser.switch_to.default_content()
    browser.get(url)
    frame = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "iframe[title='eagleflow runs']"), "eagleflow frame")[0]
    assert "allow-top-navigation" not in (frame.get_attribute("sandbox") or "")  # what the pages' script is for
    browser.switch_to.frame(frame)
    wait(browser, lambda b: b.find_elements(By.TAG_NAME, "h1"), "eagleflow page in the frame")


def follow_out_of_the_frame(browser: Any, stack: Any, css: str, run_id: str) -> None:
    """Click the link ``css`` in the frame, as a user does; it must land on Airflow's page of DAG run ``run_id``."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, css).click()
    browser.switch_to.default_content()
    page = f"{stack.url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}"
    wait(browser, lambda b: b.current_url == page, f"Airflow's DAG run page {page}")
    wait(browser, lambda b: run_id in b.find_element(By.TAG_NAME, "body").text, f"DAG run {run_id} on Airflow's page")
    assert not browser.find_elements(By.CSS_SELECTOR, "iframe[title='eagleflow runs']")  # Airflow's page, not the frame


def end_in_the_metadata_db(database: Path, run_id: str, state: str = "failed") -> None:
    """DAG run ``run_id`` ended in ``state`` (failed: as one that fails at its first task is) without running anything,
    so it is never scheduled. (Marking it failed through the REST API does not: the DAG's teardowns, still to run,
    keep it queued.)"""
    import sqlite3

    with contextlib.closing(sqlite3.connect(database, timeout=60)) as db, db:
        changed = db.execute("UPDATE dag_run SET state = ?, end_date = CURRENT_TIMESTAMP WHERE dag_id = ? AND run_id = ?",
                             (state, DAG_ID, run_id)).rowcount
    assert changed == 1


def refused_navigations(browser: Any) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if "Unsafe attempt to initiate navigation" in e["message"]
            or "sandboxed frame" in e["message"]]


def test_links_from_the_plugin_pages_in_airflows_frame_reach_airflows_dag_run_page(
    airflow_stack: Any, ui_output_root: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    from eagleflow.layout import run_name_from_run_id

    stack = airflow_stack
    stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": True})  # the runs are shown, never scheduled
    # Params the trigger form requires (never read: the runs are never scheduled).
    here = {"output_root": str(ui_output_root), "model_path": str(ui_output_root / "model"),
            "dataset_input": str(ui_output_root / "conversations.jsonl")}
    for run_id, conf in ((RUN_ID, here), (FAILED_RUN_ID, {**here, "run_name": NOT_WRITTEN})):
        stack.request("POST", f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None, "conf": conf})
    end_in_the_metadata_db(stack.home / "airflow.db", FAILED_RUN_ID)
    run_name = run_name_from_run_id(RUN_ID)

    # Browse → eagleflow runs: the list, in Airflow's frame, fits it at 1600×900 ...
    into_the_frame(browser, f"{stack.url}/plugin/eagleflow")
    right, frame_width = browser.execute_script(
        "const t = document.querySelector('table.runs'); return [t.getBoundingClientRect().right, document.documentElement.clientWidth]"
    )
    assert right <= frame_width, f"the runs table ({right:.0f} px) is wider than Airflow's frame ({frame_width} px)"
    # ... and its DAG run link opens Airflow's page of that DAG run.
    follow_out_of_the_frame(browser, stack, f"a[title^='{RUN_ID}']", RUN_ID)

    # The run page, reached from the list inside the frame: Airflow's URL follows it; its DAG run link gets out too.
    into_the_frame(browser, f"{stack.url}/plugin/eagleflow")
    browser.find_element(By.CSS_SELECTOR, f"a[href='runs/{run_name}']").click()
    wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".dagrun a"), "the run page's DAG run link")
    browser.switch_to.default_content()
    wait(browser, lambda b: b.current_url.endswith(f"/plugin/eagleflow/eagleflow/runs/{run_name}"), "Airflow's URL of the run page")
    browser.switch_to.frame(browser.find_element(By.CSS_SELECTOR, "iframe[title='eagleflow runs']"))
    follow_out_of_the_frame(browser, stack, ".dagrun a", RUN_ID)

    # A DAG run that failed before any task wrote its folder: listed, its page says so and links to it.
    into_the_frame(browser, f"{stack.url}/plugin/eagleflow")
    browser.find_element(By.CSS_SELECTOR, f"a[href='runs/{NOT_WRITTEN}']").click()
    text = wait(browser, lambda b: "No run folder was written" in b.find_element(By.TAG_NAME, "body").text
                and b.find_element(By.TAG_NAME, "body").text, "the page of a run without a folder")
    assert "the DAG run failed before its first task wrote it" in text
    follow_out_of_the_frame(browser, stack, ".dagrun a", FAILED_RUN_ID)
    assert "failed" in browser.find_element(By.TAG_NAME, "body").text.lower()

    # The same page opened on its own (not framed): the link is a plain link.
    browser.get(f"{stack.url}/eagleflow/runs/{run_name}")
    follow_out_of_the_frame(browser, stack, ".dagrun a", RUN_ID)
    assert refused_navigations(browser) == []


# An SVG whose script, run, would act in Airflow's origin: mark its own drawing, its title and Airflow's page.
SCRIPTED_SVG = """<svg xmlns="http://www.w3.org/2000/svg" width="200" height="100"><title>served svg</title>
<rect id="box" width="200" height="100" fill="green"/>
<script>document.title = "SCRIPT RAN"; document.getElementById("box").setAttribute("fill", "red");
try { parent.document.title = "SCRIPT RAN"; } catch (e) {}</script></svg>"""


def drawn(browser: Any) -> list[Any]:
    """The shown SVG's title, its box's colour and width: ``["served svg", "green", 200]`` unless its script ran."""
    wait(browser, lambda b: b.execute_script("return document.readyState") == "complete", "the SVG loaded")
    return browser.execute_script(
        "const box = document.getElementById('box');"
        "return [document.title, box.getAttribute('fill'), box.getBoundingClientRect().width]"
    )


def test_a_script_in_a_run_folders_svg_never_runs_and_the_run_page_still_shows_its_charts(
    browser: Any, airflow_stack: Any, ui_output_root: Path
) -> None:
    """In the module's browser and Airflow (no session of its own): the chart SVG the run page links holds a script."""
    import base64

    from selenium.webdriver.common.by import By

    from eagleflow.layout import run_name_from_run_id

    stack, run_name = airflow_stack, run_name_from_run_id(RUN_ID)
    (ui_output_root / run_name / "train-progress" / "acc.svg").write_text(SCRIPTED_SVG)
    # Where nothing forbids it (a data: URL), this browser runs the script: what the served file must never do.
    browser.get("data:image/svg+xml;base64," + base64.b64encode(SCRIPTED_SVG.encode()).decode())
    assert drawn(browser) == ["SCRIPT RAN", "red", 200]

    # The run page in Airflow's frame shows its charts, and an <img> of the served SVG draws it ...
    into_the_frame(browser, f"{stack.url}/plugin/eagleflow/eagleflow/runs/{run_name}")
    shown = "return [...document.images].map(i => i.complete && i.naturalWidth > 0)"
    wait(browser, lambda b: b.execute_script(shown) == [True, True], "the charts (loss, acc) shown")
    svg_link = browser.find_element(By.CSS_SELECTOR, "figcaption a[href*='train-progress/acc.svg']")
    width = browser.execute_async_script(
        "const done = arguments[1], img = new Image(); img.onload = () => done(img.naturalWidth);"
        "img.onerror = () => done('not shown'); img.src = arguments[0];", svg_link.get_attribute("href"))
    assert width == 200
    # ... and its SVG link, followed in the frame as a user does, draws the SVG without running its script.
    svg_link.click()
    wait(browser, lambda b: b.find_elements(By.ID, "box"), "the served SVG in the frame")
    assert drawn(browser) == ["served svg", "green", 200]
    browser.switch_to.default_content()
    assert browser.title != "SCRIPT RAN" and browser.find_elements(By.CSS_SELECTOR, "iframe[title='eagleflow runs']")

    # Opened on its own, as Airflow's origin's top window: drawn, its script does not run either.
    browser.get(f"{stack.url}/eagleflow/runs/{run_name}/files/train-progress/acc.svg")
    assert drawn(browser) == ["served svg", "green", 200]


def _seconds(stamp: str) -> float:
    """Epoch seconds of an Airflow API timestamp."""
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def body_text(browser: Any) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.TAG_NAME, "body").text


def click(browser: Any, text: str, within: str = "body") -> None:
    """Click the button or link whose text is ``text`` (under the CSS ``within``) once it is there, as a user does
    (again if Airflow's React page redrew it between finding and clicking)."""
    from selenium.common.exceptions import WebDriverException

    script = """const [text, within] = arguments;
        const found = [...document.querySelectorAll(within + ' button, ' + within + ' a')]
            .find(e => e.textContent.trim() === text && e.getClientRects().length);
        if (found) found.scrollIntoView({block: 'center'});
        return found || null;"""

    def clicked(b: Any) -> bool:
        found = b.execute_script(script, text, within)
        try:
            return bool(found) and (found.click() or True)
        except WebDriverException:  # stale, covered or not yet interactable: find it again
            return False

    wait(browser, clicked, f"{text!r} to click")


def test_an_out_of_range_param_is_refused_at_trigger_and_the_form_says_why(
    airflow_stack: Any, ui_output_root: Path, browser: Any
) -> None:
    """Shard size -5 typed in the trigger form: kept as typed (no clamp), the field's help says the range, and the
    refusal's reason is shown in the form (Airflow's own check has no bounds: its alert shows the API's answer)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    stack = airflow_stack
    stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": True})
    runs_before = stack.request("GET", f"/dags/{DAG_ID}/dagRuns")["total_entries"]
    browser.switch_to.default_content()
    browser.get(f"{stack.url}/dags/{DAG_ID}")
    click(browser, "Trigger")
    wait(browser, lambda b: b.find_elements(By.ID, "element_model_path"), "the trigger form")
    # The deployment's defaults fill the required fields.
    wait(browser, lambda b: b.find_element(By.ID, "element_model_path").get_attribute("value"), "the verifier folder's default")
    assert Path(browser.find_element(By.ID, "element_model_path").get_attribute("value")).is_dir()
    # Refused or not, the form would unpause the DAG first, and the module's queued DAG run would start.
    unpause = browser.find_element(By.XPATH, "//label[contains(., 'Unpause eagleflow on trigger')]")
    unpause.click()
    assert not unpause.find_element(By.TAG_NAME, "input").is_selected()

    click(browser, "Extraction", "[role=dialog]")
    shard_size = "[id='number-input:element_shard_size'] input"
    field = wait(browser, lambda b: [e for e in b.find_elements(By.CSS_SELECTOR, shard_size) if e.is_displayed()], "Shard size")[0]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", field)
    row = field.find_element(By.XPATH, "ancestor::*[contains(@class, 'chakra-field__root')][1]").get_attribute("textContent")
    assert "Shard size" in row and "At least 1." in row, row  # the range, where the value is typed
    # The form fills its fields from the DAG's Params after it opens: type once the default is shown, and again if a
    # late fill overwrote what was typed (a CI run once read an empty field here).
    wait(browser, lambda b: field.get_attribute("value"), "Shard size's default")

    def typed(b: Any) -> bool:
        if field.get_attribute("value") == "-5":
            return True
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys("-5")
        return False

    wait(browser, typed, "-5 typed in Shard size", timeout=20)
    field.send_keys(Keys.TAB)
    time.sleep(0.5)  # the field's blur handler runs: a clamp would show now
    assert field.get_attribute("value") == "-5"  # kept as typed: the bound is not the field's to enforce silently
    click(browser, "Trigger", "[role=dialog]")

    alert = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "[role=dialog] [data-testid=error-alert]"), "the form's error")[0]
    assert "Invalid input for param shard_size: -5 is less than the minimum of 1" in alert.get_attribute("textContent")
    assert stack.request("GET", f"/dags/{DAG_ID}/dagRuns")["total_entries"] == runs_before  # no DAG run was made
    assert stack.request("GET", f"/dags/{DAG_ID}")["is_paused"]


def test_the_runs_list_says_why_a_run_failed_before_writing_its_folder(airflow_stack: Any, ui_output_root: Path, browser: Any) -> None:
    """A real run whose first task refuses the verifier folder: the list shows that task's one sentence, read from its log."""
    from selenium.webdriver.common.by import By

    stack, missing = airflow_stack, ui_output_root / "no-such-model"
    for queued in stack.request("GET", f"/dags/{DAG_ID}/dagRuns", params={"state": "queued"})["dag_runs"]:
        end_in_the_metadata_db(stack.home / "airflow.db", queued["dag_run_id"])  # it would run first (one active run at a time)
    conf = {"output_root": str(ui_output_root), "model_path": str(missing), "run_name": BAD_MODEL,
            "dataset_input": str(ui_output_root / "conversations.jsonl")}
    try:
        stack.trigger(BAD_MODEL_RUN_ID, conf)
        wait(browser, lambda b: any(ti["state"] == "failed" for ti in stack.task_instances(BAD_MODEL_RUN_ID).values()),
             "the run's first task failing", timeout=180)
    finally:  # the rest of the run is not this test's: nothing more is scheduled
        stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": True})
    end_in_the_metadata_db(stack.home / "airflow.db", BAD_MODEL_RUN_ID)

    said = f"{missing} does not exist"

    def listed(b: Any) -> str | bool:
        into_the_frame(b, f"{stack.url}/plugin/eagleflow")  # (the task's log may reach its reader just after its state)
        rows = [r.text for r in b.find_elements(By.CSS_SELECTOR, "table.runs tr") if r.text.startswith(BAD_MODEL)]
        return bool(rows) and said in rows[0] and rows[0]

    row = wait(browser, listed, "the failed run's reason in the list", timeout=30)
    assert "failed" in row and "no run folder was written" in row and " failed: " in row and "Traceback" not in row
    assert not (ui_output_root / BAD_MODEL).exists()
    browser.find_element(By.CSS_SELECTOR, f"a[href='runs/{BAD_MODEL}']").click()
    wait(browser, lambda b: said in body_text(b), "the reason on the run's page")


def _file_identities(folder: Path) -> dict[str, tuple[int, int]]:
    """``{hidden-states file name: (inode, mtime_ns)}``: a rewrite (even by rename) changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.glob("hs_*.safetensors"))}


def test_a_run_from_the_form_given_only_two_families_survives_a_scheduler_restart_and_opens_with_their_comparison(
    airflow_stack: Any, ui_output_root: Path, run_inputs: Any, browser: Any
) -> None:
    """A newcomer's comparison: the trigger form with the deployment's defaults, the drafters field given two
    families and nothing else; the run trains, measures and compares both (each with its family's own settings),
    and its page, in Airflow's frame and in the DAG run's "eagleflow run" tab, opens with the comparison.

    On its way the scheduler crashes (SIGKILL to it and its LocalExecutor workers) while a shard extracts, and comes
    back. Airflow keeps each task process in a process group of its own, so the running shard's task and step
    outlive the crash and finish their rows, but nobody is left to report it: the new scheduler resets the orphaned
    task at start-up and runs it again, the rerun finds every finished row complete and skips it, and the run
    succeeds."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from eagleflow.layout import RunLayout, run_name_from_run_id
    from eagleflow.run.pipeline import PipelineConfig

    stack = airflow_stack
    for queued in stack.request("GET", f"/dags/{DAG_ID}/dagRuns", params={"state": "queued"})["dag_runs"]:
        end_in_the_metadata_db(stack.home / "airflow.db", queued["dag_run_id"])  # it would run first (one active run at a time)
    stack.inject_faults(write_delay=1.5)  # a disk slower than the engine (each dump waits 1.5 s) keeps a shard busy
    runs_before = {r["dag_run_id"] for r in stack.request("GET", f"/dags/{DAG_ID}/dagRuns", params={"limit": 100})["dag_runs"]}
    browser.switch_to.default_content()
    browser.get(f"{stack.url}/dags/{DAG_ID}")
    click(browser, "Trigger")
    wait(browser, lambda b: b.find_element(By.ID, "element_model_path").get_attribute("value"), "the form with its defaults")

    # The drafters field (Training) is a JSON editor (Monaco): the families pasted over its default [], as the help's
    # example is copied. (Typed key by key, Airflow's form rewrites the field each time it holds JSON: `[""]` at the
    # second key, the rest after its end.)
    click(browser, "Training", "[role=dialog]")
    lines = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#element_drafters .view-lines"), "the drafters field")[0]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", lines)
    browser.execute_cdp_cmd("Browser.grantPermissions", {"origin": stack.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    browser.execute_async_script("navigator.clipboard.writeText(arguments[0]).then(arguments[1], arguments[1])", json.dumps(FAMILIES))
    lines.click()
    ActionChains(browser).key_down(Keys.CONTROL).send_keys("a").send_keys("v").key_up(Keys.CONTROL).perform()

    def shown(b: Any) -> Any:
        with contextlib.suppress(ValueError):
            return json.loads(lines.text.replace("\u00a0", " "))

    wait(browser, lambda b: shown(b) == FAMILIES, "the families in the drafters field", timeout=20)
    click(browser, "Trigger", "[role=dialog]")

    def started(b: Any) -> str | None:
        runs = stack.request("GET", f"/dags/{DAG_ID}/dagRuns", params={"limit": 100})["dag_runs"]
        new = [r["dag_run_id"] for r in runs if r["dag_run_id"] not in runs_before]
        return new[0] if new else None

    run_id = wait(browser, started, "the DAG run the form triggered")
    # Airflow's page polls the API and redraws every few seconds while a run is active: left open for the run's
    # minutes it cost the browser and the api-server about 100 CPU-seconds of a 2-core machine's suite.
    browser.get("about:blank")
    run_name = run_name_from_run_id(run_id)
    layout = RunLayout.of(ui_output_root, run_name)
    try:
        # The scheduler, killed while a shard extracts (a row of it written), restarted a little later than its
        # heartbeat threshold: the new one finds its tasks orphaned at start-up and resets them.
        wait(browser, lambda b: layout.hidden_states.is_dir() and any(layout.hidden_states.glob("hs_*.safetensors"))
             and not stack.processes.dead(), "a shard's first row", timeout=600)
        running_shards = {key for key, ti in stack.task_instances(run_id).items() if key[0] == "extract_shard" and ti["state"] == "running"}
        assert running_shards, stack.describe(run_id)
        stack.processes.kill_component("scheduler")
        killed_at = time.monotonic()
        threshold = float(stack.processes.env["AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD"])
        time.sleep(max(0.0, killed_at + threshold + 5 - time.monotonic()))
        before = _file_identities(layout.hidden_states)  # what was published by then is finished work
        stack.processes.start_component("scheduler")
        state = stack.wait_for_run(run_id, 900)
    finally:
        stack.request("PATCH", f"/dags/{DAG_ID}", json={"is_paused": True})
        stack.inject_faults()
    assert state == "success", stack.describe(run_id)
    tis = stack.task_instances(run_id)
    for key in running_shards:
        assert tis[key]["try_number"] >= 2, stack.describe(run_id)  # reset by the new scheduler and run again
    after = _file_identities(layout.hidden_states)
    assert before and {name: after[name] for name in before} == before, "a finished row was rewritten"
    assert len(after) == FORM_ROWS
    run = stack.request("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")
    run_inputs(FORM_ROWS).check_every_row(layout.dataset, PipelineConfig.from_params(run["conf"], run_id).captured_aux_layer_ids())
    # What the form sent: the deployment's defaults as they were, and the families.
    defaults = json.loads((ui_output_root.parent / "form-defaults.json").read_text())
    assert {k: run["conf"][k] for k in defaults} == defaults and run["conf"]["drafters"] == FAMILIES, run["conf"]
    plan = stack.xcom(run_id, "plan_drafters")
    assert [d["name"] for d in plan] == FAMILIES, plan
    measured = {d: stack.xcom(run_id, "evaluate_drafter", i) for i, d in enumerate(FAMILIES)}
    compared = stack.xcom(run_id, "compare_drafters")

    # Browse → eagleflow runs → the run: the comparison (its heading, the winner with its SGLang flags, the winner's
    # rows) within the frame's first screen.
    into_the_frame(browser, f"{stack.url}/plugin/eagleflow/eagleflow/runs/{run_name}")
    wait(browser, lambda b: "Drafters compared" in body_text(b), "the comparison")
    bottoms, height = browser.execute_script("""
        const heading = [...document.querySelectorAll('h2')].find(h => h.textContent === 'Drafters compared');
        const winner = [...document.querySelectorAll('p')].find(p => p.textContent.startsWith('Winner:'));
        const rows = [...document.querySelectorAll('tr.winner')];
        return [[heading, winner, ...rows].map(e => e.getBoundingClientRect().bottom + window.scrollY),
                document.documentElement.clientHeight];""")
    assert len(bottoms) >= 3 and max(bottoms) <= height, f"the comparison ends at {max(bottoms):.0f} px of a {height} px screen"
    winner = browser.find_element(By.XPATH, "//p[starts-with(normalize-space(), 'Winner:')]").text
    assert any(f"--speculative-algorithm {family}" in winner for family in ("EAGLE3", "DFLASH")), winner

    # The DAG run's page in Airflow: its "eagleflow run" tab shows the same page, the comparison first, in Airflow's frame.
    browser.switch_to.default_content()
    browser.get(f"{stack.url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}")
    click(browser, "eagleflow run")
    frame = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "iframe[title='eagleflow run']"), "the tab's frame")[0]
    browser.switch_to.frame(frame)
    wait(browser, lambda b: f"eagleflow run {run_name}" in body_text(b), "the run page in the tab")
    top, height = browser.execute_script("""
        const heading = [...document.querySelectorAll('h2')].find(h => h.textContent === 'Drafters compared');
        return [heading.getBoundingClientRect().top, document.documentElement.clientHeight];""")
    assert top < height and body_text(browser).index("Drafters compared") < body_text(browser).index("Drafter eagle3")
    browser.switch_to.default_content()
    took = {f"{t}[{ti['rendered_map_index'] or i}]": round(_seconds(ti["end_date"]) - _seconds(ti["start_date"]))
            for (t, i), ti in stack.task_instances(run_id).items() if ti["end_date"] and ti["start_date"]}
    print(f"from the form: {FAMILIES} in {run_id}, {run['end_date']} - {run['start_date']}; tasks {took}; "
          f"winner {compared['winner']['drafter']} {compared['winner']['config']}, accept lengths "
          f"{ {d: m['accept_length'] for d, m in measured.items()} }")
