"""``verify-capture``: check the live engine's capture on a few rows before hours of extraction.

``python -m eagleflow verify-capture --dataset RUN/dataset --server URL --dump-dir DIR --verifier MODEL --aux-layer-ids 2,4,5``

Sends the dataset's first ``--verify-rows`` rows (cut to ``--max-tokens``) with SGLang's
input-logprob fields (``return_logprob``, ``logprob_start_len`` 0, ``top_logprobs_num``; one new
token, so the last position is scored too), takes each dump, and runs the checks of
:mod:`eagleflow.extract.capture_checks`: the dump's format (shapes, dtype, token ids, NaN/Inf, no
cached tokens), the final slot against the engine's own log-probabilities, id 0 against the
embedding, every slot's values and distinctness. Then it sends the first row again exactly as the
extractor does (prefill only, no logprobs, which a radix cache may serve from its cache) and checks
that nothing was reused and the dump is the same.

Writes ``OUT/report.json`` either way; a failure exits 1 naming the check, the slot, the worst
error and the likely cause, so the DAG stops before extraction.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch

from eagleflow.config import add_model_arguments, model_from_args
from eagleflow.data import dataset_table
from eagleflow.verifier import VerifierHead, config_int, load_verifier_head, locate_weights, read_weight, resolve_aux_layer_ids
from eagleflow.errors import UserError
from eagleflow.extract.capture_checks import (
    OFF_BY_ONE,
    PARTIAL_SUM_EMBEDDING,
    POST_NORM,
    POST_NORM_RMS_WITHIN,
    RADIX_CACHE,
    EnginePredictions,
    Finding,
    LogprobComparison,
    compare_logprobs,
    engine_predictions,
    final_slot_cause,
    format_cause,
    request_cause,
    slot_findings,
    slot_statistics,
    stored_slot_difference,
)
from eagleflow.engine import EngineClient, RowFailed, ServerGone, with_retries
from eagleflow.extract.dump_wait import DiskFull, wait_for_dump
from eagleflow.extract.handoff_reader import StoreUnreachable, handoff_for
from eagleflow.extract.sample_store import load_sample, validate
from eagleflow.extract.verify_config import VerifyCaptureConfig
from eagleflow.files import atomic_write_json
from eagleflow.layout import CAPTURE_CHECK_REPORT, RunLayout, engine_name
from eagleflow.results import emit_result
from sglang_patch.request_ids import verify_request_id
from sglang_patch.sample_file import decode_hidden_states
from sglang_patch.sample_format import sample_file_bytes

SAME_DUMP_WITHIN = 0.05  # the extraction request's dump vs the verify request's: relative, per slot


@dataclass
class CheckedRow:
    """One row the engine answered with log-probabilities and a well-formed dump."""

    row: int
    ids: list[int]
    stored: dict[str, torch.Tensor]  # the dump's tensors as stored (bf16, or fp8 with scales)
    engine: EnginePredictions

    def __post_init__(self) -> None:
        self.states = decode_hidden_states(self.stored)  # [T, n_slots, hidden] bf16, as training reads them

    @property
    def final(self) -> torch.Tensor:
        return self.states[:, -1]


def load_rows(cfg: VerifyCaptureConfig) -> list[list[int]]:
    """The first ``verify_rows`` rows' token ids, each cut to ``max_tokens``."""
    table = dataset_table(cfg.dataset, ["input_ids"])
    if len(table) == 0:
        raise UserError(f"--dataset {cfg.dataset} has no rows to check the capture with")
    if cfg.verify_rows > len(table):  # refused, not silently a smaller check
        raise UserError(
            f"--verify-rows {cfg.verify_rows} (Param verify_rows): the dataset {cfg.dataset} has only {len(table)} rows; "
            f"lower verify_rows to at most {len(table)}"
        )
    rows = table.slice(0, cfg.verify_rows).column("input_ids").to_pylist()
    return [[int(t) for t in ids[: cfg.max_tokens]] for ids in rows]


def take_dump(cfg: VerifyCaptureConfig, rid: str, ids: list[int], n_slots: int, hidden: int) -> tuple[Any, str]:
    """The dump of ``rid``, checked as extraction checks it, then removed from the hand-off folder:
    ``(tensors, "")``, or ``(None, reason)`` when its format is wrong; RowFailed if none came.

    It waits as the extractor does (:func:`~eagleflow.extract.dump_wait.wait_for_dump`): as long
    as a live writer still holds ``rid`` (a slow disk), and a "writer behind" record is a
    RowFailed with ``counts`` False, which :meth:`CaptureCheck._request` sends again."""
    needed = sample_file_bytes(len(ids), n_slots, hidden, cfg.hidden_states_dtype)
    handoff = handoff_for(cfg.dump_dir, cfg.sample_store, needed)
    beside = Path(tempfile.gettempdir()) / "eagleflow-capture-check.safetensors"  # where a store's sample is read to
    try:
        try:
            dump = wait_for_dump(handoff, rid, time.time(), cfg.dump_wait, threading.Event(), _say, needed_bytes=needed, beside=beside)
        except DiskFull as exc:
            raise RowFailed(exc.reason) from exc
        check = validate(dump, ids, n_slots, hidden, cfg.hidden_states_dtype)
        return (load_sample(dump), "") if check.ok else (None, check.reason)
    finally:
        handoff.discard(rid, beside)



def _say(line: str) -> None:
    print(line, flush=True)


class CaptureCheck:
    """One run of the checks against one engine; :meth:`run` returns the report.

    :param cfg: the step's flags.
    :param client: the engine's client (default: one for ``cfg.server``).
    """

    def __init__(self, cfg: VerifyCaptureConfig, client: EngineClient | None = None) -> None:
        self.cfg = cfg
        self.aux = resolve_aux_layer_ids(cfg.verifier, cfg.aux_layer_ids)
        self.num_layers = config_int(cfg.verifier, "num_hidden_layers")
        self.hidden = config_int(cfg.verifier, "hidden_size")
        self.layer_ids = [*self.aux, self.num_layers]
        self.client = client or EngineClient(cfg.server, cfg.request_timeout)
        self.findings: list[Finding] = []

    def run(self) -> dict[str, Any]:
        began = time.monotonic()
        rows = load_rows(self.cfg)
        engine = self.client.server_info()
        tp_size = engine.get("tp_size")
        print(
            f"verify-capture: {len(rows)} rows ({sum(map(len, rows))} tokens) to {self.cfg.server} (version "
            f"{engine.get('version', '?')}, tp_size {tp_size if tp_size is not None else '?'}, disable_radix_cache "
            f"{engine.get('disable_radix_cache', '?')}); slots = layer ids {self.layer_ids}",
            flush=True,
        )
        head = load_verifier_head(self.cfg.verifier)
        checked: list[CheckedRow] = []
        extraction: dict[str, Any] = {}
        try:
            for row, ids in enumerate(rows):
                started = time.monotonic()
                if (done := self._send_row(row, ids)) is not None:
                    checked.append(done)
                    print(f"row {row}: {len(ids)} tokens answered and captured ({time.monotonic() - started:.1f}s)", flush=True)
            extraction = self._extraction_request(rows[0], checked[0] if checked and checked[0].row == 0 else None)
        except ServerGone as exc:
            self.findings.append(Finding("engine", exc.reason, "the engine stopped (see the server log)", "tested"))
        final = self._check_final_slot(head, checked, tp_size if isinstance(tp_size, int) else None)
        embedding = self._check_embedding(checked) if 0 in self.aux else None
        slots = slot_statistics(torch.cat([c.states for c in checked]), self.layer_ids) if checked else []
        if slots:
            slots[-1]["normed_rms_range"] = final.pop("normed_rms_range")
        self.findings += slot_findings(slots)
        return {
            "passed": not self.findings and bool(checked),
            "engine": {"url": self.cfg.server, **{k: engine.get(k) for k in ("version", "tp_size", "disable_radix_cache", "chunked_prefill_size")}},
            "rows": len(rows), "rows_checked": len(checked), "tokens": sum(map(len, rows)), "layer_ids": self.layer_ids,
            "tolerance": {"atol": self.cfg.logprob_atol, "rtol": self.cfg.rtol, "top_logprobs_num": self.cfg.top_logprobs_num},
            "hidden_states_dtype": self.cfg.hidden_states_dtype,
            "final_slot": final, "embedding": embedding, "slots": slots, "extraction_request": extraction,
            "findings": [{**vars(f), "text": f.text()} for f in self.findings],
            "seconds": round(time.monotonic() - began, 3),
        }

    def _request(self, rid: str, ids: list[int], row: int, max_new_tokens: int, **fields: Any) -> tuple[dict[str, Any], Any, str]:
        """One greedy request and its dump: ``(meta_info, tensors, reason)`` as :func:`take_dump` says;
        retried under the engine client's one policy (after SGLang's abort), as the extractor's rows are."""

        def attempt() -> tuple[dict[str, Any], Any, str]:
            meta = self.client.complete(rid, ids, max_new_tokens=max_new_tokens, temperature=0.0, row=row, **fields)
            tensors, reason = take_dump(self.cfg, rid, ids, len(self.layer_ids), self.hidden)
            return meta.get("meta_info", {}), tensors, reason

        def before_retry(exc: RowFailed, delay: float) -> None:
            self.client.abort(rid)
            print(f"row {row}: {exc.reason}; sending it again in {delay:.0f}s", flush=True)

        return with_retries(attempt, self.cfg.max_retries, before_retry=before_retry)

    def _send_row(self, row: int, ids: list[int]) -> CheckedRow | None:
        """One logprob request and its dump; None (with a finding recorded) when either is unusable."""
        try:
            rid = verify_request_id(row)
            meta, tensors, reason = self._request(
                rid, ids, row, max_new_tokens=1,
                return_logprob=True, logprob_start_len=0, top_logprobs_num=self.cfg.top_logprobs_num,
            )
        except RowFailed as exc:
            self.findings.append(Finding("request", f"row {row}: {exc.reason}", *request_cause(exc.reason)))
            return None
        cached = int(meta.get("cached_tokens") or 0)
        if cached:
            self.findings.append(Finding("cached tokens", f"row {row}: the engine reused {cached} cached tokens", RADIX_CACHE, "tested"))
        if reason:
            self.findings.append(Finding("dump format", f"row {row}: {reason}", *format_cause(reason)))
            return None
        try:
            return CheckedRow(row, ids, tensors, engine_predictions(meta, ids))
        except ValueError as exc:
            self.findings.append(Finding(
                "engine log-probabilities", f"row {row}: {exc}",
                "the engine does not answer SGLang's input-logprob fields (return_logprob, logprob_start_len, top_logprobs_num)",
                "inferred",
            ))
            return None

    def _compare(self, head: VerifierHead, checked: list[CheckedRow], apply_norm: bool) -> LogprobComparison:
        result = LogprobComparison()
        for c in checked:
            logits = head.logits(c.final, apply_norm=apply_norm)
            result = result.merge(compare_logprobs(c.row, logits, c.engine, self.cfg.logprob_atol, self.cfg.rtol))
        return result

    def _check_final_slot(self, head: VerifierHead, checked: list[CheckedRow], tp_size: int | None) -> dict[str, Any]:
        """The final slot is pre-norm and reproduces the engine; a mismatch is explained by the hypotheses."""
        if not checked:
            return {"positions": 0}
        final = {"slot": len(self.layer_ids) - 1, "layer_id": self.num_layers}
        rms = torch.cat([head.normed_rms(c.final) for c in checked])
        post_norm = bool(((rms - 1).abs() <= POST_NORM_RMS_WITHIN).all())
        if post_norm:
            self.findings.append(Finding(
                "final slot is pre-norm", f"every position's RMS with the norm weight divided out is {float(rms.min()):.4f}-"
                f"{float(rms.max()):.4f}, which is a norm's output", POST_NORM, "tested", **final,
            ))
        comparison = self._compare(head, checked, apply_norm=True)
        if not comparison.passed:
            w = comparison.worst
            message = (
                f"log-probabilities differ from the engine's by up to {w['error']:.4g} nats at row {w['row']} position "
                f"{w['position']} token {w['token']} (host {w['host']:.4g}, engine {w['engine']:.4g}, tolerance "
                f"{w['tolerance']:.3g}); top-1 agrees at {comparison.top1_agree}/{comparison.positions} positions"
            ) if w else "the engine returned no log-probabilities to compare"
            without_norm = self._compare(head, checked, apply_norm=False)
            if without_norm.passed:
                cause = (POST_NORM + "; lm_head without the norm reproduces the engine", "tested")
            elif post_norm:
                cause = (POST_NORM, "tested")
            else:
                cause = final_slot_cause(tp_size)
            self.findings.append(Finding("final slot vs the engine's log-probabilities", message, *cause, **final))
        return {**comparison.summary(), "passed": comparison.passed, "normed_rms_range": [float(rms.min()), float(rms.max())]}

    def _check_embedding(self, checked: list[CheckedRow]) -> dict[str, Any] | None:
        """Id 0's slot against the prompt's embedding rows: bit for bit."""
        if not checked:
            return None
        weights = locate_weights(self.cfg.verifier)
        slot = self.aux.index(0)
        worst = {"max_abs_diff": -1.0}
        zero_or_equal = True  # every row either its embedding row or zeros: a vocab shard's partial sum
        for c in checked:
            diff, zero = stored_slot_difference(c.stored, slot, read_weight(self.cfg.verifier, weights, weights.embed_key, rows=c.ids))
            zero_or_equal &= bool(((diff == 0) | zero).all())
            if float(diff.max()) > worst["max_abs_diff"]:
                worst = {"max_abs_diff": float(diff.max()), "row": c.row, "position": int(diff.argmax())}
        result = {"slot": slot, "rows": len(checked), "equal": worst["max_abs_diff"] == 0.0, **worst}
        if not result["equal"]:
            cause = (
                (PARTIAL_SUM_EMBEDDING, "tested") if zero_or_equal
                else (f"{OFF_BY_ONE} (the slot is not the embedding, nor one tensor-parallel shard of it)", "inferred")
            )
            self.findings.append(Finding(
                "id 0 is the embedding", f"differs from the prompt's embedding rows by up to {worst['max_abs_diff']:.4g} "
                f"(row {worst['row']} position {worst['position']})", *cause, slot=slot, layer_id=0,
            ))
        return result

    def _extraction_request(self, ids: list[int], verified: CheckedRow | None) -> dict[str, Any]:
        """Row 0 again as the extractor sends it: no cached tokens, and the same states as the verify request."""
        check = "extraction request"
        try:
            rid = verify_request_id(0)  # the extractor's body (generate's), under the check's own rid
            meta, tensors, reason = self._request(rid, ids, 0, max_new_tokens=0)
        except RowFailed as exc:
            self.findings.append(Finding(check, f"row 0 sent as the extractor sends it: {exc.reason}", *request_cause(exc.reason)))
            return {"error": exc.reason}
        cached = int(meta.get("cached_tokens") or 0)
        result: dict[str, Any] = {"cached_tokens": cached, "tokens": len(ids)}
        if cached:
            self.findings.append(Finding(
                check, f"row 0 sent again as the extractor sends it reused {cached} of its {len(ids)} tokens from the "
                f"engine's cache", RADIX_CACHE, "tested",
            ))
            return result
        if reason:
            self.findings.append(Finding(check, f"row 0 sent as the extractor sends it: {reason}", *format_cause(reason)))
            return {**result, "error": reason}
        if verified is not None:
            states, before = decode_hidden_states(tensors).float(), verified.states.float()
            per_slot = ((states - before).abs().amax(dim=(0, 2)) / before.abs().amax(dim=(0, 2)).clamp_min(1e-30)).tolist()
            result["max_relative_difference"] = max(per_slot)
            worst = max(range(len(per_slot)), key=per_slot.__getitem__)
            if per_slot[worst] > SAME_DUMP_WITHIN:
                self.findings.append(Finding(
                    check, f"its dump differs from the verify request's by {per_slot[worst]:.3g} (relative)",
                    "the capture depends on the request (sampling settings, batching): what was verified is not what "
                    "extraction gets", "inferred", slot=worst, layer_id=self.layer_ids[worst],
                ))
        return result


def verify_capture(cfg: VerifyCaptureConfig) -> dict[str, Any]:
    """Run the checks, write ``report.json``, and return the report."""
    out = cfg.out or RunLayout(cfg.dataset.parent).capture_check(engine_name(0))
    report = CaptureCheck(cfg).run()
    atomic_write_json(out / CAPTURE_CHECK_REPORT, report)
    report["report_path"] = str(out / CAPTURE_CHECK_REPORT)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, VerifyCaptureConfig)


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(VerifyCaptureConfig, args)
    try:
        report = verify_capture(cfg)
    except ServerGone as exc:
        print(f"error: verify-capture: {exc.reason}", flush=True)
        return 1
    except StoreUnreachable as exc:
        print(f"error: verify-capture: {exc}", flush=True)
        return 1
    final = report["final_slot"]
    worst = final.get("worst") or {}
    print(
        f"capture check {'passed' if report['passed'] else 'FAILED'}: {report['rows']} rows, {final.get('positions', 0)} positions; "
        f"final slot worst logprob error {worst.get('error', float('nan')):.4f} (tolerance {worst.get('tolerance', float('nan')):.4f}), "
        f"top-1 agreement {final.get('top1_agreement') or 0:.1%}; report {report['report_path']}",
        flush=True,
    )
    for st in report["slots"]:
        print(f"  slot {st['slot']} (layer id {st['layer_id']}): mean token norm {st['mean_token_norm']:.4g}, std {st['std']:.4g}, "
              f"nearest slot {st['nearest_slot']} at {st['nearest_distance'] if st['nearest_distance'] is not None else float('nan'):.3g}",
              flush=True)
    emit_result({
        "passed": report["passed"], "report": report["report_path"], "worst_logprob_error": worst.get("error"),
        "top1_agreement": final.get("top1_agreement"), "findings": [f["text"] for f in report["findings"]],
    })
    if not report["passed"]:
        for finding in report["findings"]:
            print(f"error: capture check failed: {finding['text']}", flush=True)
        print("error: the capture is wrong; extraction would train the drafter on these states. See the README's "
              "'When the capture check fails'.", flush=True)
        return 1
    return 0
