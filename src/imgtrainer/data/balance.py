"""Class imbalance: images per class, balanced class weights, the note a run logs.

scikit-learn's "balanced" class weights, and the note a run logs at its start when its classes
are far apart in size.
"""

from __future__ import annotations

from collections.abc import Sequence

# Above this ratio of the largest class to the smallest, a run says so at its start.
IMBALANCE_RATIO = 5.0


# Classes named at each end of the sizes in that note.
NAMED_CLASSES = 5


def class_counts(targets: Sequence[int], num_classes: int) -> list[int]:
    """Images per class index."""
    counts = [0] * num_classes
    for target in targets:
        counts[target] += 1
    return counts


def balanced_class_weights(counts: Sequence[int]) -> list[float]:
    """scikit-learn's ``class_weight="balanced"``: n_samples / (n_classes x images of the
    class). The average weight of an image is then 1, so the loss keeps its scale."""
    if not counts or min(counts) <= 0:
        raise ValueError(f"every class needs at least one image for balanced weights: {counts}")
    total = sum(counts)
    return [total / (len(counts) * count) for count in counts]


def imbalance_note(counts: Sequence[int], class_names: Sequence[str], handled: bool) -> str | None:
    """One line with the smallest and largest classes when the largest has more than
    IMBALANCE_RATIO times the images of the smallest (else None); unless ``handled`` (a
    --class_weights or --sampler that balances), it suggests the flags that do."""
    if not counts or min(counts) <= 0 or max(counts) <= IMBALANCE_RATIO * min(counts):
        return None
    by_size = sorted(range(len(counts)), key=lambda k: (counts[k], class_names[k]))

    def named(indices: Sequence[int]) -> str:
        return ", ".join(f"{class_names[k]} {counts[k]}" for k in indices)

    if len(by_size) <= 2 * NAMED_CLASSES:
        shown = f"images per class: {named(by_size)}"
    else:
        shown = (
            f"smallest classes: {named(by_size[:NAMED_CLASSES])}; largest: "
            f"{named(by_size[::-1][:NAMED_CLASSES])}"
        )
    note = (
        f"imbalanced classes: the largest has {max(counts) / min(counts):.1f}x the images of "
        f"the smallest ({shown})"
    )
    if handled:
        return note
    return note + (
        "; --class_weights balanced (weights the loss by inverse class frequency) or "
        "--sampler balanced (draws every class equally often) may help the small classes"
    )
