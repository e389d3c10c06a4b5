"""``<log_dir>/report.html``: one page that explains a run, built from the files it writes.

The same page at the run's end (the main process) and from ``python src/utils.py --report
LOG_DIR`` at any time, mid-run too: the history and its events, the best epoch's predictions,
its configuration and its checkpoints, each shown as far as it exists.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from imgtrainer.config import TRAIN_FIELDS, TrainConfig
from imgtrainer.data import data_reading
from imgtrainer.events import LAUNCHER_EVENTS
from imgtrainer.files import atomic_write
from imgtrainer.reports.history import read_history
from imgtrainer.reports.page.html import (
    Section,
    cards,
    command_line,
    esc,
    folded,
    page,
    percent,
    preformatted,
    table,
    text,
)
from imgtrainer.reports.page.report_page import (
    best_epoch,
    classes_section,
    curves_section,
    mistakes_section,
)
from imgtrainer.reports.page.run_events import RunEvents, Start, clock, launcher_events
from imgtrainer.reports.page.thumbnails import DataImages
from imgtrainer.reports.predictions import BEST_PREDICTIONS, Predictions

log = logging.getLogger(__name__)

REPORT_NAME = "report.html"
HISTORY_NAME = "training_history.json"
UNREADABLE_LIST = "unreadable_images.txt"
UNREADABLE_SHOWN = 20


@dataclass
class RunFiles:
    """What a log folder holds, read once; anything missing is None or empty."""

    log_dir: Path
    history: dict[str, Any] | None
    predictions: Predictions | None
    predictions_note: str
    events: RunEvents
    config_text: str | None

    @classmethod
    def read(cls, log_dir: Path) -> RunFiles:
        history = read_json_history(log_dir / HISTORY_NAME)
        predictions, note = best_predictions(log_dir / BEST_PREDICTIONS, history)
        config = log_dir / "config.yaml"
        return cls(
            log_dir,
            history,
            predictions,
            note,
            RunEvents.of(history),
            config.read_text(errors="replace") if config.is_file() else None,
        )

    @property
    def config(self) -> dict[str, Any]:
        return (self.history or {}).get("config") or {}


def read_json_history(path: Path) -> dict[str, Any] | None:
    try:
        return read_history(path)
    except (OSError, ValueError):
        return None


def best_predictions(path: Path, history: dict[str, Any] | None) -> tuple[Predictions | None, str]:
    """The best epoch's validation predictions, and a line saying whose they are; None (and
    why) when there are none, or they belong to another epoch than the history's best."""
    best = best_epoch(history)
    try:
        predictions = Predictions.load(path)
    except (OSError, ValueError):
        return None, "No validation predictions yet: they are kept when an epoch is the best."
    about = predictions.about
    if best is None or about.get("epoch") != best:
        return None, (
            f"{path.name} holds the predictions of epoch {about.get('epoch')}, not of the "
            f"best epoch of this history ({best}): an earlier run's, or written before it."
        )
    weights = "EMA" if about.get("weights") == "ema" else "trained"
    return predictions, (
        f"The validation images as the best checkpoint (epoch {best}, its {weights} weights) "
        f"predicted them, in the pass that scored it ({len(predictions)} images)."
    )


# ----------------------------------------------------------------------------- the page


def run_reading(files: RunFiles):
    """How the run read its data (its byte cache in the log folder, the options it wrote), so
    that the pictures of images in a bucket come from the bytes the run read; None for a
    config of another shape."""
    try:
        known = {name: files.config[name] for name in TRAIN_FIELDS if name in files.config}
        return data_reading(replace(TrainConfig(**known), log_dir=str(files.log_dir)))
    except (TypeError, ValueError):
        return None


def build_run_report(log_dir: Path) -> str:
    files = RunFiles.read(log_dir)
    history = files.history
    sections = []
    if history and history["epochs"]:
        sections.append(curves_section(history))
    if files.predictions is not None:
        counts = history.get("train_class_counts") if history else None
        sections.append(classes_section(files.predictions, counts))
        names, reading = files.predictions.class_names, run_reading(files)
        images = DataImages(files.config.get("val_dir"), names, reading=reading)
        sections.append(mistakes_section(files.predictions, images, files.predictions_note))
    else:
        sections.append(no_predictions_section(files))
    sections += [data_section(files), run_section(files), checkpoints_section(files)]
    return page(f"Run report: {log_dir}", head(files), sections)


def no_predictions_section(files: RunFiles) -> Section:
    folder = Path(files.config.get("checkpoint_dir", "checkpoints"))
    return Section(
        "classes",
        "Classes and mistakes",
        f"<p>{esc(files.predictions_note)}</p><p class='note'>For any checkpoint: <code>python "
        f"src/evaluate.py --checkpoint {esc(folder / 'checkpoint_best.pth')} --data_dir "
        f"{esc(files.config.get('val_dir', 'DIR'))} --report</code></p>",
    )


def head(files: RunFiles) -> str:
    """How the run ended (its own words), then its key figures as tiles."""
    history, ending = files.history, files.events.ending() or {}
    said = ending.get("text") or "No ending recorded yet: the run is going on, or was killed."
    lead = f"<p class='lead'>{esc(said.splitlines()[0])}</p>"
    if not history:
        return lead + f"<p class='warn'>No {HISTORY_NAME} in {esc(files.log_dir)} yet.</p>"
    return lead + cards(best_tiles(history) + run_tiles(files))


def best_tiles(history: dict[str, Any]) -> list[tuple[str, str]]:
    """The best epoch's top-1 and top-5 (of the weights that scored it) and, when the run
    chose by another metric, its value."""
    best = history.get("best") or {}
    record = next((r for r in history["epochs"] if r.get("epoch") == best.get("epoch")), None)
    if record is None:
        return []
    ema = "_ema" if best.get("weights") == "ema" else ""
    tiles = [
        (percent(record.get("val_acc" + ema), 2), f"val top-1, best epoch {record['epoch']}"),
        (percent(record.get("val_top5" + ema), 2), "val top-5 there"),
    ]
    metric = best.get("metric", "val_acc")
    if metric != "val_acc" and best.get("value") is not None:
        tiles.insert(0, (f"{best['value']:.4f}", f"best {metric}"))
    return tiles


def run_tiles(files: RunFiles) -> list[tuple[str, str]]:
    history, config, events = files.history or {}, files.config, files.events
    tiles = [
        (f"{len(history.get('epochs', []))} / {config.get('epochs', '?')}", "epochs trained"),
        (f"{history.get('world_size', '?')} × {history.get('device', '?')}", "processes"),
        (config.get("model", "?"), "model"),
    ]
    wall = events.wall_seconds()
    if wall is not None:
        tiles.append((duration(wall), f"wall time, {len(events.starts)} start(s)"))
    return tiles


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def data_section(files: RunFiles) -> Section:
    config = files.config
    parts = [
        table(
            ["", "from"],
            [
                [text("training"), text(config.get("train_dir", "?"))],
                [text("validation"), text(config.get("val_dir", "?"))],
            ],
        )
    ]
    lines = files.events.data_lines()
    if lines:
        parts.append(preformatted("\n".join(lines)))
    parts.append(unreadable_block(files.log_dir / UNREADABLE_LIST))
    parts.append(audit_block(files))
    return Section("data", "Data", "\n".join(parts))


def audit_block(files: RunFiles) -> str:
    """What the data audit (--audit_data_every) found over the run: the images it made again
    on the CPU reference path, their largest difference, and its warnings."""
    records = (files.history or {}).get("epochs") or []
    audited = [r for r in records if isinstance(r.get("audit_images"), int)]
    every = files.config.get("audit_data_every")
    if not audited:
        return "<p>The data audit was off (--audit_data_every 0).</p>" if every == 0 else ""
    images = sum(r["audit_images"] for r in audited)
    if not images:
        return f"<p>The data audit (--audit_data_every {esc(every)}) checked no image yet.</p>"
    worst = max(audited, key=lambda r: r.get("audit_max_diff") or 0.0)
    largest = worst.get("audit_max_diff") or 0.0
    warnings = files.events.warnings("audit")
    line = (
        f"The data audit (--audit_data_every {every}) made {images} of the training images "
        f"again on the CPU reference path: the largest difference was {largest:g} levels of "
        f"0-255" + (f" (epoch {worst['epoch']})" if largest else "") + f"; {len(warnings)} "
        "image(s) over the tolerance."
    )
    if not warnings:
        return f"<p>{esc(line)}</p>"
    return f"<p class='warn'>{esc(line)}</p>" + preformatted("\n".join(warnings))


def unreadable_block(path: Path) -> str:
    try:
        rows = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "<p>No unreadable image was found (or the check has not finished yet).</p>"
    shown = "\n".join(rows[:UNREADABLE_SHOWN]) + ("\n..." if len(rows) > UNREADABLE_SHOWN else "")
    return (
        f"<p class='warn'>{len(rows)} unreadable image(s) left out ({esc(path)}):</p>"
        + preformatted(shown)
    )


def run_section(files: RunFiles) -> Section:
    history, events = files.history or {}, files.events
    parts = ["<h3>Command</h3>"]
    command = history.get("command")
    if command:
        parts.append(command_line(" ".join(map(str, command))))
    since = events.starts[0].began if events.starts else None
    launches, watchdog = launcher_events(files.log_dir / LAUNCHER_EVENTS, since)
    if launches:
        parts.append(
            folded(
                f"torchrun, as the launcher ran it ({len(launches)} launch(es))",
                preformatted("\n".join(launches)),
            )
        )
    if files.config_text:
        parts.append(
            folded("The resolved configuration (config.yaml)", preformatted(files.config_text))
        )
    parts.append("<h3>Environment</h3>" + environment_table(history))
    parts.append("<h3>Timings</h3>" + timings_table(history, events))
    parts.append("<h3>Starts, restarts, hangs and stragglers</h3>" + starts(files, watchdog))
    return Section("run", "Run", "\n".join(parts))


def environment_table(history: dict[str, Any]) -> str:
    env = history.get("environment") or {}
    versions = history.get("versions") or {}
    rows = [
        ("world size", history.get("world_size")),
        ("device", history.get("device")),
        ("precision", env.get("precision")),
        ("GPUs (main process's node)", ", ".join(env.get("gpus") or []) or "none"),
        ("CUDA / cuDNN", f"{env.get('cuda')} / {env.get('cudnn')}" if env.get("cuda") else "–"),
        ("host of the main process", env.get("host")),
        ("effective batch", history.get("effective_batch_size")),
        *((name, version) for name, version in versions.items()),
    ]
    return table(["", ""], [[text(k), text("–" if v is None else v)] for k, v in rows])


def timings_table(history: dict[str, Any], events: RunEvents) -> str:
    records = history.get("epochs") or []
    seconds = [r["epoch_seconds"] for r in records if isinstance(r.get("epoch_seconds"), float)]
    speeds = [r["train_images_per_sec"] for r in records if r.get("train_images_per_sec")]
    waits = [r["data_wait_share"] for r in records if r.get("data_wait_share") is not None]
    rows = []
    wall = events.wall_seconds()
    if wall is not None:
        rows.append(("wall time of the run's starts (from its events)", duration(wall)))
    if seconds:
        rows += [
            ("time in epochs (training and validation)", duration(sum(seconds))),
            (
                "an epoch: mean / longest",
                f"{sum(seconds) / len(seconds):.1f} s / {max(seconds):.1f} s",
            ),
        ]
    if speeds:
        rows.append(
            (
                "training images/s: mean / best epoch",
                f"{sum(speeds) / len(speeds):.0f} / {max(speeds):.0f}",
            )
        )
    if waits:
        rows.append(
            ("waiting for data: mean share of the training time", percent(sum(waits) / len(waits)))
        )
    if not rows:
        return "<p>No timing yet.</p>"
    return table(["", ""], [[text(k), text(v)] for k, v in rows])


def starts(files: RunFiles, watchdog: list[str]) -> str:
    events = files.events
    items = []
    for number, start in enumerate(events.starts, 1):
        items.append(f"<li>start {number} at {clock(start.began)}: {esc(how_started(start))}</li>")
    parts = ["<ul>" + "".join(items) + "</ul>"] if items else []
    hangs = sorted((files.log_dir / "hang").glob("*.txt"))
    if watchdog or hangs:
        parts.append(
            f"<p class='warn'>The hang watchdog acted {len(watchdog)} time(s); stacks in {esc(files.log_dir / 'hang')}:</p>"
        )
        parts.append(preformatted("\n".join(watchdog + [str(p) for p in hangs])))
    warnings = events.warnings()
    stragglers = events.warnings("straggler")
    parts.append(
        f"<p>{len(stragglers)} straggler(s) named; {len(warnings)} warning(s) in the log.</p>"
    )
    if warnings:
        parts.append(
            folded("The warnings", preformatted("\n".join(warnings)), open_=bool(stragglers))
        )
    return "\n".join(parts)


def how_started(start: Start) -> str:
    """A new run, a resume (its own sentence), or a restart by torchrun."""
    resumed, begun = start.first("resume"), start.first("start") or {}
    if resumed is not None:
        said = str(resumed.get("text")).splitlines()[0]
        return f"restarted by torchrun: {said}" if resumed.get("by") == "torchrun" else said
    attempt = begun.get("attempt") or 0
    return f"restarted by torchrun (attempt {attempt}), from the start" if attempt else "a new run"


def checkpoints_section(files: RunFiles) -> Section:
    folder = Path(files.config.get("checkpoint_dir", "checkpoints"))
    found = sorted(folder.glob("checkpoint*.pth")) if folder.is_dir() else []
    if not found:
        return Section(
            "checkpoints", "Checkpoints", f"<p>No checkpoint in {esc(folder)} (seen from here).</p>"
        )
    rows = []
    for path in found:
        try:
            stat = path.stat()
        except OSError:  # replaced or removed by the run since the listing (a mid-run report)
            continue
        when = datetime.fromtimestamp(stat.st_mtime)
        rows.append(
            [text(path.name), f"{stat.st_size / 2**20:.1f} MB", text(f"{when:%Y-%m-%d %H:%M:%S}")]
        )
    body = (
        table(["file", "size", "written"], rows)
        + f"<p>Best epoch: {esc(best_epoch(files.history))}.</p>"
        + resume_block(files, folder)
        + "<p class='note'>Evaluate one on any data, with the pictures of its mistakes:</p>"
        + command_line(
            f"python src/evaluate.py --checkpoint {folder / 'checkpoint_best.pth'} "
            "--data_dir DIR --report"
        )
    )
    return Section("checkpoints", "Checkpoints", body)


def resume_block(files: RunFiles, folder: Path) -> str:
    """The command that continues the run from its latest checkpoint (a finished run: for
    more epochs), from the command its log says reruns its configuration."""
    config, ending = files.config, files.events.ending() or {}
    finished = ending.get("finished") is True
    rerun = files.events.rerun_command()
    if rerun is None:  # a log without it: the flags alone
        command = f"--resume {folder / 'checkpoint_latest.pth'}    (or --resume auto)"
    else:
        # A run file that starts over (the demo's) is told not to, or --resume refuses it.
        command = f"{rerun} --resume auto" + (" --no_overwrite" if config.get("overwrite") else "")
    if not finished:
        return "<p>To continue the run from its latest checkpoint:</p>" + command_line(command)
    epochs = config.get("epochs")
    if rerun is not None and isinstance(epochs, int):
        return (
            f"<p>The run finished. To train it further, resume it with more epochs (here "
            f"{2 * epochs} in all):</p>" + command_line(f"{command} --epochs {2 * epochs}")
        )
    return "<p>The run finished. To train it further, raise --epochs and resume:</p>" + (
        command_line(command)
    )


# ----------------------------------------------------------------------------- writing it


def write_run_report(log_dir: Path, output: Path | None = None) -> tuple[Path, int, float]:
    """Build the page of the run in ``log_dir`` and write it (atomically) to ``output``
    (default ``<log_dir>/report.html``); returns the path, its bytes and the seconds taken."""
    started = time.perf_counter()
    text = build_run_report(log_dir).encode()
    output = output or log_dir / REPORT_NAME
    atomic_write(output, lambda f: f.write(text), lambda: len(text))
    return output, len(text), time.perf_counter() - started


def report_line(path: Path, size: int, seconds: float) -> str:
    return f"Report: {path} ({size / 2**20:.1f} MB, built in {seconds:.1f} s)"
