"""Every image's prediction of one model on one set of images: what the report's confusion
matrix, per-class table and pictures of mistakes are made from.

Plain numpy arrays, one row per image (true class, predicted class, its probability, the
image's loss) and the image's location; saved as one ``.npz`` file. No torch here.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from imgtrainer.files import atomic_write

# <log_dir>/best_predictions.npz: the validation predictions of the run's best checkpoint.
BEST_PREDICTIONS = "best_predictions.npz"


@dataclass
class Predictions:
    """One row per image, in the data's order."""

    class_names: list[str]
    locations: list[str]  # where each image is (a path, shard.tar:member, file.parquet[row N])
    targets: np.ndarray  # int64, the true class
    predicted: np.ndarray  # int64, the top-1 class
    confidence: np.ndarray  # float32, the probability of the predicted class
    loss: np.ndarray  # float32, the cross-entropy of the true class
    about: dict[str, Any] = field(default_factory=dict)  # epoch, weights, checkpoint, data

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def correct(self) -> np.ndarray:
        return self.predicted == self.targets

    @property
    def top1(self) -> float:
        return float(self.correct.mean()) if len(self) else 0.0

    def confusion(self) -> np.ndarray:
        """[K, K] counts, rows the true class, columns the predicted one."""
        k = self.num_classes
        cells = np.bincount(self.targets * k + self.predicted, minlength=k * k)
        return cells.reshape(k, k)

    def highest_loss(self, count: int) -> np.ndarray:
        """The rows of the ``count`` images with the highest loss, highest first (ties in the
        data's order)."""
        order = np.argsort(-self.loss, kind="stable")
        return order[:count]

    def mistakes_of(self, k: int, count: int) -> np.ndarray:
        """The rows of up to ``count`` images of class ``k`` predicted as another class,
        highest loss first."""
        rows = np.flatnonzero((self.targets == k) & ~self.correct)
        return rows[np.argsort(-self.loss[rows], kind="stable")][:count]

    # -- the file ------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Written to a temporary file renamed into place: a reader never sees half a file."""
        buffer = io.BytesIO()
        np.savez_compressed(
            buffer,
            targets=self.targets.astype(np.int32),
            predicted=self.predicted.astype(np.int32),
            confidence=self.confidence.astype(np.float32),
            loss=self.loss.astype(np.float32),
            locations=_text(json.dumps(self.locations)),  # any character in a file's name
            class_names=_text(json.dumps(self.class_names)),
            about=_text(json.dumps(self.about)),
        )
        data = buffer.getvalue()
        atomic_write(path, lambda f: f.write(data), lambda: len(data))

    @classmethod
    def load(cls, path: Path) -> Predictions:
        """Raises OSError or ValueError for a file that is missing or not one of these."""
        with np.load(path, allow_pickle=False) as saved:
            try:
                predictions = cls(
                    json.loads(_string(saved["class_names"])),
                    _locations(_string(saved["locations"])),
                    saved["targets"].astype(np.int64),
                    saved["predicted"].astype(np.int64),
                    saved["confidence"],
                    saved["loss"],
                    json.loads(_string(saved["about"])),
                )
            except KeyError as err:
                raise ValueError(f"{path} is not a predictions file (no {err})") from None
        if not _well_formed(predictions):
            raise ValueError(f"{path} is not a predictions file (its rows do not match)")
        return predictions


def _well_formed(p: Predictions) -> bool:
    texts = (p.class_names, p.locations)
    if not all(isinstance(t, list) and all(isinstance(n, str) for n in t) for t in texts):
        return False
    return isinstance(p.about, dict) and len(p.locations) == len(p.targets) == len(p.loss)


def _locations(text: str) -> list[str]:
    """A JSON list; older files joined the locations with newlines."""
    if text.startswith("["):
        return json.loads(text)
    return text.split("\n") if text else []


def _text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(errors="surrogateescape"), dtype=np.uint8)


def _string(array: np.ndarray) -> str:
    return array.tobytes().decode(errors="surrogateescape")
