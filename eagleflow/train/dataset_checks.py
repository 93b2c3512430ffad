"""What training checks of its dataset before speculators starts: one sample file per row, all stored alike, the
right slots and hidden size, non-empty splits, and online the window a sample must fit.

A torn or half-extracted dataset found here costs seconds; found by speculators' data loader, it costs the
trainer's start-up and a traceback in the middle of an epoch.
"""

from __future__ import annotations

from eagleflow.errors import UserError
from eagleflow.layout import hidden_states_dir
from eagleflow.progress import format_bytes, format_gb
from eagleflow.train.config import TrainConfig
from eagleflow.train.online.settings import online_window_bytes
from sglang_patch.mooncake_store import store_sample_limit
from sglang_patch.sample_format import HiddenStatesDtype, sample_file_bytes


def check_dataset(cfg: TrainConfig, hidden_size: int) -> tuple[int, HiddenStatesDtype]:
    """Fail early, naming the file or row, on what speculators would trip over mid-run.

    Checks: the folder is a whole ``datasets`` folder (every file speculators' ``load_from_disk``
    opens: ``eagleflow.data.dataset_files.check_dataset_files``) saved in torch format (speculators compares
    each row's ``input_ids`` with ``torch.equal``), both the train and the validation split get
    at least one row, and (from disk) every row has its ``hs_{row}`` file, all in one storage
    dtype (read from each header: the dtype decides how speculators reads them), the first file
    with ``len(captured) + 1`` slots of the verifier's hidden size. Online
    (``--hidden-states-source engine``) there are no files: the largest sample must fit in the
    online window. Returns the rows and the storage dtype.
    """
    from eagleflow.data import dataset_column, dataset_shape, dataset_state

    rows, columns = dataset_shape(cfg.dataset)  # first: it checks every file is whole, naming a torn one
    format_type = dataset_state(cfg.dataset).get("_format_type")
    if format_type != "torch":
        raise UserError(
            f"--dataset {cfg.dataset} is saved in format {format_type!r}; speculators reads rows as torch "
            f"tensors, so the dataset must be saved after set_format('torch') (re-run prepare-dataset)"
        )
    missing_columns = {"input_ids", "loss_mask", "seq_len"} - set(columns)
    if missing_columns:
        raise UserError(f"--dataset {cfg.dataset} lacks column(s) {sorted(missing_columns)}")
    train_rows = int(rows * cfg.train_data_ratio)
    if not 0 < train_rows < rows:
        raise UserError(
            f"--train-data-ratio {cfg.train_data_ratio} of {rows} rows leaves the train or the validation split empty"
        )
    if cfg.hidden_states_source == "engine":
        check_online_window(cfg, hidden_size, [int(n) for n in dataset_column(cfg.dataset, "seq_len")])
        return rows, cfg.hidden_states_dtype
    return rows, _check_hidden_state_files(cfg, hidden_size, rows)


def check_online_window(cfg: TrainConfig, hidden_size: int, lengths: list[int]) -> None:
    """Refuse, before training, a window too small for the largest sample (it could never be fetched)."""
    n_slots = len(cfg.captured) + 1
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    needed = sample_file_bytes(lengths[longest], n_slots, hidden_size, cfg.hidden_states_dtype)
    window = online_window_bytes(cfg)
    limit = store_sample_limit(window) if cfg.sample_store else window  # a store's sample must fit its writer's buffer
    if needed > limit:
        what = "the sample store's room for one sample" if cfg.sample_store else "the online window"
        raise UserError(
            f"{what} ({format_bytes(limit)}: Param dump_queue_gb, flag --online-window-gb) is smaller than "
            f"the largest sample, row {longest} ({lengths[longest]} tokens, {format_bytes(needed)} as "
            f"{cfg.hidden_states_dtype}); raise it to at least {format_gb(needed)} GB or lower max_len"
        )


def _check_hidden_state_files(cfg: TrainConfig, hidden_size: int, rows: int) -> HiddenStatesDtype:
    """Every row's file exists, all in one storage dtype, the first of the right shape: headers only (no torch)."""
    from sglang_patch.sample_format import HIDDEN_STATES_KEY, sample_file_name
    from sglang_patch.sample_header import read_header

    hs_dir = hidden_states_dir(cfg.dataset)
    missing = [row for row in range(rows) if not (hs_dir / sample_file_name(row)).exists()]
    if missing:
        raise UserError(
            f"--dataset {cfg.dataset}: {len(missing)} of {rows} rows have no hidden states in {hs_dir} "
            f"(rows {_rows_text(missing)}); finish extraction first, or train with --hidden-states-source engine"
        )
    stored_as: dict[HiddenStatesDtype | None, list[int]] = {}
    first_shape: tuple[int, ...] = ()
    torn = ""  # why the first unreadable file is (a truncated write names its bytes)
    for row in range(rows):
        try:
            header = read_header(hs_dir / sample_file_name(row))
        except (OSError, ValueError) as exc:
            dtype = None
            torn = torn or f"; {exc}"
        else:
            dtype = header.storage_dtype(HIDDEN_STATES_KEY)
            if row == 0 and dtype is not None:
                first_shape = header.tensors[HIDDEN_STATES_KEY].shape
        stored_as.setdefault(dtype, []).append(row)
    if len(stored_as) > 1 or None in stored_as:
        kinds = "; ".join(
            f"{dtype or 'unreadable or another dtype'}: rows {_rows_text(found)}" for dtype, found in stored_as.items()
        )
        raise UserError(
            f"--dataset {cfg.dataset}: the hidden-state files are not all stored alike ({kinds}){torn}; "
            "re-extract the odd rows with the run's hidden_states_dtype"
        )
    (dtype,) = stored_as
    expected = [len(cfg.captured) + 1, hidden_size]
    if list(first_shape[1:]) != expected:
        raise UserError(
            f"{hs_dir / sample_file_name(0)} has hidden_states of shape {list(first_shape)}; the captured layer ids "
            f"{cfg.captured} and the verifier's hidden size need [seq_len, {expected[0]}, {expected[1]}] "
            "(aux slots + the final state)"
        )
    return dtype  # type: ignore[return-value]  # None was refused above


def _rows_text(rows: list[int]) -> str:
    return ", ".join(str(r) for r in rows[:10]) + (" …" if len(rows) > 10 else "")
