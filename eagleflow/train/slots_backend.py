"""One capture, several drafters: a drafter reads only its own layers' slots of each stored sample.

A run that trains several drafters (the ``drafters`` Param) captures the union of their aux
layers once; each sample file holds those slots and the final state. speculators takes a
sample's ``hidden_states`` as ``[seq_len, slots, hidden]`` and splits off the last slot as the
verifier's final state, so a drafter must be handed exactly its own slots, in its layers' order,
then the final one. This hs-connectors backend (``--hidden-states-backend eagleflow-slots
--eagleflow-slots 0,2,3``) reads the stored files as hs-connectors' own ``fp8`` backend does
(dequantising fp8 files; a bf16 file passes through) and keeps those slots. Online, the feed's
backend selects alike (:class:`~eagleflow.train.online.settings.FeedSettings` ``slots``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hs_connectors import HiddenStatesBackend
from sglang_patch.sample_file import HIDDEN_STATES_KEY

try:
    from hs_connectors.transfer import FP8Transfer as StoredTransfer
except ImportError:  # speculators 0.8.1's hs-connectors reads bf16 files only (fp8 capture needs 0.9.0, checked before)
    from hs_connectors.transfer import FileTransfer as StoredTransfer

BACKEND_NAME = "eagleflow-slots"
SLOTS_FLAG = "--eagleflow-slots"


def select_slots(sample: dict[str, torch.Tensor] | None, slots: Sequence[int] | None) -> dict[str, torch.Tensor] | None:
    """``sample`` with only ``slots`` of its ``hidden_states`` (None: all of them), in that order."""
    if sample is None or slots is None:
        return sample
    return {**sample, HIDDEN_STATES_KEY: sample[HIDDEN_STATES_KEY][:, list(slots)].contiguous()}


def slots_flags(slots: Sequence[int]) -> list[str]:
    """speculators flags that make it read ``slots`` of each stored sample."""
    return ["--hidden-states-backend", BACKEND_NAME, SLOTS_FLAG, ",".join(str(s) for s in slots)]


class SlotsTransfer(StoredTransfer):
    """The dataset's sample files, each cut to this drafter's slots."""

    def __init__(self, hidden_states_path: Path, slots: Sequence[int]) -> None:
        super().__init__(hidden_states_path)
        self.slots = list(slots)

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        return select_slots(super().get_cached(file_idx), self.slots)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return select_slots(super().get_generated(hs_transfer_params), self.slots)


class SlotsBackend(HiddenStatesBackend):
    """``--hidden-states-backend eagleflow-slots --eagleflow-slots i,j,…``."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        if not any(action.dest == "eagleflow_slots" for action in parser._actions):  # noqa: SLF001 - as hs-connectors does
            parser.add_argument(SLOTS_FLAG, type=str, default=None, help="eagleflow: the stored slots this drafter reads")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing to launch: the files were extracted by the pipeline."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> SlotsTransfer:
        if not getattr(args, "eagleflow_slots", None):
            raise ValueError(f"--hidden-states-backend {BACKEND_NAME} needs {SLOTS_FLAG} (the training step gives it)")
        return SlotsTransfer(Path(data_path) / "hidden_states", [int(s) for s in args.eagleflow_slots.split(",")])

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise NotImplementedError("eagleflow extracts through SGLang (or its reference engine), launched by the pipeline")


def register_slots_backend() -> None:
    """Add :class:`SlotsBackend` to hs-connectors' registry (before speculators' config reads the registry)."""
    if BACKEND_NAME not in HiddenStatesBackend.registry:
        HiddenStatesBackend.register(BACKEND_NAME)(SlotsBackend)
