"""The hand-off through a Mooncake Store instead of a folder (Param ``sample_transport`` ``mooncake``).

An engine on one node and its extractor or trainer on another then need no filesystem both
see: the capture's writer puts each finished sample into the store, the reader gets it from
there and removes it. The hand-off's contract is :mod:`sglang_patch.handoff`'s, keyed under
the run's namespace instead of named in a folder:

- ``<namespace>/<rid>``: the sample, the very bytes of its §3.2 safetensors file
  (:func:`~sglang_patch.sample_file.encoded_sample_bytes`): self-describing, so the reader checks
  it as it checks a file (header, token ids, the writer's finiteness verdict) and can publish
  it as ``hs_{row}`` unchanged. hs-connectors' Mooncake format packs bare tensors and sends
  their manifest out of band, in vLLM's ``kv_transfer_params``; SGLang's answer has no such
  channel, so the manifest travels inside the value, where safetensors keeps it anyway;
- ``<namespace>/<rid>:error``: the :class:`~sglang_patch.handoff.ErrorRecord` as JSON
  (hs-connectors' own ``<key>:error`` convention);
- ``<namespace>/.writer-<host>-<pid>``: the writer's :class:`~sglang_patch.handoff.WriterStatus`,
  upserted about every second and listed through the master's HTTP admin server.

A sample lives in the segment its writer mounts (its size is the engine's byte budget,
``dump_queue_gb``), so an engine that dies takes its unread samples with it and nothing a
killed reader left outlives the engine. Standard library only until :class:`MooncakeSampleStore`
connects (the hook imports this inside the SGLang server, where ``mooncake`` must be installed:
``mooncake-transfer-engine``, or ``mooncake-transfer-engine-non-cuda`` on CPU).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

# Where an engine's capture finds the store: the address as JSON (the reference engine and the SGLang hook read it).
SAMPLE_STORE_ENV = "EAGLEFLOW_SAMPLE_STORE"
# The address this node's Mooncake client announces (127.0.0.1 unless told otherwise; a node's own address when
# engines and trainers run on different nodes). Announcing loopback, its listeners are kept to loopback too.
LOCAL_HOST_ENV = "EAGLEFLOW_MOONCAKE_HOST"
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
STATUS_MARK = ".writer-"
ERROR_MARK = ":error"
MIN_BUFFER_BYTES = 16 << 20
_WRITER_BUFFER_CAP = 4 << 30  # a writer's transfer buffer: the largest sample it can put

# Mooncake's return codes (mooncake-store's ErrorCode) that eagleflow acts on.
NO_SPACE = -200
BUFFER_OVERFLOW = -600  # larger than the client's local buffer (or an invalid argument)
NOT_FOUND = -704
LEASED = -706
TRANSFER_FAILED = -800
RPC_FAILED = -900
_MEANING = {
    NO_SPACE: "the store has no room for it",
    BUFFER_OVERFLOW: "larger than the client's transfer buffer",
    NOT_FOUND: "no such key",
    LEASED: "the object is leased by a reader",
    TRANSFER_FAILED: "the transfer from its segment failed (its engine went away?)",
    RPC_FAILED: "the master does not answer",
}


def store_sample_limit(budget_bytes: int) -> int:
    """The largest sample an engine with this byte budget can put into the store (its transfer buffer)."""
    return min(int(budget_bytes), _WRITER_BUFFER_CAP)


def code_meaning(code: int) -> str:
    """``-900 (the master does not answer)``: a Mooncake return code in words."""
    return f"{code} ({_MEANING.get(code, 'Mooncake error')})"


@dataclass(frozen=True)
class StoreAddress:
    """Where a run's samples go: the master's RPC and HTTP admin addresses, the metadata server, the keys' namespace.

    :param master: ``host:port`` of ``mooncake_master``'s RPC server.
    :param admin: ``host:port`` of the master's HTTP admin server (``/health``, ``/get_all_keys``).
    :param metadata_server: ``http://host:port/metadata`` (``mooncake_http_metadata_server``), an etcd
        address, or ``P2PHANDSHAKE`` (none: the clients exchange their segments' descriptors directly).
    :param namespace: the run's key prefix (several runs may share one master).
    :param protocol: the transfer protocol, ``tcp`` (or ``rdma`` where the nodes have it).
    """

    master: str
    admin: str
    metadata_server: str
    namespace: str
    protocol: str = "tcp"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> StoreAddress:
        """:raises ValueError: ``data`` is not a mapping holding the four addresses."""
        if not isinstance(data, dict):
            raise ValueError(f"sample store address is a JSON {type(data).__name__}, not an object {{master, admin, metadata_server, namespace}}")
        missing = [key for key in ("master", "admin", "metadata_server", "namespace") if not data.get(key)]
        if missing:
            raise ValueError(f"sample store address lacks {missing}: {data}")
        return cls(**{key: str(data[key]) for key in ("master", "admin", "metadata_server", "namespace", "protocol") if key in data})

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StoreAddress:
        """:raises ValueError: ``text`` is not JSON, or not an address (:meth:`from_dict`)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"sample store address is not JSON ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def parse(cls, address: str | dict[str, Any]) -> StoreAddress:
        """An address as the steps pass it (JSON) or as the XCom carries it (a mapping)."""
        return cls.from_json(address) if isinstance(address, str) else cls.from_dict(address)

    def describe(self) -> str:
        return f"the Mooncake master at {self.master}"

    def sample_key(self, rid: str) -> str:
        return f"{self.namespace}/{rid}"

    def error_key(self, rid: str) -> str:
        return f"{self.namespace}/{rid}{ERROR_MARK}"

    def status_key(self, host: str, pid: int) -> str:
        return f"{self.namespace}/{STATUS_MARK}{host}-{pid}"


def store_option(address: str | dict[str, Any] | None) -> dict[str, StoreAddress]:
    """A writer's ``sample_store`` keyword from an address given as JSON or a mapping (nothing when none is)."""
    return {"sample_store": StoreAddress.parse(address)} if address else {}


class StoreError(Exception):
    """The store refused or could not do what was asked; ``code`` is Mooncake's (0 when it is not one)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class MooncakeSampleStore:
    """One process's client of the run's store; thread-safe (one transfer at a time).

    :param address: the store.
    :param segment_bytes: memory this client lends the store (where the samples it puts live);
        0 for a reader, which lends none.
    :param buffer_bytes: the client's transfer buffer: the largest value it can put or get.
    """

    def __init__(self, address: StoreAddress, segment_bytes: int, buffer_bytes: int) -> None:
        # Mooncake reads these at setup: announce where told (127.0.0.1 by default), give up on a master that is
        # not there after two tries (its default retries for about 90 s), and keep its INFO lines out of the logs.
        host = os.environ.get(LOCAL_HOST_ENV, "127.0.0.1")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(
                f"sample_transport mooncake needs Mooncake's store client here ({exc}): pip install "
                "mooncake-transfer-engine (mooncake-transfer-engine-non-cuda without CUDA; it needs libibverbs1)"
            ) from exc
        self.address, self.buffer_bytes = address, max(int(buffer_bytes), MIN_BUFFER_BYTES)
        self._lock = threading.Lock()
        self._client = MooncakeDistributedStore()
        before = _listening_sockets()
        code = self._client.setup(
            host, address.metadata_server, int(segment_bytes), self.buffer_bytes, address.protocol, "", address.master
        )
        if code != 0:
            raise StoreError(f"cannot connect to {address.describe()} (metadata server {address.metadata_server}): setup returned {code}", code)
        if host in _LOOPBACK_HOSTS:
            # Setup opened this client's listeners (its transfer engine's handshake and TCP data ports) on every
            # interface whatever it announces: Mooncake has no setting for their address (MC_TCP_BIND_ADDRESS is
            # only the one announced). A client announcing loopback is reached by no other host, so keep them
            # to the loopback device: a peer on another interface is refused.
            try:
                _confine_to_loopback([fd for inode, fd in _listening_sockets().items() if inode not in before])
            except OSError as exc:
                self._client.close()
                raise StoreError(
                    f"cannot keep this process's Mooncake store client to loopback ({exc}): it would listen on every "
                    f"interface. Set {LOCAL_HOST_ENV} to this node's address to accept that"
                ) from exc

    # -- values -------------------------------------------------------------------------
    def put(self, key: str, data: bytes | bytearray | memoryview) -> int:
        """Put ``data`` under ``key`` unless it exists; Mooncake's code (0: stored)."""
        with self._lock:
            return int(self._client.put(key, data))

    def upsert(self, key: str, data: bytes) -> int:
        with self._lock:
            return int(self._client.upsert(key, data))

    def exists(self, key: str) -> bool:
        """Whether ``key`` is there; :class:`StoreError` when the master cannot say."""
        code = int(self._client.is_exist(key))
        if code < 0:
            raise StoreError(f"{self.address.describe()}: cannot look up {key}: {code_meaning(code)}", code)
        return code == 1

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, whole; None when there is none. Never a part: a value that cannot be read
        whole (its engine went away mid-read, the master is gone) is a :class:`StoreError`."""
        size = int(self._client.get_size(key))
        if size == NOT_FOUND:
            return None
        if size < 0:
            raise StoreError(f"{self.address.describe()}: cannot read {key}: {code_meaning(size)}", size)
        if size > self.buffer_bytes:
            raise StoreError(f"{key} is {size} bytes, more than this reader's {self.buffer_bytes}-byte transfer buffer", BUFFER_OVERFLOW)
        with self._lock:
            data = self._client.get(key)
        if len(data) != size:
            raise StoreError(f"{key}: read {len(data)} of its {size} bytes ({code_meaning(TRANSFER_FAILED)})", TRANSFER_FAILED)
        return bytes(data)

    def remove(self, key: str) -> None:
        """Remove ``key`` now (a reader's lease on it does not keep it); a missing key is no error."""
        self._client.remove(key, True)

    def keys(self, prefix: str) -> list[str]:
        """Keys that start with ``prefix``, from the master's admin server; :class:`StoreError` when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{self.address.admin}/get_all_keys", timeout=5) as answer:
                text = answer.read().decode("utf-8", errors="replace")
        except OSError as exc:
            raise StoreError(f"{self.address.describe()}: its admin server {self.address.admin} does not answer: {exc}", RPC_FAILED) from exc
        return [key for key in text.splitlines() if key.startswith(prefix)]

    def close(self) -> None:
        with self._lock:
            self._client.close()


def _listening_sockets() -> dict[int, int]:
    """This process's listening TCP sockets, inode to file descriptor (from /proc; none where there is no /proc)."""
    listening: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                listening.update(int(f[9]) for f in (row.split() for row in list(rows)[1:]) if f[3] == "0A")
        except OSError:
            continue
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and int(target[8:-1]) in listening:
            found[int(target[8:-1])] = int(name)
    return found


def _confine_to_loopback(fds: list[int]) -> None:
    """Bind these listening sockets that listen on every interface to the loopback device (``SO_BINDTODEVICE``):
    the kernel then refuses a connection that arrives on any other interface. Set on a duplicate of each
    descriptor (the same socket), so the owner's descriptor stays as it was."""
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed (its number perhaps reused) since it was listed: no listener of this client's
        with sock:
            if sock.getsockname()[0] in ("0.0.0.0", "::"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")


def master_healthy(admin: str, timeout: float = 2.0) -> bool:
    """Whether the master behind the admin server ``host:port`` serves (``/health`` says service_ready)."""
    try:
        with urllib.request.urlopen(f"http://{admin}/health", timeout=timeout) as answer:
            return bool(json.loads(answer.read()).get("service_ready"))
    except (OSError, ValueError):
        return False
