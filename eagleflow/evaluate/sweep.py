"""The serving-config sweep: SpecForge's ``--config-list bs,steps,topk,draft_tokens``, its engines and its verdicts.

A config ``B,S,K,M`` is ``B`` requests in flight against an engine serving the drafter with
``--speculative-num-steps S --speculative-eagle-topk K --speculative-num-draft-tokens M``; ``S`` = 0
is the engine without a drafter (the baseline). A block drafter (DFlash) drafts ``M - 1`` tokens in
one pass, so its configs are ``B,1,1,M`` (SGLang forces one step of topk 1). Every batch size gets its baseline, so each
config's speedup is over the same engine's plain decoding at the same batch size. One engine
serves every config of one draft shape (``S,K,M``): the batch size is only how many requests
are in flight.

**Trusting a speed**: greedy speculative decoding emits, per verification, the accepted drafts
and one bonus token — the accept length — and a verification costs at least one decode step of
the target. So no config can be faster than its accept length times the baseline: a figure
above that bound says the measurement was disturbed (another process, a cold cache), and is
reported as such, never as a result.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class ServeConfig:
    """One row of the sweep: batch size, steps, topk, draft tokens (all 0 but the batch size: no drafter)."""

    batch_size: int
    steps: int
    topk: int
    draft_tokens: int

    @property
    def baseline(self) -> bool:
        return self.steps == 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """The engine that serves it: configs of one shape share an engine."""
        return self.steps, self.topk, self.draft_tokens

    @property
    def label(self) -> str:
        return f"{self.batch_size},{self.steps},{self.topk},{self.draft_tokens}"

    def sglang_flags(
        self, drafter_path: str, window: int | None = None, algorithm: str = "EAGLE3", calibration: str | None = None
    ) -> list[str]:
        """SGLang's flags serving this config with a drafter of ``algorithm`` (none for the baseline), as its
        family gives them (:mod:`eagleflow.drafters`), naming its ``calibration`` file when there is one; the batch
        size is a client setting."""
        from eagleflow.drafters import family_of_algorithm

        if self.baseline:
            return []
        calibrated = {"calibration": calibration} if calibration else {}
        return family_of_algorithm(algorithm).owner("serving")(drafter_path, self.steps, self.topk, self.draft_tokens, window, **calibrated)


def default_shape(algorithm: str, num_steps: int, block_size: int | None = None) -> tuple[int, int, int]:
    """The drafter's own shape (steps, topk, draft tokens): an EAGLE-3 chain of its trained steps, or a
    block drafter's trained block (one step of topk 1, SGLang's)."""
    from eagleflow.drafters import family_of_algorithm

    return (1, 1, int(block_size or 0)) if family_of_algorithm(algorithm).block else (num_steps, 1, num_steps + 1)


def parse_config(text: str, block: bool | None = False) -> ServeConfig:
    """``"1,3,1,4"`` -> :class:`ServeConfig`; a malformed one is a ValueError quoting it.

    :param block: the drafter is a block drafter (SGLang's block rule: ``bs,1,1,B``); False: EAGLE-3's
        chain and tree rules; None: the shape alone (before the drafter's family is known), and what every
        family refuses. A config SGLang would refuse, or silently serve as another (:mod:`eagleflow.sglang_rules`),
        is refused: the report would credit the written config with another's figures.
    """
    from eagleflow.sglang_rules import check_block_flags, check_tree_flags

    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 4 or min(values) < 0 or values[0] < 1:
        raise ValueError(f"{text!r} is not 'batch size,steps,topk,draft tokens' (e.g. 1,3,1,4; batch size >= 1)")
    config = ServeConfig(*values)
    if config.baseline:
        return ServeConfig(config.batch_size, 0, 0, 0)
    if config.topk < 1:
        raise ValueError(f"{text!r}: topk must be >= 1 with a drafter (steps > 0)")
    try:
        if block:
            check_block_flags(config.draft_tokens, config.steps, config.topk)
        elif block is not None:
            check_tree_flags(config.steps, config.topk, config.draft_tokens)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}" + (" (a block drafter's config is 'batch size,1,1,block size')" if block else "")) from exc
    if config.draft_tokens < 2:  # what every family refuses, so also before the family is known
        raise ValueError(
            f"{text!r}: draft tokens must be >= 2 with a drafter (the bonus token and at least one draft); 0 is SGLang's "
            "'not set', which the engine would fill in with a shape other than the one written"
        )
    return config


def check_configs_param(text: str, family: str, block: bool) -> None:
    """Param eval_configs by the rules of drafter family ``family`` (trigger time): a :class:`UserError` naming
    the Param, the config and the rule it breaks."""
    from eagleflow.errors import UserError
    from eagleflow.evaluate.config import param_label

    try:
        parse_configs(text, 1, 1, block=block)
    except ValueError as exc:
        raise UserError(f"{param_label('eval_configs')}: {exc} (draft_algorithm {family})") from exc


def parse_configs(
    text: str, default_steps: int, default_concurrency: int, block_size: int | None = None, block: bool | None = False
) -> list[ServeConfig]:
    """The sweep of ``eval_configs`` (space-separated), or the default one; every batch size's baseline added, sorted.

    The default: the drafter's own shape (:func:`default_shape`; ``block_size`` for a block drafter) at 1 and
    ``default_concurrency`` in flight.
    """
    if text.strip():
        configs = {parse_config(item, block) for item in text.split()}
    else:
        chain = default_shape("DFLASH" if block else "EAGLE3", default_steps, block_size)
        configs = {ServeConfig(bs, *chain) for bs in {1, default_concurrency}}
    configs |= {ServeConfig(c.batch_size, 0, 0, 0) for c in configs}
    return sorted(configs, key=lambda c: (c.batch_size, c.steps, c.topk, c.draft_tokens))


def interleaved_turns(group: list[ServeConfig], n_prompts: int, round_: int) -> list[tuple[ServeConfig, slice]]:
    """The order in which one batch size's configs answer a prompt set in round ``round_`` when their
    engines run side by side: a slice of ``batch_size`` prompts at a time, every config on that slice
    before any goes on, the order reversed every slice (A B, B A, ...) and rotated every round.

    The machine's speed drifts within seconds on a shared VM; timing a whole set one config after
    another put that drift into the ratio, turn by turn it falls on every config alike.
    """
    sizes = {c.batch_size for c in group}
    if len(sizes) != 1:
        raise ValueError(f"configs of one batch size take turns, got batch sizes {sorted(sizes)}")
    size = sizes.pop()
    order = group[round_ % len(group):] + group[: round_ % len(group)]
    turns = []
    for begin in range(0, n_prompts, size):
        turns += [(config, slice(begin, min(begin + size, n_prompts))) for config in order]
        order = order[::-1]
    return turns


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of a figure measured in several rounds (and the rounds themselves)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def verdict(speedups: list[float], accept_length: float | None) -> dict[str, Any]:
    """A config's speedup over its baseline, per round and as the median; above the accept length: disturbed."""
    figure = spread(speedups)
    bound = accept_length if accept_length is not None else 1.0
    disturbed = [i for i, s in enumerate(speedups) if s > bound]
    figure["bound"] = bound
    figure["disturbed_rounds"] = disturbed
    figure["disturbed"] = figure["median"] > bound
    if figure["disturbed"]:
        figure["measured"], figure["median"] = figure["median"], None
    return figure


def fastest_per_batch_size(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each batch size, the config with the best mean speedup over the prompt sets (disturbed figures excluded)."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        speedups = [s["speedup"]["median"] for s in row["sets"].values()]
        if any(s is None for s in speedups) or not speedups:
            continue
        score = statistics.fmean(speedups)
        key = str(row["batch_size"])
        if key not in best or score > best[key]["mean_speedup"]:
            best[key] = {"config": row["config"], "mean_speedup": score, "sglang_flags": row["sglang_flags"]}
    return best
