#!/usr/bin/env python
"""Training from tar shards on the local disk against the same shards in object storage: a real
S3 server on 127.0.0.1 (moto's server mode) behind a loopback proxy that adds 20 ms and 50 ms to
every request, as a distant store's round trip. Side by side in one run, on the CPU.

    python bench/remote.py                                  # 2,048 images at 32 px, ResNet18
    python bench/remote.py --images 512 --latencies_ms 20   # quicker
    python bench/remote.py --repeat 5                       # medians of 5 rounds (a busy machine)

Each row is ``python src/train_ddp.py`` (1 process, its default loader workers and threads) for
one epoch, timed by a hook (bench/instrument/step_clock.py) at each optimizer step's end:
  * first step: seconds from starting the command to the end of the first step (the imports,
    the shard indices, the model, the first batch's reads);
  * images/s: the steps after the first ``--warmup`` to the epoch's last;
  * CPU ms/img: the CPU of the training command's processes (its loader workers, its decode
    check) per image over those same steps; "run CPU ms/img": over the whole command (its
    imports, the S3 client made in each process, validation, the checkpoint's upload), per
    image read;
  * requests per image: the requests the proxy saw over the run, per image read (training and
    validation), and the bytes the run's byte cache (<log_dir>/remote_cache) holds at its end;
  * store CPU: the seconds of CPU this process (the S3 server and the proxy, in threads) took
    during the row, on the same cores as the training, kept out of the CPU columns: a real
    store's server runs elsewhere, and moto closes the connection after each answer, so each
    request is a new connection.
Each round runs the local row before and after the rows from the bucket at each latency, and
compares those with the mean of the two: the machine's drift during a round falls out. "vs
local" and the targets are the medians of these per-round ratios; each round's ratios are
printed as it ends, and the targets' lines give their lowest and highest.
The +20 ms row writes its checkpoint to the bucket (uploaded in the background); the restart
row then continues that run for a second epoch on an empty disk (``--resume auto`` downloads
the checkpoint), and the checkpoint's download is timed on its own through the same proxy.
Rows from the bucket train in its default order (--sampler window: whole shards read ahead of
need); the ", random" row has no order of shards to fetch ahead: its loader requests image by
image, many at once, and finds in the byte cache what the decode check (which fetches whole
shards) holds by then. The "loader alone" rows read the training loader's first epoch with no
model (the ``step_clock:loader_clock`` hook): images/s, and images per CPU-second of the
process and its workers (what one core feeds).
Targets at each latency: first step within 1.2x of local shards, images/s at least 0.95x,
CPU per image within 1.1x, at most 0.02 requests per image read.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share
sys.path.insert(0, str(Path(__file__).parent / "instrument"))

from step_clock import clock_env, cpu_seconds  # noqa: E402

from imgtrainer.data.layouts.files import folder_table  # noqa: E402
from imgtrainer.tools.pack_data import write_shards  # noqa: E402
from support.harness import write_image_folder  # noqa: E402
from support.s3_server import S3Server, proxied  # noqa: E402

RUN_TIMEOUT = 1800  # seconds: one row on a busy machine
TARGET_FIRST_STEP = 1.2  # at most this many times local shards' first step
TARGET_IMAGES_PER_SEC = 0.95  # at least this share of local shards' steady images/s
TARGET_CPU = 1.1  # at most this many times local shards' CPU per image (the trainer's)
TARGET_REQUESTS = 0.02  # requests per image read, at most
SHARD_IMAGES = 256
FORMS = (">10.2f", ">7.1f", ">10.1f", ">14.1f")  # the table's columns of figures
BRACKET = ("local shards", "local shards, again")  # run before and after the rows to compare


def write_data(root: Path, images: int, classes: int, size: int) -> tuple[Path, Path, int]:
    """``images`` training and 4 validation images per class as tar shards of 256 (with their
    indices), in ``root``: the training and validation folders and the images in both."""
    folders, total = [], 0
    for role, count, seed in (("train", images // classes, 1), ("val", 4, 2)):
        images_folder = write_image_folder(
            root / "images" / role, classes, count, size=size, seed=seed, threads=2
        )
        table = folder_table(images_folder, role, None)
        entries = [(Path(table.location(i)), table.label(i)) for i in range(len(table))]
        write_shards(entries, table.classes, root / "shards" / role, SHARD_IMAGES, 2)
        folders.append(root / "shards" / role)
        total += len(entries)
    return folders[0], folders[1], total


def run_row(
    name: str, work: Path, flags: list[str], env: dict[str, str], loader_only: bool = False
) -> dict:
    """One ``src/train_ddp.py`` run in ``work`` (``loader_only``: its training loader read
    alone); its step clock's figures, and the CPU seconds it took (its loader workers too)."""
    work.mkdir(parents=True)
    clock = work / "steps.txt"
    started, cpu = time.time(), time.process_time()  # this process: the S3 server, the proxy
    children = _children_cpu()
    result = subprocess.run(
        [sys.executable, str(ROOT / "src" / "train_ddp.py"), *flags],
        cwd=work,
        env={**os.environ, **env, **clock_env(clock, loader_only)},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    if result.returncode != 0:
        sys.exit(
            f"{name}: train_ddp.py failed ({result.returncode}) in {work}:\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )
    steps = [tuple(map(float, line.split())) for line in clock.read_text().splitlines()]
    store_cpu = time.process_time() - cpu
    if loader_only:
        loader_cpu, loader_images = (clock.parent / f"{clock.name}.cpu").read_text().split()
        return {"first_step": steps[0][0] - started, "steps": steps, "store_cpu": store_cpu,
                "loader_cpu": float(loader_cpu), "loader_images": int(loader_images)}  # fmt: skip
    return {
        **{"first_step": steps[0][0] - started, "steps": steps, "store_cpu": store_cpu},
        "client_cpu": _children_cpu() - children,
    }


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (and theirs: the loader workers)."""
    return cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN))


def images_per_sec(steps: list[tuple], warmup: int, batch: int) -> float:
    timed = steps[warmup:]
    return (len(timed) - 1) * batch / (timed[-1][0] - timed[0][0])


def steady_cpu_ms(steps: list[tuple], warmup: int, batch: int) -> float:
    """Milliseconds of CPU (the run's processes: its loader workers, its decode check) per
    image over the same steps as ``images_per_sec``."""
    timed = steps[warmup:]
    return 1000 * (timed[-1][3] - timed[0][3]) / ((len(timed) - 1) * batch)


def cache_bytes(work: Path) -> int:
    """What the run's byte cache of remote reads holds on the disk."""
    folder = work / "logs" / "remote_cache"
    return sum(p.stat().st_blocks * 512 for p in folder.glob("*.data")) if folder.is_dir() else 0


def one_round(args, data: tuple[Path, Path, int], server: S3Server, url: str, work: Path) -> dict:
    """The rows of one round. The local row runs before and after the rows the targets compare
    with it (``BRACKET``): the machine's drift in between falls out of their mean."""
    train, val, images = data
    shards = f"shard-{{000000..{len(list(train.glob('*.tar'))) - 1:06d}}}.tar"
    flags = [
        *("--device", "cpu", "--image_size", str(args.image_size)),
        *("--batch_size", str(args.batch_size), "--model", args.model, "--epochs", "1"),
        *("--cache_images", "none"),  # every image of the epoch read from where it is kept
    ]
    rows: dict[str, dict] = {}
    local = [*flags, "--train_data", f"{train}/{shards}", "--val_data", str(val)]
    remote = [*flags, "--train_data", f"{url}/train/{shards}", "--val_data", f"{url}/val/"]
    run_url = f"{url}/run-{work.name}"
    ms = args.latencies_ms[0]

    def local_row(name: str, alone: bool = False) -> None:
        folder = work / name.replace(" ", "_").replace(",", "")
        rows[name] = {**run_row(name, folder, local, {}, loader_only=alone), "images": images}

    def s3_row(name: str, delay: int, extra: list[str], alone: bool = False) -> None:
        proxy, endpoint = proxied(server, delay / 1000)
        env = {**server.env(), "AWS_ENDPOINT_URL": endpoint}
        folder = work / name.replace(" ", "_").replace(",", "").replace("+", "")
        row = run_row(name, folder, [*remote, *extra], env, loader_only=alone)
        (folder / "requests.txt").write_text("\n".join(proxy.request_lines) + "\n")
        shard_reads = sum(r.startswith("GET ") and ".tar " in r for r in proxy.request_lines)
        row.update(requests=proxy.requests, shard_reads=shard_reads, images=images)
        rows[name] = {**row, "cached": cache_bytes(folder)}
        proxy.stop()

    local_row(BRACKET[0])
    for m in args.latencies_ms:  # the first latency's run keeps its checkpoint in the bucket
        s3_row(f"s3 +{m} ms", m, ["--checkpoint_dir", run_url] if m == ms else [])
    local_row(BRACKET[1])
    if args.loader_rows:
        local_row("local loader alone", alone=True)
        s3_row(f"s3 +{ms} ms loader alone", ms, [], alone=True)
    s3_row(f"s3 +{ms} ms, random", ms, ["--sampler", "random"])  # no shards to read ahead
    # The +20 ms run continued for a second epoch on an empty disk (downloads the checkpoint).
    restart = ["--checkpoint_dir", run_url, "--resume", "auto", "--epochs", "2"]
    s3_row(f"restart from s3 +{ms} ms", ms, restart)
    rows["download"] = timed_download(server, run_url, ms, work / "download")
    return rows


def timed_download(server: S3Server, url: str, ms: int, folder: Path) -> dict:
    """The restart's download alone: the store's latest checkpoint through the proxy."""
    from imgtrainer.checkpoints.remote import fetch_latest
    from imgtrainer.storage import Store

    proxy, endpoint = proxied(server, ms / 1000)
    os.environ.update({**server.env(), "AWS_ENDPOINT_URL": endpoint})
    Store().listing(url)  # the client made first, as the restarted run made it for its data
    before, started = proxy.requests, time.perf_counter()
    assert fetch_latest(url, Store(), folder)
    seconds = time.perf_counter() - started
    proxy.stop()
    size = sum(p.stat().st_size for p in folder.iterdir())
    return {"seconds": seconds, "bytes": size, "requests": proxy.requests - before}


def median(rounds: list[dict], row: str, figure) -> float:
    return statistics.median(figure(r[row]) for r in rounds)


def ratios(rounds: list[dict], row: str, figure) -> list[float]:
    """``row``'s figure over the local row's in the same round (the mean of its two runs)."""
    return [figure(r[row]) / statistics.mean(figure(r[b]) for b in BRACKET) for r in rounds]


def row_figures(args) -> dict:
    """What the table gives of each row (and the targets compare with the local rows')."""
    batch, warmup = args.batch_size, args.warmup
    return {
        "first step": lambda row: row["first_step"],
        "images/s": lambda row: images_per_sec(row["steps"], warmup, batch),
        "CPU per image": lambda row: steady_cpu_ms(row["steps"], warmup, batch),
        "run CPU per image": lambda row: 1000 * row["client_cpu"] / row["images"],
    }


def round_line(args, rows: dict) -> str:
    """One round's figures over its local rows', at each latency: the spread behind a median."""
    return "; ".join(
        f"+{ms} ms: " + ", ".join(f"{what} {ratios([rows], f's3 +{ms} ms', fn)[0]:.2f}x"
                                 for what, fn in row_figures(args).items())
        for ms in args.latencies_ms
    )  # fmt: skip


def report(args, rounds: list[dict]) -> None:
    batch, figures = args.batch_size, row_figures(args)
    print(
        f"\nLocal tar shards vs the same shards in S3 (moto on 127.0.0.1 behind a proxy adding "
        f"latency per request): {args.model} at {args.image_size} px, batch {batch}, "
        f"{args.images} images in shards of {SHARD_IMAGES}, 1 epoch, 1 process on the CPU"
        + (f"; medians of {len(rounds)} rounds" if len(rounds) > 1 else "")
        + "; vs local: each round's row over its local rows' mean"
    )
    header = f"{'source':<28} {'first s':>10} {'vs local':>8} {'img/s':>7} {'vs local':>8}"
    print(header + f" {'CPU ms/img':>10} {'vs local':>8} {'run CPU ms/img':>14} {'vs local':>8} "
          f"{'req/image':>9} {'shard GETs':>10} {'cached MiB':>10} {'store CPU s':>11}")  # fmt: skip
    for name in rounds[0]:
        if name == "download" or "loader alone" in name:
            continue
        cells = [
            format(median(rounds, name, fn), form)
            + f" {statistics.median(ratios(rounds, name, fn)):>8.2f}"
            for fn, form in zip(figures.values(), FORMS, strict=True)
        ]
        requests, gets, cached = ("-", "-", "-")
        if "requests" in rounds[0][name]:
            requests = f"{median(rounds, name, lambda r: r['requests'] / r['images']):.3f}"
            gets = f"{median(rounds, name, lambda r: r['shard_reads']):.0f}"
            cached = f"{median(rounds, name, lambda r: r['cached']) / 2**20:.1f}"
        print(
            f"{name:<28} {' '.join(cells)} {requests:>9} {gets:>10} {cached:>10} "
            f"{median(rounds, name, lambda r: r['store_cpu']):>11.1f}"
        )
    loader_rows(args, rounds, figures["images/s"])
    ms = args.latencies_ms[0]
    download = rounds[-1]["download"]
    print(
        f"restart: the checkpoint ({download['bytes'] / 2**20:.1f} MiB) downloaded in "
        f"{median(rounds, 'download', lambda r: r['seconds']):.2f} s through +{ms} ms "
        f"({download['requests']} requests); the restarted run's first step "
        f"{median(rounds, f'restart from s3 +{ms} ms', figures['first step']):.2f} s from the "
        "command"
    )
    targets = {"first step": (TARGET_FIRST_STEP, "at most"),
               "images/s": (TARGET_IMAGES_PER_SEC, "at least"),
               "CPU per image": (TARGET_CPU, "at most")}  # fmt: skip
    spread = "" if len(rounds) == 1 else " [{:.2f}-{:.2f}]"
    for ms in args.latencies_ms:
        at, verdicts = f"s3 +{ms} ms", []
        for what, fn in figures.items():
            each = ratios(rounds, at, fn)
            value = statistics.median(each)
            text = f"{what} {value:.2f}x local" + spread.format(min(each), max(each))
            if what in targets:
                target, bound = targets[what]
                held = value <= target if bound == "at most" else value >= target
                text += f" ({bound} {target}x: {'met' if held else 'MISSED'})"
            verdicts.append(text)
        per = median(rounds, at, lambda r: r["requests"] / r["images"])
        verdicts.append(f"requests per image {per:.3f} (at most {TARGET_REQUESTS}: "
                        f"{'met' if per <= TARGET_REQUESTS else 'MISSED'})")  # fmt: skip
        print(f"targets at +{ms} ms: " + "; ".join(verdicts))


def loader_rows(args, rounds: list[dict], rate) -> None:
    """The training loader read alone (no model, no device copy): images/s, and images per
    second of one core (its CPU seconds, workers included, over the epoch's images)."""
    names = [name for name in rounds[0] if "loader alone" in name]
    for name in names:
        per_core = median(rounds, name, lambda r: r["loader_images"] / r["loader_cpu"])
        print(
            f"{name}: {median(rounds, name, rate):.0f} img/s, {per_core:.0f} img/s per core "
            f"({median(rounds, name, lambda r: r['loader_cpu']):.1f} CPU s for "
            f"{rounds[0][name]['loader_images']} images)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048, help="training images")
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--image_size", type=int, default=32, help="the crop trained on")
    parser.add_argument("--source_size", type=int, default=40, help="the images' side")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--warmup", type=int, default=3, help="steps before images/s is timed")
    parser.add_argument(
        "--latencies_ms",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[20, 50],
        help="added to each request, comma-separated; the first also writes and restarts from "
        "a checkpoint in the bucket (default: 20,50)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds; prints the medians")
    parser.add_argument(
        "--loader_rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the training loader alone (no model), locally and from the bucket",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="a folder for the data and runs, kept after"
    )
    args = parser.parse_args()
    if args.images // args.classes < 1 or args.images // args.batch_size <= args.warmup + 1:
        sys.exit("--images must give more than --warmup + 1 steps of --batch_size")
    args.images = args.images // args.classes * args.classes

    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_remote_"))
        else:
            tmp = args.workdir
            shutil.rmtree(tmp, ignore_errors=True)
        data = write_data(Path(tmp) / "data", args.images, args.classes, args.source_size)
        server = S3Server.start()
        stack.callback(server.stop)
        url = server.make_bucket("bench")
        server.upload(data[0], f"{url}/train")
        server.upload(data[1], f"{url}/val")
        rounds = []
        for number in range(args.repeat):
            print(f"--- round {number + 1} of {args.repeat}", flush=True)
            rounds.append(one_round(args, data, server, url, Path(tmp) / f"round{number}"))
            print(round_line(args, rounds[-1]), flush=True)
        report(args, rounds)


if __name__ == "__main__":
    main()
