"""W&B logging for the entry points (search, evaluation); the library never imports wandb."""

from __future__ import annotations

import os
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.locks import check_writable

# W&B's own folders under the home folder, and where they go when the home folder cannot be written
_WANDB_HOME = {"WANDB_CONFIG_DIR": ".config/wandb", "WANDB_CACHE_DIR": ".cache/wandb", "WANDB_DATA_DIR": ".local/share/wandb"}


def _writable_wandb_home(root: Path) -> None:
    """Point W&B's config, cache and data folders into ``root`` (the run's W&B folder) where their usual places
    under a read-only home cannot be written; a folder the user chose (its variable set) is left as it is."""
    for var, rel in _WANDB_HOME.items():
        if os.environ.get(var):
            continue
        try:
            check_writable(Path.home() / rel, "W&B's folder")
        except (SelfSpecError, RuntimeError):
            os.environ[var] = str(root / ".home" / rel)


class WandbLogger:
    """W&B logging for the entry points (search, evaluation).

    Offline by default: runs are written under the configured folder and can be
    uploaded later with ``wandb sync``. ``logger=none`` (or ``mode: disabled``)
    makes every call a no-op. ``finish(failed=True)`` closes a run with a
    non-zero exit code, so a failed job in a sweep leaves a closed run behind.
    Nothing is written before :meth:`start` (an evaluation starts its run once
    its run folder has accepted it; calls before that are dropped).
    """

    def __init__(self, logger_cfg: dict, job: str, config: dict, name: str | None = None,
                 dir: str | Path | None = None) -> None:
        self.run = None
        self._init = None
        if logger_cfg.get("name") != "wandb" or logger_cfg.get("mode") == "disabled":
            return
        root = Path(dir or logger_cfg["dir"])
        check_writable(root, "the W&B folder (logger.dir)")  # (creates it)
        self._init = dict(project=logger_cfg["project"], entity=logger_cfg.get("entity"), mode=logger_cfg["mode"],
                          dir=str(root), job_type=job, name=name, tags=list(logger_cfg.get("tags") or ()),
                          config=config)

    def start(self) -> WandbLogger:
        if self._init is None or self.run is not None:
            return self
        os.environ.setdefault("WANDB_SILENT", "true")
        _writable_wandb_home(Path(self._init["dir"]))
        import wandb

        self.wandb = wandb
        try:
            self.run = wandb.init(**self._init, reinit="finish_previous")
        except wandb.errors.UsageError as e:
            if self._init["mode"] == "online":
                raise SelfSpecError(f"W&B cannot log online ({str(e).strip().splitlines()[0]}): log in or set "
                                    "WANDB_API_KEY, or log offline (logger.mode=offline, the default) or not at "
                                    "all (logger=none)") from None
            raise SelfSpecError(f"W&B refused to start: {e} (logger=none runs without it)") from None
        return self

    def log(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.log(metrics)

    def summary(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.summary.update(metrics)

    def table(self, key: str, rows: list[dict], columns: list[str]) -> None:
        if self.run is not None and rows:
            self.run.log({key: self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})

    def artifact(self, path: str | Path, name: str, kind: str) -> None:
        if self.run is not None and path and Path(path).is_file():
            art = self.wandb.Artifact(name, type=kind)
            art.add_file(str(path))
            self.run.log_artifact(art)

    def finish(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
