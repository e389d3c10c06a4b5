"""The report page's pieces without a training run: the page of a hand-written log folder, the
choice of pictures by loss, and the size and build time of the page at 1,000 classes."""

from __future__ import annotations

import json
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
from PIL import Image

import imgtrainer.reports.page.run_report as run_report
from imgtrainer.reports.page.report_page import GALLERY_IMAGES, classes_section, mistakes_section
from imgtrainer.reports.page.run_report import build_run_report
from imgtrainer.reports.page.svg_chart import (
    LEFT,
    RIGHT,
    WIDTH,
    Series,
    line_chart,
    nice_ticks,
    tick_label,
)
from imgtrainer.reports.predictions import BEST_PREDICTIONS, Predictions
from support.report_folder import write_log_folder

MAX_PAGE_BYTES = 8 * 2**20
MAX_BUILD_SECONDS = 15.0


class Page(HTMLParser):
    """What a test reads of a page: its images' sources, the rows of each table by id, the
    captions of each gallery by id, and every URL it names."""

    def __init__(self, text: str):
        super().__init__()
        self.images: list[str] = []
        self.rows: dict[str, int] = {}
        self.captions: dict[str, list[str]] = {}
        self.urls: list[str] = []
        self._table = self._gallery = None
        self._caption: list[str] | None = None
        self._in_body = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if name in attrs:
                self.urls.append(attrs[name])
        if tag == "img":
            self.images.append(attrs["src"])
        elif tag == "table" and attrs.get("id"):
            self._table = attrs["id"]
            self.rows[self._table] = 0
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._table and self._in_body:
            self.rows[self._table] += 1
        elif tag == "div" and "gallery" in attrs.get("class", ""):
            self._gallery = attrs.get("id") or f"row{len(self.captions)}"
            self.captions[self._gallery] = []
        elif tag == "figcaption":
            self._caption = []

    def handle_endtag(self, tag):
        if tag == "table":
            self._table, self._in_body = None, False
        elif tag == "figcaption" and self._caption is not None and self._gallery:
            self.captions[self._gallery].append(" ".join(" ".join(self._caption).split()))
            self._caption = None

    def handle_data(self, data):
        if self._caption is not None:
            self._caption.append(data)


def noise_image(location: str) -> Image.Image:
    """A picture for any location: noise, the hardest case for JPEG (the largest tiles)."""
    rng = np.random.default_rng(abs(hash(location)) % 2**32)
    return Image.fromarray(rng.integers(0, 256, (160, 200, 3), dtype=np.uint8))


def predictions_of(targets, predicted, loss, classes) -> Predictions:
    n = len(targets)
    return Predictions(
        list(classes),
        [f"val/{classes[t]}/img_{i}.jpg" for i, t in enumerate(targets)],
        np.asarray(targets, dtype=np.int64),
        np.asarray(predicted, dtype=np.int64),
        np.full(n, 0.5, dtype=np.float32),
        np.asarray(loss, dtype=np.float32),
    )


def test_chart_ticks_are_round_and_cover_the_values():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.283, 0.431) == [0.25, 0.3, 0.35, 0.4, 0.45]
    assert nice_ticks(5.0, 5.0)[0] < 5.0 < nice_ticks(5.0, 5.0)[-1]  # one value: a range around it
    assert nice_ticks(0.0, 0.0)[0] == 0.0  # a difference of 0 all along: drawn from 0 up
    assert [tick_label(t, [0.0, 1e-3, 2e-3]) for t in (0.0, 1e-3)] == ["0", "1.0e-3"]
    chart = line_chart("Loss", [Series("val_loss", [1, 2, 3], [1.0, float("nan"), 0.5])], "x", 3)
    assert chart.count("<circle") == 2 and "best epoch" in chart
    assert "not recorded" in line_chart("Loss", [Series("val_loss", [], [])])
    # One epoch (a checkpoint of the first): its point midway across, not on the y axis.
    one = line_chart("Loss", [Series("val_loss", [1], [0.5])], "x", 1)
    assert re.findall(r"<circle cx='([\d.]+)'", one) == [f"{(LEFT + WIDTH - RIGHT) / 2:.1f}"]


# ----------------------------------------------------------------------------- the gallery


def test_the_gallery_shows_the_highest_losses_first_and_the_worst_classes_mistakes():
    classes = ["cat", "dog", "fox"]
    targets = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    predicted = [0, 1, 2, 1, 1, 1, 2, 2, 0]
    loss = [0.1, 2.5, 1.5, 0.2, 0.05, 0.3, 0.4, 0.01, 3.0]
    p = predictions_of(targets, predicted, loss, classes)
    assert p.highest_loss(3).tolist() == [8, 1, 2]
    assert p.mistakes_of(0, 5).tolist() == [1, 2] and p.mistakes_of(1, 5).tolist() == []
    page = Page(mistakes_section(p, noise_image, "about").body)
    top = page.captions["gallery"]
    assert len(top) == min(GALLERY_IMAGES, 9)
    assert top[0].startswith("fox taken for cat") and "loss 3.00" in top[0]
    assert top[1].startswith("cat taken for dog") and top[2].startswith("cat taken for fox")
    rows = [captions for name, captions in page.captions.items() if name != "gallery"]
    # cat (F1 0.4) before fox (F1 0.8); dog has no mistake of its own: no row.
    assert [len(r) for r in rows] == [2, 1]
    assert rows[0][0].startswith("cat taken for dog") and rows[1][0].startswith("fox taken for")
    assert all(src.startswith("data:image/jpeg;base64,") for src in page.images)
    # The mistakes are outlined; the images it gets right are not.
    body = mistakes_section(p, noise_image, "about").body
    assert body.count("<figure class='wrong'>") == 3 + 3 and body.count("<figure>") == 6


def test_classes_named_by_their_numbers_are_not_numbered_twice():
    digits = [str(k) for k in range(4)]
    p = predictions_of([0, 1, 2, 3], [0, 1, 3, 3], [0.1] * 4, digits)
    text = classes_section(p, [5, 5, 5, 5]).body
    assert "<th class='text'>#</th>" not in text and "<th class='text'>2</th>" in text
    named = classes_section(predictions_of([0, 1], [0, 1], [0.1] * 2, ["a", "b"]), None).body
    assert "<th class='text'>#</th>" in named and "<th class='text'>1 b</th>" in named


def test_a_picture_that_cannot_be_read_is_a_tile_without_an_image():
    p = predictions_of([0, 1], [1, 0], [1.0, 2.0], ["a", "b"])
    page = Page(mistakes_section(p, lambda location: None, "about").body)
    assert page.images == [] and len(page.captions["gallery"]) == 2


# ----------------------------------------------------------------------------- the run page


def test_the_run_page_shows_what_the_log_folder_holds(tmp_path: Path):
    classes = ["cat", "dog", "fox"]
    write_log_folder(tmp_path, classes, epochs=3, images_per_class=6)
    text = build_run_report(tmp_path)
    page = Page(text)
    assert page.rows["per-class"] == 3 and page.rows["epochs"] == 3
    assert all(url.startswith(("data:", "#")) for url in page.urls), page.urls
    assert "<script" not in text
    for field in ("audit_max_diff", "rank1_step_s", "made_up_by_a_later_version", "val_acc_ema"):
        assert f">{field}<" in text, field
    assert "Done: best val_acc 0.9 (EMA weights, epoch 3)" in text
    # The starts from the history's events; the wall time from each start's first event to
    # its last (or its last write of the history): 10:00-10:05 and 10:06-10:09.
    assert "start 1 at 2026-01-01 10:00:00: a new run" in text
    assert "start 2 at 2026-01-01 10:06:00: Resumed from" in text
    assert "<b>8m00s</b><span>wall time, 2 start(s)</span>" in text
    assert "1 straggler(s) named" in text and "watchdog: rank 1" in text
    assert "2026-01-01 09:59:58 python -m torch.distributed.run" in text  # the launcher's
    assert "attempt0-rank1.txt" in text and "1 unreadable image(s)" in text
    assert "its EMA weights" in text
    # The data audit over the run, and its warning; the command that continues the run.
    assert (
        "The data audit (--audit_data_every 100) made 9 of the training images again on the CPU "
        "reference path: the largest difference was 4.2 levels of 0-255 (epoch 2); 1 image(s) "
        "over the tolerance." in text
    )
    assert "data audit: train/cat/a.jpg made from gpu" in text
    command = "python launch_ddp.py --config logs/config.yaml --resume auto --epochs 6"
    assert "<pre class='command'><span>" + "</span> <span>".join(command.split()) in text
    empty_head = "<thead><tr><th class='text'></th><th class='text'></th></tr></thead>"
    assert empty_head not in text  # the tables of names and values have no header row
    # The images are not where the history says: tiles without pictures, the page still whole.
    assert len(page.captions["gallery"]) == min(GALLERY_IMAGES, 18) and page.images == []
    # The six curves, then one chart per other field (the per-rank ones together).
    others = ["epoch_seconds", "peak_memory_mb", "micro_batch", "rank*_step_s", "audit_images"]
    others += ["audit_max_diff", "made_up_by_a_later_version"]
    titles = re.findall(r"<svg class='chart'[^>]*aria-label='([^']*)'", text)
    assert titles[6:] == others and titles[2] == "Top-5 accuracy"


def test_predictions_of_another_epoch_are_not_shown(tmp_path: Path):
    write_log_folder(tmp_path, ["a", "b"], epochs=3, images_per_class=4)
    p = Predictions.load(tmp_path / BEST_PREDICTIONS)
    p.about = {"epoch": 1}
    p.save(tmp_path / BEST_PREDICTIONS)
    text = build_run_report(tmp_path)
    assert "holds the predictions of epoch 1, not of the best epoch of this history (3)" in text
    assert "id='per-class'" not in text and "id='gallery'" not in text and "id='epochs'" in text


def test_a_history_without_events_still_makes_its_page(tmp_path: Path):
    """An older run's history (no events) and launches of earlier runs: the page without the
    parts that need the events."""
    write_log_folder(tmp_path, ["a", "b"], epochs=3, images_per_class=4)
    path = tmp_path / "training_history.json"
    history = json.loads(path.read_text())
    del history["events"]
    path.write_text(json.dumps(history))
    text = build_run_report(tmp_path)
    assert "No ending recorded yet" in text and "wall time" not in text and "start 1" not in text
    assert Page(text).rows["epochs"] == 3 and "0 warning(s)" in text
    assert "To continue the run from its latest checkpoint" in text  # no ending: not finished
    # Without a first event, every launch is listed; with one, only this run's.
    assert "09:59:58 python -m torch.distributed.run" in text
    history["events"] = [{"kind": "start", "time": "2026-01-01T10:30:00"}]
    path.write_text(json.dumps(history))
    assert "09:59:58 python -m torch.distributed.run" not in build_run_report(tmp_path)


def test_an_empty_log_folder_gives_a_page_that_says_so(tmp_path: Path):
    text = build_run_report(tmp_path)
    assert "No training_history.json" in text and "No ending recorded yet" in text


def test_the_page_of_a_thousand_classes_stays_small_and_quick(tmp_path: Path, monkeypatch):
    classes = [f"class_{k:04d}" for k in range(1000)]
    write_log_folder(tmp_path, classes, epochs=60, images_per_class=10)
    # Every picture readable, and noise: the largest pictures a page can hold.
    monkeypatch.setattr(run_report, "DataImages", lambda *args, **kwargs: noise_image)
    started = time.perf_counter()
    text = build_run_report(tmp_path)
    seconds = time.perf_counter() - started
    size = len(text.encode())
    print(f"1,000 classes, 10,000 images, 60 epochs: {size / 2**20:.2f} MB in {seconds:.1f} s")
    assert size <= MAX_PAGE_BYTES and seconds <= MAX_BUILD_SECONDS
    page = Page(text)
    assert page.rows["per-class"] == 1000 and page.rows["pairs"] == 30
    assert "id='confusion'" not in text  # beyond 100 classes: the pairs, not the matrix
    assert len(page.captions["gallery"]) == GALLERY_IMAGES
