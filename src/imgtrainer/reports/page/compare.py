"""Two models scored on the same images: each top-1 with its interval, the difference with
McNemar's exact test.

Also the per-class differences and the images one gets right and the other wrong. See
docs/tools.md for what the p-value does and does not mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from imgtrainer.reports.page.html import Section, cards, esc, page, percent, table, text
from imgtrainer.reports.page.report_page import Tiles
from imgtrainer.reports.page.thumbnails import ImageReader
from imgtrainer.reports.predictions import Predictions

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile
DISAGREEMENTS_SHOWN = 24


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default): unlike the normal
    approximation it stays inside [0, 1] and holds up near 0% and 100%."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """McNemar's exact test (two-sided): the p-value of ``only_a`` images that only A gets right
    against ``only_b`` that only B gets right, if either is equally likely to be the one right
    (a binomial test of the discordant pairs with p = 1/2; the images both get right or both
    wrong say nothing about which is better). 1.0 when they never disagree."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    # P(X <= k) for X ~ Binomial(n, 1/2), summed in log space: exact to rounding for any n.
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2)
        for i in range(k + 1)
    ]
    top = max(logs)
    tail = math.exp(top) * math.fsum(math.exp(value - top) for value in logs)
    return min(1.0, 2 * tail)


@dataclass
class Comparison:
    """Two models' predictions on the same images (the same locations, in the same order)."""

    a: Predictions
    b: Predictions
    names: tuple[str, str]  # how each model is named (its checkpoint)

    def __post_init__(self):
        if self.a.locations != self.b.locations or not np.array_equal(
            self.a.targets, self.b.targets
        ):
            raise ValueError("the two models were not scored on the same images")

    @property
    def only_a(self) -> np.ndarray:
        """Rows A gets right and B wrong."""
        return np.flatnonzero(self.a.correct & ~self.b.correct)

    @property
    def only_b(self) -> np.ndarray:
        return np.flatnonzero(self.b.correct & ~self.a.correct)

    @property
    def p_value(self) -> float:
        return mcnemar_exact(len(self.only_a), len(self.only_b))

    def accuracy(self, which: Predictions) -> tuple[float, float, float]:
        """Top-1 and its 95% Wilson interval."""
        correct = int(which.correct.sum())
        return (correct / max(len(which), 1), *wilson_interval(correct, len(which)))

    def per_class(self) -> list[dict[str, Any]]:
        """Each class with images: its images and each model's accuracy on them, the largest
        differences first."""
        rows = []
        for k, name in enumerate(self.a.class_names):
            mask = self.a.targets == k
            n = int(mask.sum())
            if not n:
                continue
            acc_a, acc_b = float(self.a.correct[mask].mean()), float(self.b.correct[mask].mean())
            rows.append({"class": name, "images": n, "a": acc_a, "b": acc_b, "diff": acc_b - acc_a})
        return sorted(rows, key=lambda r: (-abs(r["diff"]), r["class"]))

    def summary(self) -> dict[str, Any]:
        top_a, top_b = self.accuracy(self.a), self.accuracy(self.b)
        return {
            "a": self.names[0],
            "b": self.names[1],
            "images": len(self.a),
            "top1_a": top_a[0],
            "top1_a_interval": list(top_a[1:]),
            "top1_b": top_b[0],
            "top1_b_interval": list(top_b[1:]),
            "difference": top_b[0] - top_a[0],
            "only_a_right": len(self.only_a),
            "only_b_right": len(self.only_b),
            "mcnemar_exact_p": self.p_value,
            "per_class": self.per_class(),
        }

    def lines(self, classes_shown: int = 10) -> list[str]:
        """What the tool prints."""
        s = self.summary()
        out = [f"{s['images']} images, each scored by both models:"]
        for key, name in (("a", s["a"]), ("b", s["b"])):
            low, high = s[f"top1_{key}_interval"]
            out.append(
                f"  {key.upper()} {name}: top-1 {s[f'top1_{key}']:.4f} (95% interval {low:.4f} - {high:.4f})"
            )
        out.append(
            f"  B - A: {100 * s['difference']:+.2f} points; only A right on {s['only_a_right']}, "
            f"only B right on {s['only_b_right']}: McNemar's exact p = {s['mcnemar_exact_p']:.4g}"
        )
        changed = [r for r in s["per_class"] if r["diff"]][:classes_shown]
        if changed:
            out.append(
                f"  largest per-class differences (B - A, of {len(s['per_class'])} classes):"
            )
            out += [
                f"    {r['class']}: {r['a']:.3f} -> {r['b']:.3f} ({r['images']} images)"
                for r in changed
            ]
        return out


def build_comparison_page(comparison: Comparison, read_image: ImageReader) -> str:
    s = comparison.summary()
    sections = [per_class_section(s)]
    for ident, rows, loser in (
        ("only-a", comparison.only_a, comparison.b),
        ("only-b", comparison.only_b, comparison.a),
    ):
        sections.append(disagreement_section(ident, rows, loser, read_image))
    return page("Two models compared", comparison_head(s), sections)


def comparison_head(s: dict[str, Any]) -> str:
    def interval(key: str) -> str:
        low, high = s[f"top1_{key}_interval"]
        return f"{key.upper()} top-1 ({percent(low, 1)} - {percent(high, 1)})"

    tiles = [
        (percent(s["top1_a"], 2), interval("a")),
        (percent(s["top1_b"], 2), interval("b")),
        (f"{100 * s['difference']:+.2f}", "B - A, points"),
        (f"{s['mcnemar_exact_p']:.3g}", "McNemar's exact p"),
        (f"{s['only_a_right']} / {s['only_b_right']}", "only A right / only B right"),
        (str(s["images"]), "images"),
    ]
    return (
        f"<p class='lead'>A: {esc(s['a'])}<br>B: {esc(s['b'])}</p>"
        + cards(tiles)
        + "<p class='note'>Intervals: 95% Wilson score intervals. The p-value is the chance of "
        "a split of the disagreements at least this uneven if neither model were better on "
        "images like these; it is not the chance that B is better, nor the size of the gain, "
        "and it says nothing of another training seed or other data (docs/tools.md).</p>"
    )


def per_class_section(s: dict[str, Any]) -> Section:
    rows = [
        [
            text(r["class"]),
            str(r["images"]),
            percent(r["a"]),
            percent(r["b"]),
            f"{100 * r['diff']:+.1f}",
        ]
        for r in s["per_class"]
    ]
    headers = ["class", "images", "A top-1", "B top-1", "B - A, points"]
    return Section("classes", "Per class", table(headers, rows, "per-class", tall=True))


def disagreement_section(
    ident: str, rows: np.ndarray, loser: Predictions, read_image: ImageReader
) -> Section:
    """The images only one model gets right, with the other's (``loser``'s) predictions, its
    most confident mistakes first: where the two differ most."""
    winner, other = ("A", "B") if ident == "only-a" else ("B", "A")
    shown = rows[np.argsort(-loser.confidence[rows], kind="stable")][:DISAGREEMENTS_SHOWN]
    tiles = Tiles(loser, read_image)
    lead = (
        f"{len(rows)} image{'s' * (len(rows) != 1)}; the captions give {other}'s prediction, "
        "its most confident mistakes first."
        if len(rows)
        else f"None: {other} gets right every image {winner} gets right."
    )
    body = (
        f"<p>{lead}</p><div class='gallery' id='gallery-{ident}'>"
        + "".join(tiles.tile(r) for r in shown)
        + "</div>"
    )
    return Section(ident, f"Only {winner} gets these right", body)
