"""Every SGLang name the capture hook and the launcher rely on, checked in the real SGLang wheels.

SGLang cannot be installed on a CPU machine, so nothing here imports it: the wheels are fetched
with ``pip download --no-deps`` into ``.cache/sglang-wheels`` (kept between runs) and their
source is read straight from the zip and parsed with ``ast``. The one piece of SGLang that is
executed is ``hook_manager.py`` (standard library + torch.nn), to register the hook on
SGLang-shaped stand-ins exactly as a server would.

Checked versions: both ends of the supported range, the last release before the CUDA-graph flag
change (0.5.13.post1) and the first after it (0.5.14), both ends of each layer-boundary API
(0.5.20 | 0.5.21 … 0.5.23) and the pin in pyproject.toml; plus the release just below the
range, to show why it starts where it does. Set ``EAGLEFLOW_SGLANG_SOURCE_VERSIONS=0.5.10,
0.5.11,...`` to check other supported releases.
"""

from __future__ import annotations

import ast
import enum
import json
import os
import re
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sglang_fakes as fakes
from sglang_wheels import Wheel, cli_flags, find_class, find_function, get_wheel, pinned_version
from eagleflow.engine import sglang_command
from eagleflow.errors import UserError
from sglang_patch import hook as capture_hook
from sglang_patch import hook_spec, request_ids
from sglang_patch.handoff import dump_path
from sglang_patch.layer_output import SNAPSHOT_MODULE

pytestmark = pytest.mark.sglang_source

BELOW_RANGE = "0.5.9"  # newest release under the range

HOOK_MANAGER = "sglang/srt/model_executor/hook_manager.py"
DEEPSEEK = "sglang/srt/models/deepseek_v2.py"
KIMI_K25 = "sglang/srt/models/kimi_k25.py"
FORWARD_BATCH = "sglang/srt/model_executor/forward_batch_info.py"
PARALLEL_STATE = "sglang/srt/distributed/parallel_state.py"
CONSTANTS = "sglang/srt/constants.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
SNAPSHOT_FILE = SNAPSHOT_MODULE.replace(".", "/") + ".py"
STREAM_FILE = "sglang/srt/layers/layer_boundary/residual/stream.py"



def checked_versions() -> list[str]:
    override = os.environ.get("EAGLEFLOW_SGLANG_SOURCE_VERSIONS")
    if override:
        return [v.strip() for v in override.split(",") if v.strip()]
    versions = {"0.5.10", "0.5.13.post1", "0.5.14", "0.5.20", "0.5.21", "0.5.22", "0.5.23", pinned_version()}
    return sorted(versions, key=hook_spec.parse_version)



# -- ast helpers ------------------------------------------------------------------------------



def params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def calls(scope: ast.AST, func_text: str) -> list[ast.Call]:
    return [n for n in ast.walk(scope) if isinstance(n, ast.Call) and ast.unparse(n.func) == func_text]


def self_assignments(fn: ast.FunctionDef) -> dict[str, list[ast.AST]]:
    """``self.x = value`` (also in tuple targets) inside ``fn``: attribute name -> assigned values."""
    out: dict[str, list[ast.AST]] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            for elt in elts:
                if isinstance(elt, ast.Attribute) and isinstance(elt.value, ast.Name) and elt.value.id == "self":
                    out.setdefault(elt.attr, []).append(node.value)
    return out



def field_annotation(wheel: Wheel, field: str) -> str:
    """Source of the annotation of ServerArgs field ``field`` (wherever it is declared)."""
    for name in ["sglang/srt/server_args.py", *wheel.under("sglang/srt/arg_groups/")]:
        for node in ast.walk(wheel.tree(name)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == field:
                return ast.unparse(node.annotation)
    raise AssertionError(f"ServerArgs field {field} not found in sglang {wheel.version}")


def load_real_forward_mode(wheel: Wheel) -> type[enum.IntEnum]:
    """SGLang's own ForwardMode class, executed from its source (it needs only enum)."""
    source = wheel.text(FORWARD_BATCH)
    node = find_class(wheel.tree(FORWARD_BATCH), "ForwardMode")
    namespace: dict[str, object] = {"IntEnum": enum.IntEnum, "auto": enum.auto}
    exec(compile(ast.get_source_segment(source, node), FORWARD_BATCH, "exec"), namespace)
    return namespace["ForwardMode"]  # type: ignore[return-value]


def load_real_hook_manager(wheel: Wheel) -> types.ModuleType:
    """SGLang's hook_manager module, executed from the wheel (imports: stdlib and torch.nn)."""
    module = types.ModuleType(f"sglang_hook_manager_{wheel.version.replace('.', '_')}")
    module.__file__ = str(wheel.path / HOOK_MANAGER)
    exec(compile(wheel.text(HOOK_MANAGER), HOOK_MANAGER, "exec"), module.__dict__)
    return module


def launcher_argv(version: str, tmp: Path) -> list[str]:
    cfg = sglang_command.SGLangServerConfig(
        model_path=str(tmp / "model"), dump_dir=tmp / "dumps", aux_layer_ids=[3, 31, 59], num_layers=61,
        sglang_version=version, python="python3", hook_pythonpath="", base_gpu_id=4,  # a second engine on the node
    )
    argv, _ = sglang_command.build_command(cfg, compute_caps=lambda: None)
    return argv


# -- the supported versions -------------------------------------------------------------------


@pytest.fixture(params=checked_versions())
def wheel(request: pytest.FixtureRequest) -> Wheel:
    return get_wheel(request.param)


def test_pin_is_inside_the_supported_range() -> None:
    assert hook_spec.is_supported_version(pinned_version()), pinned_version()


def test_version_the_hook_reads(wheel: Wheel) -> None:
    # sglang/__init__.py re-exports sglang.version.__version__, which comes from _version.py.
    assert "from sglang.version import __version__" in wheel.text("sglang/__init__.py")
    assert "from sglang._version import __version__" in wheel.text("sglang/version.py")
    match = re.search(r"^__version__ = version = '([^']+)'", wheel.text("sglang/_version.py"), re.MULTILINE)
    assert match and match.group(1) == wheel.version
    assert hook_spec.is_supported_version(match.group(1))


def test_forward_hooks_registration(wheel: Wheel) -> None:
    tree = wheel.tree(HOOK_MANAGER)
    register = find_function(tree, "register_forward_hooks")
    assert params(register) == ["model", "hook_specs"]
    keys = {c.args[0].value for c in calls(register, "spec.get") if isinstance(c.args[0], ast.Constant)}
    assert keys == {"name", "target_modules", "hook_factory", "config"}, wheel.where(HOOK_MANAGER, register)
    # The factory is called once per spec, with the spec's config dict only.
    (factory_call,) = calls(register, "hook_factory")
    assert [ast.unparse(a) for a in factory_call.args] == ["config"] and not factory_call.keywords
    # Patterns are fnmatch'ed against model.named_modules() names.
    assert calls(register, "model.named_modules") and calls(register, "fnmatch.fnmatch")
    # A plain post hook: hook(module, args, output); no pre hooks, no kwargs.
    (reg,) = calls(register, "module.register_forward_hook")
    assert [ast.unparse(a) for a in reg.args] == ["hook"] and not reg.keywords
    assert "register_forward_pre_hook" not in wheel.text(HOOK_MANAGER)
    # "pkg.mod:factory" paths are split on ":".
    assert "split(':', 1)" in ast.unparse(find_function(tree, "resolve_callable"))
    # And the model runner calls it on the whole model with --forward-hooks' list.
    runner_files = [n for n in wheel.under("sglang/srt/model_executor/") if "model_runner" in n or "cuda_graph_setup" in n]
    sites = [(n, c) for n in runner_files for c in calls(wheel.tree(n), "register_forward_hooks")]
    assert sites, f"no register_forward_hooks call in {runner_files}"
    for name, call in sites:
        model_arg, specs_arg = (ast.unparse(a) for a in call.args)
        assert model_arg.endswith(".model") and specs_arg.endswith(".forward_hooks"), wheel.where(name, call)


def test_forward_hooks_flag_parses_our_json(wheel: Wheel, tmp_path: Path) -> None:
    assert "json_list_type" in field_annotation(wheel, "forward_hooks") or any(
        "json_list_type" in ast.unparse(c) for c in calls(wheel.tree("sglang/srt/server_args.py"), "parser.add_argument")
        if any(isinstance(a, ast.Constant) and a.value == "--forward-hooks" for a in c.args)
    )
    utils = wheel.tree("sglang/srt/utils/common.py")
    assert "orjson.loads(value)" in ast.unparse(find_function(utils, "json_list_type"))
    argv = launcher_argv(wheel.version, tmp_path)
    specs = json.loads(argv[argv.index("--forward-hooks") + 1])
    assert isinstance(specs, list) and specs[0]["hook_factory"] == hook_spec.HOOK_FACTORY


def test_every_launcher_flag_exists(wheel: Wheel, tmp_path: Path) -> None:
    flags = cli_flags(wheel)
    argv = launcher_argv(wheel.version, tmp_path)
    used = [a for a in argv[3:] if a.startswith("--")]
    missing = [f for f in used if f not in flags]
    assert not missing, f"sglang {wheel.version} has no {missing}"
    if hook_spec.parse_version(wheel.version) >= sglang_command.CUDA_GRAPH_BACKEND_FLAGS_SINCE:
        for phase in ("decode", "prefill"):
            assert "'disabled'" in field_annotation(wheel, f"cuda_graph_backend_{phase}")
    else:
        assert "--cuda-graph-backend-decode" not in flags  # so the old flags are the only way there


def test_refused_extra_flags_are_real_flags(tmp_path: Path) -> None:
    known: set[str] = set()
    for version in checked_versions():
        known |= cli_flags(get_wheel(version))
    unknown = [f for f in [*sglang_command.OWNED_FLAGS, *sglang_command.CAPTURE_BREAKING_FLAGS] if f not in known]
    assert not unknown, f"refusing flags no checked sglang has: {unknown}"


def test_decoder_layer_interface(wheel: Wheel) -> None:
    tree = wheel.tree(DEEPSEEK)
    layer = find_class(tree, "DeepseekV2DecoderLayer")
    forward = find_function(layer, "forward")
    returned = forward.body[-1]
    assert isinstance(returned, ast.Return) and isinstance(returned.value, ast.Tuple)
    if hook_spec.layer_boundary_api(wheel.version) == hook_spec.LAYER_TUPLE:
        assert params(forward)[:5] == ["self", "positions", "hidden_states", "forward_batch", "residual"], wheel.where(DEEPSEEK, forward)
        assert [ast.unparse(e) for e in returned.value.elts[:2]] == ["hidden_states", "residual"], wheel.where(DEEPSEEK, returned)
        # The marker the hook checks for a per-rank partial sum.
        assert "hidden_states._sglang_needs_allreduce_fusion = True" in ast.unparse(forward)
    else:
        # No residual in or out: (hidden_states, topk_indices), the residual in forward_batch's stream.
        assert params(forward)[:5] == ["self", "positions", "hidden_states", "forward_batch", "zero_allocator"], wheel.where(DEEPSEEK, forward)
        assert "residual" not in params(forward)
        assert [ast.unparse(e) for e in returned.value.elts] == ["hidden_states", "topk_indices"], wheel.where(DEEPSEEK, returned)
    assigned = self_assignments(find_function(layer, "__init__"))
    assert [ast.unparse(v) for v in assigned["layer_id"]] == ["layer_id"]
    assert [ast.unparse(v) for v in assigned["config"]] == ["config"]


def test_model_tree_and_call_order(wheel: Wheel) -> None:
    tree = wheel.tree(DEEPSEEK)
    model = find_class(tree, "DeepseekV2Model")
    assigned = self_assignments(find_function(model, "__init__"))
    assert any(ast.unparse(v).startswith("VocabParallelEmbedding(") for v in assigned["embed_tokens"])
    # make_pp_layers from 0.5.22: the same ModuleList under "layers", PPMissingLayer where another stage holds one.
    layers = [ast.unparse(v) for v in assigned["layers"]]
    assert any(v.startswith(("make_layers(", "make_pp_layers(")) and "add_prefix('layers', prefix)" in v for v in layers), layers
    assert any(ast.unparse(v).startswith("RMSNorm(") for v in assigned["norm"])
    forward = find_function(model, "forward")
    assert [ast.unparse(a) for a in calls(forward, "self.embed_tokens")[0].args] == ["input_ids"]
    (layer_call,) = calls(forward, "layer")
    positional = [ast.unparse(a) for a in layer_call.args]
    if hook_spec.layer_boundary_api(wheel.version) == hook_spec.LAYER_TUPLE:
        assert positional[:4] == ["positions", "hidden_states", "forward_batch", "residual"], wheel.where(DEEPSEEK, layer_call)
        assert any([ast.unparse(a) for a in c.args] == ["hidden_states", "residual"] for c in calls(forward, "self.norm"))
    else:
        assert positional[:4] == ["positions", "hidden_states", "forward_batch", "zero_allocator"], wheel.where(DEEPSEEK, layer_call)
        # A fresh stream per pass, the last layer's owed output completed, then the fused final norm.
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.layers.layer_boundary.residual"]
        assert any((a.name, a.asname) == ("batch", "residual_batch") for n in imports for a in n.names)
        assert [ast.unparse(a) for a in calls(forward, "residual_batch.start")[0].args] == ["forward_batch"]
        (complete,) = calls(forward, "residual_batch.complete_output")
        assert [ast.unparse(a) for a in complete.args] == ["hidden_states", "forward_batch"]
        final = calls(forward, "residual_batch.norm") + calls(forward, "residual_batch.final_norm")
        assert [[ast.unparse(a) for a in c.args] for c in final] == [["hidden_states", "forward_batch", "self.norm"]]
    causal = find_class(tree, "DeepseekV2ForCausalLM")
    assert any(ast.unparse(v).startswith("DeepseekV2Model(") for v in self_assignments(find_function(causal, "__init__"))["model"])
    assert [ast.unparse(b) for b in find_class(tree, "DeepseekV3ForCausalLM").bases] == ["DeepseekV2ForCausalLM"]


def test_kimi_k25_wraps_deepseek_v3_as_language_model(wheel: Wheel) -> None:
    tree = wheel.tree(KIMI_K25)
    kimi = find_class(tree, "KimiK25ForConditionalGeneration")
    init = find_function(kimi, "__init__")
    values = [ast.unparse(v) for v in self_assignments(init).get("language_model", [])]
    assert any(v.startswith("DeepseekV3ForCausalLM(config.text_config") for v in values), values
    # Its layers are named language_model.model.layers.N. 0.5.10 also sets self.model to the same
    # module, after language_model: named_modules() lists each module once, under its first
    # name, so the hook is still registered once per module.
    aliases = [ast.unparse(v) for v in self_assignments(init).get("model", [])]
    assert aliases in ([], ["self.language_model.model"]), aliases
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.models.deepseek_v2"]
    assert any(a.name == "DeepseekV3ForCausalLM" for n in imports for a in n.names)
    assert "EntryClass = [KimiK25ForConditionalGeneration]" in wheel.text(KIMI_K25)


def test_forward_batch_fields(wheel: Wheel) -> None:
    tree = wheel.tree(FORWARD_BATCH)
    batch = find_class(tree, "ForwardBatch")
    fields = {s.target.id for s in batch.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    needed = {"forward_mode", "input_ids", "rids", "extend_seq_lens", "extend_prefix_lens", "extend_seq_lens_cpu", "extend_prefix_lens_cpu"}
    if hook_spec.layer_boundary_api(wheel.version) == hook_spec.RESIDUAL_STREAM:
        needed.add("residual_stream")
    assert needed <= fields, f"missing {needed - fields} in sglang {wheel.version}"
    # The two-batch-overlap flag the hook reads to name --enable-two-batch-overlap.
    can_run_tbo = find_function(batch, "can_run_tbo")
    assert [ast.unparse(d) for d in can_run_tbo.decorator_list] == ["property"]
    init_new = find_function(batch, "init_new")
    rid_kw = [k for c in calls(init_new, "cls") for k in c.keywords if k.arg == "rids"]  # ret = cls(...)
    assert [ast.unparse(k.value) for k in rid_kw] == ["[req.rid for req in batch.reqs]"]
    # The hook's pass filter, evaluated on SGLang's own ForwardMode.
    mode = load_real_forward_mode(wheel)
    for name in ("is_extend", "is_decode", "is_idle", "is_target_verify"):
        assert callable(getattr(mode, name))
    captured = {m.name for m in mode if capture_hook._is_capture_pass(m)}
    assert "EXTEND" in captured and not captured & {"DECODE", "IDLE", "TARGET_VERIFY"}


def test_tensor_parallel_rank_and_health_check_names(wheel: Wheel) -> None:
    find_function(wheel.tree(PARALLEL_STATE), "get_tensor_model_parallel_rank")
    assert f'HEALTH_CHECK_RID_PREFIX = "{request_ids.HEALTH_CHECK_PREFIX}"' in wheel.text(CONSTANTS)
    assert re.search(r'rid = f"\{HEALTH_CHECK_RID_PREFIX\}_', wheel.text(HTTP_SERVER))


def test_the_capture_checks_request_and_answer_fields(wheel: Wheel) -> None:
    """verify-capture's request fields, the meta_info keys it reads and /server_info's settings are SGLang's own."""
    request = find_class(wheel.tree("sglang/srt/managers/io_struct.py"), "GenerateReqInput")
    fields = {s.target.id for s in request.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num"} <= fields
    manager = wheel.text("sglang/srt/managers/tokenizer_manager.py")
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs", "cached_tokens"):
        assert re.search(rf'meta_info\["{key}"\] =|"{key}":', manager), f"{key} in sglang {wheel.version}"
    assert '@app.get("/server_info")' in wheel.text(HTTP_SERVER)
    for setting in ("tp_size", "disable_radix_cache", "chunked_prefill_size"):
        field_annotation(wheel, setting)


@pytest.mark.parametrize("kind", ["deepseek", "kimi", "kimi-aliased"])
def test_real_hook_manager_registers_the_launcher_spec(wheel: Wheel, kind: str, tmp_path: Path, monkeypatch) -> None:
    """The launcher's --forward-hooks value, registered by SGLang's own code, captures the right states."""
    fakes.FakeSGLang(monkeypatch).install(wheel.version)
    num_layers, aux = 6, [0, 2, 4]
    cfg = sglang_command.SGLangServerConfig(
        model_path="unused", dump_dir=tmp_path, aux_layer_ids=aux, num_layers=num_layers,
        sglang_version=wheel.version, python="python3",
    )
    argv, env = sglang_command.build_command(cfg, compute_caps=lambda: None)
    specs = json.loads(argv[argv.index("--forward-hooks") + 1])
    model = fakes.build_model(kind, num_layers, layer_api=hook_spec.layer_boundary_api(wheel.version))
    load_real_hook_manager(wheel).register_forward_hooks(model, specs)
    requests = {"row0-a": [1, 2, 3, 4], "HEALTH_CHECK_x": [5], "row1-b": [6, 7]}
    fakes.run(model, fakes.extend_batch(requests))
    for module in model.modules():
        for hook in module._forward_hooks.values():
            if isinstance(hook, capture_hook.HiddenStateCapture):
                hook.close()
    expected = torch.stack([model.oracle[k] for k in [*aux, num_layers]], dim=1).to(torch.bfloat16)
    assert torch.equal(load_file(dump_path(tmp_path, "row0-a"))["hidden_states"], expected[:4])
    assert torch.equal(load_file(dump_path(tmp_path, "row1-b"))["hidden_states"], expected[5:7])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row0-a.safetensors", "row1-b.safetensors"]


# -- the residual stream (0.5.21 on) -----------------------------------------------------------


def stream_wheels() -> list[str]:
    return [v for v in checked_versions() if hook_spec.layer_boundary_api(v) == hook_spec.RESIDUAL_STREAM]


@pytest.mark.parametrize("version", stream_wheels())
def test_snapshot_is_a_fresh_hidden_plus_residual_completed_on_a_copy(version: str) -> None:
    """What the hook relies on (and sglang_fakes.ResidualStream.snapshot reproduces), read in the wheel."""
    wheel = get_wheel(version)
    snapshot = find_function(wheel.tree(SNAPSHOT_FILE), "snapshot")
    assert params(snapshot) == ["hidden_states", "forward_batch"]
    assert isinstance(snapshot.body[-1], ast.Return)
    assert re.fullmatch(r"\w+\(forward_batch\)\.snapshot\(hidden_states\)", ast.unparse(snapshot.body[-1].value))

    stream = find_class(wheel.tree(STREAM_FILE), "ResidualStream")
    method = find_function(stream, "snapshot")
    source = ast.unparse(method)
    assert "self.check(hidden)" in source
    assert "if pending is None:\n        return hidden.clone()" in source
    # An owed sum is completed on a copy of this rank's partial: the stream itself stays owed.
    assert re.search(r"value = pending\.owed\.complete\(pending\.value\.clone\(\)\)", source) or re.search(
        r"replace\(pending\.owed, partial=pending\.value\.clone\(\)\)\.complete\(\)", source
    )
    refusals = [ast.unparse(n.exc) for n in ast.walk(method) if isinstance(n, ast.Raise)]
    assert refusals and all(r.startswith("NotImplementedError(") for r in refusals), refusals
    assert ast.unparse(method.body[-1]) == "return value.clone() if self.residual is None else value + self.residual"
    # Completing a declared sum is the group's all-reduce: a collective, so every TP rank must take part.
    declared = find_function(find_class(wheel.tree(STREAM_FILE), "DeclaredSum"), "complete")
    assert "all_reduce(value)" in ast.unparse(declared)


@pytest.mark.parametrize("version", stream_wheels())
def test_refused_flag_values_and_the_mhc_key_are_sglangs_own(version: str) -> None:
    """The launcher refuses --moe-runner-backend flashinfer_trtllm and hc_mult > 1: both are SGLang's names."""
    wheel = get_wheel(version)
    flags = cli_flags(wheel)
    for (flag, value), _ in sglang_command.CAPTURE_BREAKING_VALUES.items():
        assert flag in flags, f"sglang {version} has no {flag}"
        field = flag.removeprefix("--").replace("-", "_").upper() + "_CHOICES"  # MOE_RUNNER_BACKEND_CHOICES
        choices = [
            ast.literal_eval(node.value)
            for name in wheel.under("sglang/srt/") if field in wheel.text(name)
            for node in ast.walk(wheel.tree(name))
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [field]
        ]
        assert choices and all(value in c for c in choices), (field, choices)
    model_config = wheel.text("sglang/srt/configs/model_config.py")
    assert f'getattr(self.hf_text_config, "{sglang_command.MHC_CONFIG_KEY}", 1)' in model_config


def test_the_residual_stream_arrived_in_0_5_21() -> None:
    """Where LAYER_BOUNDARY_APIS draws its line: 0.5.20 has no snapshot module, 0.5.21 has it."""
    assert SNAPSHOT_FILE not in get_wheel("0.5.20").names
    assert SNAPSHOT_FILE in get_wheel("0.5.21").names
    assert hook_spec.layer_boundary_api("0.5.20") == hook_spec.LAYER_TUPLE
    assert hook_spec.layer_boundary_api("0.5.21") == hook_spec.RESIDUAL_STREAM


# -- why the range ends where it does ---------------------------------------------------------


def test_below_the_range_forward_batch_has_no_rids() -> None:
    wheel = get_wheel(BELOW_RANGE)
    batch = find_class(wheel.tree(FORWARD_BATCH), "ForwardBatch")
    fields = {s.target.id for s in batch.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert "rids" not in fields
    assert not hook_spec.is_supported_version(BELOW_RANGE)


@pytest.mark.parametrize("version", ["0.5.24", "0.5.24.post1", "0.6.0"])
def test_releases_not_yet_read_are_refused_by_name(version: str, tmp_path: Path) -> None:
    """0.5.24 and later: the layer-boundary package changes every release; refused until its wheel is read."""
    assert not hook_spec.is_supported_version(version)
    with pytest.raises(UserError, match=re.escape(f"found sglang {version!r}")):
        launcher_argv(version, tmp_path)
