#!/usr/bin/env python
"""Host time per training step of the on-device batch path: Python and dispatch only, on
``meta`` tensors (shapes, no arithmetic), next to the GPU's budget per step.

    python bench/host_cost.py                       # batch 256 at 224 px, resnet18
    python bench/host_cost.py --model resnet50 --repeats 10
    python bench/host_cost.py --model none          # the augmentation alone

Per source (ram: the crops packed, laid on a canvas on the device; gpu: indices into a device cache; nvjpeg: JPEG
bytes through ``JpegDecoder`` with a decoder that returns meta images) and per
``--auto_augment`` policy, per step (times: medians over ``--repeats``):

  * draws: the host draws and the collate of one batch (``AugmentDraws``, ``collate_samples``),
    real CPU work, in ms, done in the loader workers (the gpu source's workers only draw);
  * augment, ops: ``DeviceBatches.apply`` on meta tensors with CUDA's resample (the banded
    bmm): ms, and the aten ops it dispatches (views included), the batch's decoding, placing
    and augmentation;
  * step, ops: forward, loss, backward and AdamW (foreach) of ``--model``, eager, the same way;
  * estimate: the main thread's time per step on CUDA, (augment ops + step ops) x
    ``--launch_us`` (one eager op's dispatch and launch there; for nvjpeg the decoding
    thread's ops are counted as if the main thread ran them: its share of the GIL), against the GPU's budget (19 ms: 256 images at 13,500 img/s). Over 100% the GPU waits.

Then the data audit (--audit_data_every): the ops its look at an audited batch adds to the main
thread, and the audit thread's CPU time to make one image again on the CPU reference path (a
real photo-like JPEG of ``--short_side``: PIL's decode, the crop, the gathered taps), per
audited image and per step at ``--audit_every``.

The meta times are not CUDA's: many ops' meta functions are Python (torch._meta_registrations,
the refs), about 10x dearer than CUDA's C++ dispatch and launch, so the estimate counts ops
instead; a busy machine blurs times, not counts. Confirm on a GPU with the profiler. Not
here: the GPU's own time, the pin thread, the workers' decoding, torch.compile (fewer ops).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from imgtrainer.data.device.augment import BatchAugment  # noqa: E402
from imgtrainer.data.device.batches import DeviceBatches  # noqa: E402
from imgtrainer.data.device.jpeg import JpegDecoder  # noqa: E402
from imgtrainer.data.device.policy import BatchPolicy  # noqa: E402
from imgtrainer.data.host.collate import JpegBytes, collate_samples  # noqa: E402
from imgtrainer.data.host.draws import AugmentDraws  # noqa: E402
from imgtrainer.data.host.ragged import Ragged  # noqa: E402
from imgtrainer.data.host.sample_row import crop_of, set_key, set_whole_crop  # noqa: E402

META = torch.device("meta")
SOURCES = ("ram", "gpu", "nvjpeg")
POLICIES = ("none", "trivialaugment", "randaugment")
GPU_BUDGET_MS = 19.0  # 256 images at 13,500 img/s
LAUNCH_US = 8.0  # an eager op on CUDA: Python, dispatch and launch (views cost less)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--short_side", type=int, default=256, help="the images' short side")
    parser.add_argument("--model", default="resnet18", help="a timm model, or none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget_ms", type=float, default=GPU_BUDGET_MS)
    parser.add_argument("--launch_us", type=float, default=LAUNCH_US, help="per eager op")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--audit_every", type=int, default=100, help="--audit_data_every")
    return parser.parse_args(argv)


def image_sizes(count: int, short: int) -> list[tuple[int, int]]:
    """4:3 pictures in both orientations, as a photo folder has them."""
    long = short * 4 // 3
    return [(short, long) if n % 2 else (long, short) for n in range(count)]


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def median_ms(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up: first-call caches (normalisers, grids, imports)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def host_batch(source: str, draws: AugmentDraws, sizes: list[tuple[int, int]]):
    """One collated batch as ``source`` hands it over, its pixels meta tensors."""
    samples = []
    for n, (height, width) in enumerate(sizes):
        row = draws(height, width)
        if source == "gpu":
            samples.append((n, row, 0))
        elif source == "nvjpeg":
            data = torch.zeros(1, dtype=torch.uint8)
            samples.append((JpegBytes(data, (n, 0), (height, width)), row, 0))
        else:  # the worker hands over the crop: the box is then all of it
            h, w = crop_of(row)[2:].tolist()
            set_whole_crop(row, h, w)
            samples.append((torch.zeros(3, h, w, dtype=torch.uint8), row, 0))
    pixels, params, labels = collate_samples(samples)
    if isinstance(pixels, Ragged) and source == "ram":
        pixels = pixels.to(META)  # as if copied to the device
    return pixels, params, labels


def meta_batches(source: str, augment: BatchAugment, sizes: list[tuple[int, int]]):
    """``DeviceBatches`` on the meta device: a meta cache for gpu, a decoder of meta images
    of each file's size for nvjpeg."""
    cache = jpegs = None
    if source == "gpu":
        height = max(max(s) for s in sizes)
        cache = torch.empty(len(sizes), 3, height, height, dtype=torch.uint8, device=META)
    elif source == "nvjpeg":

        def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:  # every row a JPEG
            return [
                torch.empty(3, *sizes[n], dtype=torch.uint8, device=META) for n in range(len(data))
            ]

        jpegs = JpegDecoder(META, augment.size, fallback=None, decode=decode)
    return DeviceBatches([], augment, META, cache, jpegs)


def model_step(name: str, batch: int, size: int) -> Callable[[], None] | None:
    """Forward, loss, backward and an AdamW step of ``name`` on meta tensors; None: no model."""
    if name == "none":
        return None
    import timm

    with META:
        model = timm.create_model(name, num_classes=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    images = torch.empty(batch, 3, size, size, device=META)
    labels = torch.zeros(batch, dtype=torch.int64, device=META)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed_and_counted(work: Callable[[], object], repeats: int) -> tuple[float, int]:
    """(median ms, aten ops dispatched) of ``work``."""
    ms = median_ms(work, repeats)
    with OpCount() as ops:
        work()
    return ms, ops.count


def measure(args: argparse.Namespace, source: str, policy: str) -> dict:
    size = args.image_size
    draws = AugmentDraws(size, random_erasing=0.25, policy=policy)
    # The CUDA resample (banded bmm) and the policy, as the trainer runs them there.
    batch_policy = BatchPolicy(policy, size) if policy != "none" else None
    augment = BatchAugment(size, batch_policy)
    augment.banded = True
    sizes = image_sizes(args.batch_size, args.short_side)
    batches = meta_batches(source, augment, sizes)
    draw_ms = median_ms(lambda: host_batch(source, draws, sizes), args.repeats)
    pixels, params, labels = host_batch(source, draws, sizes)
    ms, ops = timed_and_counted(lambda: batches.apply(pixels, params, labels), args.repeats)
    return {"source": source, "policy": policy, "draws": draw_ms, "augment": ms, "ops": ops}


def audit_cost(args: argparse.Namespace) -> dict:
    """The data audit's cost: the main thread's ops at an audited batch (on meta tensors), and
    the audit thread's CPU milliseconds to make one image again (a real JPEG, real work)."""
    import io
    import tempfile

    from PIL import Image

    from imgtrainer.data.device.audit import DataAudit
    from imgtrainer.data.host.samples import Source
    from imgtrainer.data.layouts.files import folder_table
    from imgtrainer.data.layouts.table import TableImages

    size, short = args.image_size, args.short_side
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "a"
        folder.mkdir()
        pixels = torch.randint(0, 256, (short, short * 4 // 3, 3), dtype=torch.uint8).numpy()
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=90)
        (folder / "photo.jpg").write_bytes(out.getvalue())
        reference = TableImages(folder_table(Path(tmp), "training", ["a"]))
        audit = DataAudit(reference, BatchAugment(size), Source.FILES, args.audit_every, META)
        row = AugmentDraws(size, random_erasing=0.25)(short, short * 4 // 3)
        set_key(row, (0, 0))  # image 0 of epoch 0
        remake_ms = median_ms(lambda: audit.remake(row), args.repeats)
        images = torch.empty(args.batch_size, 3, size, size, device=META)
        rows = row.expand(args.batch_size, -1).clone()
        audit.seen, audit._check = 0, lambda *_: None  # due; no thread work counted here
        with OpCount() as ops:
            audit.look(images, rows)
        audit.close()
    return {"look_ops": ops.count, "remake_ms": remake_ms}


def print_table(rows: list[dict], args: argparse.Namespace, header: str) -> None:
    print(header)
    print(
        f"{'source':<8}{'policy':<16}{'draws':>8}{'augment':>9}{'ops':>6}{'step':>8}{'ops':>6}"
        f"{'estimate':>10}"
    )
    for row in rows:
        launches = (row["ops"] + row["step_ops"]) * args.launch_us / 1000
        main = launches
        share = f"{100 * main / args.budget_ms:.0f}%"
        print(
            f"{row['source']:<8}{row['policy']:<16}{row['draws']:>8.2f}{row['augment']:>9.2f}"
            f"{row['ops']:>6}{row['step']:>8.2f}{row['step_ops']:>6}{main:>10.2f}"
            f" ({share} of {args.budget_ms:g} ms)"
        )
    print(f"ms per step; estimate: ops x {args.launch_us:g} us (the draws: in the loader workers)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    step = model_step(args.model, args.batch_size, args.image_size)
    step_ms, step_ops = timed_and_counted(step, args.repeats) if step is not None else (0.0, 0)
    rows = []
    for source in args.sources:
        for policy in args.policies:
            rows.append({**measure(args, source, policy), "step": step_ms, "step_ops": step_ops})
    header = (
        f"Host cost per step on meta tensors (no kernels): batch {args.batch_size} at "
        f"{args.image_size} px, {args.short_side} px short sides (4:3), model {args.model}, "
        f"median of {args.repeats}, torch {torch.__version__}"
    )
    print_table(rows, args, header)
    audit = audit_cost(args)
    print(
        f"data audit: {audit['look_ops']} ops in the main thread at an audited batch (every "
        f"{args.audit_every}th, after the first 3: {audit['look_ops'] / args.audit_every:.2f} per "
        f"step); the audit thread's CPU to make one image again {audit['remake_ms']:.1f} ms "
        f"({audit['remake_ms'] / args.audit_every:.3f} ms per step)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
