"""Hidden-state capture inside an SGLang server: the hook SGLang's ``--forward-hooks`` loads.

:mod:`sglang_patch.hook_spec` builds the spec that names :func:`capture_hook_factory`; SGLang
calls the factory once per model-runner process with the spec's ``config`` dict and registers
the :class:`HiddenStateCapture` it returns as a *post* forward hook, ``hook(module, args,
output)``, on every target module. No SGLang file is edited and the model's return value is
never touched (this hook always returns None).

What is captured (docs/design.md §3.1): layer id k is the residual stream entering decoder layer k,
``hidden_states + residual`` in SGLang's DeepSeek-V2/V3 code, before any norm. SGLang only
registers post hooks, and a layer's *inputs* are no use there (the next norm folds the residual
add in place), so:

- id k >= 1: the output of layer k-1, read at once into a new tensor by the reader of the
  installed SGLang's layer-boundary API (:mod:`sglang_patch.layer_output`: the layer's
  ``(hidden_states, residual)`` summed up to 0.5.20, SGLang's own residual-stream snapshot
  from 0.5.21);
- id 0: the output of ``embed_tokens`` (layer 0's input), cloned;
- the final slot: the output of the last layer, read the same way, before ``model.norm``.

Each request of an EXTEND pass (rid from ``forward_batch.rids``) gets
``<dump_dir>/<rid>.safetensors`` with ``hidden_states [seq_len, n_aux + 1, hidden]`` in the run's
storage dtype (bf16, or fp8 with per-token scales) and ``token_ids [seq_len]``, written by
:class:`sglang_patch.dump_writer.DumpWriter` (encoded where the states are, host copy,
background thread, atomic files). Only tensor-parallel rank 0 writes; where reading a layer's state is a collective
(an owed TP sum completed on a copy), every rank reads it at the same point and discards it.
Health-check requests and decode/idle passes are skipped; a request whose pass reuses a cached
prefix (``extend_prefix_len > 0``) would give a short dump, so it gets ``<rid>.error.json``.

Memory: at the pass's first hooked layer each request reserves its host bytes in the writer's
budget and gets its buffers (or, when the writer stays behind, an error record: the pass never
waits more than the writer's ``wait_seconds`` in all). In bf16 each layer's state is copied to
the host as soon as it is read, so the capture holds at most one layer's state on the GPU. In
fp8 one scale spans every slot of a token, so each request's slots are kept on the states' own
device (a staging tensor: n_slots x tokens x hidden in the model dtype, 57 KB per token at Kimi
shape) until the last captured layer; there they are quantised, and only the fp8 bytes and the
scales are copied to (pinned) host memory, half the bytes of bf16. The same code runs on CPU
tensors, where the "device" is the host.

The factory refuses an SGLang outside :data:`sglang_patch.hook_spec.SUPPORTED_RANGE`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_patch.handoff import CAPTURE_FAILED, PREFIX_REUSED
from sglang_patch.hook_spec import DUMP_DIR_ENV, HOOK_NAME, UnsupportedSGLangVersion
from sglang_patch.layer_ids import validate_aux_layer_ids
from sglang_patch.layer_output import LayerOutputReader, LayerTupleReader, StateSum, reader_for
from sglang_patch.mooncake_store import SAMPLE_STORE_ENV, store_option
from sglang_patch.request_ids import is_captured
from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HiddenStatesDtype, check_hidden_states_dtype

if TYPE_CHECKING:  # torch is imported where it is used: importing this module stays cheap
    import torch

    from sglang_patch.dump_writer import DumpWriter
    from sglang_patch.pending_dump import PendingDump

logger = logging.getLogger(__name__)


def installed_sglang_version() -> str:
    """``sglang.__version__`` of the running server (already imported there, so this is cheap)."""
    try:
        import sglang
    except ImportError as exc:
        raise UnsupportedSGLangVersion("not installed") from exc
    return str(getattr(sglang, "__version__", "unknown"))


def _sglang_tp_rank() -> int:
    """This process's tensor-parallel rank, from SGLang's own parallel state."""
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def capture_hook_factory(config: dict[str, Any] | None) -> HiddenStateCapture:
    """The ``hook_factory`` SGLang calls once per model-runner process with the spec's config.

    Refuses an unsupported SGLang (the server then fails at start-up with the message,
    rather than producing wrong dumps for hours). Config keys: ``aux_layer_ids`` (list of
    ints), ``num_layers`` (the model's decoder-layer count), ``dump_dir`` (else the
    ``SGLANG_HS_DUMP_DIR`` environment variable), optional ``hidden_states_dtype`` (``bf16``,
    the default, or ``fp8``), ``max_pending_bytes`` (the writer's byte budget; default: from the
    host's memory) and ``wait_seconds`` (how long a pass may wait for budget before its requests
    get "writer behind"), optional ``sample_store`` (a Mooncake Store's address: samples go there, not to
    the folder; else the ``EAGLEFLOW_SAMPLE_STORE`` environment variable).
    """
    version = installed_sglang_version()
    reader = reader_for(version)
    config = dict(config or {})
    missing = [key for key in ("aux_layer_ids", "num_layers") if key not in config]
    if missing:
        raise ValueError(f"forward-hooks config of {HOOK_NAME} lacks {missing}; got keys {sorted(config)}")
    dump_dir = config.get("dump_dir") or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir:
        raise ValueError(f"no dump folder: set 'dump_dir' in the {HOOK_NAME} hook config or ${DUMP_DIR_ENV}")
    capture = HiddenStateCapture(
        aux_layer_ids=config["aux_layer_ids"],
        num_layers=int(config["num_layers"]),
        dump_dir=str(dump_dir),
        tp_rank=_sglang_tp_rank,
        writer_options={key: config[key] for key in ("max_pending_bytes", "wait_seconds") if config.get(key) is not None}
        | store_option(config.get("sample_store") or os.environ.get(SAMPLE_STORE_ENV)),
        hidden_states_dtype=config.get("hidden_states_dtype", DEFAULT_HIDDEN_STATES_DTYPE),
        reader=reader,
    )
    logger.info(
        "eagleflow capture hook loaded (sglang %s, %s API): aux layer ids %s + final %d as %s -> %s",
        version, reader.api, capture.aux_layer_ids, capture.num_layers, capture.hidden_states_dtype, dump_dir,
    )
    return capture


class HiddenStateCapture:
    """The post forward hook: collects one pass's slot states, then hands per-request dumps over.

    One instance is registered on every target module; calls arrive in forward order
    (``embed_tokens``, the aux layers, the last layer), and the last layer's call ends the pass.

    :param aux_layer_ids: layer ids to capture, in slot order (the final slot is added).
    :param num_layers: number of decoder layers of the model (id ``num_layers`` = final slot).
    :param dump_dir: where ``<rid>.safetensors`` / ``<rid>.error.json`` appear.
    :param tp_rank: returns this process's tensor-parallel rank; only rank 0 writes.
    :param writer_factory: builds the writer for ``dump_dir`` (the real DumpWriter by default).
    :param writer_options: keyword arguments for the writer (``max_pending_bytes``, ``wait_seconds``).
    :param hidden_states_dtype: storage dtype of the dumps (``bf16`` or ``fp8``).
    :param reader: reads a layer's residual-stream state (:func:`sglang_patch.layer_output.reader_for`).
    """

    def __init__(
        self,
        aux_layer_ids: Sequence[int],
        num_layers: int,
        dump_dir: str | os.PathLike[str],
        tp_rank: Callable[[], int],
        writer_factory: Callable[..., DumpWriter] | None = None,
        writer_options: dict[str, Any] | None = None,
        hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
        reader: LayerOutputReader | None = None,
    ) -> None:
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, num_layers)
        self.hidden_states_dtype = check_hidden_states_dtype(hidden_states_dtype)
        self._reader: LayerOutputReader = reader or LayerTupleReader()
        self.num_layers = num_layers
        self.dump_dir = str(dump_dir)
        self.n_slots = len(self.aux_layer_ids) + 1
        self._tp_rank = tp_rank
        self._writer_factory = writer_factory
        self._writer_options = dict(writer_options or {})
        # Which slots a layer's output fills: id k >= 1 is layer k-1's output; the final slot
        # is the last layer's output.
        self._slots_of_layer: dict[int, list[int]] = {}
        for slot, k in enumerate(self.aux_layer_ids):
            if k >= 1:
                self._slots_of_layer.setdefault(k - 1, []).append(slot)
        self._slots_of_layer.setdefault(num_layers - 1, []).append(self.n_slots - 1)
        self._embedding_slots = [slot for slot, k in enumerate(self.aux_layer_ids) if k == 0]
        self._is_rank0: bool | None = None
        self._writer: DumpWriter | None = None
        self._lock = threading.Lock()
        # State of the pass in progress.
        self._batch: Any = None
        self._pass_done = False  # True once self._batch's dumps/errors are handed over
        self._requests: list[_Request] = []  # this pass's captured requests that hold a buffer
        self._settled: set[str] = set()  # rids of this pass that already have a buffer or a record
        self._filled: set[int] = set()  # slots copied so far in this pass
        self._total_tokens = 0
        self._embedding: torch.Tensor | None = None

    # -- the hook -------------------------------------------------------------------------

    def __call__(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        """``register_forward_hook`` signature; returns None so the output is left as it is."""
        if self._is_rank0 is None:
            self._is_rank0 = self._tp_rank() == 0
        if not (self._is_rank0 or self._reader.every_rank):
            return None
        batch = None
        try:
            if not isinstance(output, (tuple, list)):
                if self._is_rank0:
                    self._on_embedding(output)
                return None
            batch = _forward_batch_of(args)
            # First, and on every rank alike: a read may be a collective, so no rank may skip it
            # for a reason of its own (an error, a finished pass) while the others go ahead.
            state = self._read_state(module, batch, output)
            if not self._is_rank0 or (batch is self._batch and self._pass_done):
                return None  # another rank, or a pass that already handed its dumps or errors over
            self._on_layer(module, batch, state)
        except Exception as exc:  # a capture bug must cost rows, not the server
            logger.exception("eagleflow capture hook failed on %s", type(module).__name__)
            if self._is_rank0 and not (batch is not None and batch is self._batch and self._pass_done):
                self._fail_batch(batch, f"capture hook error: {type(exc).__name__}: {exc}")  # the pass's first error
        return None

    def close(self) -> None:
        """Write what is queued and stop the writer thread (also run at interpreter exit)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- one pass -------------------------------------------------------------------------

    def _on_embedding(self, output: torch.Tensor) -> None:
        # No forward_batch reaches embed_tokens; keep a copy (the layers' in-place norms
        # overwrite this tensor) until the first layer call of the same pass picks it up.
        if self._embedding_slots:
            self._embedding = output.detach().clone()

    def _read_state(self, module: Any, batch: Any, output: Sequence[Any]) -> torch.Tensor | StateSum | None:
        """This layer's residual-stream state when the pass captures it, else None.

        Decided by what every TP rank sees alike (the pass mode, the layer), never by
        rank 0's own bookkeeping, so every rank that must read reads at the same points.
        """
        if not _is_capture_pass(batch.forward_mode) or int(module.layer_id) not in self._slots_of_layer:
            return None
        if getattr(batch, "can_run_tbo", False):
            raise RuntimeError(
                "two-batch overlap runs this pass's later layers without calling them as modules, so their "
                "hooks never fire: launch SGLang without --enable-two-batch-overlap"
            )
        try:
            return self._reader.read(output, batch)
        except RuntimeError as exc:
            raise RuntimeError(f"layer {int(module.layer_id)}: {exc}") from exc

    def _on_layer(self, module: Any, batch: Any, state: torch.Tensor | StateSum | None) -> None:
        if not _is_capture_pass(batch.forward_mode):
            self._reset()
            return
        layer_id = int(module.layer_id)
        slots = self._slots_of_layer.get(layer_id)
        if slots is None or state is None:
            return  # a module this hook was not meant for (the patterns are exact, so: a second model)
        if batch is not self._batch:
            self._start_pass(module, batch, state)
        if int(state.shape[0]) != self._total_tokens:
            raise RuntimeError(f"layer {layer_id} output has {int(state.shape[0])} rows, the pass {self._total_tokens} tokens")
        # Copied out now (on the GPU the reader's state is a new tensor; on CPU tensors the sum is
        # added straight into the buffers): in bf16 to the host, so the GPU holds one layer's state
        # at a time; in fp8 into each request's staging, quantised after the last captured layer.
        for slot in slots:
            self._copy_out(slot, state, 0)
        self._filled.update(slots)
        if layer_id == self.num_layers - 1:
            self._finish_pass(batch)
            self._reset()
            # Keep the batch: a module reached twice in one pass (registered under two names)
            # must not start a second, incomplete pass.
            self._batch, self._pass_done = batch, True

    def _copy_out(self, slot: int, part: Any, begin: int) -> None:
        """Copy the batch's tokens ``begin…`` of ``slot`` into each request's host buffer."""
        end = begin + int(part.shape[0])
        for request in self._requests:
            lo, hi = max(begin, request.start), min(end, request.start + request.length)
            if lo < hi:
                request.dump.put(slot, part[lo - begin : hi - begin], start=lo - request.start)

    def _start_pass(self, module: Any, batch: Any, hidden_states: Any) -> None:
        """Name the pass's requests, check their lengths, reserve their buffers (or record why not)."""
        self._reset()
        self._batch = batch
        configured = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if configured is not None and int(configured) != self.num_layers:
            raise RuntimeError(
                f"hook configured for num_layers={self.num_layers} but the model has "
                f"num_hidden_layers={configured}: relaunch with the right layer count"
            )
        embedding, self._embedding = self._embedding, None
        if self._embedding_slots and embedding is None:
            raise RuntimeError("layer id 0 requested but embed_tokens' output was not seen in this pass")
        rids = list(batch.rids) if batch.rids is not None else None
        if rids is None:
            raise RuntimeError("forward_batch.rids is None: cannot name the dumps")
        seq_lens = _int_list(batch.extend_seq_lens_cpu, batch.extend_seq_lens)
        prefix_lens = _int_list(batch.extend_prefix_lens_cpu, batch.extend_prefix_lens)
        if not (len(rids) == len(seq_lens) == len(prefix_lens)):
            raise RuntimeError(f"{len(rids)} rids but {len(seq_lens)} extend lengths and {len(prefix_lens)} prefix lengths")
        self._total_tokens = total = sum(seq_lens)
        if int(batch.input_ids.shape[0]) != total or int(hidden_states.shape[0]) != total:
            raise RuntimeError(
                f"token count mismatch: extend lengths sum to {total}, input_ids has "
                f"{int(batch.input_ids.shape[0])}, the layer output {int(hidden_states.shape[0])} rows"
            )
        if not any(is_captured(rid) for rid in rids):
            return
        writer = self._get_writer()
        deadline = time.monotonic() + writer.wait_seconds  # the whole pass waits at most this long
        start = 0
        for rid, length, prefix in zip(map(str, rids), seq_lens, prefix_lens):
            offset, start = start, start + length
            if not is_captured(rid):
                continue
            self._settled.add(rid)
            if prefix > 0:
                writer.submit_error(
                    rid,
                    f"extend pass reused a cached prefix of {prefix} tokens, so only {length} of "
                    f"{prefix + length} states were computed (radix cache or chunked prefill is on)",
                    kind=PREFIX_REUSED, extend_prefix_len=prefix, extend_seq_len=length,
                )
                continue
            dump = writer.begin(
                rid, length, self.n_slots, int(hidden_states.shape[-1]), hidden_states.dtype,
                device=hidden_states.device, deadline=deadline,
            )
            if dump is not None:
                self._requests.append(_Request(rid, offset, length, dump))
        if embedding is not None:
            for slot in self._embedding_slots:
                self._copy_out(slot, embedding, 0)
            self._filled.update(self._embedding_slots)

    def _finish_pass(self, batch: Any) -> None:
        layer_ids = [*self.aux_layer_ids, self.num_layers]
        missing = [layer_ids[s] for s in range(self.n_slots) if s not in self._filled]
        if missing:
            raise RuntimeError(f"no state captured for layer ids {missing}: the hook is not registered on their modules")
        for request in self._requests:
            request.dump.commit(batch.input_ids[request.start : request.start + request.length])
        self._requests = []

    def _fail_batch(self, batch: Any, reason: str) -> None:
        """Give every wanted request of ``batch`` an error record, so no row waits for a dump."""
        requests, settled = self._requests, self._settled
        self._reset()
        self._batch, self._pass_done = batch, batch is not None
        try:
            for request in requests:
                request.dump.cancel(reason, kind=CAPTURE_FAILED)
            rids = getattr(batch, "rids", None) if batch is not None else None
            for rid in rids or []:
                if is_captured(rid) and str(rid) not in settled:
                    self._get_writer().submit_error(str(rid), reason, kind=CAPTURE_FAILED)
        except Exception:
            logger.exception("eagleflow capture hook could not record the failure")

    def _reset(self) -> None:
        self._batch, self._pass_done = None, False
        self._requests, self._settled, self._filled = [], set(), set()
        self._total_tokens = 0

    def _get_writer(self) -> DumpWriter:
        with self._lock:
            if self._writer is None:
                factory = self._writer_factory
                if factory is None:
                    from sglang_patch.dump_writer import DumpWriter as factory
                self._writer = factory(self.dump_dir, hidden_states_dtype=self.hidden_states_dtype, **self._writer_options)
                atexit.register(self.close)
            return self._writer


@dataclass
class _Request:
    """One captured request of the pass in progress: its tokens in the batch and its buffer."""

    rid: str
    start: int
    length: int
    dump: PendingDump


def _is_capture_pass(mode: Any) -> bool:
    """EXTEND-like passes of the target model; not decode, idle or speculative verification."""
    if mode.is_decode() or mode.is_idle():
        return False
    return bool(mode.is_extend()) and not mode.is_target_verify()


def _forward_batch_of(args: tuple[Any, ...]) -> Any:
    """The ForwardBatch among a decoder layer's positional arguments (index 2 in SGLang)."""
    if len(args) > 2 and hasattr(args[2], "forward_mode"):
        return args[2]
    for arg in args:
        if hasattr(arg, "forward_mode"):
            return arg
    raise RuntimeError(f"no ForwardBatch among the layer's {len(args)} positional arguments")


def _int_list(cpu: Sequence[int] | None, device: Any) -> list[int]:
    if cpu is not None:
        return [int(n) for n in cpu]
    if device is None:
        raise RuntimeError("forward_batch has no extend lengths")
    return [int(n) for n in device.tolist()]  # the gpu-only path leaves the *_cpu mirrors unset
