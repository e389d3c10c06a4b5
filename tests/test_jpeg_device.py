"""JPEG files decoded on the training device (data.device.jpeg): which files the header rule sends
there, mixed batches of bytes and pixels, crops equal to the CPU path's up to the decoders'
differences, and the fallback to the CPU path for what the device decoder fails on. The device
is the CPU here (torchvision's decode_jpeg on the CPU injected); one test runs nvjpeg on CUDA."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import folder_images
from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.batches import BatchPlan, DeviceBatches
from imgtrainer.data.device.jpeg import JpegDecoder, device_decoder
from imgtrainer.data.host.collate import EncodedBatch, JpegBytes, collate_samples
from imgtrainer.data.host.draws import AugmentDraws
from imgtrainer.data.host.samples import Source, TrainingSamples
from imgtrainer.data.layouts.image_files import EXIF_ORIENTATION, nvjpeg_size

HAS_CUDA = torch.cuda.is_available()
SIZE = 16
LEVEL = 1 / 255 / 0.224  # one uint8 level after normalisation (the smallest std)


def photo(height: int, width: int, seed: int) -> Image.Image:
    """A smooth natural-like RGB picture (JPEG keeps it within a few levels)."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.zeros(3, height, width)
    for _ in range(4):
        fy, fx, phase = (torch.rand(3, generator=g) * torch.tensor([0.1, 0.1, 6.3])).tolist()
        image += torch.rand(3, 1, 1, generator=g) * torch.sin(fy * y + fx * x + phase)
    image = (image - image.min()) / (image.max() - image.min())
    return Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())


def encoded(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def test_header_rule_sends_only_upright_baseline_rgb_jpegs_to_the_device():
    image = photo(20, 30, 0)
    assert nvjpeg_size(encoded(image)) == (20, 30)
    rotated = Image.Exif()
    rotated[EXIF_ORIENTATION] = 6
    upright = Image.Exif()
    upright[EXIF_ORIENTATION] = 1
    assert nvjpeg_size(encoded(image, exif=upright)) == (20, 30)
    adobe_rgb = encoded(image)  # with an Adobe marker saying "no colour transform" below
    for data in (
        encoded(image, exif=rotated),  # open_rgb turns it upright, nvjpeg would not
        encoded(image, progressive=True),
        adobe_rgb[:2] + b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00" + adobe_rgb[2:],
        encoded(image.convert("L")),
        encoded(image.convert("CMYK")),
        encoded(image, "PNG"),
        encoded(image)[:2] + b"not a jpeg",
        b"",
    ):
        assert nvjpeg_size(data) is None


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two classes: baseline JPEGs large enough for the workers' block shrink, a PNG, and a
    rotated JPEG (both decoded on the CPU)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for n in range(4):
        photo(90 + 20 * n, 130 - 10 * n, n).save(tmp_path / "a" / f"{n}.jpg", quality=95)
    photo(40, 50, 7).save(tmp_path / "b" / "p.png")
    rotated = Image.Exif()
    rotated[EXIF_ORIENTATION] = 8
    photo(60, 40, 8).save(tmp_path / "b" / "r.jpg", quality=95, exif=rotated)
    photo(70, 80, 9).save(tmp_path / "b" / "s.jpg", quality=95)
    return tmp_path


def both_paths(root: Path, keys):
    draws = AugmentDraws(SIZE, scale=(0.08, 1.0))
    on_device = TrainingSamples(folder_images(root), draws, seed=3, source=Source.NVJPEG)
    on_cpu = TrainingSamples(folder_images(root), draws, seed=3)
    return (
        on_device,
        collate_samples([on_device[k] for k in keys]),
        on_cpu,
        [on_cpu[k] for k in keys],
    )


KEYS = [(i, e) for e in range(3) for i in range(7)]


def test_mixed_batches_are_decoded_cropped_and_placed_like_the_cpu_path(folder):
    on_device, (batch, params, labels), _, cpu_samples = both_paths(folder, KEYS)
    assert isinstance(batch, EncodedBatch)
    # Four JPEGs of "a" and the upright one of "b" come as bytes; the PNG and the rotated one
    # as pixels.
    kinds = [type(on_device[k][0]) for k in KEYS[:7]]
    assert kinds.count(JpegBytes) == 5 and kinds.count(torch.Tensor) == 2
    assert sorted(batch.pixel_positions + batch.jpeg_positions) == list(range(len(KEYS)))
    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, device_decoder("cpu"))
    canvas, params, labels = decoder(batch, params, labels)
    assert labels.tolist() == [s[2] for s in cpu_samples]
    shrunk = 0
    for row, (pixels, cpu_params, _) in enumerate(cpu_samples):
        assert torch.equal(params[row], cpu_params)  # same draws, same box after the shrink
        h, w = pixels.shape[-2:]
        piece = canvas[row, :, :h, :w].int()
        # The same libjpeg on the CPU; the shrink rounds halves to even, PIL up.
        assert (piece - pixels.int()).abs().max() <= 1
        assert canvas[row, :, h:].sum() == 0 and canvas[row, :, :, w:].sum() == 0
        shrunk += int(max(h, w) < max(on_device.images[KEYS[row][0]][0].size) // 2)
    assert shrunk > 0  # some crops went through the block shrink
    cpu_canvas, cpu_params, _ = collate_samples(cpu_samples)
    cpu_canvas = cpu_canvas.canvas()
    augment = BatchAugment(SIZE)
    gap = augment(canvas, params) - augment(cpu_canvas, cpu_params)
    assert gap.abs().max() <= 1.01 * LEVEL  # the shrink's rounding at most


def test_a_jpeg_the_device_fails_on_is_found_by_halves_then_made_by_the_cpu_path(folder, caplog):
    data = (folder / "a" / "0.jpg").read_bytes()
    cut = data.index(b"\xff\xda") + 300  # the header whole, the pixels cut short
    (folder / "a" / "0.jpg").write_bytes(data[:cut])
    keys = [(0, 0), (1, 0), (2, 0), (6, 0)]
    on_device, (batch, params, labels), _, cpu_samples = both_paths(folder, keys)
    assert len(batch.jpegs) == 4  # the truncated file's header still reads
    real = device_decoder("cpu")
    calls = []

    def decode(data):
        calls.append(len(data))
        if any(len(d) == cut for d in data):
            raise RuntimeError("nvjpeg: bad bitstream")
        return real(data)

    loader = torch.utils.data.DataLoader(
        [on_device[k] for k in keys], batch_size=4, collate_fn=collate_samples
    )
    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, decode)
    batches = DeviceBatches(loader, BatchAugment(SIZE), "cpu", jpegs=decoder)
    cpu_canvas, cpu_params, _ = collate_samples(cpu_samples)
    cpu_canvas = cpu_canvas.canvas()
    expected = BatchAugment(SIZE)(cpu_canvas, cpu_params)
    for _ in range(2):  # two epochs
        images, labels = next(iter(batches))
        # The CPU path's handling: the unreadable file is replaced by the next image (class a).
        assert labels.tolist() == [s[2] for s in cpu_samples]
        assert (images - expected).abs().max() <= 1.01 * LEVEL
        assert torch.equal(images[0], expected[0])  # made by the CPU path itself
    # The batch, its halves down to the bad file; then, remembered, it never reaches the device.
    assert calls == [4, 2, 1, 1, 2] + [3]
    assert decoder.failures.bad == {0}
    warned = [r.message for r in caplog.records if r.name == "imgtrainer.data.device.jpeg"]
    assert len(warned) == 1 and "failed on 1 more file(s), 1 so far" in warned[0]
    assert "bad bitstream" in warned[0] and "decoded on the CPU" in warned[0]


def test_a_device_decoder_that_fails_on_a_whole_batch_is_switched_off(folder, caplog):
    """No nvjpeg (every image fails alone too): one warning, then the CPU path without
    retrying the device for each batch."""
    keys = [(0, 0), (1, 0), (2, 0), (6, 0)]
    on_device, _, _, cpu_samples = both_paths(folder, keys)
    calls = []

    def decode(data):
        calls.append(len(data))
        raise RuntimeError("nvjpeg: not available")

    loader = torch.utils.data.DataLoader(
        [on_device[k] for k in keys], batch_size=4, collate_fn=collate_samples
    )
    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, decode)
    batches = DeviceBatches(loader, BatchAugment(SIZE), "cpu", jpegs=decoder)
    for _ in range(2):
        images, labels = next(iter(batches))
        assert labels.tolist() == [s[2] for s in cpu_samples]
    assert calls == [4, 2, 1, 1, 2, 1, 1]  # the second batch never reached the device decoder
    warned = [r.message for r in caplog.records if r.name == "imgtrainer.data.device.jpeg"]
    assert len(warned) == 1 and "decoding every JPEG on the CPU from here on" in warned[0]
    assert "nvjpeg: not available" in warned[0] and "slower" in warned[0]
    assert not decoder.failures.bad  # not the files' fault


def test_after_the_decoder_switched_itself_off_the_next_epoch_loads_decoded_images(folder):
    """The rest of the epoch is made in this process; from the next one the loader that
    ``cpu_path`` builds (whose workers decode) takes over, with the same images."""
    keys = [(0, 0), (1, 0), (2, 0), (6, 0)]
    on_device, _, on_cpu, cpu_samples = both_paths(folder, keys)
    loaded = []

    def loader_of(dataset):
        def collate(samples):
            loaded.append(collate_samples(samples)[0])
            return collate_samples(samples)

        return torch.utils.data.DataLoader(dataset, sampler=keys, batch_size=4, collate_fn=collate)

    def fail(data):
        raise RuntimeError("nvjpeg: not available")

    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, fail)
    batches = DeviceBatches(
        loader_of(on_device),
        BatchAugment(SIZE),
        "cpu",
        jpegs=decoder,
        plan=BatchPlan(cpu_path=lambda: loader_of(on_cpu)),
    )
    first, _ = next(iter(batches))
    assert isinstance(loaded[-1], EncodedBatch) and not decoder.enabled
    second, labels = next(iter(batches))
    assert batches.jpegs is None and not isinstance(loaded[-1], EncodedBatch)
    assert torch.equal(first, second) and labels.tolist() == [s[2] for s in cpu_samples]


def fake_decoder(bad: set[int], calls: list[list[int]]):
    """A device decoder over 1-byte "files" holding their number: fails for any call with a
    number of ``bad`` in it, records each call's numbers."""

    def decode(data):
        numbers = [int(d[0]) for d in data]
        calls.append(numbers)
        if bad.intersection(numbers):
            raise RuntimeError(f"nvjpeg: bad bitstream in {sorted(bad.intersection(numbers))}")
        return [torch.full((3, 2, 2), n, dtype=torch.uint8) for n in numbers]

    return decode


def decode_numbers(decoder: JpegDecoder, numbers: list[int]) -> list[int | None]:
    data = [torch.tensor([n], dtype=torch.uint8) for n in numbers]
    return [
        None if image is None else int(image[0, 0, 0])
        for image in decoder.decode_all(data, numbers)
    ]


def test_a_failing_call_is_split_in_halves_and_bad_files_are_skipped_after(caplog):
    calls: list[list[int]] = []
    decoder = JpegDecoder(torch.device("cpu"), SIZE, None, fake_decoder({5}, calls))
    assert decode_numbers(decoder, list(range(8))) == [0, 1, 2, 3, 4, None, 6, 7]
    # 1 + 2 log2(8) calls, not 1 + 8.
    assert calls == [list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]
    assert decoder.failures.bad == {5} and decoder.enabled
    calls.clear()  # two bad files in one call
    decoder = JpegDecoder(torch.device("cpu"), SIZE, None, fake_decoder({1, 6}, calls))
    assert decode_numbers(decoder, list(range(8))) == [0, None, 2, 3, 4, 5, None, 7]
    assert len(calls) == 11 and decoder.failures.bad == {1, 6}


def test_decoding_goes_in_chunks_and_warns_once_per_new_count_of_bad_files(folder, caplog):
    keys = [(i, e) for e in range(2) for i in (0, 1, 2, 3, 6)]
    on_device, (batch, params, labels), _, cpu_samples = both_paths(folder, keys)
    real, calls = device_decoder("cpu"), []

    def decode(data):
        calls.append(len(data))
        if any(len(d) == len(batch.jpegs[1].data) for d in data):
            raise RuntimeError("nvjpeg: bad bitstream")
        return real(data)

    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, decode, chunk=4)
    canvas, out_params, out_labels = decoder(batch, params, labels)
    # Chunks of 4, 4 and 2; the two samples (two epochs) of file 1 are found in their chunks.
    assert calls == [4, 2, 1, 1, 2, 4, 2, 2, 1, 1, 2]
    assert decoder.failures.bad == {1}
    cpu_canvas, cpu_params, cpu_labels = collate_samples(cpu_samples)
    cpu_canvas = cpu_canvas.canvas()
    assert torch.equal(out_params, cpu_params) and torch.equal(out_labels, cpu_labels)
    assert canvas.shape == cpu_canvas.shape
    for row in (1, 6):  # made by the CPU path: the same pixels
        assert torch.equal(canvas[row], cpu_canvas[row])
    calls.clear()
    decoder(batch, params, labels)
    assert calls == [4, 4]  # file 1 never reaches the device again
    warned = [r.message for r in caplog.records if r.name == "imgtrainer.data.device.jpeg"]
    assert len(warned) == 1  # one warning for the new count, none for the batch that followed


class Recorder:
    """Stands for host pixels: records what is done to it."""

    def __init__(self, calls):
        self.calls = calls

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking))
        return self


def test_cpu_pixels_go_to_cuda_pinned_and_without_blocking_and_stay_put_elsewhere():
    from imgtrainer.data.device.jpeg import upload

    for device, expected in (
        ("cuda", ["pin_memory", ("to", "cuda", True)]),
        ("cuda:1", ["pin_memory", ("to", "cuda:1", True)]),
        ("cpu", [("to", "cpu", False)]),
    ):
        calls: list = []
        upload(Recorder(calls), torch.device(device))
        assert calls == expected


def test_a_batch_is_decoded_once_and_previewed_as_trained(folder):
    on_device, *_ = both_paths(folder, KEYS[:7])
    real, calls = device_decoder("cpu"), []

    def decode(data):
        calls.append(len(data))
        return real(data)

    loader = torch.utils.data.DataLoader(
        on_device, sampler=KEYS[:7], batch_size=7, collate_fn=collate_samples
    )
    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, decode)
    batches = DeviceBatches(loader, BatchAugment(SIZE), "cpu", jpegs=decoder)
    images, _ = next(iter(batches))
    assert calls == [5]  # the five JPEGs that come as bytes, in one call
    assert torch.equal(batches.preview(KEYS[:7]), images) and calls == [5, 5]


def test_cache_sources_never_hand_over_bytes(folder):
    from imgtrainer.data.host.image_cache import DecodedImageCache
    from imgtrainer.data.host.samples import choose_source

    cache = DecodedImageCache(folder_images(folder).table, SIZE)
    with pytest.raises(ValueError, match="images from nvjpeg do not fit a DecodedImageCache"):
        TrainingSamples(cache, AugmentDraws(SIZE), seed=0, source=Source.NVJPEG)
    cuda = torch.device("cuda")
    assert [choose_source(c, cuda) for c in ("gpu", "ram", "none")] == ["gpu", "ram", "nvjpeg"]
    assert choose_source("none", torch.device("cpu")) is Source.FILES


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_nvjpeg_batches_match_the_cpu_path(folder):
    on_device, _, _, cpu_samples = both_paths(folder, KEYS)
    loader = torch.utils.data.DataLoader(
        [on_device[k] for k in KEYS],
        batch_size=len(KEYS),
        collate_fn=collate_samples,
        pin_memory=True,
    )
    cuda = torch.device("cuda")
    decoder = JpegDecoder(cuda, SIZE, on_device.pixel_sample)  # nvjpeg
    images, labels = next(iter(DeviceBatches(loader, BatchAugment(SIZE), cuda, jpegs=decoder)))
    cpu_canvas, cpu_params, cpu_labels = collate_samples(cpu_samples)
    cpu_canvas = cpu_canvas.canvas()
    expected = BatchAugment(SIZE)(cpu_canvas, cpu_params)
    assert images.is_cuda and torch.equal(labels.cpu(), cpu_labels)
    # nvjpeg's IDCT and chroma upsampling differ from libjpeg's by a few levels.
    gap = (images.cpu() - expected).abs()
    assert gap.max() < 8 * LEVEL and gap.mean() < 2 * LEVEL


def test_files_on_cuda_hand_over_bytes_through_loader_workers(folder, tmp_path_factory):
    """build_datasets turns the bytes path on for files on CUDA only; a mixed batch crosses from
    a loader worker process and is decoded like the CPU path's."""
    from dataclasses import replace

    from conftest import ONE_CPU_PROCESS, data_config
    from imgtrainer.data.loaders import LoaderSpec, build_datasets, make_loader

    val = tmp_path_factory.mktemp("val")
    for name in ("a", "b"):
        (val / name).mkdir()
        photo(20, 20, 0).save(val / name / "v.png")
    cfg = data_config(folder, val, image_size=SIZE, seed=3)
    sets = {}
    for device in ("cpu", "cuda"):  # nothing here touches the device itself
        dist = replace(ONE_CPU_PROCESS, device=torch.device(device))
        sets[device] = build_datasets(cfg, dist)[0]
    assert (sets["cuda"].source, sets["cpu"].source) == (Source.NVJPEG, Source.FILES)
    keys = [(i, 0) for i in range(len(sets["cuda"]))]
    loader = make_loader(sets["cuda"], keys, LoaderSpec(len(keys), train=True, num_workers=1))
    assert isinstance(next(iter(loader))[0], EncodedBatch)
    decoder = JpegDecoder(
        torch.device("cpu"), SIZE, sets["cuda"].pixel_sample, device_decoder("cpu")
    )
    images, labels = next(iter(DeviceBatches(loader, BatchAugment(SIZE), "cpu", jpegs=decoder)))
    cpu_canvas, cpu_params, cpu_labels = collate_samples([sets["cpu"][k] for k in keys])
    cpu_canvas = cpu_canvas.canvas()
    assert torch.equal(labels, cpu_labels)
    assert (images - BatchAugment(SIZE)(cpu_canvas, cpu_params)).abs().max() <= 1.01 * LEVEL


def baited(stream: torch.cuda.Stream, sizes, record_on: torch.cuda.Stream | None = None):
    """Blocks of exactly ``sizes`` (twice each) allocated on ``stream``, then a long sleep, writes
    and reads of them queued (on ``record_on`` where given, else on ``stream``), then freed
    (recorded on ``record_on`` first, as the decoder records its outputs): the sums the queued
    reads will give, 101 x each size when no one else wrote the blocks meanwhile."""
    cuda = torch.device("cuda")
    with torch.cuda.stream(stream):
        bait = [torch.full(size, 1, dtype=torch.uint8, device=cuda) for size in sizes * 2]
    with torch.cuda.stream(record_on or stream):
        torch.cuda._sleep(200_000_000)  # the stream stays busy for a while (~0.1 s)
        for t in bait:
            t.add_(100)  # queued writes into the blocks freed below
        sums = torch.stack([t.sum(dtype=torch.int64) for t in bait])  # queued reads of them
    if record_on is not None:
        for t in bait:
            t.record_stream(record_on)
    expected = torch.tensor([101 * torch.Size(size).numel() for size in sizes * 2])
    return sums, expected


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_nvjpeg_never_writes_blocks_that_queued_work_still_uses(folder):
    """pytorch/vision#9606's race, where the decoder allocates: nvjpeg's outputs come from the
    pool of the decoder's allocation stream, which runs no kernel; every block there was an
    earlier output, read by crops queued on the decoder's stream and recorded on it. The bait is
    exactly that: blocks of the decoded images' sizes allocated on the allocation stream, used
    by long queued work on the decoder's stream, recorded there, freed. The caching allocator
    must keep them until that work is done, so the next call's outputs cannot take them: the
    queued sums and the batch both come out right. (The naive decoder of the next test, which
    takes its outputs where the queued work runs, fails this same bait.)"""
    on_device, (batch, params, labels), _, _ = both_paths(folder, KEYS)
    cpu = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, device_decoder("cpu"))
    expected, expected_params, expected_labels = cpu(batch, params, labels)
    sizes = [device_decoder("cpu")([jpeg.data])[0].shape for jpeg in batch.jpegs]
    decoder = JpegDecoder(torch.device("cuda"), SIZE, on_device.pixel_sample)
    decoder(batch, params, labels)  # nvjpeg and the streams set up
    torch.cuda.synchronize()
    for _ in range(5):
        sums, right = baited(decoder.alloc_stream, sizes, record_on=decoder.stream)
        canvas, out_params, out_labels = decoder(batch, params, labels)
        images = canvas.cpu()  # waits for everything queued on the current stream
        torch.cuda.synchronize()
        assert torch.equal(sums.cpu(), right)
        assert torch.equal(out_params, expected_params) and torch.equal(out_labels, expected_labels)
        assert images.shape == expected.shape
        # nvjpeg's IDCT and chroma upsampling differ from libjpeg's by a few levels; a write
        # of the bait's +100 into an image would not.
        gap = (images.int() - expected.int()).abs()
        assert gap.max() <= 16 and gap.float().mean() < 2


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_bait_catches_a_decoder_that_takes_memory_queued_work_still_uses(folder):
    """The control of the test above: torchvision's decode_jpeg called plainly on a stream with
    the bait's work queued on it (vision#9606's use: its outputs from that stream's pool, the
    bait freed there without a wait, which the allocator allows for work of the same stream,
    while nvjpeg writes from its own stream at once). nvjpeg then overwrites blocks the queued
    work still reads: the sums come out wrong in at least one of the tries. Were it not so, the
    bait could not tell the protected decoder from this one."""
    from torchvision.io import ImageReadMode, decode_jpeg

    on_device, (batch, _, _), _, _ = both_paths(folder, KEYS)
    sizes = [device_decoder("cpu")([jpeg.data])[0].shape for jpeg in batch.jpegs]
    data = [jpeg.data for jpeg in batch.jpegs]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")  # nvjpeg set up
    torch.cuda.synchronize()
    corrupted = 0
    for _ in range(5):
        sums, right = baited(stream, sizes)
        with torch.cuda.stream(stream):
            decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
        torch.cuda.synchronize()
        corrupted += int(not torch.equal(sums.cpu(), right))
    assert corrupted > 0, "the bait never caught the unprotected decoder: it cannot judge"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_nvjpeg_decoding_in_another_thread_for_the_training_stream(folder):
    """Decode-ahead: the decoder called from a worker thread, handed the training thread's
    stream, gives the same canvas as a call from the training thread."""
    from concurrent.futures import ThreadPoolExecutor

    on_device, (batch, params, labels), _, _ = both_paths(folder, KEYS)
    cuda = torch.device("cuda")
    decoder = JpegDecoder(cuda, SIZE, on_device.pixel_sample)
    here = decoder(batch, params, labels)[0].cpu()
    training = torch.cuda.Stream(cuda)
    with torch.cuda.stream(training), ThreadPoolExecutor(1) as pool:
        canvas = pool.submit(decoder, batch, params, labels, training).result()[0]
        doubled = canvas.int() * 2  # queued on the training stream, after the decode
    training.synchronize()  # .cpu() below copies on the default stream
    assert torch.equal(doubled.cpu(), here.int() * 2)


def test_large_crops_shrink_to_a_short_side_between_the_output_size_and_one_and_a_half_times():
    """Both paths use shrink_factor; the device's shrink, the canvas's planned size and PIL's
    reduce agree on the size."""
    from imgtrainer.data.device.jpeg import shrink
    from imgtrainer.data.host.samples import shrink_factor, shrunk_size

    for h, w in [(31, 40), (32, 40), (47, 100), (48, 48), (200, 33), (1000, 700), (63, 64)]:
        factor = shrink_factor(h, w, SIZE)
        size = shrunk_size(h, w, SIZE)
        if min(h, w) < 2 * SIZE:
            assert factor < 2 and size == (h, w)
            continue
        assert SIZE <= min(size) <= 1.5 * SIZE
        assert Image.new("RGB", (w, h)).reduce(factor).size == size[::-1]
        assert shrink(torch.zeros(3, h, w, dtype=torch.uint8), factor).shape[-2:] == size


def test_an_image_smaller_than_its_header_said_is_made_by_the_cpu_path_and_remembered(
    folder, caplog
):
    keys = [(0, 0), (1, 0), (2, 0), (6, 0)]
    on_device, (batch, params, labels), _, cpu_samples = both_paths(folder, keys)
    real, calls = device_decoder("cpu"), []
    short = len(batch.jpegs[2].data)

    def decode(data):
        calls.append(len(data))
        return [
            image[:, :1, :1] if len(d) == short else image
            for d, image in zip(data, real(data), strict=True)
        ]

    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, decode)
    canvas, out_params, out_labels = decoder(batch, params, labels)
    cpu_canvas, cpu_params, cpu_labels = collate_samples(cpu_samples)
    cpu_canvas = cpu_canvas.canvas()
    assert torch.equal(out_params, cpu_params) and torch.equal(out_labels, cpu_labels)
    assert torch.equal(canvas[2], cpu_canvas[2])  # the CPU path's own pixels
    assert decoder.failures.bad == {2}
    decoder(batch, params, labels)
    assert calls == [4, 3]
    warned = [r.message for r in caplog.records if r.name == "imgtrainer.data.device.jpeg"]
    assert len(warned) == 1 and "decoded (1, 1), box" in warned[0]


def test_a_call_too_large_for_the_decoder_makes_the_chunks_smaller(caplog):
    """A failure no single file causes (out of memory): halves decode, and later calls are
    no larger than what worked, with one warning."""
    calls: list[list[int]] = []
    fake = fake_decoder(set(), calls)

    def decode(data):
        if len(data) > 4:
            calls.append([int(d[0]) for d in data])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return fake(data)

    decoder = JpegDecoder(torch.device("cpu"), SIZE, None, decode, chunk=8)
    assert decode_numbers(decoder, list(range(8))) == list(range(8))
    assert [len(c) for c in calls] == [8, 4, 4] and decoder.chunk == 4
    assert not decoder.failures.bad
    warned = [r.message for r in caplog.records if r.name == "imgtrainer.data.device.jpeg"]
    assert len(warned) == 1 and "4 at a time" in warned[0] and "out of memory" in warned[0]


def test_on_cuda_the_decoder_works_on_its_own_stream_and_hands_over_only_the_canvas(
    folder, monkeypatch
):
    """The ordering protocol of JpegDecoder.__call__ on CUDA, with streams faked on the CPU:
    the decoder called (so its outputs allocated) with the allocation stream current, which
    runs no kernel; each output recorded on the decoder's stream, which crops it, before
    anything reads it; nothing synchronised on the host; then the consumer waits for the
    decoder's stream and the canvas is recorded on the consumer, which never waits the other
    way."""
    import contextlib

    events: list[tuple] = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            events.append(("synchronize", self.name))

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    current = [FakeStream("training")]

    @contextlib.contextmanager
    def stream(s):
        previous, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = previous

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, s: events.append(("record", s.name, t.shape))
    )
    on_device, (batch, params, labels), _, _ = both_paths(folder, KEYS[:7])
    real = device_decoder("cpu")

    def decode(data):
        events.append(("decode", current[0].name, len(data)))
        return real(data)

    decoder = JpegDecoder(torch.device("cpu"), SIZE, on_device.pixel_sample, decode, chunk=3)
    decoder.stream = FakeStream("decode")  # what __init__ makes on CUDA
    decoder.alloc_stream = FakeStream("alloc")
    canvas, *_ = decoder(batch, params, labels)
    shapes = [real([jpeg.data])[0].shape for jpeg in batch.jpegs]
    assert events == [
        ("decode", "alloc", 3),
        *[("record", "decode", shape) for shape in shapes[:3]],
        ("decode", "alloc", 2),
        *[("record", "decode", shape) for shape in shapes[3:]],
        ("wait", "training", "decode"),
        ("record", "training", canvas.shape),
    ]
    events.clear()  # a decode-ahead thread names the training stream
    decoder(batch, params, labels, FakeStream("given"))
    assert events[-2:] == [("wait", "given", "decode"), ("record", "given", canvas.shape)]


def test_seeded_draws_in_two_threads_are_each_seeds_own():
    """The decode-ahead thread's CPU fallback and the main thread's mixing both seed torch's CPU
    generator: each seeded block draws what its seed draws, however the threads interleave."""
    import threading

    from imgtrainer.data.host.samples import seeded_cpu_generator

    def draw(seed: int) -> torch.Tensor:
        with seeded_cpu_generator(seed):
            first = torch.rand(64)
            time.sleep(0)  # let the other thread run in the middle of the block
            return torch.cat([first, torch.rand(64)])

    expected = {seed: draw(seed) for seed in range(40)}
    results: dict[int, torch.Tensor] = {}

    def worker(seeds: range) -> None:
        for _ in range(5):
            for seed in seeds:
                got = draw(seed)
                if not torch.equal(got, expected[seed]):
                    results[seed] = got

    threads = [threading.Thread(target=worker, args=(range(k, 40, 2),)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not results, f"seeds drawn differently under two threads: {sorted(results)}"


def test_the_decoders_working_memory_is_bounded_by_bytes_for_phone_photos(monkeypatch):
    """64 JPEGs of 12 and 24 MP (4032 x 3024, 6000 x 4000), crops drawn as RandomResizedCrop
    draws them: each decoder call's outputs stay within DECODE_BYTES (one photo over it alone),
    and each group of crops shrunk together has a float copy within SHRINK_BYTES. Run on the
    meta device: the shapes of a real run, no memory."""
    from imgtrainer.data.device import jpeg as jpeg_module
    from imgtrainer.data.device.jpeg import DECODE_BYTES, SHRINK_BYTES, JpegDecoder
    from imgtrainer.data.device.memory import canvas_side_bound
    from imgtrainer.data.host.collate import EncodedBatch, JpegBytes

    draws, meta = AugmentDraws(224), torch.device("meta")
    sizes = [(3024, 4032) if n % 3 else (4000, 6000) for n in range(64)]
    torch.manual_seed(0)
    rows = torch.stack([draws(h, w) for h, w in sizes])
    jpegs = [
        JpegBytes(torch.tensor([n], dtype=torch.uint8), (n, 0), size)
        for n, size in enumerate(sizes)
    ]
    batch = EncodedBatch.of(None, [], jpegs, list(range(64)))
    calls, groups = [], []

    def decode(data):
        shapes = [sizes[int(d[0])] for d in data]
        calls.append(sum(3 * h * w for h, w in shapes))
        return [torch.empty(3, h, w, dtype=torch.uint8, device=meta) for h, w in shapes]

    real_shrink = jpeg_module.shrink_group

    def recorded(crops, crop_sizes, factor):
        groups.append((crops.shape, factor))
        return real_shrink(crops, crop_sizes, factor)

    monkeypatch.setattr(jpeg_module, "shrink_group", recorded)
    decoder = JpegDecoder(meta, 224, None, decode)
    canvas, out_rows, _ = decoder(batch, rows, torch.zeros(64, dtype=torch.int64))
    assert canvas.shape[0] == 64 and decoder.decoded == 64
    assert len(calls) >= sum(3 * h * w for h, w in sizes) // DECODE_BYTES
    assert all(b <= DECODE_BYTES or b == 3 * 4000 * 6000 for b in calls)
    for (n, _, h, w), _ in groups:
        assert 4 * n * 3 * h * w <= SHRINK_BYTES or n == 1
    # Every crop shrunk below twice the output size on its short side, as the workers shrink.
    assert max(out_rows[:, 2:4].amax(1).tolist()) <= canvas_side_bound(224, Source.NVJPEG)
