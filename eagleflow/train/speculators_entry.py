"""In-child launcher of ``speculators`` training: CPU shims, metric capture, then speculators' own entry.

``python -m eagleflow.train.speculators_entry --metrics M [--summary S] [--noise-std X] -- <speculators train flags>``
(or the same module under ``torchrun``). It is what ``python -m eagleflow train`` starts as its
child; it can also run in-process through :func:`run`. With ``--flags-on-stdin`` (one process,
not torchrun) it imports speculators first and then reads its flags from stdin, so the step can
start it before its own checks and the imports overlap them.

First the installed speculators must be a release whose internals these patches were checked
against (:mod:`eagleflow.train.speculators_support`). Then, before speculators'
``cli.main(TrainConfig.resolve(argv))``:

* Without CUDA, the three device look-ups speculators makes are pointed at the CPU
  (:func:`apply_cpu_shims`); with CUDA nothing is changed.
* Metric capture: speculators' ``setup_metric_logger`` runs ``dictConfig``, which drops any
  handler attached to ``speculators.metrics`` before it. We wrap that function and attach
  :class:`~eagleflow.train.recorder.MetricsRecorder` *after* it, so records are written however
  the host configured logging. The metric logger then stops propagating: the recorder prints
  a readable line per step, so the root handlers need not print raw dict reprs.
* Plain log lines: when nothing configured the root logger yet, it gets a plain stdout handler
  instead of speculators' Rich handler, whose 80-column wrapping shreds lines in a task log.
* ``--noise-std`` (releases without speculators' own, 0.9.0 on): eagleflow's noise augmentation
  of the training split's aux hidden states (:mod:`eagleflow.train.noise`).
* A stop signal is never lost in a log call: speculators' SIGTERM/SIGINT handler raises
  ``TrainingInterruptedError`` wherever the trainer stands, and a signal landing inside a logging
  handler's ``emit`` would be swallowed by ``Handler.handleError`` (every stdlib handler and our
  recorder catch ``Exception`` there): the record lost and the trainer going on after it was told
  to stop. :func:`let_interrupts_through_logging` lets that one exception through.
* ``--online`` (``hidden_states_source=engine``): eagleflow's hidden-states backend is registered
  with hs-connectors before speculators reads the registry, and the feed's order and wait hooks
  are installed (:mod:`eagleflow.train.online.backend`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagleflow.engine import die_with_parent
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_json
from eagleflow.startup import collector_paused
from eagleflow.train.recorder import MetricsRecorder
from eagleflow.train.speculators_support import check_internals, installed_release

METRICS_LOGGER = "speculators.metrics"
DEFAULT_COLLECTIVE_TIMEOUT = 600.0


def apply_cpu_shims() -> None:
    """Point speculators' three device look-ups at the CPU (docs/design.md §5).

    * ``trainer.get_local_rank`` -> ``"cpu"``: the trainer moves the model and every batch to
      ``.to(local_rank)``, an int that means ``cuda:<n>``.
    * ``checkpointer.get_current_device`` -> ``"cpu"``: resume loads state dicts onto it, and
      it falls back to ``"cuda:0"`` when there is no accelerator.
    * ``torch.accelerator.synchronize`` -> no-op: the step timer calls it on every logged step
      and it raises when there is no accelerator.
    """
    import torch

    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"  # type: ignore[assignment]
    checkpointer.get_current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]


def distributed_setup_shim(on_cpu: bool, collective_timeout: float) -> Callable[[], None]:
    """Wrap speculators' ``maybe_setup_distributed`` so that it runs on CPU (gloo) and bounds every collective.

    speculators sets up the process group for the accelerator: ``torch.accelerator.set_device_index``
    (raises without one), the backend of ``torch.accelerator.current_accelerator()`` (None on CPU:
    "No accelerator found") and ``init_process_group(backend, device_id=local_rank)`` (an int
    device id is refused without an accelerator). During that one call, on CPU only, the device
    index is not set, the accelerator reads as the CPU (whose default backend is gloo) and no
    device id is passed; speculators' own code then fills its topology as usual. On every device
    the process group gets ``collective_timeout``: a rank whose peer vanished without closing its
    connections (a lost machine) fails after that long instead of torch's 30 minutes (gloo) or
    10 (NCCL). Returns the undo.
    """
    import datetime

    import torch
    import torch.distributed as dist

    import speculators.train.cli as cli

    setup = cli.maybe_setup_distributed

    def setup_with_shims(*args: Any, **kwargs: Any) -> Any:
        init = dist.init_process_group
        accelerator = (torch.accelerator.set_device_index, torch.accelerator.current_accelerator)

        def init_bounded(*init_args: Any, **init_kwargs: Any) -> Any:
            if on_cpu:
                init_kwargs.pop("device_id", None)
            init_kwargs["timeout"] = datetime.timedelta(seconds=collective_timeout)
            return init(*init_args, **init_kwargs)

        dist.init_process_group = init_bounded  # type: ignore[assignment]
        if on_cpu:
            torch.accelerator.set_device_index = lambda *_args, **_kwargs: None  # type: ignore[assignment]
            torch.accelerator.current_accelerator = lambda *_args, **_kwargs: torch.device("cpu")  # type: ignore[assignment]
        try:
            return setup(*args, **kwargs)
        finally:
            dist.init_process_group = init  # type: ignore[assignment]
            torch.accelerator.set_device_index, torch.accelerator.current_accelerator = accelerator  # type: ignore[assignment]

    cli.maybe_setup_distributed = setup_with_shims

    def restore() -> None:
        cli.maybe_setup_distributed = setup

    return restore


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _plain_root_logger(level: str = "INFO") -> None:
    """Our stand-in for speculators' ``setup_root_logger``: plain lines, rank 0 only."""
    root = logging.getLogger()
    if not root.handlers:
        from speculators.train.logger import IsRank0Filter

        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
        handler.addFilter(IsRank0Filter())
        root.addHandler(handler)
        root.setLevel(level)
    logging.getLogger("httpx").propagate = False  # as speculators does: one line per HTTP call is noise


def _count_parameters(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total_parameters": int(total), "trainable_parameters": int(trainable)}


def let_interrupts_through_logging() -> Callable[[], None]:
    """Make ``logging.Handler.handleError`` re-raise speculators' ``TrainingInterruptedError``.

    Returns a function that undoes it.
    """
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    handle_error = logging.Handler.handleError

    def handle_error_but_interrupts(self: logging.Handler, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, TrainingInterruptedError):
            raise exc
        handle_error(self, record)

    logging.Handler.handleError = handle_error_but_interrupts  # type: ignore[method-assign]

    def restore() -> None:
        logging.Handler.handleError = handle_error  # type: ignore[method-assign]

    return restore


def install(metrics_path: Path, summary_path: Path | None = None, online: bool = False) -> Callable[[], None]:
    """Patch speculators' CLI module so that metrics, parameter counts and epochs reach us.

    Returns a function that undoes the patches, so an in-process caller can train again.
    """
    import speculators.train.cli as cli
    from speculators.train.trainer import Trainer

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Made inside the wrapped setup, not here: dictConfig closes every handler that exists
    # when it runs, attached or not. Rank 0 only: speculators logs metrics on every rank.
    recorders: list[MetricsRecorder] = []
    originals = {
        "setup_metric_logger": cli.setup_metric_logger,
        "setup_root_logger": cli.setup_root_logger,
        "build_draft_model": cli.build_draft_model,
    }
    train_epoch = Trainer.train_epoch

    def setup_metric_logger_then_attach(*args: Any, **kwargs: Any) -> None:
        originals["setup_metric_logger"](*args, **kwargs)  # dictConfig: drops earlier handlers on the logger
        metric_logger = logging.getLogger(METRICS_LOGGER)
        if _rank() == 0:
            data_wait = None
            if online:
                from eagleflow.train.online.backend import current_feed

                data_wait = lambda: current_feed().data_wait_s if current_feed() else 0.0  # noqa: E731
            recorders.append(MetricsRecorder(metrics_path, world_size=world_size, data_wait=data_wait))
            metric_logger.addHandler(recorders[-1])
        metric_logger.propagate = False

    def build_draft_model_and_report(*args: Any, **kwargs: Any) -> Any:
        model = originals["build_draft_model"](*args, **kwargs)
        summary = _count_parameters(model)
        summary.update(
            draft_vocab_size=int(model.draft_vocab_size),
            verifier_vocab_size=int(model.verifier_vocab_size),
            hidden_size=int(model.hidden_size),
            draft_layers=int(model.config.transformer_layer_config.num_hidden_layers),
            target_layer_ids=list(model.target_layer_ids),
        )
        if _rank() == 0:
            logging.getLogger("eagleflow").info("drafter: %s", json.dumps(summary))
            if summary_path is not None:
                atomic_write_json(summary_path, summary)
        return model

    def train_epoch_with_progress(self: Any, epoch: int, *args: Any, **kwargs: Any) -> Any:
        for recorder in recorders:
            recorder.begin_epoch(epoch, self.config.num_epochs, len(self.train_loader), self.global_step)
        return train_epoch(self, epoch, *args, **kwargs)

    cli.setup_metric_logger = setup_metric_logger_then_attach
    cli.setup_root_logger = _plain_root_logger
    cli.build_draft_model = build_draft_model_and_report
    Trainer.train_epoch = train_epoch_with_progress  # type: ignore[method-assign]

    def restore() -> None:
        for name, value in originals.items():
            setattr(cli, name, value)
        Trainer.train_epoch = train_epoch  # type: ignore[method-assign]
        for recorder in recorders:
            logging.getLogger(METRICS_LOGGER).removeHandler(recorder)
            recorder.close()

    return restore


def run(
    argv: Sequence[str],
    metrics_path: Path,
    summary_path: Path | None = None,
    noise_std: float = 0.0,
    online: bool = False,
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
) -> None:
    """Train with speculators' own entry point on ``argv`` (its flags), capturing metrics.

    :param noise_std: eagleflow's noise on the training split's aux states, for releases
        without ``--noise-std`` (give that release's own flag in ``argv`` instead).
    :param online: the samples come from the engines (``argv`` names eagleflow's backend).
    :param collective_timeout: under torchrun, seconds a collective may wait for a peer.
    :raises UnsupportedSpeculators: another speculators release than those supported.
    """
    import torch

    release = installed_release()
    check_internals(release, online=online)
    if noise_std and release.noise_std_flag:
        raise UserError(f"speculators {release.version} adds the noise itself: pass --noise-std among its flags")
    if not torch.cuda.is_available():
        apply_cpu_shims()
    undo = [let_interrupts_through_logging()]
    if "LOCAL_RANK" in os.environ:  # under torchrun
        undo.append(distributed_setup_shim(not torch.cuda.is_available(), collective_timeout))
    from eagleflow.train.slots_backend import register_slots_backend

    register_slots_backend()  # before speculators' config module reads the registry
    if online:
        from eagleflow.train.online.backend import install_hooks, register_backend

        register_backend()
    undo.append(install(Path(metrics_path), summary_path, online=online))
    if online:
        undo.append(install_hooks())
    if noise_std:
        from eagleflow.train.noise import install_noise

        undo.append(install_noise(noise_std))
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    try:
        speculators_main(TrainConfig.resolve(list(argv)))
    finally:
        for restore in reversed(undo):
            restore()


def main(argv: Sequence[str] | None = None) -> int:
    parent = os.getppid()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: python -m eagleflow.train.speculators_entry --metrics PATH [--summary PATH] [--noise-std X] "
            "-- <speculators flags>",
            file=sys.stderr,
        )
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m eagleflow.train.speculators_entry")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics.jsonl to append records to")
    parser.add_argument("--summary", type=Path, help="JSON file for the drafter's parameter counts")
    parser.add_argument("--noise-std", type=float, default=0.0, help="eagleflow's noise on the training split's aux states")
    parser.add_argument("--online", action="store_true", help="samples from the engines (eagleflow's hidden-states backend)")
    parser.add_argument(
        "--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT,
        help="under torchrun: seconds a collective may wait for a peer before the rank fails",
    )
    parser.add_argument(
        "--flags-on-stdin", action="store_true",
        help="import speculators first, then read its flags from stdin (one JSON list; end of input: exit, nothing to train)",
    )
    ours = parser.parse_args(argv[:split])
    # Under torchrun each worker runs in a session of its own: if torchrun dies (even by SIGKILL),
    # the kernel kills the worker too, so no trainer is left holding the GPUs.
    die_with_parent(signal.SIGKILL, parent)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    flags = argv[split + 1 :]
    if ours.online:
        from eagleflow.train.online.backend import register_backend

        register_backend()  # before speculators' config module (imported next) reads hs-connectors' registry
    # The seconds of imports (with --flags-on-stdin, while the step still checks its inputs), without
    # the cyclic collector walking them as they grow (eagleflow.startup): a rank's start-up, 1.5 CPU-s less.
    with collector_paused():
        import speculators.train.cli  # noqa: F401
        import torch  # noqa: F401
    if ours.flags_on_stdin:
        line = sys.stdin.readline()
        if not line.strip():
            return 0  # the step stopped before training (its checks failed, or every epoch is done)
        flags = [*json.loads(line), *flags]
    try:
        run(flags, ours.metrics, ours.summary, ours.noise_std, online=ours.online, collective_timeout=ours.collective_timeout)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        stopped = _feed_failure() if ours.online else None
        if stopped is None:
            raise  # a fault of the trainer's own: its traceback is the report
        # The feed stopped (it said why, naming the engine or row): the trainer's traceback through the
        # data loader, where the missing sample surfaced, would only bury that.
        print(f"error: online feed stopped: {stopped}; a retry resumes from the last checkpoint", file=sys.stderr, flush=True)
        return 1
    return 0


def _feed_failure() -> str | None:
    """Why this process's online feed stopped (None: it did not, or never started)."""
    from eagleflow.train.online.backend import current_feed

    feed = current_feed()
    return feed.failure if feed is not None else None


if __name__ == "__main__":
    sys.exit(main())
