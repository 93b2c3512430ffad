"""Benchmark: how long Airflow takes to parse the DAG file, and which heavy libraries parsing imports.

Airflow's own ``DagBag`` parses ``dags/eagleflow_dag.py`` in a fresh interpreter (as the
dag-processor does, with Airflow already imported); the figure is the file's parse duration
from ``DagBag.dagbag_stats``, median of three interpreters after one that warms the bytecode
cache (kept under ``.cache/``): the dag-processor re-parses the file every 30 s with its
imports' bytecode cached, while this machine's environment may forbid writing bytecode at all
(``PYTHONDONTWRITEBYTECODE``). Two thirds of a parse is Airflow copying the DAG's 44 Params into
each of its 35 tasks (``copy.deepcopy(dag.params)`` per operator, measured with cProfile). Parsing must import none of torch,
transformers, datasets, speculators, matplotlib (they belong in the tasks' child processes).

Run: ``.venv/bin/python benchmarks/bench_dag_parse.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_common import Row, median, print_table

REPO = Path(__file__).resolve().parent.parent
GOAL_SECONDS = 0.5
HEAVY = ("torch", "transformers", "datasets", "speculators", "matplotlib", "pandas", "safetensors")
FORBIDDEN = ("torch", "transformers", "datasets", "speculators", "matplotlib")
REPEATS = 3

_PARSE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
before = set(sys.modules)
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
(stat,) = bag.dagbag_stats
duration = stat.duration.total_seconds() if hasattr(stat.duration, "total_seconds") else float(stat.duration)
heavy = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules and m not in before)
print(json.dumps({"seconds": duration, "heavy": heavy, "dags": stat.dag_num}))
"""


def parse_once() -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(REPO / ".cache" / "bench-airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"), "PYTHONPATH": str(REPO),
           "PYTHONPYCACHEPREFIX": str(REPO / ".cache" / "bench-pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", _PARSE, str(REPO / "dags" / "eagleflow_dag.py"), json.dumps(HEAVY)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure() -> list[Row]:
    warm = parse_once()  # fills the bytecode cache; its imports still count below
    runs = [parse_once() for _ in range(REPEATS)]
    seconds = median([r["seconds"] for r in runs])
    heavy = sorted({m for r in [warm, *runs] for m in r["heavy"]})
    bad = [m for m in heavy if m in FORBIDDEN]
    shown = ", ".join(f"{r['seconds']:.3f}s" for r in runs)
    print(f"DAG parse: {shown} (warm-up {warm['seconds']:.3f}s); heavy modules imported: {heavy or 'none'}", flush=True)
    return [
        Row("DAG parse time (Airflow DagBag, bytecode cached, median of 3)", f"{seconds:.3f} s", f"< {GOAL_SECONDS} s", seconds < GOAL_SECONDS),
        Row("heavy modules the DAG file imports", ", ".join(heavy) or "none", "none of " + "/".join(FORBIDDEN), not bad),
    ]


def main() -> int:
    print_table(measure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
