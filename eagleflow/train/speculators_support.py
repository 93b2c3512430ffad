"""Which speculators releases the training step drives, and the internals it relies on in each.

eagleflow does more than call ``speculators train``: inside the child it points three device
look-ups at the CPU, attaches its metrics recorder after speculators' own logging setup, counts
the drafter's parameters and, from 0.9.0, adds the noise augmentation speculators dropped
(:mod:`eagleflow.train.noise`). Each of those touches a name inside speculators that a release
may move, so the step runs only releases whose names were read and tested
(:data:`RELEASES`) and refuses any other by its version, as the SGLang hook does.

- 0.8.1: ``--noise-std`` is speculators' own; no fp8 backend (hs-connectors 0.8.1).
- 0.9.0 (the pin): no ``--noise-std`` (an argparse error); ``--hidden-states-backend fp8`` reads
  fp8 sample files; hs-connectors' ``HiddenStatesBackend`` registry, through which online training
  (``hidden_states_source=engine``) hands samples over (:mod:`eagleflow.train.online.backend`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

from eagleflow.errors import UserError


@dataclass(frozen=True)
class SpeculatorsRelease:
    """What one speculators release offers the training step."""

    version: str
    noise_std_flag: bool  # speculators adds the training noise itself (--noise-std)
    fp8_backend: bool  # --hidden-states-backend fp8 reads fp8 sample files
    transfer_backends: bool  # hs-connectors' HiddenStatesBackend registry: the online feed's seam


RELEASES = {
    "0.8.1": SpeculatorsRelease("0.8.1", noise_std_flag=True, fp8_backend=False, transfer_backends=False),
    "0.9.0": SpeculatorsRelease("0.9.0", noise_std_flag=False, fp8_backend=True, transfer_backends=True),
}

# "module:attribute.path" of every speculators name eagleflow patches, wraps or calls.
INTERNALS = (
    "speculators.train.trainer:get_local_rank",  # CPU shim
    "speculators.train.checkpointer:get_current_device",  # CPU shim
    "speculators.train.trainer:Trainer.train_epoch",  # epoch progress for the recorder
    "speculators.train.cli:setup_metric_logger",  # the recorder is attached after it
    "speculators.train.cli:setup_root_logger",  # replaced by plain log lines
    "speculators.train.cli:build_draft_model",  # parameter counts
    "speculators.train.cli:maybe_setup_distributed",  # under torchrun: gloo on CPU, bounded collectives
    "speculators.train.cli:main",
    "speculators.train.config:TrainConfig.resolve",
    "speculators.train.logger:IsRank0Filter",
    "speculators.train.graceful_shutdown:TrainingInterruptedError",  # must pass through logging handlers
)
NOISE_INTERNALS = (
    "speculators.train.dataloader:ArrowDataset",  # the train split gets eagleflow's noise
    "speculators.train.data:SampleUnavailable",
)
ONLINE_INTERNALS = (
    "hs_connectors.transfer:HiddenStatesBackend.register",  # the online feed's backend
    "hs_connectors.transfer:HiddenStatesTransfer.get_cached",  # how a sample is handed over
    "speculators.train.data:ArrowDataset._get_raw_data",  # asks get_cached first
    "speculators.train.dataloader:_setup_dataloader",  # builds each split's sampler: the order goes to the feed
    "speculators.train.dataloader:MultipackDistributedBatchSamplerV2._generate_batches",
    "speculators.train.trainer:Trainer.train_epoch",  # the trainer's wait for data
)


class UnsupportedSpeculators(UserError):
    """The installed speculators is not a release the training step was built against."""

    def __init__(self, version: str, detail: str = "") -> None:
        self.version = version
        supported = ", ".join(RELEASES)
        super().__init__(
            f"eagleflow's training step supports speculators {supported}; found speculators {version!r}"
            + (f", which {detail}" if detail else "")
            + f". Install a supported release (pip install --no-deps speculators=={list(RELEASES)[-1]})."
        )


def installed_release() -> SpeculatorsRelease:
    """The installed speculators release; :class:`UnsupportedSpeculators` for any other version."""
    try:
        version = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    release = RELEASES.get(version)
    if release is None:
        raise UnsupportedSpeculators(version)
    return release


def check_online(release: SpeculatorsRelease) -> None:
    """Refuse, by name, a release that cannot train from the engines (``hidden_states_source=engine``)."""
    if not release.transfer_backends:
        raise UserError(
            f"hidden_states_source engine needs speculators 0.9.0: speculators {release.version} has no hidden-states "
            "transfer backends (hs-connectors' HiddenStatesBackend), the seam the online feed plugs into; "
            "use hidden_states_source disk, or install speculators 0.9.0"
        )


def check_internals(release: SpeculatorsRelease, online: bool = False) -> None:
    """Import every name of :data:`INTERNALS` (and, without ``--noise-std``, the noise ones; online, the
    online ones); refuse what is missing."""
    names = INTERNALS if release.noise_std_flag else INTERNALS + NOISE_INTERNALS
    if online:
        check_online(release)
        names += ONLINE_INTERNALS
    missing = [name for name in names if not _resolves(name)]
    if missing:
        raise UnsupportedSpeculators(release.version, f"lacks {', '.join(missing)}")


def _resolves(name: str) -> bool:
    module_name, _, path = name.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError:
        return False
    for part in path.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True
