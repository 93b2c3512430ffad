"""``python -m eagleflow <step> …``: one sub-command per pipeline step.

Each step module offers ``add_arguments(parser)`` and ``main(args) -> int``; the module is
imported only when its step runs, so ``--help`` and unrelated steps stay fast. Errors a user
can fix (bad input, bad flags) are raised as :class:`eagleflow.errors.UserError` and turned
into exit code 2 with the message, nothing else.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from eagleflow.errors import UserError
from eagleflow.startup import collector_paused

# Set by the operator that starts a step: the step then gets SIGTERM when the Airflow task
# process dies, even by SIGKILL (it runs in its own session, out of the task's process group).
PARENT_PID_ENV = "EAGLEFLOW_PARENT_PID"

# step name -> (module, one-line help)
STEPS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("eagleflow.demo.tiny_model", "write a tiny DeepSeek-V3-architecture verifier"),
    "make-dataset": ("eagleflow.demo.synthetic_data", "write synthetic chat conversations as JSONL"),
    "serve-reference": ("eagleflow.engine.reference.server", "serve the CPU reference engine"),
    "launch": ("eagleflow.run.launch", "start one engine of a run (or reuse it when it is up) and print its address"),
    "stop": ("eagleflow.run.launch", "stop one engine of a run and its whole process group"),
    "sglang-command": ("eagleflow.engine.sglang_command", "print the SGLang server command with the capture hook (starts nothing)"),
    "regenerate": ("eagleflow.data.regenerate", "rewrite the assistant turns with the verifier through a running engine"),
    "prepare-dataset": ("eagleflow.data.prepare", "tokenize conversations into the training dataset"),
    "dataset-stats": ("eagleflow.data.stats", "rows, tokens and hidden-state bytes of a dataset"),
    "check-disk": ("eagleflow.data.disk_check", "fail early when the disk cannot hold the hidden states"),
    "verify-capture": ("eagleflow.extract.verify_capture", "check the engine's capture on a few rows before extraction"),
    "extract": ("eagleflow.extract.shard", "extract hidden states for a range of rows"),
    "build-vocab": ("eagleflow.data.vocab", "build the draft vocabulary (d2t/t2d)"),
    "train": ("eagleflow.train.step", "train the EAGLE-3 drafter with speculators"),
    "plot": ("eagleflow.metrics.plot", "draw loss and accuracy charts from training metrics"),
    "export": ("eagleflow.export.step", "write the drafter folders SGLang and vLLM serve from a checkpoint"),
    "evaluate": ("eagleflow.evaluate.step", "serve the drafter, measure accept length and speedup on held-out prompts"),
    "compare": ("eagleflow.report.compare", "every drafter of the run side by side: accept length, speedup, size, training time"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each step's flags are added only when that step is chosen."""
    parser = argparse.ArgumentParser(prog="python -m eagleflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True, metavar="STEP")
    for name, (_, summary) in STEPS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one step and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Line buffering even when stdout is a pipe: the operator streams our output into the
    # task log, and a block-buffered child left the seed's log empty for hours.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if not argv or argv[0] not in STEPS:
        build_parser().parse_args(argv)  # prints usage / the unknown-step error and exits 2
        return 2
    name, rest = argv[0], argv[1:]
    # Taken out of the environment: it names *our* parent, and the engines, trainers and steps we
    # start (evaluate's engines) would otherwise read it, see a different parent and stop at once.
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if parent.isdigit():
        import signal

        from eagleflow.engine.process import die_with_parent

        die_with_parent(signal.SIGTERM, int(parent))
    with collector_paused():  # several steps import torch and datasets at the top (eagleflow.startup)
        module = importlib.import_module(STEPS[name][0])
    parser = argparse.ArgumentParser(prog=f"python -m eagleflow {name}", description=STEPS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    args.step = name
    try:
        return int(module.main(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
