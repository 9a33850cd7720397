"""Prediction files (``.jsonl`` or ``.csv``): one row per input, naming it, with the predicted
class index as ``label``, its class name, and optionally the true label and the logits.
Rows are written to ``PATH.partial`` and renamed into place when the stream ends."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import IO, Any

import numpy as np


class PredictionWriter:
    """Context manager: ``write(names, logits, true_labels)`` appends rows."""

    def __init__(
        self, path: str | os.PathLike, class_names: list[str], with_logits: bool = False
    ) -> None:
        self.path = Path(path)
        if self.path.suffix not in (".jsonl", ".csv"):
            raise ValueError(f"unsupported predictions file {self.path}: use .jsonl or .csv")
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.class_names = class_names
        self.with_logits = with_logits
        self._file: IO[str] | None = None
        self._csv: Any = None  # csv.writer's type is private

    def __enter__(self) -> PredictionWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.partial, "w", encoding="utf-8", newline="")
        if self.path.suffix == ".csv":
            self._csv = csv.writer(self._file)
            header = ["input", "label", "class", "true_label"]
            self._csv.writerow(header + (["logits"] if self.with_logits else []))
        return self

    def write(self, names: list[str], logits: np.ndarray, true: np.ndarray | None) -> None:
        labels = logits.argmax(axis=1)
        for i, name in enumerate(names):
            row: dict[str, Any] = {
                "input": name,
                "label": int(labels[i]),
                "class": self.class_names[int(labels[i])],
                "true_label": int(true[i]) if true is not None else None,
            }
            if self.with_logits:
                row["logits"] = [round(float(v), 6) for v in logits[i]]
            if self._csv is not None:
                values = [row["input"], row["label"], row["class"], row["true_label"]]
                if self.with_logits:
                    values.append(" ".join(map(str, row["logits"])))
                self._csv.writerow(["" if v is None else v for v in values])
            else:
                self._opened().write(json.dumps(row) + "\n")

    def _opened(self) -> IO[str]:
        if self._file is None:
            raise RuntimeError("PredictionWriter is used outside its `with` block")
        return self._file

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close and publish the rows written so far (whole batches), even when the stream
        stopped on an error or an interrupt: no ``.partial`` is left behind."""
        file = self._opened()
        file.flush()
        os.fsync(file.fileno())
        file.close()
        os.replace(self.partial, self.path)
