"""The seam between speculators and the online feed: an hs-connectors backend, and two small hooks.

speculators 0.9.0 reads every sample through an hs-connectors ``HiddenStatesTransfer``, chosen by
``--hidden-states-backend`` from ``HiddenStatesBackend.registry`` and built by the backend's
``from_train_args``; its ``ArrowDataset`` first asks ``transfer.get_cached(file_idx)``. That is
where eagleflow plugs in (:class:`EngineTransfer`, registered as :data:`BACKEND_NAME`): the sample
for a file index is the one the feed fetched ahead of the trainer, loaded, handed over and
deleted. (speculators' other online path, ``on_missing="generate"``, is an OpenAI completions
call that expects vLLM's ``kv_transfer_params`` in the answer; SGLang answers neither, and that
path asks for one sample at a time from inside the loader, with no way to get ahead of it.)

Two hooks give the feed what the transfer interface does not carry:

- the order: speculators' ``_setup_dataloader`` builds a ``MultipackDistributedBatchSamplerV2``
  per split; built through :class:`PlannedSampler`, each pass over a split first tells the feed
  which file indices it will read, in order (the batches are generated up front by speculators
  itself, so this costs nothing);
- the trainer's wait: during ``Trainer.train_epoch`` the train loader is read through
  :class:`TimedLoader`, which adds the time each batch took to arrive to the feed's total; the
  metrics recorder prints it per logged step.

Each name used is in :data:`~eagleflow.train.speculators_support.ONLINE_INTERNALS`, checked
before training like every other patched name.
"""

from __future__ import annotations

import argparse
import atexit
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer
from eagleflow.layout import FeedLayout
from eagleflow.train.online.feed import SampleFeed
from eagleflow.train.online.share import FollowerFeed, follower_wait_failure, join_lead
from eagleflow.train.slots_backend import select_slots
from eagleflow.train.online.settings import BACKEND_NAME, SETTINGS_FLAG, FeedSettings
from sglang_patch.sample_file import HIDDEN_STATES_KEY, SCALES_KEY

POLL_MAX_S = 0.02
WAIT_NOTE_EVERY_S = 30.0

_feed: SampleFeed | FollowerFeed | None = None  # the trainer process's feed (rank-local), started by the backend


class EngineTransfer(HiddenStatesTransfer):
    """Hands speculators the sample of a file index: from the cache, or the one the feed fetched for it.

    Picklable (settings only), so spawned data-loader workers get it too; they wait for the files
    the feed in the main process publishes.
    """

    def __init__(self, settings: FeedSettings) -> None:
        self.settings = settings

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        layout = self.settings.layout
        lead = FeedLayout(self.settings.lead) if self.settings.lead is not None else None  # a follower: the lead's cache
        cached, ready = (lead or layout).sample((lead or layout).cache, file_idx), layout.sample(layout.ready, file_idx)
        began = time.monotonic()
        next_note = began + WAIT_NOTE_EVERY_S
        delay = 0.001
        while True:
            if cached.exists():
                return self._load(cached)
            if ready.exists():
                sample = self._load(ready)
                ready.unlink(missing_ok=True)  # the feed sees it gone and frees its bytes
                return sample
            if layout.failure.exists():
                raise RuntimeError(f"online feed stopped: {_failure_text(layout.failure)}; rerun the step to resume")
            if lead is not None and (why := follower_wait_failure(layout, lead)) is not None and not ready.exists():
                raise RuntimeError(f"row {file_idx}: {why}; rerun the step to resume (it fetches alone then)")
            waited = time.monotonic() - began
            if waited > self.settings.stall_seconds:
                raise RuntimeError(
                    f"row {file_idx}: no hidden states from the engines within {waited:.0f}s (see the feed's lines above)"
                )
            if time.monotonic() >= next_note:
                next_note += WAIT_NOTE_EVERY_S
                print(f"[eagleflow] waiting {waited:.0f}s for row {file_idx}'s hidden states from the engines", flush=True)
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        sample = load_file(str(path))
        if SCALES_KEY in sample:  # fp8 storage: what hs-connectors' FP8Transfer hands over
            from hs_connectors.fp8_utils import dequantize_fp8_tensor

            sample[HIDDEN_STATES_KEY] = dequantize_fp8_tensor(sample[HIDDEN_STATES_KEY], sample.pop(SCALES_KEY))
        return select_slots(sample, self.settings.slots)  # type: ignore[return-value]  # a sample in, a sample out

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise RuntimeError(
            "eagleflow's engine backend hands samples over by file index (get_cached); run speculators with --on-missing raise"
        )

    def delete(self, handle: str) -> None:
        Path(handle).unlink(missing_ok=True)


def _failure_text(path: Path) -> str:
    import json

    try:
        return str(json.loads(path.read_text()).get("error", "unknown"))
    except (OSError, ValueError):
        return "unknown"


def _rank_settings(settings: FeedSettings) -> FeedSettings:
    """With several data-parallel ranks, each has its own feed: its own folder and a share of the budgets."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return settings
    rank = int(os.environ.get("RANK", "0"))
    return settings.model_copy(
        update={
            "folder": settings.folder / f"rank-{rank}",
            "window_bytes": max(1, settings.window_bytes // world),
            "cache_bytes": settings.cache_bytes // world,
        }
    )


def start_feed(settings: FeedSettings, say: Callable[[str], None]) -> SampleFeed:
    """Start this process's feed (once) over the dataset's rows; it stops when the process exits."""
    global _feed
    if _feed is None:
        from eagleflow.data import dataset_table

        table = dataset_table(settings.dataset, ["seq_len", "input_ids"])
        lengths = [int(n) for n in table["seq_len"].to_pylist()]

        def rows_of(row: int) -> list[int]:
            return table["input_ids"][row].as_py()

        _feed = SampleFeed(settings, rows_of, lengths, say).start()
        atexit.register(_feed.stop)
    return _feed


def start_follower(settings: FeedSettings, say: Callable[[str], None]) -> FollowerFeed:
    """Start this process's follower feed (once): it takes the lead's samples; it stops when the process exits."""
    global _feed
    if _feed is None:
        assert settings.lead is not None
        _feed = FollowerFeed(settings.layout, FeedLayout(settings.lead), say).start()
        atexit.register(_feed.stop)
    return _feed  # type: ignore[return-value]


def current_feed() -> SampleFeed | FollowerFeed | None:
    return _feed


class EngineBackend(HiddenStatesBackend):
    """``--hidden-states-backend eagleflow-engine --eagleflow-feed <train>/online/feed.json``."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        if not any(action.dest == "eagleflow_feed" for action in parser._actions):  # noqa: SLF001 - as hs-connectors does
            parser.add_argument(SETTINGS_FLAG, type=str, default=None, help="eagleflow's online feed settings (feed.json)")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing to launch: the engines are the run's, started by the pipeline."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> EngineTransfer:
        if not getattr(args, "eagleflow_feed", None):
            raise ValueError(f"--hidden-states-backend {BACKEND_NAME} needs {SETTINGS_FLAG} (the training step writes it)")
        settings = _rank_settings(FeedSettings.read(Path(args.eagleflow_feed)))

        def say(line: str) -> None:
            print(f"[eagleflow] {line}", flush=True)

        if settings.lead is not None:  # several drafters: take the lead's samples when it runs this pass with us
            if join_lead(settings.layout, FeedLayout(settings.lead), settings.peer_wait, say):
                start_follower(settings, say)
                return EngineTransfer(settings)
            settings = settings.model_copy(update={"lead": None})
        start_feed(settings, say)
        return EngineTransfer(settings)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise NotImplementedError("eagleflow's engines are SGLang (or its reference engine), launched by the pipeline")


def register_backend() -> None:
    """Add :class:`EngineBackend` to hs-connectors' registry (before speculators' config reads the registry)."""
    if BACKEND_NAME not in HiddenStatesBackend.registry:
        HiddenStatesBackend.register(BACKEND_NAME)(EngineBackend)


class PlannedSampler:
    """Mixed into speculators' batch sampler: each pass first tells the feed its file indices, in order."""

    file_offset = 0

    def __iter__(self) -> Iterator[Any]:
        batches = self._generate_batches(self.epoch)  # type: ignore[attr-defined]
        if _feed is not None:
            _feed.plan([self.file_offset + int(i) for batch in batches for i in batch])
        return iter(batches)


class TimedLoader:
    """A data loader read through a clock: the time each batch took to arrive goes to ``on_wait``."""

    def __init__(self, loader: Any, on_wait: Callable[[float], None]) -> None:
        self._loader, self._on_wait = loader, on_wait

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self._loader)
        while True:
            began = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._on_wait(time.perf_counter() - began)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def install_hooks() -> Callable[[], None]:
    """Hook the order and the wait into speculators (see the module docstring); returns the undo."""
    import speculators.train.dataloader as dataloader
    from speculators.train.trainer import Trainer

    sampler_class = dataloader.MultipackDistributedBatchSamplerV2
    planned = type("PlannedMultipackSampler", (PlannedSampler, sampler_class), {})
    setup_dataloader = dataloader._setup_dataloader  # noqa: SLF001
    train_epoch = Trainer.train_epoch

    def setup_planned_dataloader(dataset: Any, *args: Any, **kwargs: Any) -> Any:
        offset = int(getattr(dataset, "start_file_idx", 0))

        def make_sampler(*s_args: Any, **s_kwargs: Any) -> Any:
            sampler = planned(*s_args, **s_kwargs)
            sampler.file_offset = offset
            return sampler

        dataloader.MultipackDistributedBatchSamplerV2 = make_sampler  # type: ignore[assignment,misc]
        try:
            return setup_dataloader(dataset, *args, **kwargs)
        finally:
            dataloader.MultipackDistributedBatchSamplerV2 = sampler_class  # type: ignore[misc]

    def train_epoch_timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        feed = _feed
        if feed is None:
            return train_epoch(self, *args, **kwargs)
        loader = self.train_loader
        self.train_loader = TimedLoader(loader, feed.add_data_wait)
        try:
            return train_epoch(self, *args, **kwargs)
        finally:
            self.train_loader = loader

    dataloader._setup_dataloader = setup_planned_dataloader  # type: ignore[assignment]  # noqa: SLF001
    Trainer.train_epoch = train_epoch_timed  # type: ignore[method-assign]

    def restore() -> None:
        dataloader._setup_dataloader = setup_dataloader  # noqa: SLF001
        Trainer.train_epoch = train_epoch  # type: ignore[method-assign]

    return restore
