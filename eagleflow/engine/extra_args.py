"""Which engine arguments a run's ``server_extra_args`` may not set, matched as the engine's parser matches them.

Both engines parse their flags with ``argparse``, which takes ``--flag=value`` and also any
unambiguous prefix of a long option (``--ho 0.0.0.0`` is ``--host 0.0.0.0``). An extra argument
is therefore refused when it *is* a refused flag or argparse would read it as one: with the
engine's whole option list (the reference engine's), exactly argparse's rule (a prefix of one
option only; an exact option name is never an abbreviation); where that list is not known here
(SGLang's), any prefix of a refused flag, even one argparse would call ambiguous: it fails either way.

The flags each engine may not be given are stated beside the code that sets them:
:data:`REFERENCE_OWNED` here, :data:`eagleflow.engine.sglang_command.OWNED_FLAGS` (capture) and
:data:`eagleflow.engine.sglang_serving.SERVING_OWNED` (evaluation).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from eagleflow.errors import UserError, excerpt_repr

LISTEN = "the run's engines listen on 127.0.0.1 only: README, 'Where a run may write and listen'"
# The reference engine's flags the run sets itself (eagleflow.run.launch), and where their values come from.
REFERENCE_OWNED: dict[str, str] = {
    "--host": LISTEN,
    "--port": "server_port",
    "--model": "model_path",
    "--dump-dir": "the run's dump folder, <run>/server/dumps",
    "--aux-layers": "aux_layer_ids",
    "--hidden-states-dtype": "hidden_states_dtype",
    "--dump-queue-bytes": "dump_queue_gb",
    "--speculative-algorithm": "the evaluation serves the exported drafter (export.json), the baseline none",
    "--speculative-draft-model-path": "the evaluation serves the exported drafter (export.json)",
    "--speculative-num-steps": "the exported drafter's draft length (export.json)",
    "--speculative-num-draft-tokens": "the exported drafter's draft length (export.json)",
    "--speculative-draft-window-size": "the exported drafter's window (export.json)",
}


def refused_match(arg: str, refused: Iterable[str], known: Collection[str] = ()) -> str | None:
    """The refused flag that argument ``arg`` sets as argparse reads it (exactly, by prefix, or as ``--flag=value``), else None.

    :param known: every option of the engine, when known: an exact one of them is no abbreviation.
    """
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg.partition("=")[0]
    refused = list(refused)
    if name in refused:
        return name
    if name in known or len(name) <= 2:
        return None
    if known:  # argparse's own rule: a prefix of exactly one option is that option; of several, an error
        candidates = [option for option in known if option.startswith(name)]
        return candidates[0] if len(candidates) == 1 and candidates[0] in refused else None
    return next((flag for flag in refused if flag.startswith(name)), None)


def check_extra_args(
    extra: Sequence[str], refused: Mapping[str, str], known: Collection[str] = (), *, who: str = "the run"
) -> None:
    """Raise :class:`UserError` for the first extra argument that sets one of ``refused`` (flag -> why)."""
    for arg in extra:
        flag = refused_match(str(arg), refused, known)
        if flag is not None:
            given = excerpt_repr(str(arg), 80)
            read_as = "" if str(arg).partition("=")[0] == flag else f" (the engine's parser reads it as {flag})"
            raise UserError(f"extra argument {given}{read_as} is refused: {flag} is set by {who} ({refused[flag]})")


def reference_options() -> set[str]:
    """Every long option of ``serve-reference`` (its config's fields, booleans' ``--no-`` forms too)."""
    from eagleflow.config import _strip_optional, flag_name
    from eagleflow.engine.reference_config import ReferenceEngineConfig

    options = {"--help"}
    for name, field in ReferenceEngineConfig.model_fields.items():
        options.add(flag_name(name))
        if _strip_optional(field.annotation) is bool:
            options.add("--no-" + name.replace("_", "-"))
    return options


def check_reference_extra_args(extra: Sequence[str]) -> None:
    """Refuse extra arguments of a reference engine that set what the run sets (:data:`REFERENCE_OWNED`)."""
    check_extra_args(extra, REFERENCE_OWNED, reference_options())
