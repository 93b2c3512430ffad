"""eagleflow's noise augmentation of the aux hidden states, for speculators releases without it.

The seed run trained with ``noise_std`` 0.05: speculators 0.8.1 added uniform noise in
``[-std, std]`` to each training sample's aux hidden states (the concatenated aux slots, not the
verifier's final state) and never to validation samples (``AddUniformNoise``, applied by its
train ``ArrowDataset``). speculators 0.9.0 removed ``--noise-std`` with no replacement, so
eagleflow does the same itself: :func:`install_noise` wraps the train split that speculators'
``create_train_val_loaders`` builds in :class:`NoisyTrainSplit`; the validation split is left
alone, so validation metrics stay comparable between runs. The draws come from torch's global
generator in the process that loads the sample (a data-loader worker, seeded by torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

AUX_STATES_KEY = "hidden_states"  # speculators' sample key of the concatenated aux slots


def add_uniform_noise(states: torch.Tensor, std: float) -> torch.Tensor:
    """``states`` plus noise drawn uniformly from ``[-std, std]`` (speculators 0.8.1's formula)."""
    return states + 2 * (torch.rand_like(states) - 0.5) * std


class NoisyTrainSplit(Dataset):
    """speculators' train split, each sample's aux states with :func:`add_uniform_noise`.

    Carries the two attributes speculators' data loader reads from a dataset
    (``approx_lengths`` for packing, ``hidden_states_dtype`` for collation); picklable, so
    spawned data-loader workers get it too.
    """

    def __init__(self, dataset: Any, std: float) -> None:
        self.dataset = dataset
        self.std = std
        self.approx_lengths = dataset.approx_lengths
        self.hidden_states_dtype = dataset.hidden_states_dtype

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        if isinstance(sample, dict):  # not a SampleUnavailable
            sample[AUX_STATES_KEY] = add_uniform_noise(sample[AUX_STATES_KEY], self.std)
        return sample


def install_noise(std: float) -> Callable[[], None]:
    """Give the train split speculators builds noise of ``std``; returns the undo.

    speculators' ``create_train_val_loaders`` builds both splits with
    ``ArrowDataset(..., split="train" | "val", ...)``; the train one comes back wrapped.
    """
    import speculators.train.dataloader as dataloader

    original = dataloader.ArrowDataset

    def arrow_dataset(*args: Any, **kwargs: Any) -> Any:
        dataset = original(*args, **kwargs)
        return NoisyTrainSplit(dataset, std) if kwargs.get("split") == "train" else dataset

    dataloader.ArrowDataset = arrow_dataset  # type: ignore[assignment,misc]

    def restore() -> None:
        dataloader.ArrowDataset = original  # type: ignore[misc]

    return restore
