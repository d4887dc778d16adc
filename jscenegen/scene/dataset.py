"""Grain data source over a JSONL scene set, and a checkpointable, seeded scene order.

`SceneSetSource` implements grain's RandomAccessDataSource protocol (`__len__`, `__getitem__`).
`scene_iterator` yields SceneRecords in file order (the GRPO schedule's order) or, with a seed,
in a reproducible shuffled order per epoch; its `get_state()` / `set_state()` dict goes into the
training checkpoint, so a resumed run continues with the very next scene. grain is imported
lazily: the GPU machines that lack it can still import the rest of the scene package.
"""
from __future__ import annotations

from pathlib import Path

from .sceneset import SceneRecord, read_scene_set


class SceneSetSource:
    """Random access to the records of one JSONL scene set (read once, validated)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._records = read_scene_set(path)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> SceneRecord:
        return self._records[index]

    def __repr__(self) -> str:
        return f"SceneSetSource({self.path!r}, {len(self)} scenes)"


def scene_dataset(path: str | Path, seed: int | None = None, num_epochs: int | None = 1):
    """grain.MapDataset of SceneRecords: file order when `seed` is None, else shuffled per epoch.

    num_epochs None repeats forever.
    """
    import grain

    ds = grain.MapDataset.source(SceneSetSource(path))
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    return ds


def scene_iterator(path: str | Path, seed: int | None = None, num_epochs: int | None = 1, state: dict | None = None):
    """A grain DatasetIterator over the set; `state` (from `get_state()`) resumes where it stopped."""
    it = iter(scene_dataset(path, seed, num_epochs).to_iter_dataset())
    if state is not None:
        it.set_state(state)
    return it
