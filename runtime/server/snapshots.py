"""Adaptation-state snapshots in a directory: written atomically, numbered, the newest few kept.

Files are ``snapshot-<seq>.npz`` (the state format of :mod:`..state`: npz + SHA-256 + model
fingerprint) with a sequence number that only grows, so a reset (step back to 0) never makes an
older snapshot look newer. At start the newest snapshot that verifies is loaded; a corrupt one
is refused with a logged reason and the next older one is tried. A sound one this server cannot
use (another model's, another method's, an adapted theta for the one-forward tier:
:class:`~..state.StateMismatch`) stops the start instead: starting afresh would write new
snapshots over the directory's history and prune it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..state import StateError, StateMismatch, write_state_file

if TYPE_CHECKING:
    from ..policy import Policy

log = logging.getLogger("eva0_edge.serve")

T = TypeVar("T")
_NAME = re.compile(r"^snapshot-(\d+)\.npz$")


class SnapshotStore:
    """Numbered snapshots under ``directory``; ``keep`` newest ones survive pruning."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep at least one snapshot")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.written = 0

    def _existing(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def save(self, model: Policy) -> Path:
        """Write the model's state as the newest snapshot, then prune the oldest."""
        return self.save_bytes(model.state_bytes())

    def save_bytes(self, data: bytes) -> Path:
        """Write encoded state bytes as the newest snapshot, then prune the oldest."""
        existing = self._existing()
        seq = existing[-1][0] + 1 if existing else 1
        path = write_state_file(self.directory / f"snapshot-{seq:08d}.npz", data)
        self.written += 1
        for _, old in existing[: max(0, len(existing) + 1 - self.keep)]:
            old.unlink(missing_ok=True)
        return path

    def load_newest(self, read: Callable[[Path], T]) -> tuple[Path, T] | None:
        """``read`` the newest snapshot it accepts (StateError or OSError: refused with a logged
        reason, the next older one is tried); (path, what ``read`` returned), or None.
        StateMismatch (a sound snapshot this server cannot use) is raised, naming the
        directory: the history is kept for the server that wrote it."""
        for _, path in reversed(self._existing()):
            try:
                return path, read(path)
            except StateMismatch as err:
                raise StateMismatch(
                    f"--state-dir {self.directory} holds another server's history ({err}); "
                    "start this one with another --state-dir, or with the options that wrote "
                    "it") from err
            except (StateError, OSError) as err:
                log.warning("snapshot refused, trying an older one: %s", err)
        return None

    def restore_latest(self, model: Policy) -> Path | None:
        """Load the newest snapshot that verifies into ``model``; None when there is none."""
        loaded = self.load_newest(model.load_state)
        return loaded[0] if loaded else None
