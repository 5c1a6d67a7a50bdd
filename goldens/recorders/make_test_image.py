#!/usr/bin/env python3
"""Write the committed test images of the vision-language goldens (issues 24 and 39).

usage: make_test_image.py OUT_DIR

Writes OUT_DIR/grid-112x168.png (H 112, W 168: the Qwen2-VL image, a
multiple of its resize factor 28, so smart_resize is the identity: grid
[1, 8, 12]), OUT_DIR/grid-224x320.png (H 224, W 320: the Qwen3-VL image,
a multiple of 32 with 71680 pixels >= its real min_pixels 65536: grid
[1, 14, 20]) and OUT_DIR/grid-56x56.png (the LLaVA image, both families:
the tiny CLIP tower's 56x56, so CLIP's shortest-edge resize and centre crop
and NeXT's base-image resize are the identity; NeXT's best pinpoint is
[56, 112] at scale exactly 1: two tiles of the image zero-padded 28 columns
each side, never resampled). RGB, 8 bits per channel, no alpha, no metadata chunks.

All are pure functions of their size (numpy integer/float64 arithmetic,
no random numbers), written by the pinned Pillow (requirements.txt) with
fixed PNG settings, so the bytes are reproducible. The Qwen-VL ones are
non-square on purpose (an engine that swaps height and width fails; LLaVA's
must be square, see above), all with structure in every
channel: R a horizontal ramp, G a vertical ramp, B a diagonal sine, then
shapes that each touch all three channels differently (a disc, a rectangle,
a triangle, a checkerboard patch, a thin cross-hair). A mirrored or
transposed image, a channel swap, a wrong patch order or a missing
normalisation change the pixel values an engine feeds its vision tower.
"""
import os
import sys

import numpy as np
from PIL import Image

SIZES = [(112, 168), (224, 320), (56, 56)]  # (H, W)


def name(h, w):
    return f"grid-{h}x{w}.png"


def render(h, w):
    """The image as a [H, W, 3] uint8 array (pure numpy, float64)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    u, v = x / (w - 1), y / (h - 1)  # 0..1 across, 0..1 down
    r = 30 + 190 * u  # left -> right
    g = 220 - 170 * v  # top -> bottom
    b = 128 + 90 * np.sin(2 * np.pi * (1.5 * u + 0.75 * v))  # diagonal waves
    img = np.stack([r, g, b], axis=-1)
    # A disc in the upper left third (yellowish), radius relative to H.
    cy, cx, rad = 0.30 * h, 0.25 * w, 0.18 * h
    disc = (y - cy) ** 2 + (x - cx) ** 2 <= rad ** 2
    img[disc] = [235, 200, 40]
    # A dark blue rectangle in the lower right.
    rect = (y >= 0.58 * h) & (y < 0.86 * h) & (x >= 0.62 * w) & (x < 0.92 * w)
    img[rect] = [20, 40, 170]
    # A magenta right triangle in the lower left (its hypotenuse is diagonal).
    tri = (x >= 0.08 * w) & (y <= 0.92 * h) & ((x - 0.08 * w) / (0.30 * w) <= (y - 0.50 * h) / (0.42 * h))
    img[tri] = [200, 30, 150]
    # A checkerboard of 4-pixel cells, top right: black and light green.
    chk = (y >= 0.08 * h) & (y < 0.40 * h) & (x >= 0.60 * w) & (x < 0.90 * w)
    cells = ((np.floor(y / 4) + np.floor(x / 4)) % 2) == 0
    img[chk & cells] = [0, 0, 0]
    img[chk & ~cells] = [170, 250, 170]
    # A thin white cross-hair through the centre (one row, one column).
    img[h // 2, :] = [255, 255, 255]
    img[:, w // 2] = [255, 255, 255]
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1])
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for h, w in SIZES:
        a = render(h, w)
        assert a.shape == (h, w, 3) and a.dtype == np.uint8
        # Every channel has structure (not constant, not a copy of another).
        assert all(a[..., c].std() > 20 for c in range(3))
        assert not np.array_equal(a[..., 0], a[..., 1]) and not np.array_equal(a[..., 1], a[..., 2])
        path = os.path.join(out, name(h, w))
        # Fixed encoder settings, no metadata: the bytes depend on the pixels
        # and the pinned Pillow (its bundled zlib) only.
        Image.fromarray(a, mode="RGB").save(path, format="PNG", optimize=False, compress_level=9)
        back = np.asarray(Image.open(path).convert("RGB"))
        assert np.array_equal(back, a), "PNG round trip changed the pixels"
        print(f"{path}: {w}x{h} RGB, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
