"""`make demo`: the whole eagleflow DAG on this machine's CPU, through Airflow.

Builds the tiny verifier and 120 synthetic conversations (cached under .cache/demo), gives
Airflow a SQLite home in .airflow-demo, runs the DAG in-process with ``dag.test()`` (the
real scheduling loop, deferrals and mapped tasks; no scheduler daemon needed) with the
demo's Params, printing one line per task as it ends (state, duration, the figure that matters
for it) while Airflow's task logs go to ``<run folder>/demo.log`` (a failed task's last lines
come to the terminal too), then prints where everything is and a short summary (the capture
check's figures among it).

``--hidden-states-dtype fp8`` runs the same DAG storing fp8 hidden states, ``--regenerate``
with the verifier's own answers (``regenerate_responses``), and ``--online`` trains from the
live engine instead of extracted files (``hidden_states_source=engine``, a 2 MB window on
disk), each in its own run folder (``demo-fp8``, ``demo-regenerated``, ``demo-online``), so
each can be compared with ``demo``. ``--draft-algorithm dflash`` trains, exports, serves and measures
a DFlash block drafter instead of EAGLE-3 (``demo-dflash``) from the same capture settings, ``dspark`` a DSpark
(``demo-dspark``).
``--thinking`` serves the verifier as a thinking, tool-calling model (``demo-thinking``): its thinking
template, the conversations with thinking and tool calls, and ``chat_template_kwargs``.
``--sample-transport mooncake`` hands the samples over through a Mooncake Store the run starts beside
its engine instead of the dump folder (``demo-mooncake``; with ``--online``, ``demo-online-mooncake``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagleflow.demo.console import LogsToFile, TaskOutcome

REPO = Path(__file__).resolve().parents[1]
ONLINE_WINDOW_GB = 0.002
DEMO_DIR = REPO / ".cache" / "demo"
DEMO_LOG = "demo.log"  # in the run folder: Airflow's task logs, which the terminal shows one line per task
AIRFLOW_HOME = REPO / ".airflow-demo"

DEMO_ENV = {
    "AIRFLOW_HOME": str(AIRFLOW_HOME),
    "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "EAGLEFLOW_DEMO_DIR": str(DEMO_DIR),
    "PYTHONUNBUFFERED": "1",
}
sys.path.insert(0, str(REPO))
# dag.test() logs "[DAG TEST] starting task_id=%s map_index=%s" and "[DAG TEST] end task …" here around each task it runs.
DAG_TEST_LOGGER = "airflow.sdk.definitions.dag"
DAG_TEST_EVENTS = ("[DAG TEST] starting task_id=", "[DAG TEST] end task task_id=")
SHOWN_STATES = ("success", "failed", "skipped", "upstream_failed", "removed", "up_for_retry")


def main() -> int:
    os.environ.update(DEMO_ENV)  # here, not on import: the tests load this module beside their own Airflow
    from eagleflow.demo import (
        DEMO_COMPARE_DRAFTERS, DEMO_DFLASH_PARAMS, DEMO_DSPARK_PARAMS, DEMO_RUN_NAME, DEMO_THINKING_PARAMS, demo_params, make_demo_inputs, make_thinking_inputs,
        run_summary,
    )
    from eagleflow.demo.console import LogsToFile
    from eagleflow.progress import format_bytes
    from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HIDDEN_STATES_DTYPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-states-dtype", choices=HIDDEN_STATES_DTYPES, default=DEFAULT_HIDDEN_STATES_DTYPE,
                        help="how the run stores hidden states (the Param hidden_states_dtype)")
    parser.add_argument("--regenerate", action="store_true",
                        help="train on the verifier's own answers (the Param regenerate_responses)")
    parser.add_argument("--online", action="store_true",
                        help="train from the live engine, no extraction (the Param hidden_states_source engine)")
    parser.add_argument("--draft-algorithm", choices=["eagle3", "dflash", "dspark"], default="eagle3",
                        help="the drafter family to train (the Param draft_algorithm; dflash, dspark: block drafters)")
    parser.add_argument("--compare", action="store_true",
                        help="train the EAGLE-3 and the DFlash from one capture and compare them (the Param drafters)")
    parser.add_argument("--thinking", action="store_true",
                        help="serve the verifier as a thinking, tool-calling model: its thinking template, conversations "
                        "with thinking and tool calls, and the Param chat_template_kwargs {\"enable_thinking\": true}")
    parser.add_argument("--sample-transport", choices=["file", "mooncake"], default="file",
                        help="how the engine hands samples over (the Param sample_transport; mooncake: through a Mooncake "
                        "Store the run starts on 127.0.0.1)")
    args = parser.parse_args()
    if args.compare and (args.online or args.draft_algorithm != "eagle3"):
        parser.error("--compare trains both families from extracted hidden states: without --online or --draft-algorithm")
    dtype = args.hidden_states_dtype

    began = time.monotonic()
    print(f"[demo] inputs in {DEMO_DIR} (built once, then cached)", flush=True)
    thinking_inputs = make_thinking_inputs(DEMO_DIR) if args.thinking else make_demo_inputs(DEMO_DIR)
    print(f"[demo] Airflow metadata DB in {AIRFLOW_HOME}", flush=True)
    for command in (["db", "migrate"], ["pools", "import", str(REPO / "docker" / "pools.json")]):
        subprocess.run([sys.executable, "-m", "airflow", *command], check=True, stdout=subprocess.DEVNULL)

    variant = (
        ([] if dtype == DEFAULT_HIDDEN_STATES_DTYPE else [dtype])
        + (["regenerated"] if args.regenerate else [])
        + (["online"] if args.online else [])
        + ([args.draft_algorithm] if args.draft_algorithm != "eagle3" else [])
        + (["compare"] if args.compare else [])
        + (["thinking"] if args.thinking else [])
        + (["mooncake"] if args.sample_transport == "mooncake" else [])
    )
    conf = {**demo_params(DEMO_DIR), "run_name": "-".join([DEMO_RUN_NAME, *variant]), "hidden_states_dtype": dtype,
            "regenerate_responses": args.regenerate, "sample_transport": args.sample_transport}
    if args.draft_algorithm in ("dflash", "dspark"):
        conf.update(DEMO_DFLASH_PARAMS if args.draft_algorithm == "dflash" else DEMO_DSPARK_PARAMS)
    # The DAG's default drafters are the form's (a comparison, make airflow's): a run of one family says so.
    conf["drafters"] = DEMO_COMPARE_DRAFTERS if args.compare else []
    if args.thinking:
        conf.update(thinking_inputs, **DEMO_THINKING_PARAMS)
    if args.online:
        # A window of a few samples: the disk holds megabytes whatever the dataset's size.
        conf.update(hidden_states_source="engine", dump_queue_gb=ONLINE_WINDOW_GB)
    from eagleflow.run.pipeline import PipelineConfig

    cfg = PipelineConfig.from_params(conf)
    log_path = cfg.layout.root / DEMO_LOG
    print(f"[demo] running DAG eagleflow into {cfg.layout.root}; one line per task as it ends, Airflow's logs in {log_path}",
          flush=True)
    with LogsToFile(log_path) as logs:
        print(f"[demo] running DAG eagleflow with conf {json.dumps(conf)}")  # into the log: the whole run's Params
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(dag_folder=str(REPO / "dags"))
        if bag.import_errors:
            logs.say(f"[demo] the DAG does not import: {bag.import_errors}")
            return 1
        try:
            run = run_with_task_lines(bag.get_dag("eagleflow"), conf, logs, logs.say)
        except Exception as exc:
            traceback.print_exc()  # into the log
            logs.say(f"[demo] the DAG run stopped: {type(exc).__name__}: {exc}; the traceback is at the end of {log_path}")
            return 1
    summary = run_summary(cfg.layout.root, cfg.model_path, cfg.captured_aux_layer_ids(), cfg.hidden_states_dtype)
    print(f"\n[demo] DAG run {run.run_id}: {run.state} in {time.monotonic() - began:.0f}s; Airflow's logs in {log_path}")
    regeneration = summary.get("regeneration")
    if regeneration:
        print(f"  regenerated  {regeneration['rows']} conversations in {regeneration['seconds']:.0f}s; "
              f"{regeneration['shortened_conversations']} shortened to fit the {regeneration['context_length']}-token context "
              f"({regeneration['dropped_turns']} turns dropped, {regeneration['capped_answers']} answers capped), "
              f"{regeneration['skipped_rows']} rows left out")
    if summary.get("prepared_from"):
        print(f"  prepared     from {summary['prepared_from']}")
    online = summary.get("online")
    if online:
        print(f"  dataset      {summary['dataset']} ({summary.get('tokens', '?')} tokens; no hidden states stored: "
              f"training asked the engine; no shard extracted)")
        print(f"  online       {online['fetched']} samples from the engine ({format_bytes(online['fetched_bytes'] or 0)} of "
              f"{dtype} hidden states), peak on disk {format_bytes(online['peak_bytes'] or 0)} (window "
              f"{format_bytes(online['window_bytes'] or 0)}), trainer waited {online['data_wait_s'] or 0:.1f}s for data")
    else:
        print(f"  dataset      {summary['dataset']} ({summary['rows']} rows, {summary.get('tokens', '?')} tokens, "
              f"{format_bytes(summary['hidden_state_bytes'])} of {dtype} hidden states in shards {', '.join(summary['shards'])})")
        if summary.get("tokens"):
            print(f"  on disk      {summary['hidden_state_bytes'] / summary['tokens']:.1f} B of hidden states per token")
        print(f"  validated    {summary.get('validated_rows', 0)}/{summary['rows']} rows' hidden-state files"
              + (f"; problems: {summary['invalid_rows']}" if summary.get("invalid_rows") else ""))
    for check in summary.get("capture_checks", []):
        worst = check["worst"]
        print(f"  capture      {check['name']} {'passed' if check['passed'] else 'FAILED'} on {check['rows']} rows: final slot "
              f"worst logprob error {worst.get('error', float('nan')):.3f} (tolerance {worst.get('tolerance', float('nan')):.3f}), "
              f"top-1 agreement {check['top1_agreement'] or 0:.1%}; report {cfg.layout.capture_check_report(check['name'])}")
    if summary["checkpoint"]:  # the run's one drafter (with --compare each drafter has its own, in the comparison)
        print(f"  checkpoint   {summary['checkpoint']}")
        print(f"  charts       {', '.join(summary['charts'])}")
    if "step0_acc_last" in summary:
        what = "step-0 accuracy" if summary["accuracy_metric"] == "full_acc_0" else "block accuracy (full_acc)"
        print(f"  {what}: first steps {summary['step0_acc_first']:.3f} -> last steps {summary['step0_acc_last']:.3f}")
    evaluation = summary.get("evaluation")
    if evaluation:
        single = evaluation["tokens_per_s"]["single_stream"]
        speedup = "disturbed" if single.get("disturbed") else f"{single['speedup'] or 0:.2f}x"
        print(f"  drafter      accept length {evaluation['accept_length']['mean']:.2f} on {evaluation['prompts']} "
              f"{evaluation['prompt_sets'][0]} prompts, speedup {speedup} one at a time ({single['drafter'] or 0:.1f} vs "
              f"{single['baseline'] or 0:.1f} tokens/s, median of {evaluation['rounds']} rounds, {evaluation['engine']} engine); "
              f"report {cfg.layout.evaluation / 'report.json'}")
        print(f"  sweep        {'config':<10} {'prompt set':<11} {'accept len':>10} {'p50/p90':>9} {'tok/s':>7} {'speedup':>9}  rounds")
        for row in evaluation["sweep"]:
            a, speed = row["accept_length"], row["speedup"]
            shown = "disturbed" if speed["disturbed"] else f"{speed['median'] or 0:.2f}x"
            p50_p90 = f"{a['p50'] or 0:.1f}/{a['p90'] or 0:.1f}" if a["mean"] is not None else "-"
            print(f"               {row['config']:<10} {row['set']:<11} {(a['mean'] or 1.0):>10.2f} {p50_p90:>9} "
                  f"{row['tokens_per_s']['median'] or 0:>7.1f} {shown:>9}  {speed['min'] or 0:.2f}-{speed['max'] or 0:.2f}x")
        for batch_size, best in (evaluation.get("fastest") or {}).items():
            flags = " ".join(best["sglang_flags"]) or "(no drafter)"
            print(f"  fastest      batch size {batch_size}: {best['config']} ({best['mean_speedup']:.2f}x); SGLang: {flags}")
    complete = (online or {}).get("fetched", 0) > 0 if args.online else summary.get("validated_rows") == summary["rows"] > 0
    if args.compare:
        return 0 if str(run.state) == "success" and complete and print_comparison(summary.get("comparison")) and check and check["passed"] else 1
    evaluated = bool(evaluation) and (evaluation["accept_length"]["mean"] or 0) > 1
    # Greedy speculative decoding is lossless: every config answers every prompt as the baseline does.
    lossy = [f"{row['config']} {row['set']}" for row in (evaluation or {}).get("sweep", [])
             if row.get("same_tokens_as_baseline") is not None and row["same_tokens_as_baseline"] < 1]
    if lossy:
        print(f"  LOSSY        answers differ from the baseline's: {', '.join(lossy)}")
    evaluated = evaluated and not lossy
    checked = bool(check) and check["passed"]
    return 0 if str(run.state) == "success" and complete and evaluated and checked else 1


class TaskLines(logging.Handler):
    """Says one line per task of the DAG run ``dag.test()`` makes, as each ends.

    dag.test() logs a record before and after each task it runs (:data:`DAG_TEST_EVENTS`); at each, this
    notes where the task's share of the log file begins or ends and reads the run's task instances and
    results from the metadata DB, saying those that ended since (tasks skipped or held back by an upstream
    failure end without running). :meth:`report` after the run says whatever is left.
    """

    def __init__(self, dag_id: str, after_run_id: int, logs: LogsToFile, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.dag_id, self.after_run_id, self.logs, self.say = dag_id, after_run_id, logs, say
        self.spans: dict[tuple[str, int], list[int | None]] = {}  # a task's [first, last) byte of the log file
        self.shown: set[tuple[str, int, int, str]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not (isinstance(record.msg, str) and record.msg.startswith(DAG_TEST_EVENTS) and len(args) == 2):
            return
        key, offset = (str(args[0]), int(str(args[1]))), self.logs.offset()
        if record.msg.startswith(DAG_TEST_EVENTS[0]):
            self.spans[key] = [offset, None]
        else:
            self.spans.setdefault(key, [0, None])[1] = offset
        try:
            self.report()
        except Exception:  # the DB busy a moment: the next record, or the report after the run, catches up
            logging.getLogger(__name__).exception("[demo] could not read the run's task instances")

    def report(self) -> list[TaskOutcome]:
        """Say the tasks that ended since the last report; return every task instance of the run, as it is now."""
        from airflow.models.dagrun import DagRun
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        from eagleflow.demo.console import TaskOutcome, task_line

        with create_session(scoped=False) as session:  # never dag.test()'s own (thread-scoped) session
            run_id = session.scalar(select(DagRun.run_id).where(DagRun.dag_id == self.dag_id, DagRun.id > self.after_run_id)
                                    .order_by(DagRun.id).limit(1))
            if run_id is None:
                return []
            tis = list(session.scalars(select(TaskInstance).where(TaskInstance.dag_id == self.dag_id, TaskInstance.run_id == run_id)))
            results = {(x.task_id, x.map_index): XComModel.deserialize_value(x)
                       for x in session.scalars(XComModel.get_many(run_id=run_id, key="return_value", dag_ids=self.dag_id))}
            now: list[tuple[float, tuple[str, int, int, str], TaskOutcome]] = []
            for ti in tis:  # read here: the session's objects expire when it closes
                state = str(getattr(ti.state, "value", ti.state))
                result = results.get((ti.task_id, ti.map_index))
                ended = ti.end_date.timestamp() if ti.end_date else float("inf")
                now.append((ended, (ti.task_id, ti.map_index, ti.try_number, state),
                            TaskOutcome(ti.task_id, task_label(ti), state, ti.duration, result, ti.map_index)))
        for _, key, outcome in sorted(now, key=lambda row: row[0]):  # in the order they ended
            if outcome.state in SHOWN_STATES and key not in self.shown:  # a retried task: a line per try
                self.shown.add(key)
                self.say(task_line(outcome))
        return [outcome for _, _, outcome in now]


def task_label(ti: Any) -> str:
    """``extract_shard[rows_0-40]``: the task, and its map index by name where it has one."""
    return ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.rendered_map_index or ti.map_index}]"


def run_with_task_lines(dag: Any, conf: dict[str, Any], logs: LogsToFile, say: Callable[[str], None]) -> Any:
    """``dag.test(run_conf=conf)`` with its logs in ``logs``' file: ``say`` gets one line per task as it ends, then,
    for each task that failed, the last lines of its log and where the rest is. Returns the DAG run."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    from eagleflow.demo.console import TAIL_LINES, log_tail

    with create_session(scoped=False) as session:
        after = session.scalar(select(func.max(DagRun.id)).where(DagRun.dag_id == dag.dag_id)) or 0
    lines = TaskLines(dag.dag_id, after, logs, say)
    watched = logging.getLogger(DAG_TEST_LOGGER)
    watched.addHandler(lines)
    try:
        run = dag.test(run_conf=conf)
    finally:
        watched.removeHandler(lines)
    for outcome in lines.report():  # the last tasks, and every one had dag.test() stopped logging its records
        if outcome.state == "failed":
            start, end = lines.spans.get((outcome.task_id, outcome.map_index), [0, None])
            say(f"[demo] {outcome.label} failed; the last {TAIL_LINES} lines of its log (all of Airflow's logs: {logs.path}):")
            for line in log_tail(logs.path, start or 0, end):
                say(f"    {line}")
    return run


def print_comparison(comparison: dict | None) -> bool:
    """Print the run's comparison (eval/compare.json); whether every drafter was measured, drafted and lossless."""
    import json
    from pathlib import Path

    if not comparison or not comparison.get("drafters"):
        print("  compare      no comparison was written")
        return False
    compared = json.loads(Path(comparison["path"]).read_text()) if comparison.get("path") else comparison
    good = not compared.get("missing")
    print(f"  compare      {'drafter':<8} {'config':<9} {'set':<10} {'accept len':>10} {'p50/p90':>9} {'speedup':>8} {'range':>11}  "
          f"{'params':>8} {'MB':>6} {'trained':>8}")
    for drafter in compared["drafters"]:
        for config in drafter["configs"]:
            for name, figures in config["sets"].items():
                a, speed = figures["accept_length"], figures["speedup"]
                print(f"               {drafter['label']:<8} {config['config']:<9} {name:<10} {(a['mean'] or 1.0):>10.2f} "
                      f"{(a['p50'] or 0):>4.1f}/{(a['p90'] or 0):<4.1f} {(speed['median'] or 0):>7.2f}x "
                      f"{(speed['min'] or 0):>5.2f}-{(speed['max'] or 0):.2f}x {drafter['parameters'] or 0:>8} "
                      f"{(drafter['bytes'] or 0) / 1e6:>6.2f} {drafter['train_seconds'] or 0:>7.0f}s")
                good = good and (a["mean"] or 0) > 1
        report = json.loads(Path(drafter["report"]).read_text())
        lossy = [f"{row['config']}" for row in report.get("sweep", []) for s in row["sets"].values()
                 if s.get("same_tokens_as_baseline") is not None and s["same_tokens_as_baseline"] < 1]
        if lossy:
            print(f"  LOSSY        {drafter['label']}: answers differ from the baseline's in {', '.join(lossy)}")
            good = False
    for batch_size, best in (compared.get("fastest") or {}).items():
        print(f"  fastest      batch size {batch_size}: {best['drafter']} {best['config']} ({best['mean_speedup']:.2f}x); "
              f"SGLang: {' '.join(best['sglang_flags'])}")
    winner = compared.get("winner")
    if winner:
        print(f"  winner       {winner['drafter']} ({winner['algorithm']}) {winner['config']} at batch size {winner['batch_size']}: "
              f"{winner['mean_speedup']:.2f}x")
    for missing in compared.get("missing", []):
        print(f"  MISSING      {missing['drafter']}: {missing['reason']}")
    return good


if __name__ == "__main__":
    sys.exit(main())
