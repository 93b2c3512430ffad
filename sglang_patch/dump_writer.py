"""Writes captured hidden states to ``<dump_dir>/<rid>.safetensors`` off the forward path.

Used by both capture paths: the SGLang forward hook (inside the server's model-runner
process) and eagleflow's reference engine. The caller hands over device tensors; this
writer encodes them in the run's storage dtype where they are (fp8 quantisation on the GPU,
so only the stored bytes cross to the host), copies them to host memory (pinned,
non-blocking where CUDA is used) and a background thread writes them, so the forward pass
never waits on disk. The queue is
bounded: when the disk falls behind, ``submit`` blocks rather than letting host memory grow
without limit.

A request that cannot give a complete dump gets ``<rid>.error.json`` instead, with the
reason; the extractor reports it for that row rather than training on a short file.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from sglang_patch.file_mode import published_file_mode
from sglang_patch.sample_file import TOKEN_IDS_KEY, encode_hidden_states, write_encoded_sample
from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HiddenStatesDtype, check_hidden_states_dtype

DUMP_SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error.json"


def dump_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    """Where the dump of request ``rid`` appears."""
    return Path(dump_dir) / f"{rid}{DUMP_SUFFIX}"


def error_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    """Where the error record of request ``rid`` appears instead of a dump."""
    return Path(dump_dir) / f"{rid}{ERROR_SUFFIX}"


class DumpWriter:
    """Background writer of per-request dumps and error records.

    :param dump_dir: folder the files appear in (created if missing).
    :param max_pending: bound of the queue of captured-but-unwritten requests.
    :param hidden_states_dtype: storage dtype of the dumps (``bf16`` or ``fp8``).
    """

    def __init__(
        self,
        dump_dir: str | os.PathLike[str],
        max_pending: int = 16,
        hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
    ) -> None:
        self.hidden_states_dtype = check_hidden_states_dtype(hidden_states_dtype)
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=max_pending)
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="hs-dump-writer", daemon=True)
        self._thread.start()

    def submit(self, rid: str, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Queue ``[seq_len, n_slots, hidden]`` states and ``[seq_len]`` ids of request ``rid``."""
        encoded = encode_hidden_states(hidden_states, self.hidden_states_dtype)
        host_states = {key: _to_host(value) for key, value in encoded.items()}
        host_ids = _to_host(token_ids)
        event = None
        if hidden_states.is_cuda or token_ids.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._queue.put((rid, (host_states, host_ids, event)))

    def submit_error(self, rid: str, reason: str, **fields: Any) -> None:
        """Queue an error record for ``rid`` (``reason`` plus any JSON-able fields)."""
        self._queue.put((rid, {"rid": rid, "error": reason, **fields}))

    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued item is on disk (``timeout`` in seconds, None = forever)."""
        done = threading.Event()
        self._queue.put(("", done))
        if not done.wait(timeout):
            raise TimeoutError(f"dump writer did not drain within {timeout}s")

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    @property
    def write_errors(self) -> list[str]:
        """Messages of writes that failed (disk full, permissions); empty when all went well."""
        return list(self._errors)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            rid, payload = item
            try:
                if isinstance(payload, threading.Event):
                    payload.set()
                elif isinstance(payload, dict):
                    _write_json_atomic(error_path(self.dump_dir, rid), payload)
                else:
                    host_states, host_ids, event = payload
                    if event is not None:
                        event.synchronize()
                    write_encoded_sample(dump_path(self.dump_dir, rid), {**host_states, TOKEN_IDS_KEY: host_ids})
            except Exception as exc:  # a failed write must not kill the server's writer thread
                message = f"{rid}: {type(exc).__name__}: {exc}"
                self._errors.append(message)
                try:
                    _write_json_atomic(error_path(self.dump_dir, rid), {"rid": rid, "error": f"write failed: {message}"})
                except Exception:
                    pass


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_cuda:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
    return tensor.detach().clone()


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, published_file_mode())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
