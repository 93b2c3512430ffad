"""The capture gate's checks: do an engine's dumps hold what training needs (docs/design.md §3.1)?

The engine's own logits come from the final state the hook captures, so the verifier's final norm
and ``lm_head``, applied on the host to the captured final slot, must reproduce the log-probabilities
the engine returns for the same prompt. What the gate can *test* with the weights it reads (final
norm, ``lm_head``, the embedding rows of the prompt):

- **final slot is pre-norm**: its rows, divided by the norm weight, must not all have RMS 1 (that is
  the norm's *output*); and if the log-probabilities mismatch, ``lm_head`` without the norm matching
  them says the same;
- **final slot reproduces the engine**: every position's top-1 token (a swap within the tolerance
  counts as a tie) and log-probabilities within ``atol + rtol · max|logit|`` at that position;
- **id 0**, when captured, equals the embedding rows of the prompt exactly (rows that are either
  right or zeros are one vocabulary shard's partial sum);
- **every slot** is finite, not constant, and distinct from every slot of another layer id.

What it can only *infer*: for a final slot that is neither right nor post-norm, whether it is a
tensor-parallel rank's partial sum or an off-by-one layer; the engine's ``tp_size`` decides which
is likely (a partial sum needs several ranks). An aux slot other than id 0 taken from the wrong
layer is caught only when it duplicates another slot: the gate has no layer weights.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sglang_patch.sample_file import HIDDEN_STATES_KEY, SCALES_KEY

POST_NORM_RMS_WITHIN = 0.01  # a norm's output has RMS 1 (per row, weight divided out) to bf16 precision
SAME_SLOT_BELOW = 1e-3  # relative distance under which two slots hold the same tensor

POST_NORM = "post-norm final state: the final slot holds the final norm's output, not its input (hook the norm's input)"
PARTIAL_SUM = (
    "tensor-parallel partial sum: the final slot holds one rank's share before the all-reduce (SGLang with "
    "flashinfer all-reduce fusion: launch with --enforce-disable-flashinfer-allreduce-fusion)"
)
PARTIAL_SUM_EMBEDDING = (
    "tensor-parallel partial sum: each id-0 row is its embedding row or zeros, one rank's vocabulary shard "
    "before the embedding's all-reduce (capture the embedding's output after the all-reduce)"
)
OFF_BY_ONE = "off-by-one layer: the slot holds another layer's state (e.g. a layer's output taken as its input)"
RADIX_CACHE = "radix cache on: a request reused cached prompt tokens, so fewer states than tokens were computed (--disable-radix-cache)"


@dataclass
class Finding:
    """One failed check: what, where, the worst figure, and the likely cause (tested or inferred)."""

    check: str
    message: str
    cause: str
    basis: str  # "tested": a hypothesis test confirmed the cause; "inferred": reasoned from the engine's settings
    slot: int | None = None
    layer_id: int | None = None

    def text(self) -> str:
        where = f" slot {self.slot} (layer id {self.layer_id})" if self.slot is not None else ""
        return f"{self.check}{where}: {self.message}; likely cause ({self.basis}): {self.cause}"


def final_slot_cause(tp_size: int | None) -> tuple[str, str]:
    """The likely cause of a final slot that matches neither the engine nor the post-norm hypothesis."""
    if tp_size is None:
        return f"{PARTIAL_SUM}; or {OFF_BY_ONE} (the engine does not report its tp_size)", "inferred"
    if tp_size > 1:
        return f"{PARTIAL_SUM} (the engine reports tp_size {tp_size}); else {OFF_BY_ONE}", "inferred"
    return f"{OFF_BY_ONE} (the engine reports tp_size 1, so no partial sum)", "inferred"


def request_cause(reason: str) -> tuple[str, str]:
    """The likely cause of a request that got no dump (the engine's or the client's reason)."""
    if "cached prefix" in reason:  # the SGLang hook's error record for an extend pass with a prefix
        return RADIX_CACHE, "tested"
    return "the engine could not answer or capture the request (see the reason and the server log)", "inferred"


def format_cause(reason: str) -> tuple[str, str]:
    """The likely cause of a dump whose format is wrong, from :func:`~eagleflow.extract.sample_store.validate`'s reason."""
    shapes = re.match(r"hidden_states shape \((\d+), (\d+), (\d+)\), expected \((\d+), (\d+), (\d+)\)", reason)
    if shapes:
        (tokens, slots, hidden), (want_tokens, want_slots, want_hidden) = (
            tuple(map(int, shapes.groups()[:3])), tuple(map(int, shapes.groups()[3:]))
        )
        if tokens < want_tokens:
            return f"fewer states than tokens: {RADIX_CACHE}, or chunked prefill (--chunked-prefill-size -1)", "tested"
        if slots != want_slots:
            return "the engine captures other layer ids than this run (its --aux-layers / hook config)", "tested"
        if hidden != want_hidden:
            return "the engine serves another model than this run's verifier", "tested"
    if "non-finite" in reason:
        return "NaN/Inf in the captured states: a slot read before it was written, or an overflow", "inferred"
    return "the dump does not match the request (see the reason)", "inferred"


# ---- the engine's answer --------------------------------------------------------------------


@dataclass
class EnginePredictions:
    """What the engine answered at each prompt position p (predicting token p+1): its top tokens, best first."""

    top: list[list[tuple[int, float]]]
    next_token: list[int | None]
    next_logprob: list[float | None]


def engine_predictions(meta: dict[str, Any], input_ids: Sequence[int]) -> EnginePredictions:
    """Read SGLang's ``input_token_logprobs`` / ``input_top_logprobs`` (and ``output_*`` for the last
    position) into per-position predictions; ValueError naming the field when the answer lacks them."""
    tokens, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    if not isinstance(tokens, list) or len(tokens) != len(input_ids):
        got = len(tokens) if isinstance(tokens, list) else tokens
        raise ValueError(f"meta_info.input_token_logprobs has {got} entries for {len(input_ids)} prompt tokens")
    if not isinstance(tops, list) or len(tops) != len(input_ids):
        raise ValueError(f"meta_info.input_top_logprobs is missing or not one entry per prompt token ({len(input_ids)})")
    top = [[(int(e[1]), float(e[0])) for e in entries or []] for entries in tops[1:]]
    next_token: list[int | None] = list(input_ids[1:])  # SGLang clips ids, so take them from the request
    next_logprob = [None if e[0] is None else float(e[0]) for e in tokens[1:]]
    out_tokens, out_tops = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
    if out_tokens and out_tops and out_tops[0]:  # the last position's prediction: the generated token
        top.append([(int(e[1]), float(e[0])) for e in out_tops[0]])
        next_token.append(int(out_tokens[0][1]))
        next_logprob.append(float(out_tokens[0][0]))
    return EnginePredictions(top, next_token, next_logprob)


# ---- the verifier's head on the host --------------------------------------------------------


@dataclass
class LogprobComparison:
    """Host log-probabilities against the engine's, over every compared position."""

    positions: int = 0
    top1_agree: int = 0
    worst_ratio: float = 0.0  # worst error / that position's tolerance
    worst: dict[str, Any] = field(default_factory=dict)
    top1_mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.positions > 0 and self.worst_ratio <= 1.0 and not self.top1_mismatches

    def merge(self, other: LogprobComparison) -> LogprobComparison:
        worse = other if other.worst_ratio > self.worst_ratio or not self.worst else self
        return LogprobComparison(
            self.positions + other.positions, self.top1_agree + other.top1_agree, worse.worst_ratio, worse.worst,
            (self.top1_mismatches + other.top1_mismatches)[:20],
        )

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "top1_agreement": self.top1_agree / self.positions if self.positions else None}


def compare_logprobs(row: int, logits: torch.Tensor, engine: EnginePredictions, atol: float, rtol: float) -> LogprobComparison:
    """Compare host ``logits`` ``[T, V]`` with the engine's predictions at each position."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tolerance = atol + rtol * logits.abs().max(dim=-1).values
    host_top1 = logprobs.argmax(dim=-1)
    result = LogprobComparison()
    for p, (top, token, token_lp) in enumerate(zip(engine.top, engine.next_token, engine.next_logprob)):
        if not top:
            continue
        compared = dict(top)
        if token is not None and token_lp is not None:
            compared[token] = token_lp
        tol = float(tolerance[p])
        for tok, engine_lp in compared.items():
            ratio = abs(float(logprobs[p, tok]) - engine_lp) / tol
            if ratio > result.worst_ratio or not result.worst:
                result.worst_ratio = ratio
                result.worst = {"row": row, "position": p, "token": tok, "host": float(logprobs[p, tok]),
                                "engine": engine_lp, "error": abs(float(logprobs[p, tok]) - engine_lp), "tolerance": tol}
        result.positions += 1
        engine_top1, engine_best = top[0]
        mine = int(host_top1[p])
        # A swap of two tokens the engine itself rates within the tolerance is a bf16 tie, not a mismatch.
        tied = mine in compared and engine_best - compared[mine] <= tol
        if mine == engine_top1 or tied:
            result.top1_agree += 1
        else:
            result.top1_mismatches.append({"row": row, "position": p, "engine_top1": engine_top1, "host_top1": mine})
    return result


# ---- slots ------------------------------------------------------------------------------------


def stored_slot_difference(
    stored: dict[str, torch.Tensor], slot: int, expected_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: the largest difference between ``slot`` as stored and ``expected_rows`` stored the same way
    (fp8: quantised with the dump's own per-token scale, so equal rows give 0), and whether the stored row is all zeros."""
    states = stored[HIDDEN_STATES_KEY][:, slot]
    zero = (states.float() == 0).all(dim=-1)
    if SCALES_KEY in stored:
        scale = stored[SCALES_KEY][:, 0]  # [T, 1]
        expected = (expected_rows.float() / scale).to(states.dtype)
        return (states.float() - expected.float()).abs().max(dim=-1).values * scale[:, 0], zero
    return (states.float() - expected_rows.to(states.dtype).float()).abs().max(dim=-1).values, zero


def slot_statistics(states: torch.Tensor, layer_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Per slot of ``states`` ``[N, S, H]`` (every row's positions): norms, spread, and the nearest slot of another id."""
    x = states.float()
    stats = []
    for s, layer_id in enumerate(layer_ids):
        slot = x[:, s]
        nearest, distance = None, None
        for o, other_id in enumerate(layer_ids):
            if o == s or other_id == layer_id:
                continue
            d = float((slot - x[:, o]).norm() / max(float(slot.norm()), float(x[:, o].norm()), 1e-30))
            if distance is None or d < distance:
                nearest, distance = o, d
        stats.append({
            "slot": s, "layer_id": layer_id,
            "mean_token_norm": float(slot.norm(dim=-1).mean()), "max_token_norm": float(slot.norm(dim=-1).max()),
            "std": float(slot.std()) if slot.numel() > 1 else 0.0,
            "varies_over_positions": bool((slot - slot[:1]).abs().max() > 0) if slot.shape[0] > 1 else True,
            "finite": bool(torch.isfinite(slot).all()),
            "nearest_slot": nearest, "nearest_distance": distance,
        })
    return stats


def slot_findings(stats: list[dict[str, Any]]) -> list[Finding]:
    """Slots that are not finite, constant, or the same tensor as a slot of another layer id."""
    findings = []
    for st in stats:
        where = {"slot": st["slot"], "layer_id": st["layer_id"]}
        if not st["finite"]:
            findings.append(Finding("slot values", "NaN or Inf values", "a slot filled from an uninitialised or overflowed tensor", "inferred", **where))
        elif st["std"] == 0.0 or not st["varies_over_positions"]:
            findings.append(Finding(
                "slot values", f"constant (std {st['std']:.3g}; the same at every position: {not st['varies_over_positions']})",
                "a slot never written or filled from the wrong tensor (a broadcast, a bias)", "inferred", **where,
            ))
        # Each pair once: reported on its lower slot.
        if st["nearest_distance"] is not None and st["nearest_distance"] < SAME_SLOT_BELOW and st["slot"] < st["nearest_slot"]:
            findings.append(Finding(
                "distinct slots", f"the same tensor as slot {st['nearest_slot']} (relative distance {st['nearest_distance']:.2e})",
                f"two slots filled from one tensor, e.g. {OFF_BY_ONE}", "tested", **where,
            ))
    return findings
