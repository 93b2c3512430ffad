"""The reference engine's model: forward passes, hidden-state capture and dumps, speculative decoding.

With ``--dump-dir``, every prefill of a request whose rid is captured
(:func:`sglang_patch.request_ids.is_captured`: all but SGLang's health checks) is recorded by
hooks (:mod:`eagleflow.engine.capture`) and handed to the same
:class:`sglang_patch.dump_writer.DumpWriter` as the SGLang hook, which writes
``<dump_dir>/<rid>.safetensors`` in the background. As in SGLang the answer does not wait for
the disk: the dump may land after it (the extractor waits for it), and a writer that stays
behind its byte budget gives the request a "writer behind" error record instead of stalling the
engine. ``abort`` is SGLang's ``/abort_request``: a request not yet run is dropped. With
``--speculative-algorithm``, greedy requests decode with the exported drafter, by its family's decoder
(named in :mod:`eagleflow.drafters`; the loop they share: :mod:`eagleflow.engine.reference.speculative`).
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleflow.engine.capture import HiddenStateCapture
from eagleflow.engine.context import derived_context_length
from eagleflow.engine.reference.capture_faults import FaultyCapture, PrefixCache, server_info_overrides
from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.reference.faults import FaultSwitches, faults_from_env
from eagleflow.engine.reference.logprobs import logprob_meta_info
from eagleflow.engine.reference.turns import ForwardTurns
from eagleflow.engine.reference.protocol import (
    GREEDY_BELOW_TEMPERATURE,
    READY_LINE,
    GenerateRequest,
    ModelLimits,
    RequestError,
    parse_generate,
)
from eagleflow.errors import UserError, excerpt, excerpt_repr
from sglang_patch.layer_ids import validate_aux_layer_ids
from sglang_patch.request_ids import HEALTH_CHECK_PREFIX, is_captured

if TYPE_CHECKING:
    import torch

STATS_INTERVAL_S = 30.0


class ReferenceEngine:
    """The model, its capture settings and the request logic, independent of the HTTP layer.

    :param model: a loaded ``transformers`` causal LM in eval mode.
    :param tokenizer: its tokenizer, or None when the folder has none (then only ``input_ids`` work).
    :param config: the engine's flags.
    """

    def __init__(self, model: Any, tokenizer: Any, config: ReferenceEngineConfig) -> None:
        from eagleflow.engine.capture import decoder_layers_and_norm, model_device
        from sglang_patch.dump_writer import DumpWriter
        from sglang_patch.mooncake_store import store_option

        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model_device(model)
        layers, _ = decoder_layers_and_norm(model)
        self.num_layers = len(layers)
        self.aux_layer_ids: list[int] | None = None
        if config.aux_layers is not None:
            try:
                self.aux_layer_ids = validate_aux_layer_ids(config.aux_layers, self.num_layers)
            except ValueError as exc:
                raise UserError(f"--aux-layers: {exc}") from exc
        text_config = model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.hidden_size = int(text_config.hidden_size)
        derived = derived_context_length(text_config)
        if config.context_length is not None and config.context_length > derived:  # SGLang refuses it too
            raise UserError(f"--context-length {config.context_length} is more than the {derived} tokens the model's config allows")
        self.limits = ModelLimits(
            vocab_size=self.vocab_size, context_length=config.context_length or derived,
            tokenize=tokenizer.encode if tokenizer is not None else None,
        )
        self.eos_token_ids = _eos_token_ids(model)
        # Only the last position's logits are needed; older/remote modelling code may lack the knob.
        self._logits_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        # TEST ONLY faults, from the environment (EAGLEFLOW_TEST_FAULTS): rows still to fail in this process (a
        # marker left by an earlier process means its one injected failure already happened), a slow disk, ….
        self.faults = FaultSwitches(faults_from_env(), config.dump_dir)
        self.writer = (
            DumpWriter(
                config.dump_dir, max_pending_bytes=config.dump_queue_bytes, write_delay=self.faults.settings.write_delay,
                hidden_states_dtype=config.hidden_states_dtype, **store_option(config.sample_store),
            )
            if config.dump_dir is not None
            else None
        )
        if config.speculative_algorithm:
            from eagleflow.drafters import family_of_algorithm  # the family's decoding, SGLang's semantics

            self.speculative: Any = family_of_algorithm(config.speculative_algorithm).owner("reference")(model, config)
        else:
            self.speculative = None
        self.ready = threading.Event()
        self.shutting_down = False
        self.warmup_error: str | None = None
        self.turns = ForwardTurns()  # one forward at a time; /abort_request drops a request still waiting
        self.prefix_cache = PrefixCache() if self.faults.settings.capture_fault == "radix-cache" else None  # TEST ONLY
        self._stats_lock = threading.Lock()
        self._requests = self._failed = self._prompt_tokens = 0
        self._last_stats = (time.monotonic(), 0, 0)

    @classmethod
    def load(cls, config: ReferenceEngineConfig) -> ReferenceEngine:
        """Load the model (and its tokenizer when the folder has one) named by ``config.model``."""
        import torch
        from transformers import AutoModelForCausalLM

        if not (config.model / "config.json").is_file():
            raise UserError(f"--model: {config.model} is not a model folder (no config.json there)")
        if config.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device here; use --device cpu")
        if config.threads:
            torch.set_num_threads(config.threads)
        dtype: Any = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(config.model), dtype=dtype, trust_remote_code=config.trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise UserError(f"--model: cannot load {config.model}: {exc}") from exc
        model.to(config.device).eval()
        return cls(model, _load_tokenizer(config.model, config.trust_remote_code), config)

    # ---- requests -------------------------------------------------------------------------

    def generate(self, body: Any) -> dict[str, Any]:
        """Answer one ``/generate`` body; raises :class:`RequestError` for an error answer."""
        started = time.time()
        rid: Any = excerpt_repr(body.get("rid")) if isinstance(body, dict) else None  # for the log line, until parsed
        try:
            request = parse_generate(body, self.limits)
            rid = request.rid
            if is_captured(rid):
                self.faults.fail_request(rid)
            try:
                output_ids, finish_reason, extra_meta = self._run(request)
            except RequestError:
                raise
            except Exception as exc:  # the model failed (e.g. out of memory): a 500 naming it, the server lives on
                traceback.print_exc()
                raise RequestError(500, f"rid {rid}: forward failed: {type(exc).__name__}: {excerpt(exc)}") from exc
        except RequestError as exc:
            self._count(0, failed=True)
            print(f"generate rid={rid}: HTTP {exc.status}: {exc.message}", file=sys.stderr, flush=True)
            raise
        if is_captured(rid):
            self._count(len(request.input_ids), failed=False)
            # Off the forward lock: slowed requests still overlap, as a batching engine's do.
            time.sleep(max(self.faults.settings.min_request_seconds - (time.time() - started), 0.0))
        return {
            "text": self._decode(output_ids),
            "output_ids": output_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish_reason,
                "prompt_tokens": len(request.input_ids),
                "weight_version": "default",
                "total_retractions": 0,
                "completion_tokens": len(output_ids),
                # No prefix cache here, so every prompt token is computed (and captured).
                "cached_tokens": 0,
                "e2e_latency": time.time() - started,
                **extra_meta,
            },
        }

    def health(self) -> bool:
        """SGLang's ``/health_generate``: False before warmup or during shutdown, else a real 1-token forward."""
        if self.shutting_down or not self.ready.is_set():
            return False
        rid = f"{HEALTH_CHECK_PREFIX}_{time.time()}"
        try:
            self.generate({"rid": rid, "input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        except Exception as exc:  # an unhealthy model is a 503, never a crashed endpoint
            print(f"health check failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return False
        return True

    def model_info(self) -> dict[str, Any]:
        """``/model_info``: SGLang's fields, plus the shape facts a client of this engine needs."""
        return {
            "model_path": str(self.config.model),
            "tokenizer_path": str(self.config.model) if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
            # Extras (not in SGLang's answer): enough to size and check dumps without the model.
            "engine": "eagleflow-reference",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "context_length": self.limits.context_length,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "aux_layer_ids": self.aux_layer_ids,
            "num_hidden_state_slots": len(self.aux_layer_ids) + 1 if self.aux_layer_ids is not None else None,
            "dump_dir": str(self.config.dump_dir) if self.config.dump_dir is not None else None,
            "speculative_algorithm": self.config.speculative_algorithm,
            "speculative_num_steps": self.config.speculative_num_steps if self.speculative else None,
            "speculative_eagle_topk": self.config.speculative_eagle_topk if self.speculative else None,
            # What one round verifies (SGLang's --speculative-num-draft-tokens): a chain's steps + 1, a tree's or block's size.
            "speculative_num_draft_tokens": self.speculative.draft_tokens_per_round + 1 if self.speculative else None,
        }

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: SGLang's names for the settings a client checks capture against."""
        return {
            "model_path": str(self.config.model),
            "tp_size": 1,
            "disable_radix_cache": True,  # there is no prefix cache: every prompt token is computed
            "chunked_prefill_size": -1,
            "version": "eagleflow-reference",
            "eagleflow_captured_requests": self._requests - self._failed,  # not SGLang's: captured prefills answered
            **server_info_overrides(self.faults.settings.capture_fault),
        }

    def warmup(self) -> None:
        """One real forward (as SGLang's warmup request), then wait out ``--warmup-seconds``; sets :attr:`ready`."""
        started = time.monotonic()
        try:
            ids = [i % self.vocab_size for i in (10, 11, 12)]  # SGLang's warmup ids without a tokenizer
            self._run(GenerateRequest("WARMUP", ids, max_new_tokens=1, temperature=0.0, ignore_eos=True), dump=False)
        except Exception as exc:
            self.warmup_error = f"{type(exc).__name__}: {exc}"
            print(f"warmup forward failed: {self.warmup_error}", file=sys.stderr, flush=True)
            return
        remaining = self.config.warmup_seconds - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
        self.ready.set()
        print(READY_LINE, flush=True)

    def close(self) -> None:
        """Write every queued dump, then stop the writer thread."""
        self.shutting_down = True
        if self.writer is None:
            return
        self.writer.close()
        for message in self.writer.write_errors:
            print(f"dump write failed: {message}", file=sys.stderr, flush=True)

    # ---- internals ------------------------------------------------------------------------

    def _submit_dump(self, rid: str, states: torch.Tensor, input_ids: list[int]) -> None:
        """Hand the states to the writer (no copy; at most 2s wait for budget, else "writer behind")."""
        import torch

        poisoned = self.faults.poison(rid, states)
        if self.writer.submit(rid, states, torch.tensor(input_ids, dtype=torch.int64)) and poisoned is not None:
            self.faults.poison_taken(poisoned, rid)

    def abort(self, rid: str) -> None:
        """SGLang's ``/abort_request``: a request still waiting for the forward lock is dropped."""
        self.turns.abort(rid)

    def _run(self, request: GenerateRequest, dump: bool = True) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        """Prefill (captured unless a health check, ``dump=False`` or no dump folder), then up to
        ``max_new_tokens`` decode steps (speculative when a drafter is loaded); returns the output
        ids, the finish reason and the extra ``meta_info`` fields (spec, logprobs)."""
        import torch

        max_new_tokens = request.max_new_tokens
        capture = dump and self.writer is not None and is_captured(request.rid)
        if self.speculative is not None and max_new_tokens > 1 and not capture:
            if request.temperature >= GREEDY_BELOW_TEMPERATURE:
                raise RequestError(400, f"rid {request.rid}: the reference engine's speculative decoding is greedy only; send temperature 0")
            if request.return_logprob:
                raise RequestError(400, f"rid {request.rid}: return_logprob is not supported with the reference engine's speculative decoding")
            with self.turns.lock, torch.inference_mode():
                output_ids, finish_reason, stats = self.speculative.generate(
                    request.input_ids, max_new_tokens, self.eos_token_ids, request.ignore_eos, between_rounds=self.turns.pause
                )
            return output_ids, finish_reason, stats.meta_info(len(output_ids))
        ids = torch.tensor([request.input_ids], dtype=torch.long, device=self.device)
        # Prompt logprobs need every position's logits, not only the last one's.
        prompt_logprobs_wanted = request.return_logprob and request.logprob_start_len < len(request.input_ids)
        logits_kwargs = {} if prompt_logprobs_wanted else self._logits_kwargs
        cached = 0
        if self.prefix_cache is not None:  # TEST ONLY: capture_fault radix-cache
            cached = self.prefix_cache.reuse(request.input_ids, request.return_logprob, request.logprob_start_len)
        output_ids: list[int] = []
        output_logprobs: list[torch.Tensor] = []
        finish_reason: dict[str, Any] = {"type": "length", "length": max_new_tokens}
        with self.turns.turn(request.rid) as aborted, torch.inference_mode():
            if aborted:
                return [], {"type": "abort", "message": f"request {request.rid} aborted by /abort_request"}, {}
            if capture:
                fault = self.faults.forward_capture_fault()  # TEST ONLY when set (and forward_seconds)
                hooks = FaultyCapture(self.model, self.aux_layer_ids, fault) if fault else HiddenStateCapture(self.model, self.aux_layer_ids)
                with hooks:
                    out = self.model(input_ids=ids, use_cache=max_new_tokens > 1, **logits_kwargs)
                self._submit_dump(request.rid, hooks.stacked()[cached:], request.input_ids[cached:])
            else:
                out = self.model(input_ids=ids, use_cache=max_new_tokens > 1, **logits_kwargs)
            prompt_logprobs = torch.log_softmax(out.logits[0].float(), dim=-1) if prompt_logprobs_wanted else None
            for step in range(max_new_tokens):
                logits = out.logits[0, -1]
                token = _pick_token(logits, request.temperature)
                output_ids.append(token)
                if request.return_logprob:
                    output_logprobs.append(_sampling_logprobs(logits, request.temperature))
                if token in self.eos_token_ids and not request.ignore_eos:
                    finish_reason = {"type": "stop", "matched": token}
                    break
                if step + 1 < max_new_tokens:
                    # Between decode steps, requests waiting for a forward (a /health check) get theirs:
                    # one long generation never holds the engine past a step.
                    self.turns.pause()
                    out = self.model(
                        input_ids=torch.tensor([[token]], device=self.device),
                        past_key_values=out.past_key_values,
                        use_cache=True,
                        **self._logits_kwargs,
                    )
        # The answer does not wait for the dump: the writer publishes it off the forward path (as in SGLang).
        decode = self._token_decoder(request)
        meta = logprob_meta_info(request, prompt_logprobs, output_logprobs, output_ids, self.vocab_size, decode)
        return output_ids, finish_reason, {**meta, **({"cached_tokens": cached} if cached else {})}

    def _token_decoder(self, request: GenerateRequest) -> Callable[[list[int]], str] | None:
        """The tokenizer's ``decode`` when the answer's logprobs carry text (SGLang needs a tokenizer for it)."""
        if not (request.return_logprob and request.return_text_in_logprobs):
            return None
        if self.tokenizer is None:
            raise RequestError(400, f"rid {request.rid}: return_text_in_logprobs needs a tokenizer and the model folder has none")
        return self.tokenizer.decode

    def _decode(self, output_ids: list[int]) -> str:
        return self.tokenizer.decode(output_ids) if self.tokenizer is not None and output_ids else ""

    def _count(self, prompt_tokens: int, failed: bool) -> None:
        """Count a request and print a rate line every ``STATS_INTERVAL_S`` seconds (a server runs for hours)."""
        with self._stats_lock:
            self._requests += 1
            self._failed += int(failed)
            self._prompt_tokens += prompt_tokens
            now = time.monotonic()
            last_time, last_requests, last_tokens = self._last_stats
            if now - last_time < STATS_INTERVAL_S:
                return
            elapsed = now - last_time
            self._last_stats = (now, self._requests, self._prompt_tokens)
            line = (
                f"generate: {self._requests} requests ({self._failed} failed), {self._prompt_tokens} prompt tokens; "
                f"last {elapsed:.0f}s: {(self._requests - last_requests) / elapsed:.2f} req/s, "
                f"{(self._prompt_tokens - last_tokens) / elapsed:.0f} prompt tok/s"
            )
        print(line, flush=True)


def _pick_token(logits: torch.Tensor, temperature: float) -> int:
    import torch

    if temperature < GREEDY_BELOW_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1))


def _sampling_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-softmax SGLang reports for a generated token: raw when greedy, else of the scaled logits."""
    import torch

    scaled = logits.float() if temperature < GREEDY_BELOW_TEMPERATURE else logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1)


def _eos_token_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


def _load_tokenizer(model_dir: Path, trust_remote_code: bool) -> Any:
    """The folder's tokenizer, or None when it ships none (a bare test model)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
    if not any((model_dir / name).exists() for name in names):
        return None
    from eagleflow.verifier import load_tokenizer

    return load_tokenizer(model_dir, trust_remote_code)
