"""The policies grouped by op (data.host.draws, data.device.policy): every op at every magnitude is torchvision's
per-image result, bit for bit; the host draws are torchvision's own choices; and a batch through
BatchAugment is torchvision's policy applied to each resampled image."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from imgtrainer.data.device.augment import BatchAugment, erase
from imgtrainer.data.device.policy import BatchPolicy, autocontrast
from imgtrainer.data.host.collate import collate_samples
from imgtrainer.data.host.draws import CROP_TRIES, GEOMETRIC, OPS, AugmentDraws, draw_policy
from imgtrainer.data.host.sample_row import POLICY, POLICY_WIDTH, SLOTS
from imgtrainer.data.host.samples import seeded_cpu_generator
from imgtrainer.data.host.transforms import AUTO_AUGMENT, IMAGENET_MEAN, IMAGENET_STD
from test_batch_augment import smooth_image

POLICIES = ["trivialaugment", "randaugment"]


def sample_images(count: int, size: int) -> torch.Tensor:
    """Natural-like pictures (a few, rolled by n pixels), noise, a flat grey (AutoContrast's
    and Equalize's special case) and a two-level picture, in turn."""
    g = torch.Generator().manual_seed(size)
    pictures = [smooth_image(size, size, seed) for seed in range(3)]
    images = []
    for n in range(count):
        kind = n % 5
        if kind < 3:
            images.append(pictures[kind].roll(n, dims=-1))
        elif kind == 3:
            images.append(torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8))
        else:
            images.append(torch.full((3, size, size), 77 + n % 100, dtype=torch.uint8))
    two_levels = torch.where(torch.arange(size) < size // 3, 200, 10).to(torch.uint8)
    images[1] = two_levels[:, None].expand(3, size, size)  # Equalize's step 0 (no change)
    return torch.stack(images)


def recorder(policy, calls: list) -> None:
    """Replace the policy's op dispatch by one that records (op, magnitude) of each call."""

    def recording(image, transform_id, magnitude, interpolation, fill):
        calls.append((transform_id, magnitude))
        return image  # the choices are what counts here

    policy._apply_image_or_video_transform = recording


def every_op_against_torchvision(name: str, size: int, device: str) -> tuple[dict, set]:
    """One batch holding every (op, bin, sign) once, each sample its own picture, through
    BatchPolicy on ``device``, against torchvision's functional on each image alone there (the
    op dispatch its policy calls): {(op, bin, negative): share of values differing} for the
    samples that differ, and the ops that changed their image."""
    policy = BatchPolicy(name, size)
    tv = policy.transform
    rows = [
        (op, b, negative)
        for op, op_name in enumerate(OPS)
        for b in range(tv.num_magnitude_bins)
        for negative in ((0, 1) if tv._AUGMENTATION_SPACE[op_name][1] else (0,))
        if b == 0 or tv._AUGMENTATION_SPACE[op_name][0](2, 1, 1) is not None
    ]
    choices = torch.zeros(len(rows), POLICY_WIDTH, dtype=torch.int64)
    choices[:, :3] = torch.tensor(rows)
    images = sample_images(len(rows), size).to(device)
    out = policy(images.clone(), choices)
    magnitudes = policy.magnitudes(choices, 0).tolist()
    differ, changed = {}, set()
    for n, (op, b, negative) in enumerate(rows):
        expected = tv._apply_image_or_video_transform(
            images[n], OPS[op], magnitudes[n], interpolation=tv.interpolation, fill=tv._fill
        )
        if not torch.equal(out[n], expected):
            differ[OPS[op], b, negative] = (out[n] != expected).float().mean().item()
        if not torch.equal(out[n], images[n]):
            changed.add(OPS[op])
    return differ, changed


@pytest.mark.parametrize(("name", "size"), [("trivialaugment", 32), ("randaugment", 21)])
def test_every_op_at_every_magnitude_is_torchvisions_per_image_result(name, size):
    """Every (op, bin, sign) equals torchvision's per-image result bit for bit, Rotate's 90
    and 270 degrees (its rot90 path) included; every op but Identity changed its picture."""
    differ, changed = every_op_against_torchvision(name, size, "cpu")
    assert not differ, differ
    assert changed == set(OPS) - {"Identity"}


def test_autocontrast_without_masked_writes_is_torchvisions():
    """The sync-free AutoContrast equals torchvision's on pictures, noise, flat greys (no
    range: kept) and a channel flat in one image only."""
    images = sample_images(10, 24)
    images[0, 1] = 128  # one flat channel beside two with a range
    assert torch.equal(autocontrast(images.clone()), TF.autocontrast(images))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", POLICIES)
def test_every_op_on_cuda_is_torchvisions_per_image_result_there(name):
    """On CUDA the same, except that the affine ops' grids come from a batched matrix product
    that may round a coordinate apart from the single one: a nearest pixel may then differ."""
    differ, changed = every_op_against_torchvision(name, 32, "cuda")
    geometric = {OPS[op] for op in GEOMETRIC}
    assert not {key: share for key, share in differ.items() if key[0] not in geometric}, differ
    assert all(share < 0.01 for share in differ.values()), differ
    assert changed == set(OPS) - {"Identity"}


@pytest.mark.parametrize("name", POLICIES)
def test_host_draws_are_torchvisions_own_choices(name):
    """Under the same seed, ``draw_policy`` draws the ops and signed magnitudes torchvision's
    policy picks for a size x size image, and leaves the generator where the policy does."""
    size, seeds = 24, 300
    tv = AUTO_AUGMENT[name]()
    policy = BatchPolicy(name, size)
    image = smooth_image(size, size)
    seen = set()
    for seed in range(seeds):
        calls: list = []
        recorder(tv, calls)
        torch.manual_seed(seed)
        tv(image)
        after_policy = torch.rand(())
        torch.manual_seed(seed)
        choices = torch.tensor([draw_policy(name)])
        assert torch.equal(torch.rand(()), after_policy), seed
        ours = [
            (OPS[int(choices[0, 3 * slot])], policy.magnitudes(choices, slot).item())
            for slot in range(policy.num_ops)
        ]
        assert ours == calls, seed
        assert (choices[0, 3 * policy.num_ops :] == 0).all()  # unused slots: Identity
        seen.update(calls)
    assert {op for op, _ in seen} == set(OPS)
    assert any(m < 0 for _, m in seen) and any(m > 0 for _, m in seen)
    assert policy.num_ops == {"trivialaugment": 1, "randaugment": 2}[name] <= SLOTS


@pytest.mark.parametrize("name", POLICIES)
def test_a_batch_is_torchvisions_policy_on_each_resampled_image(name):
    """Samples drawn under their own seeds, augmented as one batch: equal to resampling, then
    torchvision's policy on each image with the generator where the host draws leave it
    (after the crop's uniforms), then normalising and erasing: bit for bit."""
    size = 20
    draws = AugmentDraws(size, policy=name, random_erasing=0.5)
    pictures = [smooth_image(20 + 3 * n, 26 - n, seed=n) for n in range(16)]
    samples = []
    for seed, picture in enumerate(pictures):
        with seeded_cpu_generator(seed):
            samples.append((picture, draws(*picture.shape[-2:]), 0))
    pixels, params, _ = collate_samples(samples)
    pixels = pixels.canvas()  # packed as the loader sends it
    assert params[:, POLICY].unique().numel() > 5  # many ops in one batch
    augment = BatchAugment(size, BatchPolicy(name, size))
    batch = augment(pixels, params)
    assert batch.is_contiguous()  # the model's layout on the CPU

    resampled = augment.resample(pixels, params).round_().clamp_(0, 255).to(torch.uint8)
    tv = AUTO_AUGMENT[name]()
    expected = []
    for seed, image in enumerate(resampled):
        with seeded_cpu_generator(seed):
            torch.rand(2 * CROP_TRIES + 3)  # the crop's and flip's uniforms
            expected.append(tv(image.contiguous()))
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = torch.stack(expected).float().div_(255).sub_(mean).div_(std)
    assert torch.equal(batch, erase(expected, params))
