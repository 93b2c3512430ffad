"""What the training step hands its speculators child for online training, and where the feed keeps its files.

Light (no torch), so the step writes it before the child has imported anything, and the run
page can read the feed's status.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from eagleflow.layout import FeedLayout, TrainLayout
from sglang_patch.handoff import STATUS_PREFIX
from sglang_patch.sample_format import HiddenStatesDtype

if TYPE_CHECKING:
    from eagleflow.train.config import TrainConfig

BACKEND_NAME = "eagleflow-engine"  # speculators --hidden-states-backend
SETTINGS_FLAG = "--eagleflow-feed"  # the backend's one flag: the settings file


class EngineEndpoint(BaseModel):
    """One engine the feed asks: its name, URL and where its capture hands samples over (its dump folder, or the
    run's sample store: an address as JSON)."""

    name: str
    url: str
    dump_dir: Path
    sample_store: str | None = None


class FeedSettings(BaseModel):
    """The online feed's settings (``<train>/online/feed.json``)."""

    dataset: Path
    folder: Path
    engines: list[EngineEndpoint] = Field(min_length=1)
    n_slots: int
    slots: list[int] | None = None  # the slots this drafter reads, when the capture holds more (None: all)
    hidden_size: int
    hidden_states_dtype: HiddenStatesDtype
    prefetch: int = Field(ge=1)
    window_bytes: int = Field(ge=1)
    cache_bytes: int = Field(ge=0)
    request_timeout: float
    dump_wait: float
    max_retries: int
    engine_wait: float
    # Several drafters online (eagleflow.train.online.share): the lead lists its followers' feed folders by
    # drafter name; a follower names the lead's feed folder.
    followers: dict[str, Path] = Field(default_factory=dict)
    lead: Path | None = None
    peer_wait: float = 600.0

    @property
    def layout(self) -> FeedLayout:
        return FeedLayout(self.folder)

    @property
    def stall_seconds(self) -> float:
        """How long the trainer waits for one sample before it gives up on the feed (it reports failures sooner)."""
        return self.request_timeout * (self.max_retries + 1) + self.engine_wait + self.dump_wait + 60.0

    def write(self) -> Path:
        from eagleflow.files import atomic_write_json

        self.folder.mkdir(parents=True, exist_ok=True)
        return atomic_write_json(self.layout.settings, json.loads(self.model_dump_json()))

    @classmethod
    def read(cls, path: Path) -> FeedSettings:
        return cls.model_validate_json(Path(path).read_text())


def online_window_bytes(cfg: TrainConfig) -> int:
    """The online window in bytes: ``--online-window-gb``, else the engines' own default dump queue budget."""
    from sglang_patch.dump_writer import default_queue_budget

    return int(cfg.online_window_gb * 1e9) if cfg.online_window_gb else default_queue_budget()


def online_cache_bytes(cfg: TrainConfig) -> int:
    return int(cfg.online_cache_gb * 1e9)


def read_status(layout: FeedLayout) -> dict[str, Any]:
    """The feed's last status (empty when it never ran or the file is torn)."""
    try:
        data = json.loads(layout.status.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def held_bytes(folders: list[Path]) -> int:
    """Bytes of hidden states on disk in ``folders``: dumps, their temp files, ready and cached samples.

    The engine writers' status and reserve files (``STATUS_PREFIX``…) are bookkeeping, not samples;
    a sample linked into several trainers' folders counts once (one inode).
    """
    total = 0
    seen: set[tuple[int, int]] = set()
    for folder in folders:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(STATUS_PREFIX):
                continue
            try:
                stat = entry.stat()
            except OSError:
                continue  # consumed or renamed while we looked
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def feed_settings(cfg: TrainConfig, paths: TrainLayout, hidden_size: int) -> FeedSettings:
    """What the online feed in the speculators child needs (written to ``<train>/online/feed.json``)."""
    names = cfg.engine_names or [f"engine-{i}" for i in range(len(cfg.engine_urls))]
    assert cfg.dump_dir is not None  # TrainConfig requires it with --hidden-states-source engine
    return FeedSettings(
        dataset=cfg.dataset,
        folder=paths.online,
        engines=[
            EngineEndpoint(name=n, url=u, dump_dir=cfg.dump_dir.absolute(), sample_store=cfg.sample_store)
            for n, u in zip(names, cfg.engine_urls)
        ],
        n_slots=len(cfg.captured) + 1,
        slots=cfg.sample_slots,
        hidden_size=hidden_size,
        hidden_states_dtype=cfg.hidden_states_dtype,
        prefetch=cfg.online_prefetch,
        window_bytes=online_window_bytes(cfg),
        cache_bytes=online_cache_bytes(cfg),
        request_timeout=cfg.request_timeout,
        dump_wait=cfg.dump_wait,
        max_retries=cfg.max_retries,
        engine_wait=cfg.engine_wait,
        peer_wait=cfg.online_peer_wait,
        **shared_feed(cfg),
    )


def shared_feed(cfg: TrainConfig) -> dict[str, Any]:
    """Several drafters online (:mod:`eagleflow.train.online.share`): the lead's followers, or a follower's lead."""
    trainers = [Path(t).absolute() for t in cfg.online_trainers]
    if len(trainers) < 2:
        return {}
    own = cfg.out.absolute()
    if own == trainers[0]:
        return {"followers": {t.parent.name: TrainLayout(t).online for t in trainers[1:] if t != own}}
    return {"lead": TrainLayout(trainers[0]).online}
