#!/usr/bin/env python
"""Measure training recipes: named sets of flags, each trained through the real launcher on the
same data with the same seed and epochs, and timm's own train.py with its equivalent flags.

    apt-get install mate-backgrounds lomiri-wallpapers-16.04
    python bench/recipes/natural_data.py data/photos
    python bench/recipes/recipes.py --data data/photos --list                        # the configurations
    python bench/recipes/recipes.py --data data/photos --only defaults,recipe --output recipes.json
    python bench/recipes/recipes.py --data data/photos --output recipes.json \\
        --timm_train /tmp/timm/train.py                                              # + timm's train.py rows

Every configuration runs ``python launch_ddp.py --device DEVICE --nproc 1`` with the common flags
(``--train_dir``/``--val_dir`` from --data, ``--image_size``, ``--epochs``, ``--seed``) plus its
own, into ``WORK/<name>/{checkpoints,logs}``, one after the other by default (on the CPU two at
once would share the cores and slow each other). Afterwards the table: best and final validation
top-1 of the raw weights and, when the run kept an EMA, of the EMA weights (read from each run's
``training_history.json``), and the wall time from starting the launcher to its exit.

``--seeds 1,2,3`` trains every configuration once per seed (into ``WORK/<name>/seed_<N>``) and the
table gives the mean and the standard deviation over the seeds: on a few hundred validation
images one seed's difference of a point or two is noise. ``--device cuda --jobs 6`` trains on the
GPU, six runs at a time (small runs leave most of a large GPU idle; wall times are then shared).

A configuration whose flags this checkout's trainer does not know (a feature not merged yet) is
listed as skipped, with the missing flags, instead of failing the others.

timm's train.py is not part of timm's pip package: give a copy with --timm_train (it was taken
from pytorch-image-models at commit 2aabaef039d918d453b58714ab84562609981112). It runs on the CPU
through a ``-c`` config file holding ``device: cpu``; where its ``train_one_epoch``/``validate``
still default to ``torch.device('cuda')`` a patched copy is written into WORK (the one CPU patch,
recorded in the JSON). Its rows read the validation top-1 it logs per epoch, raw and EMA.

``--cpus 0`` runs every training under ``taskset -c 0``: the trainer then uses one thread, and
timm's run too (OMP_NUM_THREADS is set to the same count). On a machine shared with other jobs,
two threads that get less than two cores wait on each other (a bare ResNet18 step ran 3x slower
with 2 threads than with 1 under a load of 11 on 2 cores). Wall times are only comparable
between rows of one invocation on one machine; compare ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

from imgtrainer.errors import UserError, exit_on_user_error  # noqa: E402
from support.harness import launcher_command  # noqa: E402

TIMM_COMMIT = "2aabaef039d918d453b58714ab84562609981112"

# The from-scratch recipe of issue 12, on top of today's defaults (RandomResizedCrop, flip,
# AdamW, cosine). No weight decay on norm layers and biases is the trainer's default once that
# branch lands (--decay_norm_and_bias turns it off), so the recipe needs no flag for it.
# mixup/cutmix are not in the base recipe: they pay off on long schedules (torchvision, timm RSB);
# "recipe + mixup/cutmix" measures them.
RECIPE = [
    "--auto_augment", "trivialaugment",
    "--random_erasing", "0.25",
    "--label_smoothing", "0.1",
    "--model_ema", "--ema_decay", "0.99",
]  # fmt: skip


def _without(flags: list[str], *names: str) -> list[str]:
    """``flags`` less each ``--name`` and the values that follow it."""
    out, skipping = [], False
    for token in flags:
        if token.startswith("--"):
            skipping = token in names
        if not skipping:
            out.append(token)
    return out


# name -> the flags added to the common ones. Order: baselines, the recipe, then one ingredient
# taken out (or added) per row, the ablation.
CONFIGS: dict[str, list[str]] = {
    "defaults": [],
    "defaults + label smoothing": ["--label_smoothing", "0.1"],
    "defaults + lr 0.002": ["--learning_rate", "0.002"],
    "defaults + lr 0.004": ["--learning_rate", "0.004"],
    "defaults + wd 0.05": ["--weight_decay", "0.05"],
    "defaults + batch 64 + lr 0.002": ["--batch_size", "64", "--learning_rate", "0.002"],
    "recipe": RECIPE,
    "recipe - trivialaugment": _without(RECIPE, "--auto_augment"),
    "recipe - random erasing": _without(RECIPE, "--random_erasing"),
    "recipe - label smoothing": _without(RECIPE, "--label_smoothing"),
    "recipe - ema": _without(RECIPE, "--model_ema", "--ema_decay"),
    "recipe - no wd on norm": [*RECIPE, "--decay_norm_and_bias"],
    "recipe with randaugment": [*_without(RECIPE, "--auto_augment"), "--auto_augment", "randaugment"],
    "recipe + mixup/cutmix": [
        *RECIPE,
        "--mixup",
        "0.2",
        "--cutmix",
        "1.0",
        "--mix_off_epochs",
        "2",
    ],
    "recipe + clip grad 1": [*RECIPE, "--clip_grad_norm", "1.0"],
    "recipe + eval resize 1.0": [*RECIPE, "--eval_resize_ratio", "1.0"],
    "recipe + warmup 1": [*RECIPE, "--warmup_epochs", "1"],
    "defaults + batch 16": ["--batch_size", "16"],
    "recipe + batch 16": [*RECIPE, "--batch_size", "16"],
    "recipe + lr 0.002": [*RECIPE, "--learning_rate", "0.002"],
    "recipe + lr 0.004 + warmup 1": [*RECIPE, "--learning_rate", "0.004", "--warmup_epochs", "1"],
    "defaults + files (no cache)": ["--cache_images", "none"],
    # The data audit reads, it draws nothing: off, or at every batch, the same weights.
    "defaults + no data audit": ["--audit_data_every", "0"],
    "defaults + data audit every batch": ["--audit_data_every", "1"],
    "lr 0.004 + label smoothing": ["--learning_rate", "0.004", "--label_smoothing", "0.1"],
    "batch 64 + lr 0.004 + label smoothing": [
        "--batch_size", "64", "--learning_rate", "0.004", "--label_smoothing", "0.1",
    ],
}  # fmt: skip

# timm's train.py: the same model, data, image size, batch, epochs, optimizer, schedule (cosine,
# stepped every update, no warm-up) and 2 loader workers. timm's own defaults that differ from the
# trainer's are set back: label smoothing 0.1 -> 0, colour jitter 0.4 -> 0, random train
# interpolation -> bilinear, the model's crop_pct -> 0.875. Its AdamW never decays norm weights
# and biases (timm's filter), which the trainer does today (and will not once that branch lands).
TIMM_PLAIN = [
    "--model", "resnet18", "--opt", "adamw", "--weight-decay", "0.01",
    "--sched", "cosine", "--sched-on-updates", "--warmup-epochs", "0", "--min-lr", "0",
    "--cooldown-epochs", "0", "--smoothing", "0", "--color-jitter", "0",
    "--interpolation", "bilinear", "--train-interpolation", "bilinear", "--crop-pct", "0.875",
    "-j", "2", "--no-prefetcher", "--log-interval", "50", "--checkpoint-hist", "1",
]  # fmt: skip
# Its stronger flags, the counterpart of RECIPE: RandAugment (timm has no TrivialAugment; the
# policy of its "ResNet strikes back" recipes), random erasing, label smoothing, EMA with a decay
# that suits a few hundred steps (its 0.9998 default would leave the EMA near the initial weights;
# timm's ModelEmaV2 has no warm-up). "mmax9" clips RandAugment's noisy magnitude at 9 instead of
# 10: at 10 timm's PosterizeIncreasing keeps 0 bits, which Pillow 13 rejects (ValueError, 4 in
# 3,000 draws), ending the run.
TIMM_RECIPE = [
    *_without(TIMM_PLAIN, "--smoothing"),
    "--aa", "rand-m9-mstd0.5-inc1-mmax9", "--reprob", "0.25", "--smoothing", "0.1",
    "--model-ema", "--model-ema-decay", "0.99",
]  # fmt: skip
# Fine-tuning from a checkpoint given with --pretrained_path (PRETRAINED below), next to training
# from scratch on the same data. Offline there are no ImageNet weights: bench/recipes/finetune.sh
# pretrains on some classes of the photo set and fine-tunes on the others.
FINETUNE = [
    "--pretrained_path", "PRETRAINED", "--learning_rate", "0.0005", "--warmup_epochs", "1",
    "--head_lr_scale", "10", "--freeze_backbone_epochs", "1",
]  # fmt: skip
FINETUNE_CONFIGS: dict[str, list[str]] = {
    "fine-tune plain": ["--pretrained_path", "PRETRAINED", "--learning_rate", "0.0005"],
    "fine-tune recipe": FINETUNE,
    "fine-tune recipe + label smoothing": [*FINETUNE, "--label_smoothing", "0.1"],
    "fine-tune recipe - freeze": _without(FINETUNE, "--freeze_backbone_epochs"),
    "fine-tune recipe - head lr": _without(FINETUNE, "--head_lr_scale"),
    "fine-tune recipe + lr 0.001": [
        *_without(FINETUNE, "--learning_rate"),
        "--learning_rate",
        "0.001",
    ],
}

TIMM_CONFIGS: dict[str, list[str]] = {
    "timm train.py plain": TIMM_PLAIN,
    "timm train.py recipe": TIMM_RECIPE,
    "timm train.py lr 0.004 + smoothing": [
        *_without(TIMM_PLAIN, "--smoothing"), "--smoothing", "0.1", "--lr", "0.004",
    ],
    "timm train.py recipe + mixup/cutmix": [
        *TIMM_RECIPE, "--mixup", "0.2", "--cutmix", "1.0", "--mixup-off-epoch", "EPOCHS-2",
    ],
}  # fmt: skip


@dataclass
class Row:
    name: str
    tool: str  # "launcher" or "timm"
    flags: list[str]
    status: str = "ok"  # ok | skipped: ... | failed: ...
    best_val_acc: float | None = None
    final_val_acc: float | None = None
    best_val_acc_ema: float | None = None
    final_val_acc_ema: float | None = None
    epochs_done: int = 0
    wall_seconds: float | None = None
    val_acc_per_epoch: list[float] = field(default_factory=list)
    val_acc_ema_per_epoch: list[float] = field(default_factory=list)
    seed: int = 42


def trainer_flags() -> set[str]:
    """Every ``--flag`` the launcher and this checkout's trainer accept (from their --help)."""
    text = ""
    for tool in ("launch_ddp.py", "src/train_ddp.py"):
        result = subprocess.run(
            [sys.executable, str(ROOT / tool), "--help"], capture_output=True, text=True
        )
        text += result.stdout
    return set(re.findall(r"--[a-z][a-z0-9_]*", text))


def taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def run_logged(command: list[str], log: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run ``command`` with its output in ``log``; return (exit code, wall seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  $ {shlex.join(command)}", flush=True)
    started = time.time()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    return code, time.time() - started


def run_folder(args: argparse.Namespace, name: str, seed: int) -> Path:
    return args.work / slug(name) / (f"seed_{seed}" if len(args.seeds) > 1 else "")


def run_launcher(
    name: str, flags: list[str], args: argparse.Namespace, known: set[str], seed: int
) -> Row:
    row = Row(name, "launcher", flags, seed=seed)
    missing = sorted({f for f in flags if f.startswith("--")} - known)
    if missing:
        row.status = f"skipped: not on this branch: {' '.join(missing)}"
        return row
    folder = run_folder(args, name, seed)
    common = [
        "--device", args.device, "--nproc", "1",
        "--train_dir", str(args.data / "train"), "--val_dir", str(args.data / "val"),
        "--image_size", str(args.image_size), "--epochs", str(args.epochs),
        "--seed", str(seed), "--log_interval", "50", "--no_tensorboard",
        "--checkpoint_dir", str(folder / "checkpoints"), "--log_dir", str(folder / "logs"),
        "--overwrite",
    ]  # fmt: skip
    command = [*taskset(args.cpus), *launcher_command(*common)]
    command += [
        *args.extra,
        *(str(args.pretrained_path) if f == "PRETRAINED" else f for f in flags),
    ]
    code, row.wall_seconds = run_logged(command, folder / "console.log", dict(os.environ))
    history = folder / "logs" / "training_history.json"
    if history.is_file():
        records = json.loads(history.read_text())["epochs"]
        row.val_acc_per_epoch = [r["val_acc"] for r in records]
        row.val_acc_ema_per_epoch = [r["val_acc_ema"] for r in records if "val_acc_ema" in r]
    finish(row, code, folder / "console.log")
    return row


# timm's validate() logs, at its last batch, the running averages over the whole set:
#   Test: [  17/17]  ...  Acc@1:  50.000 ( 61.250)  Acc@5: ...
#   Test (EMA): [  17/17]  ...
_TIMM_TEST = re.compile(
    r"(Test(?: \(EMA\))?): \[\s*(\d+)/(\d+)\].*?Acc@1:\s*[\d.]+\s*\(\s*([\d.]+)\)"
)


def timm_script(args: argparse.Namespace) -> tuple[Path, str]:
    """timm's train.py, patched for the CPU where needed; returns (path, what was patched)."""
    text = args.timm_train.read_text()
    cuda_default = "device=torch.device('cuda'),"
    if cuda_default not in text:
        return args.timm_train, "none"
    patched = args.work / "timm_train_cpu.py"
    patched.parent.mkdir(parents=True, exist_ok=True)
    patched.write_text(
        text.replace(
            cuda_default, "device=torch.device('cuda' if torch.cuda.is_available() else 'cpu'),"
        )
    )
    return patched, f"{text.count(cuda_default)} x {cuda_default!r} -> cuda if available else cpu"


def run_timm(name: str, flags: list[str], args: argparse.Namespace, script: Path, seed: int) -> Row:
    row = Row(name, "timm", flags, seed=seed)
    folder = run_folder(args, name, seed)
    folder.mkdir(parents=True, exist_ok=True)
    device_file = folder / "timm_device.yaml"
    device_file.write_text(f"device: {args.device}\n")  # older train.py has no --device flag
    classes = sum(1 for p in (args.data / "train").iterdir() if p.is_dir())
    command = [
        *taskset(args.cpus), sys.executable, str(script), "-c", str(device_file),
        "--data-dir", str(args.data), "--train-split", "train", "--val-split", "val",
        "--num-classes", str(classes), "--img-size", str(args.image_size),
        "-b", str(args.batch_size or 32), "--lr", str(args.timm_lr),
        "--epochs", str(args.epochs), "--seed", str(seed),
        "--output", str(folder), "--experiment", "run",
        *(str(args.epochs - 2) if f == "EPOCHS-2" else f for f in flags),
        *args.timm_extra,  # last: they override the row's own flags
    ]  # fmt: skip
    env = dict(os.environ)
    if args.cpus:  # the trainer sets one thread per core it may use; timm leaves it to torch
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0) & cpu_set(args.cpus)) or 1)
    code, row.wall_seconds = run_logged(command, folder / "console.log", env)
    for kind, batch, last, top1 in _TIMM_TEST.findall((folder / "console.log").read_text()):
        if batch == last:
            target = row.val_acc_ema_per_epoch if "EMA" in kind else row.val_acc_per_epoch
            target.append(float(top1) / 100)
    finish(row, code, folder / "console.log")
    return row


def finish(row: Row, code: int, log: Path) -> None:
    raw, ema = row.val_acc_per_epoch, row.val_acc_ema_per_epoch
    row.epochs_done = len(raw)
    if raw:
        row.best_val_acc, row.final_val_acc = max(raw), raw[-1]
    if ema:
        row.best_val_acc_ema, row.final_val_acc_ema = max(ema), ema[-1]
    if code != 0:
        row.status = f"failed: exit code {code}, see {log}"


def cpu_set(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def mean_std(values: list[float | None]) -> str:
    """``mean`` in %, and ``±std`` over the seeds when there are several."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    mean = sum(known) / len(known)
    if len(known) == 1:
        return f"{100 * mean:.1f}"
    std = math.sqrt(sum((v - mean) ** 2 for v in known) / (len(known) - 1))
    return f"{100 * mean:.1f}±{100 * std:.1f}"


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    seeds = ",".join(map(str, args.seeds))
    print(
        f"\n{args.data.name}: {args.epochs} epochs at {args.image_size} px on {args.device}, "
        f"seed(s) {seeds}" + (f", extra flags {shlex.join(args.extra)}" if args.extra else "")
    )
    width = 12 if len(args.seeds) > 1 else 7
    header = (
        f"{'name':<38}{'best':>{width}}{'final':>{width}}{'best EMA':>{width + 3}}"
        f"{'final EMA':>{width + 4}}{'wall':>9}"
    )
    print(header + "  flags")
    print("-" * len(header))
    by_name: dict[str, list[Row]] = {}
    for row in rows:
        by_name.setdefault(row.name, []).append(row)
    for name, runs in by_name.items():
        done = [r for r in runs if r.status == "ok"] or runs
        walls = [r.wall_seconds for r in done if r.wall_seconds is not None]
        wall = f"{sum(walls) / len(walls) / 60:.1f} min" if walls else "-"
        first = runs[0]
        line = (
            f"{name:<38}{mean_std([r.best_val_acc for r in done]):>{width}}"
            f"{mean_std([r.final_val_acc for r in done]):>{width}}"
            f"{mean_std([r.best_val_acc_ema for r in done]):>{width + 3}}"
            f"{mean_std([r.final_val_acc_ema for r in done]):>{width + 4}}{wall:>9}"
            f"  {shlex.join(first.flags) if first.tool == 'launcher' else '(timm flags in JSON)'}"
        )
        print(line)
        for r in runs:
            if r.status != "ok":
                print(f"{'':<4}seed {r.seed}: {r.status}")
    print(
        "(validation top-1 in %"
        + (f", mean±std over {len(args.seeds)} seeds" if len(args.seeds) > 1 else "")
        + "; EMA columns only for runs that kept an EMA; wall: per run)",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="recipes.py", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    parser.add_argument("--data", type=Path, help="folder with train/ and val/ (natural_data.py)")
    parser.add_argument("--epochs", type=int, default=15, help="default: 15")
    parser.add_argument("--image_size", type=int, default=64, help="default: 64")
    parser.add_argument(
        "--seeds",
        default="42",
        help="comma-separated seeds: every configuration once per seed (default: 42, the "
        "trainer's)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time (default: 1; more on a GPU only)"
    )
    parser.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help="passed to every launcher run (default: the trainer's, 32) and to timm's",
    )
    parser.add_argument(
        "--timm_lr", type=float, default=0.001, help="timm's --lr (default: 0.001, the trainer's)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated names of the configurations to run, in order"
    )
    parser.add_argument(
        "--list", action="store_true", help="print the configurations and their flags, run none"
    )
    parser.add_argument(
        "--extra", default="", help="flags added to every launcher run, as one quoted string"
    )
    parser.add_argument(
        "--timm_extra",
        default="",
        help="flags added to every timm run, after its row's own (e.g. the counterparts of a "
        "preset given with --extra), as one quoted string",
    )
    parser.add_argument("--timm_train", type=Path, help="timm's train.py: adds its rows")
    parser.add_argument(
        "--pretrained_path",
        type=Path,
        help="a checkpoint to fine-tune from: runs the fine-tuning rows instead of the others "
        "(with --only, the rows named)",
    )
    parser.add_argument(
        "--work", type=Path, default=Path("bench_results/recipes"), help="run folders"
    )
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--cpus", help="run every training under taskset -c CPUS (e.g. 0)")
    args = parser.parse_args(argv)
    args.extra = shlex.split(args.extra)
    args.timm_extra = shlex.split(args.timm_extra)
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
        args.seeds = list(dict.fromkeys(seeds))  # once each: a seed's runs share a folder
    except ValueError:
        parser.error(f"--seeds: comma-separated whole numbers, got {args.seeds!r}")
    if not args.seeds or args.jobs < 1:
        parser.error("--seeds needs at least one seed and --jobs at least 1")
    if args.batch_size:
        args.extra = ["--batch_size", str(args.batch_size), *args.extra]
    return args


def selected(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(tool, name, flags) for every configuration to run, in order."""
    every = [("launcher", n, f) for n, f in CONFIGS.items()]
    every += [("launcher", n, f) for n, f in FINETUNE_CONFIGS.items()]
    every += [("timm", n, f) for n, f in TIMM_CONFIGS.items()]
    if args.only:
        names = list(dict.fromkeys(n.strip() for n in args.only.split(",") if n.strip()))
        known = {*CONFIGS, *FINETUNE_CONFIGS, *TIMM_CONFIGS}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UserError(f"unknown configuration(s) {unknown}: --list shows the names")
        by_name = {name: (tool, name, flags) for tool, name, flags in every}
        every = [by_name[n] for n in names]  # in the order given
    elif not args.list:
        every = [c for c in every if c[0] == "launcher" or args.timm_train]
        every = [c for c in every if (c[1] in FINETUNE_CONFIGS) == bool(args.pretrained_path)]
    if any(tool == "timm" for tool, _, _ in every) and not args.timm_train and not args.list:
        raise UserError("timm rows need --timm_train PATH (timm's train.py)")
    finetune = any(name in FINETUNE_CONFIGS for _, name, _ in every)
    if finetune and not args.pretrained_path and not args.list:
        raise UserError("fine-tuning rows need --pretrained_path FILE (a checkpoint)")
    return every


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = selected(args)
    if args.list:
        for _tool, name, flags in configs:
            print(f"{name:<38}{shlex.join(flags)}")
        return
    if args.data is None or not (args.data / "train").is_dir() or not (args.data / "val").is_dir():
        raise UserError(
            "--data must be a folder with train/ and val/ (bench/recipes/natural_data.py)"
        )
    if args.timm_train and not args.timm_train.is_file():
        raise UserError(f"--timm_train {args.timm_train}: no such file")
    if args.output and args.output.is_dir():
        raise UserError(f"--output {args.output} is a folder; give a file name")
    args.data, args.work = args.data.resolve(), args.work.resolve()
    known = trainer_flags()
    script, patch = timm_script(args) if args.timm_train else (None, "none")
    runs = [(tool, name, flags, seed) for tool, name, flags in configs for seed in args.seeds]
    rows: list[Row] = []
    lock = threading.Lock()

    def one(run: tuple[str, str, list[str], int]) -> Row:
        tool, name, flags, seed = run
        if tool == "launcher":
            row = run_launcher(name, flags, args, known, seed)
        else:
            row = run_timm(name, flags, args, script, seed)
        with lock:
            rows.append(row)
            print(
                f"[{len(rows)}/{len(runs)}] {name}, seed {seed}: {row.status}; best "
                f"{percent(row.best_val_acc)}, EMA {percent(row.best_val_acc_ema)}, "
                f"{row.wall_seconds or 0:.0f} s",
                flush=True,
            )
            if args.output:  # after every run: a long benchmark that stops keeps what it measured
                write_json(args, rows, patch)
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(one, runs))  # in the order of the runs, for the table
    print_table(done, args)


def write_json(args: argparse.Namespace, rows: list[Row], patch: str) -> None:
    data: dict[str, Any] = {
        "data": str(args.data),
        "epochs": args.epochs,
        "image_size": args.image_size,
        "seeds": args.seeds,
        "device": args.device,
        "jobs": args.jobs,
        "extra_flags": args.extra,
        "timm_extra_flags": args.timm_extra,
        "cpus": args.cpus,
        "load_average_at_end": os.getloadavg(),
        "timm_train": str(args.timm_train) if args.timm_train else None,
        "timm_train_commit": TIMM_COMMIT if args.timm_train else None,
        "timm_cpu_patch": patch,
        "rows": [asdict(r) for r in rows],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(args.output)


if __name__ == "__main__":
    main()
