"""Runtime changes that survive a restart: ``--state-file`` (docs/configuration.md).

Thresholds set with ``POST /busy_threshold`` and classes changed with ``POST /classes``
are written to one JSON file after each change (to a temporary file, then renamed, so a
crash never leaves half a file) and applied again at the next start, over the startup
flags. Without the file a restarted extproc starts from its flags and environment (with
replicas, it also learns the others' current values within a second).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from extproc.core.busy import BusyThresholds
from extproc.core.classes import ClassConfigError, ClassRegistry
from extproc.core.pool import WorkerPool

log = logging.getLogger("extproc.admin.state")
VERSION = 1


class StateFileError(ValueError):
    """The state file cannot be read; the message names the file and what is wrong."""


class RuntimeState:
    """Keeps the runtime changes of ``pool`` (and ``classes``) in ``path``."""

    def __init__(self, path: str | Path, pool: WorkerPool, classes: ClassRegistry | None) -> None:
        self.path = Path(path)
        self.pool = pool
        self.classes = classes
        self.changed_models: set[str] = set()
        self.changed_classes: set[str] = set()

    def load(self) -> int:
        """Apply the saved changes; returns how many. A missing file is an empty state."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            raise StateFileError(f"cannot read the state file {self.path}: {exc}") from None
        if not isinstance(raw, dict) or raw.get("v") != VERSION:
            raise StateFileError(f"{self.path}: not a state file of version {VERSION}")
        applied = 0
        for model, values in (raw.get("thresholds") or {}).items():
            try:
                th = BusyThresholds(
                    values["active_decode_blocks_threshold"],
                    values["active_prefill_tokens_threshold"],
                    values["active_prefill_tokens_threshold_frac"],
                    values.get("ttft_p99_target_ms"),
                    values.get("itl_p99_target_ms"),
                )
            except (KeyError, TypeError) as exc:
                raise StateFileError(f"{self.path}: thresholds.{model}: {exc!r}") from None
            self.pool.set_thresholds(model, th, (1, ""))
            self.changed_models.add(model)
            applied += 1
        for name, settings in (raw.get("classes") or {}).items():
            if self.classes is None:
                break
            try:
                self.classes.update_class(name, settings, (1, ""))
            except KeyError:
                log.warning("state file %s: class %r is not configured; ignored", self.path, name)
                continue
            except ClassConfigError as exc:
                raise StateFileError(f"{self.path}: {exc}") from None
            self.changed_classes.add(name)
            applied += 1
        return applied

    def watch(self) -> None:
        """Save after every change made on this replica."""
        self.pool.threshold_versions.listeners.append(self._threshold_changed)
        if self.classes is not None:
            self.classes.versions.listeners.append(self._class_changed)

    def _threshold_changed(self, model: str) -> None:
        self.changed_models.add(model)
        self.save()

    def _class_changed(self, name: str) -> None:
        self.changed_classes.add(name)
        self.save()

    def save(self) -> None:
        doc: dict[str, Any] = {
            "v": VERSION,
            "thresholds": {
                m: self.pool.thresholds_for(m).as_dict() for m in sorted(self.changed_models)
            },
            "classes": {},
        }
        if self.classes is not None:
            for name in sorted(self.changed_classes):
                entry = self.classes.table.by_name(name).as_dict()
                doc["classes"][name] = {k: v for k, v in entry.items() if k != "name"}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # the change applies; only its persistence failed
            log.error("cannot write the state file %s: %s", self.path, exc)
