"""The SGLang server command line: the one place that decides how ``sglang.launch_server`` is run.

:func:`build_command` turns a typed :class:`SGLangServerConfig` into ``(argv, env)`` — an argv
list (never a shell string) and the environment variables to add — with:

- the seed's tuning: ``--attention-backend triton``, ``--num-continuous-decode-steps 4``,
  ``NCCL_PROTO=LL``, ``NCCL_ALGO=Ring``;
- what hidden-state capture needs (docs/design.md §4): ``--disable-radix-cache`` and
  ``--chunked-prefill-size -1`` (a pass must see the whole prompt, or the dump is short),
  CUDA graphs off for decode *and* prefill (Python hooks do not run inside graph replay; the
  flags for that changed at 0.5.14), ``--enforce-disable-flashinfer-allreduce-fusion`` (with
  TP > 1 the fusion leaves a layer's output as a per-rank partial sum), and ``--forward-hooks``
  pointing at :mod:`sglang_patch.hook` (spec: :mod:`sglang_patch.hook_spec`) with the aux layer ids, layer count and dump folder;
- ``PYTHONUNBUFFERED=1`` (the server log is streamed), ``SGLANG_HS_DUMP_DIR``, and
  ``PYTHONPATH`` led by the folder holding ``sglang_patch`` so every spawned model-runner
  process can import the hook.

It refuses what would silently break capture: an SGLang outside the hook's supported range,
``--attention-backend flashinfer`` on an SM120 (Blackwell) GPU, extra arguments that override a
flag this module owns, flags (or flag values) under which the hook cannot see whole, full-rank
states (two-batch overlap, the deferred MoE finalize of ``--moe-runner-backend
flashinfer_trtllm``, …), and mHC models, whose residual stream SGLang cannot snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from eagleflow.config import AuxLayerIds, StoredHiddenStatesDtype, add_model_arguments, model_from_args
from eagleflow.deploy import SGLANG_PYTHON_ENV
from eagleflow.errors import UserError
from eagleflow.verifier import config_int, text_config
from sglang_patch import hook_spec

# Seed tuning (90.0 tok/s single-stream on the reference node).
NCCL_ENV = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
# The release whose flag names changed: --disable-cuda-graph / --disable-piecewise-cuda-graph
# became deprecated aliases of --cuda-graph-backend-{decode,prefill}=disabled, and 0.5.20
# dropped --disable-piecewise-cuda-graph altogether.
CUDA_GRAPH_BACKEND_FLAGS_SINCE = (0, 5, 14)
FLASHINFER_HANG_COMPUTE_MAJOR = 12  # SM120/SM121 (Blackwell workstation parts)
ATTENTION_BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")

# Flags this module sets from a config field: an extra argument repeating one would silently
# win (argparse keeps the last value), so it is refused with the field to use instead.
OWNED_FLAGS: dict[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--host": "host; the run's engines listen on 127.0.0.1 only: README, 'Where a run may write and listen'",
    "--port": "port",
    "--attention-backend": "attention_backend",
    "--num-continuous-decode-steps": "num_continuous_decode_steps",
    "--forward-hooks": "aux_layer_ids / dump_dir (the capture hook spec)",
    "--chunked-prefill-size": "none: capture needs -1, a chunked prompt gives short dumps",
    "--cuda-graph-backend-decode": "none: capture needs CUDA graphs off",
    "--cuda-graph-backend-prefill": "none: capture needs CUDA graphs off",
    "--cuda-graph-config": "none: capture needs CUDA graphs off",
}
# Flags under which the hook cannot capture correctly, and why.
CAPTURE_BREAKING_FLAGS: dict[str, str] = {
    "--enable-dp-attention": "DP attention spreads requests over attention ranks and shards layer outputs; "
    "the hook writes from tensor-parallel rank 0 only and needs full states",
    "--enable-two-batch-overlap": "two-batch overlap runs layers through op_* functions, not module calls, "
    "so forward hooks never fire",
    "--enable-mixed-chunk": "mixed chunks put decode tokens of other requests into extend passes",
    "--pp-size": "pipeline parallelism puts later layers in another process than the one holding layer 0",
    "--pipeline-parallel-size": "pipeline parallelism puts later layers in another process than the one holding layer 0",
    "--enable-torch-compile": "a compiled forward may trace around the Python hooks",
    "--speculative-algorithm": "speculative decoding adds draft/verify passes; a capture server only prefills",
    "--enable-piecewise-cuda-graph": "prefill CUDA graphs replay without running Python hooks",
    "--enforce-piecewise-cuda-graph": "prefill CUDA graphs replay without running Python hooks",
    "--enable-breakable-cuda-graph": "prefill CUDA graphs replay without running Python hooks",
}
# Flag values under which the hook cannot capture, and why (the flag itself is fine otherwise).
CAPTURE_BREAKING_VALUES: dict[tuple[str, str], str] = {
    ("--moe-runner-backend", "flashinfer_trtllm"): "its deferred MoE finalize hands the next layer an unfinished "
    "output that SGLang's residual-stream snapshot cannot read (0.5.21+); use another --moe-runner-backend",
}
# The model config key of manifold-constrained hyper-connections (DeepSeek-V4, GLM-5-next):
# their residual stream is several streams mixed by learned weights, which SGLang cannot snapshot.
MHC_CONFIG_KEY = "hc_mult"


class SGLangServerConfig(BaseModel):
    """How to launch the SGLang server that captures hidden states."""

    model_path: str = Field(description="the base model: a local folder (its config.json gives the layer count) or a hub id")
    dump_dir: Path = Field(description="folder the capture hook writes <rid>.safetensors / <rid>.error.json to")
    aux_layer_ids: AuxLayerIds = Field(
        description="layer ids to capture (id k = the state entering decoder layer k); the final pre-norm "
        "state is always added as the last slot. Kimi-K2.5: 3,31,59"
    )
    hidden_states_dtype: StoredHiddenStatesDtype
    num_layers: int | None = Field(
        None, description="decoder layers of the model; default: num_hidden_layers (or text_config's) from <model_path>/config.json"
    )
    dump_queue_bytes: int | None = Field(
        None, ge=1,
        description="bytes of captured, not yet written dumps the hook may hold (pinned host memory); "
        "default: 1/8 of the server host's memory, at most 32 GiB",
    )
    tp_size: int = Field(8, description="tensor-parallel size (--tp-size); the reference node has 8 GPUs")
    host: str = Field("127.0.0.1", description="address the server binds")
    port: int = Field(30000, description="port the server binds")
    base_gpu_id: int = Field(
        0, ge=0, description="first GPU the server uses (--base-gpu-id); another engine on the same node holds the ones before it"
    )
    attention_backend: str = Field("triton", description="--attention-backend; flashinfer is refused on SM120 GPUs (it hung there)")
    num_continuous_decode_steps: int = Field(4, description="--num-continuous-decode-steps (seed tuning)")
    extra_args: list[str] = Field(
        default_factory=list, description="further sglang.launch_server arguments, appended as separate argv items"
    )
    sglang_version: str | None = Field(
        None, description="SGLang version of the server's interpreter; default: asked from that interpreter"
    )
    python: str = Field(
        default_factory=lambda: os.environ.get(SGLANG_PYTHON_ENV) or sys.executable,
        description=f"interpreter that has sglang installed; default: ${SGLANG_PYTHON_ENV}, else this one",
    )
    hook_pythonpath: str | None = Field(
        None,
        description="folder put first on PYTHONPATH so the server imports sglang_patch; default: the folder "
        "holding this checkout's sglang_patch; empty = leave PYTHONPATH alone (sglang_patch installed there)",
    )

    @field_validator("tp_size", "num_continuous_decode_steps")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("num_layers")
    @classmethod
    def _positive_layers(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("port")
    @classmethod
    def _port_in_range(cls, port: int) -> int:
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is outside 1..65535")
        return port


def build_command(
    cfg: SGLangServerConfig,
    *,
    compute_caps: Callable[[], list[str] | None] | None = None,
    version_probe: Callable[[str], str] | None = None,
    base_env: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` for ``python -m sglang.launch_server``; ``env`` holds only the variables to add.

    :param compute_caps: returns the GPUs' compute capabilities (``["12.0", ...]``) or None when
        unknown; default: :func:`query_compute_caps` (``nvidia-smi``).
    :param version_probe: returns the sglang version installed for an interpreter; default:
        :func:`detect_sglang_version`. Unused when ``cfg.sglang_version`` is given.
    :param base_env: the environment the server starts from (for PYTHONPATH); default ``os.environ``.
    """
    version = cfg.sglang_version or (version_probe or detect_sglang_version)(cfg.python)
    if not hook_spec.is_supported_version(version):
        raise UserError(str(hook_spec.UnsupportedSGLangVersion(version)))
    num_layers = cfg.num_layers or read_num_layers(cfg.model_path)
    check_residual_stream(cfg.model_path)
    try:
        hooks_json = hook_spec.forward_hooks_argument(
            cfg.aux_layer_ids, num_layers, cfg.dump_dir,
            max_pending_bytes=cfg.dump_queue_bytes, hidden_states_dtype=cfg.hidden_states_dtype,
        )
    except ValueError as exc:
        raise UserError(f"--aux-layer-ids: {exc}") from exc
    extra = [str(arg) for arg in cfg.extra_args]
    check_attention_backend([cfg.attention_backend, *flag_values(extra, ATTENTION_BACKEND_FLAGS)], compute_caps)
    check_extra_args(extra)

    argv = [
        cfg.python, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--tp-size", str(cfg.tp_size),
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--attention-backend", cfg.attention_backend,
        "--num-continuous-decode-steps", str(cfg.num_continuous_decode_steps),
        "--disable-radix-cache",
        "--chunked-prefill-size", "-1",
        *cuda_graph_off_flags(version),
        "--enforce-disable-flashinfer-allreduce-fusion",
        "--forward-hooks", hooks_json,
        *(["--base-gpu-id", str(cfg.base_gpu_id)] if cfg.base_gpu_id else []),
        *extra,
    ]
    env = {**NCCL_ENV, "PYTHONUNBUFFERED": "1", hook_spec.DUMP_DIR_ENV: str(cfg.dump_dir)}
    if cfg.hook_pythonpath is not None:
        hook_path = cfg.hook_pythonpath
    elif os.environ.get(SGLANG_PYTHON_ENV):
        hook_path = ""  # that interpreter's image installs sglang_patch itself (docker/sglang.Dockerfile)
    else:
        hook_path = default_hook_pythonpath()
    if hook_path:
        inherited = (os.environ if base_env is None else base_env).get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hook_path, inherited) if p)
    return argv, env


def cuda_graph_off_flags(version: str) -> list[str]:
    """Flags that turn decode and prefill CUDA graphs off in SGLang ``version``."""
    if hook_spec.parse_version(version) < CUDA_GRAPH_BACKEND_FLAGS_SINCE:
        return ["--disable-cuda-graph", "--disable-piecewise-cuda-graph"]
    return ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


def flag_values(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """Values given to any of ``flags`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    values: list[str] = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in flags:
            continue
        if eq:
            values.append(value)
        elif i + 1 < len(args):
            values.append(args[i + 1])
    return values


def check_attention_backend(backends: Sequence[str], compute_caps: Callable[[], list[str] | None] | None = None) -> None:
    """Refuse flashinfer attention on an SM120 GPU, where it hung SGLang in the seed run."""
    if "flashinfer" not in backends:
        return
    caps = (compute_caps or query_compute_caps)()
    blackwell = [cap for cap in caps or [] if _compute_major(cap) == FLASHINFER_HANG_COMPUTE_MAJOR]
    if blackwell:
        raise UserError(
            f"--attention-backend flashinfer is refused on this GPU (compute capability {blackwell[0]}, SM120 "
            "Blackwell): flashinfer attention hung the SGLang server there. Use --attention-backend triton "
            "(the default)."
        )


def check_extra_args(extra: Sequence[str]) -> None:
    """Refuse extra arguments that override a flag this module owns or that break capture.

    Matched as SGLang's argparse reads them: ``--flag=value`` and any prefix of a long option
    (``--ho`` is ``--host``) too (:func:`eagleflow.engine.extra_args.refused_match`).
    """
    from eagleflow.engine.extra_args import refused_match

    for arg in extra:
        given = arg.partition("=")[0]
        name = refused_match(arg, OWNED_FLAGS)
        read_as = "" if name == given else f" (SGLang's parser reads {given} as {name})"
        if name is not None:
            raise UserError(
                f"extra argument {name}{read_as} is set by the launcher; use the config field instead "
                f"({OWNED_FLAGS[name]})"
            )
        name = refused_match(arg, CAPTURE_BREAKING_FLAGS)
        read_as = "" if name == given else f" (SGLang's parser reads {given} as {name})"
        if name is not None:
            raise UserError(f"extra argument {name}{read_as} is refused for a capture server: {CAPTURE_BREAKING_FLAGS[name]}")
    for (flag, value), why in CAPTURE_BREAKING_VALUES.items():
        if value in flag_values(extra, [flag]):
            raise UserError(f"extra argument {flag} {value} is refused for a capture server: {why}")


def check_residual_stream(model_path: str) -> None:
    """Refuse an mHC model (``hc_mult`` > 1 in its config): the hook cannot read its residual stream."""
    if not (Path(model_path) / "config.json").is_file():
        return  # a hub id: SGLang reads the config; the hook reports an mHC model per row instead
    streams = text_config(model_path).get(MHC_CONFIG_KEY, 1)
    if isinstance(streams, int) and streams > 1:
        raise UserError(
            f"{model_path} is an mHC model ({MHC_CONFIG_KEY}={streams} hyper-connection streams): SGLang cannot "
            "snapshot its residual stream, so its hidden states cannot be captured"
        )


def query_compute_caps() -> list[str] | None:
    """The GPUs' compute capabilities from ``nvidia-smi`` (``["12.0", ...]``); None when unknown."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def detect_sglang_version(python: str) -> str:
    """The sglang version installed for interpreter ``python``, from its package metadata.

    Metadata, not ``import sglang``: importing it initializes CUDA and takes seconds.
    """
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"could not run {python} to find its sglang version: {exc}; pass --sglang-version") from exc
    if done.returncode != 0 or not done.stdout.strip():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(
            f"no sglang installed for {python} ({tail}); install sglang{hook_spec.SUPPORTED_RANGE} "
            "there, or point --python at the interpreter that has it"
        )
    return done.stdout.strip()


def read_num_layers(model_path: str) -> int:
    """Decoder-layer count of the model folder (Kimi-K2.5 nests it in ``text_config``)."""
    if not (Path(model_path) / "config.json").is_file():
        raise UserError(f"cannot read the layer count: {Path(model_path) / 'config.json'} not found; pass --num-layers")
    return config_int(model_path, "num_hidden_layers")


def default_hook_pythonpath() -> str:
    """The folder that holds this checkout's ``sglang_patch`` package."""
    return str(Path(hook_spec.__file__).resolve().parent.parent)


def _compute_major(cap: str) -> int | None:
    try:
        return int(cap.strip().split(".")[0])
    except ValueError:
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m eagleflow sglang-command`` (one per config field)."""
    add_model_arguments(parser, SGLangServerConfig)


def main(args: argparse.Namespace) -> int:
    """Print the server command as JSON ``{"argv": [...], "env": {...}}`` without starting anything."""
    cfg = model_from_args(SGLangServerConfig, args)
    argv, env = build_command(cfg)
    print(json.dumps({"argv": argv, "env": env}, indent=2))
    return 0
