"""Hidden-state capture inside an SGLang server, entered through SGLang's own ``--forward-hooks``.

SGLang (``sglang/srt/model_executor/hook_manager.py``) imports the factory named by a hook spec
in every model-runner process, calls it once with the spec's ``config`` dict, and registers the
callable it returns as a *post* forward hook, ``hook(module, args, output)``, on every module
whose qualified name matches one of the spec's ``target_modules`` fnmatch patterns. No SGLang
file is edited and the model's return value is never touched (this hook always returns None).

What is captured (DESIGN.md §3.1): layer id k is the residual stream entering decoder layer k,
``hidden_states + residual`` in SGLang's DeepSeek-V2/V3 code, before any norm. SGLang only
registers post hooks, and a layer's *inputs* are no use there: the next norm folds the
residual add into ``residual`` in place (``fused_add_rmsnorm``), so by the time a hook on layer
k runs, the tensors it was called with hold something else. Hence:

- id k >= 1: the output ``(hidden_states, residual, ...)`` of layer k-1, summed at once into
  a new tensor (before layer k's norm mutates them);
- id 0: the output of ``embed_tokens`` (layer 0's input; its residual is None), cloned;
- the final slot: the output of the last layer, summed the same way, before ``model.norm``.

Each request of an EXTEND pass (rid from ``forward_batch.rids``) gets
``<dump_dir>/<rid>.safetensors`` with ``hidden_states [seq_len, n_aux + 1, hidden]`` in the
model dtype and ``token_ids [seq_len]``, written by :class:`sglang_patch.dump_writer.DumpWriter`
(host copy, background thread, atomic files). Only tensor-parallel rank 0 writes; health-check
requests and decode/idle passes are skipped; a request whose pass reuses a cached prefix
(``extend_prefix_len > 0``) would give a short dump, so it gets ``<rid>.error.json`` instead.

Supported SGLang: ``>=0.5.10,<0.5.21`` (see :data:`SUPPORTED_RANGE`); the factory refuses
anything else when SGLang loads it. Standard library only at import time, so the launcher
(:mod:`eagleflow.sglang_server`) can import the spec helpers without torch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the launcher imports this module too
    import torch

    from sglang_patch.dump_writer import DumpWriter

logger = logging.getLogger(__name__)

# The supported SGLang versions, [MIN, BELOW). Why these ends (checked against the wheels by
# tests/sglang_patch/test_sglang_source.py):
# - 0.5.10 is the first release whose ForwardBatch carries ``rids`` (forward_batch_info.py);
#   before it the hook cannot tell which request a token belongs to.
# - 0.5.21 folded the residual into the layer's hidden-state handle: DeepseekV2DecoderLayer.forward
#   lost its ``residual`` argument and returns ``(hidden_states, topk_indices)``, so
#   "hidden_states + residual at a layer's output" no longer exists as two tensors.
# Within the range every DeepSeek-V2/V3 decoder layer is called positionally as
# ``layer(positions, hidden_states, forward_batch, residual, ...)`` and returns
# ``(hidden_states, residual, topk_indices)``, and Kimi-K2.5 (KimiK25ForConditionalGeneration)
# wraps the same DeepseekV3ForCausalLM as ``language_model``.
SUPPORTED_MIN = (0, 5, 10)
SUPPORTED_BELOW = (0, 5, 21)
SUPPORTED_RANGE = ">=0.5.10,<0.5.21"

HOOK_NAME = "eagleflow_hidden_states"
HOOK_FACTORY = "sglang_patch.hook:capture_hook_factory"
DUMP_DIR_ENV = "SGLANG_HS_DUMP_DIR"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang/srt/constants.py; /health's rid is f"{prefix}_{uuid}"

# Where the DeepseekV2Model sits in SGLang's module tree:
# DeepseekV3ForCausalLM.model (DeepSeek-V3) and
# KimiK25ForConditionalGeneration.language_model.model (Kimi-K2.5, a multimodal wrapper).
DEEPSEEK_V3_MODEL_PREFIX = "model"
KIMI_K25_MODEL_PREFIX = "language_model.model"
MODEL_PREFIXES = (DEEPSEEK_V3_MODEL_PREFIX, KIMI_K25_MODEL_PREFIX)


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is outside :data:`SUPPORTED_RANGE`; carries the version found."""

    def __init__(self, version: str) -> None:
        self.version = version
        super().__init__(
            f"eagleflow's hidden-state capture hook supports sglang {SUPPORTED_RANGE}, found sglang "
            f"{version!r}. Below 0.5.10 ForwardBatch has no rids (no way to name a request's dump); "
            "from 0.5.21 a decoder layer no longer returns (hidden_states, residual). "
            f"Install a supported release, e.g. pip install 'sglang{SUPPORTED_RANGE}'."
        )


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; raises ValueError for text without a x.y.z start."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"not a version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def is_supported_version(version: str) -> bool:
    """Whether SGLang ``version`` lies in :data:`SUPPORTED_RANGE`."""
    try:
        parsed = parse_version(version)
    except ValueError:
        return False
    return SUPPORTED_MIN <= parsed < SUPPORTED_BELOW


def check_supported_version(version: str) -> None:
    """Raise :class:`UnsupportedSGLangVersion` unless ``version`` is supported."""
    if not is_supported_version(version):
        raise UnsupportedSGLangVersion(version)


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


def validate_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Check aux ids against the model depth (0..num_layers); returns them as ints, order kept."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    ids = [int(k) for k in aux_layer_ids]
    if not ids:
        raise ValueError("aux_layer_ids is empty: name at least one layer id to capture")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux_layer_ids has duplicates: {ids}")
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(
            f"aux_layer_ids {bad} out of range for a {num_layers}-layer model: ids are 0..{num_layers} "
            f"(id k = the state entering layer k; id {num_layers} = the last layer's pre-norm output, "
            "which is also always captured as the final slot)"
        )
    return ids


def target_module_names(aux_layer_ids: Sequence[int], num_layers: int) -> list[str]:
    """The module names the hook must be registered on, for DeepSeek-V3 and Kimi-K2.5 trees.

    ``embed_tokens`` for id 0, layer k-1 for id k >= 1, and the last layer for the final slot.
    They are exact names (fnmatch patterns without wildcards), so ``layers.2`` never matches
    ``layers.20``; the names of the layout a model does not have simply match nothing.
    """
    ids = validate_layer_ids(aux_layer_ids, num_layers)
    layers = sorted({k - 1 for k in ids if k >= 1} | {num_layers - 1})
    names: list[str] = []
    for prefix in MODEL_PREFIXES:
        if 0 in ids:
            names.append(f"{prefix}.embed_tokens")
        names += [f"{prefix}.layers.{i}" for i in layers]
    return names


def forward_hooks_spec(
    aux_layer_ids: Sequence[int], num_layers: int, dump_dir: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """The ``--forward-hooks`` value (a JSON list) that switches the capture on."""
    config: dict[str, Any] = {"aux_layer_ids": validate_layer_ids(aux_layer_ids, num_layers), "num_layers": num_layers}
    if dump_dir is not None:
        config["dump_dir"] = str(dump_dir)
    return [
        {
            "name": HOOK_NAME,
            "target_modules": target_module_names(aux_layer_ids, num_layers),
            "hook_factory": HOOK_FACTORY,
            "config": config,
        }
    ]


def forward_hooks_argument(
    aux_layer_ids: Sequence[int], num_layers: int, dump_dir: str | os.PathLike[str] | None = None
) -> str:
    """:func:`forward_hooks_spec` as the one argv element SGLang's ``json_list_type`` parses."""
    return json.dumps(forward_hooks_spec(aux_layer_ids, num_layers, dump_dir), separators=(",", ":"))


def capture_hook_factory(config: dict[str, Any] | None) -> HiddenStateCapture:
    """The ``hook_factory`` SGLang calls once per model-runner process with the spec's config.

    Refuses an unsupported SGLang (the server then fails at start-up with the message,
    rather than producing wrong dumps for hours). Config keys: ``aux_layer_ids`` (list of
    ints), ``num_layers`` (the model's decoder-layer count), ``dump_dir`` (else the
    ``SGLANG_HS_DUMP_DIR`` environment variable), optional ``max_pending`` (writer queue bound).
    """
    version = installed_sglang_version()
    check_supported_version(version)
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
        max_pending=int(config.get("max_pending", 16)),
    )
    logger.info(
        "eagleflow capture hook loaded (sglang %s): aux layer ids %s + final %d -> %s",
        version, capture.aux_layer_ids, capture.num_layers, dump_dir,
    )
    return capture


class HiddenStateCapture:
    """The post forward hook: collects one pass's slot states, then hands per-request dumps over.

    One instance is registered on every target module; calls arrive in forward order
    (``embed_tokens``, the aux layers, the last layer), and the last layer's call ends the pass.

    :param aux_layer_ids: layer ids to capture, in slot order (the final slot is added).
    :param num_layers: number of decoder layers of the model (id ``num_layers`` = final slot).
    :param dump_dir: where ``<rid>.safetensors`` / ``<rid>.error.json`` appear.
    :param tp_rank: returns this process's tensor-parallel rank; only rank 0 captures.
    :param writer_factory: builds the writer for ``dump_dir`` (the real DumpWriter by default).
    :param max_pending: bound of the writer's queue.
    """

    def __init__(
        self,
        aux_layer_ids: Sequence[int],
        num_layers: int,
        dump_dir: str | os.PathLike[str],
        tp_rank: Callable[[], int],
        writer_factory: Callable[..., DumpWriter] | None = None,
        max_pending: int = 16,
    ) -> None:
        self.aux_layer_ids = validate_layer_ids(aux_layer_ids, num_layers)
        self.num_layers = num_layers
        self.dump_dir = str(dump_dir)
        self.n_slots = len(self.aux_layer_ids) + 1
        self._tp_rank = tp_rank
        self._writer_factory = writer_factory
        self._max_pending = max_pending
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
        self._slots: dict[int, torch.Tensor] = {}
        self._embedding: torch.Tensor | None = None

    # -- the hook -------------------------------------------------------------------------

    def __call__(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        """``register_forward_hook`` signature; returns None so the output is left as it is."""
        if self._is_rank0 is None:
            self._is_rank0 = self._tp_rank() == 0
        if not self._is_rank0:
            return None
        batch = None
        try:
            if not isinstance(output, (tuple, list)):
                self._on_embedding(output)
                return None
            batch = _forward_batch_of(args)
            if batch is self._batch and self._pass_done:
                return None  # this pass already handed its dumps or error records over
            self._on_layer(module, batch, output)
        except Exception as exc:  # a capture bug must cost rows, not the server
            logger.exception("eagleflow capture hook failed on %s", type(module).__name__)
            self._fail_batch(batch, f"capture hook error: {type(exc).__name__}: {exc}")
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

    def _on_layer(self, module: Any, batch: Any, output: Sequence[Any]) -> None:
        if not _is_capture_pass(batch.forward_mode):
            self._reset()
            return
        layer_id = int(module.layer_id)
        if batch is not self._batch:
            self._start_pass(module, batch)
        slots = self._slots_of_layer.get(layer_id)
        if slots is None:
            return  # a module this hook was not meant for (the patterns are exact, so: a second model)
        hidden_states, residual = output[0], output[1]
        if getattr(hidden_states, "_sglang_needs_allreduce_fusion", False):
            # The MLP all-reduce is deferred into the next layer: this is a per-rank partial sum.
            raise RuntimeError(
                f"layer {layer_id} output is a per-rank partial sum (flashinfer all-reduce fusion); "
                "launch SGLang with --enforce-disable-flashinfer-allreduce-fusion"
            )
        # A new tensor, computed now: the next layer's fused add+norm rewrites both in place.
        state = hidden_states.detach() if residual is None else hidden_states.detach() + residual.detach()
        for slot in slots:
            self._slots[slot] = state
        if layer_id == self.num_layers - 1:
            self._finish_pass(batch)
            self._reset()
            # Keep the batch: a module reached twice in one pass (registered under two names)
            # must not start a second, incomplete pass.
            self._batch, self._pass_done = batch, True

    def _start_pass(self, module: Any, batch: Any) -> None:
        self._batch = batch
        self._pass_done = False
        self._slots = {}
        configured = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if configured is not None and int(configured) != self.num_layers:
            raise RuntimeError(
                f"hook configured for num_layers={self.num_layers} but the model has "
                f"num_hidden_layers={configured}: relaunch with the right layer count"
            )
        if self._embedding_slots:
            if self._embedding is None:
                raise RuntimeError("layer id 0 requested but embed_tokens' output was not seen in this pass")
            for slot in self._embedding_slots:
                self._slots[slot] = self._embedding
        self._embedding = None

    def _finish_pass(self, batch: Any) -> None:
        import torch

        layer_ids = [*self.aux_layer_ids, self.num_layers]
        missing = [layer_ids[s] for s in range(self.n_slots) if s not in self._slots]
        if missing:
            raise RuntimeError(f"no state captured for layer ids {missing}: the hook is not registered on their modules")
        rids = list(batch.rids) if batch.rids is not None else None
        if rids is None:
            raise RuntimeError("forward_batch.rids is None: cannot name the dumps")
        seq_lens = _int_list(batch.extend_seq_lens_cpu, batch.extend_seq_lens)
        prefix_lens = _int_list(batch.extend_prefix_lens_cpu, batch.extend_prefix_lens)
        if not (len(rids) == len(seq_lens) == len(prefix_lens)):
            raise RuntimeError(f"{len(rids)} rids but {len(seq_lens)} extend lengths and {len(prefix_lens)} prefix lengths")
        total = sum(seq_lens)
        rows = {s: int(t.shape[0]) for s, t in self._slots.items()}
        if any(n != total for n in rows.values()) or int(batch.input_ids.shape[0]) != total:
            raise RuntimeError(
                f"token count mismatch: extend lengths sum to {total}, input_ids has "
                f"{int(batch.input_ids.shape[0])}, captured rows {sorted(set(rows.values()))}"
            )
        wanted = [i for i, rid in enumerate(rids) if _wanted(rid)]
        if not wanted:
            return
        writer = self._get_writer()
        slots = [self._slots[s] for s in range(self.n_slots)]
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        for i in wanted:
            rid, start, length, prefix = str(rids[i]), starts[i], seq_lens[i], prefix_lens[i]
            if prefix > 0:
                writer.submit_error(
                    rid,
                    f"extend pass reused a cached prefix of {prefix} tokens, so only {length} of "
                    f"{prefix + length} states were computed (radix cache or chunked prefill is on)",
                    extend_prefix_len=prefix,
                    extend_seq_len=length,
                )
                continue
            # Stacked per request, so the extra GPU memory is one request's [seq, slots, hidden] at a time.
            states = torch.stack([slot[start : start + length] for slot in slots], dim=1)
            writer.submit(rid, states, batch.input_ids[start : start + length])

    def _fail_batch(self, batch: Any, reason: str) -> None:
        """Give every wanted request of ``batch`` an error record, so no row waits for a dump."""
        self._reset()
        self._batch, self._pass_done = batch, batch is not None
        rids = getattr(batch, "rids", None) if batch is not None else None
        if not rids:
            return
        try:
            writer = self._get_writer()
            for rid in rids:
                if _wanted(rid):
                    writer.submit_error(str(rid), reason)
        except Exception:
            logger.exception("eagleflow capture hook could not record the failure")

    def _reset(self) -> None:
        self._batch, self._pass_done = None, False
        self._slots = {}
        self._embedding = None

    def _get_writer(self) -> DumpWriter:
        with self._lock:
            if self._writer is None:
                factory = self._writer_factory
                if factory is None:
                    from sglang_patch.dump_writer import DumpWriter as factory
                self._writer = factory(self.dump_dir, max_pending=self._max_pending)
                atexit.register(self.close)
            return self._writer


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


def _wanted(rid: Any) -> bool:
    return rid is not None and not str(rid).startswith(HEALTH_CHECK_RID_PREFIX)
