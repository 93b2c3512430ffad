"""``make bench``: every benchmark of the pipeline, one table — each measured figure, its goal, pass/fail.

Goals are ratios measured in one run on the same machine (the pipeline against a raw write of the
same bytes to the same disk, eagleflow's training against speculators alone), or absolute limits
where the figure is about us alone (DAG parse time, bytes per token, parse+plot of the metrics).
On a machine shared with other work the absolute MB/s swing; the ratios are measured in pairs,
back to back, and repeated. Figures that need hardware this machine lacks are listed as pending.

Run: ``.venv/bin/python benchmarks/bench.py [--only extraction,writer,dag,training,metrics,online]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bench_dag_parse
import bench_dump_writer
import bench_extraction
import bench_metrics_plot
import bench_online
import bench_training
from bench_common import Row, measure_in_scratch, run_sections


def metrics_rows() -> list[Row]:
    worst, lines = bench_metrics_plot.measure(forms=("jsonl",))
    for line in lines:
        print(line, flush=True)
    goal = bench_metrics_plot.GOAL_SECONDS
    return [Row(f"parse + plot {bench_metrics_plot.SEED_RECORDS:,} metric records (metrics.jsonl)", f"{worst:.2f} s", f"<= {goal:.0f} s",
                worst <= goal, "the Rich and repr log forms: python benchmarks/bench_metrics_plot.py")]


def fp8_rows(work: Path) -> list[Row]:
    """fp8 vs bf16 bytes per token: the same Kimi-shaped states written in each storage dtype."""
    import torch

    from sglang_patch.sample_file import write_sample_file

    tokens, slots, hidden = 1024, bench_extraction.SLOTS, bench_extraction.HIDDEN
    states = torch.randn(tokens, slots, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.arange(tokens)
    size = {dtype: write_sample_file(work / f"{dtype}.safetensors", states, ids, dtype).stat().st_size for dtype in ("bf16", "fp8")}
    ratio = size["fp8"] / size["bf16"]
    return [Row("bytes per token on disk, fp8 vs bf16 (1,024 tokens x 4 x 7168)",
                f"{size['fp8'] / tokens:,.1f} vs {size['bf16'] / tokens:,.1f} B = {ratio:.3f}x", f"<= {FP8_GOAL}x", ratio <= FP8_GOAL,
                "what the drafter learns from each: python benchmarks/bench_hidden_states_dtype.py")]


FP8_GOAL = 0.55


SUITES = {
    "extraction": lambda: measure_in_scratch(bench_extraction.measure, "bench-extraction"),
    "writer": lambda: measure_in_scratch(bench_dump_writer.measure, "bench-dump-writer"),
    "dag": bench_dag_parse.measure,
    "training": lambda: measure_in_scratch(bench_training.measure, "bench-training"),
    "metrics": metrics_rows,
    "online": lambda: measure_in_scratch(bench_online.measure, "bench-online"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SUITES), help=f"comma list of {', '.join(SUITES)}")
    args = parser.parse_args()
    # The extraction section also writes the same states as fp8 and as bf16 (bytes per token).
    sections = [
        (name, (lambda measure=SUITES[name]: measure() + measure_in_scratch(fp8_rows, "bench-fp8")) if name == "extraction" else SUITES[name])
        for name in args.only.split(",")
    ]
    return run_sections("eagleflow benchmarks", sections)

if __name__ == "__main__":
    sys.exit(main())
