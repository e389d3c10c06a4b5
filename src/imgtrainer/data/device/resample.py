"""The batched resample: every sample's crop box of a canvas resized at once.

A uint8 canvas (N, 3, H, W) to size x size with the weights of torch's antialiased bilinear
``interpolate`` (clamped to the crop, as it clamps), in two forms: gathered taps (the CPU's,
the reference) and two ``bmm`` with banded weight matrices (CUDA's).
"""

from __future__ import annotations

import torch

from imgtrainer.data.host.sample_row import FLIP, HEIGHT, LEFT, TOP, WIDTH

CHUNK_BYTES = 2**30  # the banded resample's float canvas per group of samples at most (1 GiB)


def resample_taps(start: torch.Tensor, length: torch.Tensor, size: int, taps: int):
    """Where and how much each output pixel reads, for the antialiased bilinear resize of each
    sample's span [start, start + length) of a canvas axis to ``size`` pixels: (N, size, taps)
    canvas indices and float32 weights, the weights of ``interpolate(crop, mode="bilinear",
    antialias=True, align_corners=False)`` (clamped to the crop as it is; 0 past its taps)."""
    start = start.to(torch.float64)[:, None, None]
    length = length.to(torch.float64)[:, None, None]
    scale = length / size
    support = scale.clamp(min=1.0)  # the triangle widens with the downscale factor
    at = torch.arange(size, dtype=torch.float64, device=start.device)[None, :, None]
    center = scale * (at + 0.5)
    low = torch.trunc(center - support + 0.5).clamp(min=0)
    high = torch.minimum(torch.trunc(center + support + 0.5), length)
    x = low + torch.arange(taps, dtype=torch.float64, device=start.device)
    weights = (1 - ((x - center + 0.5) / support).abs()).clamp(min=0) * (x < high)
    weights = weights / weights.sum(-1, keepdim=True)
    return (torch.minimum(x, length - 1) + start).long(), weights.float()


def tap_count(lengths: torch.Tensor, size: int) -> int:
    """Taps enough for every sample: a span of 2 * support + 1 pixels at most."""
    return int(2 * max(float(lengths.max()) / size, 1.0)) + 2


def weighted_taps(images: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Resample dim 1 of the contiguous ``images`` (N, L, M, C): output j of sample n is the sum
    over taps k of weights[n, j, k] * images[n, index[n, j, k]], as float32 (N, size, M, C)."""
    n, length = images.shape[:2]
    size, taps = index.shape[1:]
    flat = images.view(n * length, -1)
    rows = index + length * torch.arange(n, device=index.device)[:, None, None]
    out = torch.zeros(n, size, *images.shape[2:], device=images.device)
    for k in range(taps):  # one tap at a time: whole rows of M x C values, one index_select
        gathered = flat.index_select(0, rows[:, :, k].reshape(-1)).view(out.shape)
        out.addcmul_(gathered, weights[:, :, k, None, None])
    return out


def band_matrix(
    start: torch.Tensor, length: torch.Tensor, size: int, taps: int, extent: int, flip=None
) -> torch.Tensor:
    """``resample_taps`` as dense matrices (N, size, extent) float32 over a canvas axis of
    ``extent`` pixels: row j holds output j's weights at their canvas positions, zeros
    elsewhere; rows reversed where ``flip`` (N,) is true. The taps' positions are consecutive
    before clamping, so they are scattered unclamped into ``taps`` spare columns (no two writes
    to one place: deterministic), where the taps past the crop put their zero weights."""
    index, weights = resample_taps(start, length, size, taps)
    first = index[..., :1]  # consecutive from there, as resample_taps makes them
    index = first + torch.arange(taps, device=index.device)
    matrix = weights.new_zeros(len(weights), size, extent + taps)
    matrix = matrix.scatter_(2, index, weights)[..., :extent]
    if flip is not None:
        matrix = torch.where(flip[:, None, None], matrix.flip(1), matrix)
    return matrix


def banded_resample(
    pixels: torch.Tensor,
    rows: torch.Tensor,
    size: int,
    taps: tuple[int, int],
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``banded_chunk`` over groups of samples whose float canvas takes at most CHUNK_BYTES:
    large canvases (JPEG crops of 1,000 px and more) then need no multi-GB transient copy."""
    n, _, height, width = pixels.shape
    step = max(1, CHUNK_BYTES // (3 * height * width * 4))
    parts = [
        banded_chunk(pixels[i : i + step], rows[i : i + step], size, taps, scale, shift)
        for i in range(0, n, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def banded_chunk(
    pixels: torch.Tensor,
    rows: torch.Tensor,
    size: int,
    taps: tuple[int, int],
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batched resample as two ``bmm`` with banded weight matrices, on the NCHW canvas as
    it comes (no transpose of it): columns, (N, 3H, W) @ Wx^T -> (N, 3H, size), then rows,
    per channel Wy (size, H) @ (H, size). The same filter as the taps (antialiased bilinear,
    clamped to the crop) with float32 weights; only the summation order differs (about 1e-5
    of 0..255 on the CPU). With ``scale`` and ``shift`` (3,) the rows' weights carry the
    per-channel scale and the output its shift: the normalisation costs no pass of its own.
    Of the forms that keep this filter and run on the CPU too, it moves the fewest bytes in a
    few launches (docs/results.md, "The device resample").
    The sample ``rows`` on the pixels' device; ``taps`` (height, width) from the host."""
    n, _, height, width = pixels.shape
    flip = rows[:, FLIP].bool()
    wx = band_matrix(rows[:, LEFT], rows[:, WIDTH], size, taps[1], width, flip)
    wy = band_matrix(rows[:, TOP], rows[:, HEIGHT], size, taps[0], height)
    columns = torch.bmm(pixels.float().reshape(n, 3 * height, width), wx.transpose(1, 2))
    wy = wy[:, None].expand(n, 3, size, height)
    if scale is not None:
        wy = wy * scale.view(1, 3, 1, 1)
    wy = wy.reshape(n * 3, size, height)
    columns = columns.view(n * 3, height, size)
    if shift is None:
        resized = torch.bmm(wy, columns)
    else:
        bias = shift.view(1, 3, 1, 1).expand(n, 3, 1, 1).reshape(n * 3, 1, 1)
        resized = torch.baddbmm(bias, wy, columns)
    return resized.view(n, 3, size, size)
