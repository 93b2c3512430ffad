"""speculators as the training step's child process: device, flags, command, signals, log.

The child is ``python -m eagleflow.train.speculators_entry …`` on CPU or one GPU, and
``torchrun --nproc-per-node G -m eagleflow.train.speculators_entry …`` on several. A single
process is started before the step's checks (:class:`TrainerChild`) and imports speculators
while they run, then gets its flags on stdin: the step costs next to nothing on top. Its output
goes line by line to stdout and ``train.log``; SIGTERM/SIGINT are forwarded to its process
group (speculators then saves an ``interrupted`` checkpoint and stops).

The whole tree dies with the step: the child gets SIGKILL from the kernel when the step dies
(``PR_SET_PDEATHSIG``; by then nobody would record its result, and a trainer left behind would
hold the GPUs and the folder), torchrun's workers the same when torchrun dies (they run in
sessions of their own, out of reach of any process-group signal), data-loader workers notice
their parent's death themselves. The child inherits the folder's lock
(:class:`~eagleflow.train.lock.TrainFolderLock`), so no second trainer starts while any of it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagleflow.engine import die_with_parent
from eagleflow.errors import UserError
from eagleflow.drafters import family
from eagleflow.layout import TrainLayout
from eagleflow.train.config import TrainConfig
from eagleflow.train.lock import TrainFolderLock
from eagleflow.train.speculators_support import SpeculatorsRelease
from sglang_patch.hook_spec import parse_version
from sglang_patch.sample_format import HiddenStatesDtype


class TrainingFailed(Exception):
    """The speculators child failed or stopped early; ``returncode`` is its exit status."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


@dataclass(frozen=True)
class Device:
    kind: Literal["cpu", "cuda"]
    gpus: int


# Device nodes a GPU driver creates (NVIDIA's control node, ROCm's, WSL's): with none of them, torch sees
# no GPU either, and saying so needs no import of torch (seconds of every training step's start on CPU).
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> int:
    """How many GPUs torch sees; 0, without importing torch, on a machine with no GPU driver."""
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(cfg: TrainConfig) -> Device:
    """``--device auto`` -> cuda when torch sees a GPU; ``--gpus`` defaults to all it sees."""
    if cfg.device == "cpu":  # known without importing torch (TrainConfig refuses --gpus with it)
        return Device("cpu", 0)
    available = visible_gpus()
    kind = cfg.device if cfg.device != "auto" else ("cuda" if available else "cpu")
    if kind == "cpu":
        if cfg.gpus is not None:
            raise UserError(f"--gpus {cfg.gpus}: torch sees no GPU (use --device cpu without --gpus to train on CPU)")
        return Device("cpu", 0)
    if available == 0:
        raise UserError("--device cuda: torch sees no GPU")
    gpus = cfg.gpus or available
    if gpus > available:
        raise UserError(f"--gpus {gpus}: torch sees only {available} GPU(s)")
    return Device("cuda", gpus)


class TrainLog:
    """Appends to ``train.log`` and echoes to stdout: what the operator streams into the task log."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 - closed in close()
        self.start = os.fstat(self.handle.fileno()).st_size  # where this attempt's lines begin

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.handle.write(text)
        self.handle.flush()

    def say(self, message: str) -> None:
        self.write(f"[eagleflow] {message}\n")

    def close(self) -> None:
        self.handle.close()


def speculators_flags(
    cfg: TrainConfig,
    verifier: Path,
    device: Device,
    paths: TrainLayout,
    release: SpeculatorsRelease,
    stored_dtype: HiddenStatesDtype = "bf16",
    mask_token_id: int | None = None,
) -> list[str]:
    """speculators ``train`` flags for this run (an argv list; nothing goes through a shell).

    :param release: the installed speculators; 0.8.1 takes ``--noise-std`` itself, later
        releases get the noise from the child entry instead (:func:`child_command`).
    :param stored_dtype: how the dataset's hidden states are stored; fp8 needs the fp8 backend.
    :param mask_token_id: block drafters: the mask token SGLang will resolve (:func:`resolve_mask_token`).
    """
    chosen = family(cfg.draft_algorithm)
    if parse_version(release.version) < parse_version(chosen.minimum_speculators):
        raise UserError(
            f"draft_algorithm {chosen.name} needs speculators >= {chosen.minimum_speculators} (it has no "
            f"--speculator-type {chosen.speculator_type}); found speculators {release.version}"
        )
    if stored_dtype == "fp8" and not release.fp8_backend:
        raise UserError(
            f"the dataset's hidden states are stored as fp8, which speculators {release.version} cannot read "
            "(its hs-connectors has no fp8 backend); install speculators 0.9.0 or extract with hidden_states_dtype bf16"
        )
    on_gpu = device.kind == "cuda"
    loss = cfg.loss_implementation if cfg.loss_implementation != "auto" else ("fused" if on_gpu else "eager")
    attn = cfg.draft_attn_impl if cfg.draft_attn_impl != "auto" else ("simple_flex_attention" if on_gpu else "sdpa")
    flags = [
        "--verifier-name-or-path", str(verifier),  # absolute: the checkpoint records it as typed
        "--data-path", str(cfg.dataset.absolute()),
        "--save-path", str(paths.checkpoints.absolute()),
        "--log-dir", str(paths.speculators_logs.absolute()),
        "--target-layer-ids", *[str(i) for i in cfg.aux_layer_ids],
        "--epochs", str(cfg.epochs),
        "--lr", str(cfg.lr),
        "--optimizer", cfg.optimizer,
        "--total-seq-len", str(cfg.total_seq_len),
        "--scheduler-type", cfg.scheduler_type,
        "--scheduler-warmup-ratio", str(cfg.scheduler_warmup_ratio),
        "--num-workers", str(cfg.num_workers),
        "--train-data-ratio", str(cfg.train_data_ratio),
        "--log-freq", str(cfg.log_freq),
        "--seed", str(cfg.seed),
        # speculators turns autocast off on CPU, and its DFlash fc does not cast the states: float32 there.
        "--hidden-states-dtype", "float32" if chosen.block and not on_gpu else cfg.compute_dtype,
        "--loss-implementation", loss,
        "--draft-attn-impl", attn,
        # Every epoch: resume needs them. (--save-best would keep only the best one; without it
        # speculators still points checkpoint_best at the lowest validation loss.)
        "--checkpoint-freq", "1",
        # Extraction made every file, or (online) the feed hands each over: a gap is a bug, not a vLLM call.
        "--on-missing", "raise",
        # What differs by family: its speculator type and the settings it is served with.
        *family(cfg.draft_algorithm).owner("train")(cfg, mask_token_id),
    ]
    if release.noise_std_flag:
        flags += ["--noise-std", str(cfg.noise_std)]
    if cfg.sample_slots is not None and cfg.hidden_states_source == "disk":
        from eagleflow.train.slots_backend import slots_flags

        flags += slots_flags(cfg.sample_slots)  # one capture, several drafters: this one's slots (fp8 dequantised too)
    elif stored_dtype == "fp8" and cfg.hidden_states_source == "disk":
        flags += ["--hidden-states-backend", "fp8"]  # dequantises to bf16 as it loads each sample (online: the feed's backend does)
    if cfg.draft_config is not None:
        flags += ["--draft-config", str(cfg.draft_config.absolute())]
    else:
        flags += ["--num-layers", str(cfg.num_layers)]
    if cfg.trust_remote_code:
        flags.append("--trust-remote-code")
    return flags


def online_flags(settings_file: Path) -> list[str]:
    """speculators flags for online training: eagleflow's hidden-states backend, fed by ``settings_file``."""
    from eagleflow.train.online.settings import BACKEND_NAME, SETTINGS_FLAG

    return ["--hidden-states-backend", BACKEND_NAME, SETTINGS_FLAG, str(settings_file.absolute())]


def child_command(
    device: Device,
    paths: TrainLayout,
    flags: list[str] | None,
    noise_std: float = 0.0,
    online: bool = False,
    collective_timeout: float | None = None,
) -> list[str]:
    """``python -m eagleflow.train.speculators_entry …``, under torchrun for more than one GPU.

    :param flags: speculators' flags; None: the child reads them from its stdin once it has
        imported speculators (:class:`TrainerChild`; a single process only).
    :param noise_std: eagleflow's own noise augmentation, for releases without ``--noise-std``.
    :param online: the samples come from the engines (:func:`online_flags` among the flags).
    :param collective_timeout: under torchrun, how long a collective waits for a silent peer.
    """
    entry = entry_argv(paths, flags, noise_std, online, collective_timeout)
    if device.kind == "cuda" and device.gpus > 1:
        if flags is None:
            raise ValueError("torchrun's workers cannot read their flags from the step's stdin")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={device.gpus}"]
        return launcher + entry
    return [sys.executable, "-u"] + entry


def entry_argv(
    paths: TrainLayout, flags: list[str] | None, noise_std: float, online: bool, collective_timeout: float | None
) -> list[str]:
    """``-m eagleflow.train.speculators_entry …`` (its flags, then speculators'): what a launcher runs."""
    entry = ["-m", "eagleflow.train.speculators_entry", "--metrics", str(paths.metrics.absolute()),
             "--summary", str(paths.drafter.absolute()), "--noise-std", str(noise_std)]
    if online:
        entry.append("--online")
    if collective_timeout is not None:
        entry += ["--collective-timeout", str(collective_timeout)]
    return entry + (["--flags-on-stdin", "--"] if flags is None else ["--", *flags])


def ranks_per_node(device: Device) -> int:
    """torchrun's ``--nproc-per-node``: one rank per GPU; on CPU one rank per node."""
    return device.gpus if device.kind == "cuda" else 1


def child_env(device: Device) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device.kind == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --device cpu on a GPU machine: speculators must not see one
    return env


def run_child(
    command: list[str], env: dict[str, str], log: TrainLog, lock: TrainFolderLock | None
) -> tuple[int, int | None]:
    """Run the child, stream its output, forward SIGTERM/SIGINT; return (exit code, signal forwarded)."""
    return TrainerChild(command, env, log, lock).run(None)


class TrainerChild:
    """The speculators child, started with :func:`child_command` (``flags`` None: it waits for them).

    Started before the step's own checks, the child imports torch and speculators (seconds)
    while the step checks the dataset and prepares the verifier head; :meth:`run` then hands it
    its flags. :meth:`cancel` (the checks failed, nothing to train) closes its stdin: it exits
    without training. It holds the folder's lock (a node other than node-0 has none), and dies
    with the step, from its start.
    """

    def __init__(self, command: list[str], env: dict[str, str], log: TrainLog, lock: TrainFolderLock | None) -> None:
        step_pid = os.getpid()
        self.log, self.command = log, command
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if "--flags-on-stdin" in command else subprocess.DEVNULL,
            env=env,
            process_group=0,  # its own group, so a forwarded signal reaches its data-loader workers too
            pass_fds=(lock.fd,) if lock else (),  # the lock stays held while the child runs, even if this process is killed
            preexec_fn=lambda: die_with_parent(signal.SIGKILL, step_pid),
        )
        if lock:
            lock.record_trainer(self.process.pid)

    def run(self, flags: list[str] | None) -> tuple[int, int | None]:
        """Hand over ``flags`` (when it waits for them), stream its output, forward SIGTERM/SIGINT;
        return (exit code, signal forwarded)."""
        process = self.process
        # The command it amounts to: what a user would run by hand.
        command = [arg for arg in self.command if arg != "--flags-on-stdin"] + list(flags or [])
        self.log.say("command: " + " ".join(command))
        if process.stdin is not None:
            try:
                process.stdin.write((json.dumps(flags or []) + "\n").encode())
                process.stdin.close()
            except BrokenPipeError:
                pass  # it died while starting: its output and status say why
        forwarded: list[int] = []

        def forward(signum: int, _frame: Any) -> None:
            forwarded.append(signum)
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                pass

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            assert process.stdout is not None
            for raw in iter(process.stdout.readline, b""):
                self.log.write(raw.decode("utf-8", errors="replace"))
            returncode = process.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if process.poll() is None:  # we are unwinding on an error: do not leave training behind
                os.killpg(process.pid, signal.SIGTERM)
                process.wait()
        return returncode, (forwarded[0] if forwarded else None)

    def cancel(self) -> None:
        """Stop a child that has not been given its flags: it exits without training (SIGKILL after 30s).

        Still importing, it is told to stop (SIGTERM to its group) rather than left to finish seconds of
        imports only to find its stdin closed: the refusal is reported at once, and costs no CPU.
        """
        process = self.process
        if process.poll() is not None:
            return
        if process.stdin is not None and not process.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                process.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
