"""Image preprocessing against transformers' Gemma-4 image processor (its Pillow backend), and bad images refused in
one line, fast."""

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from dgcli.errors import UserError
from dgcli.text.images import preprocess


def png(w, h, mode="RGB", seed=0):
    shape = (h, w) if mode == "L" else (h, w, len(mode))
    arr = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG")
    return buf.getvalue()


def jpeg(w, h):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


# Sizes the processor shrinks, keeps, stretches to one cell, for 70 and 280 soft tokens; grey, alpha, JPEG.
CASES = [(png(100, 60), 70), (png(144, 96), 70), (png(30, 400, "L"), 70), (png(500, 20, "RGBA"), 70),
         (jpeg(640, 480), 280), (png(37, 53, "RGBA"), 280)]


@pytest.mark.parametrize("data,soft", CASES, ids=range(len(CASES)))
def test_patches_positions_and_soft_tokens_are_the_reference_processors(data, soft):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    want = Gemma4ImageProcessorPil(max_soft_tokens=soft)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    got = preprocess(data, 16, 3, soft)
    n = len(got.patches)
    assert got.soft_tokens == want["num_soft_tokens_per_image"][0] == n // 9
    assert np.array_equal(want["pixel_values"][0, :n], got.patches)
    assert np.array_equal(want["image_position_ids"][0, :n], got.positions)
    assert (want["image_position_ids"][0, n:] == -1).all()  # the rest is the reference's padding


def with_size(data: bytes, w: int, h: int) -> bytes:
    """A PNG whose header claims w x h (the CRC fixed): what a decompression bomb looks like before decoding."""
    ihdr = data[12:16] + struct.pack(">II", w, h) + data[24:29]
    return data[:8] + data[8:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


@pytest.mark.parametrize("data,needle", [
    (png(64, 64)[:200], "not a readable image"),
    (b"%PDF-1.4 definitely not pixels", "not a readable image"),
    (with_size(png(8, 8), 20000, 20000), "pixels"),
    (with_size(png(8, 8), 9000, 9000), "pixels"),
], ids=["truncated", "not_an_image", "20000x20000", "9000x9000"])
def test_bad_images_are_one_line_and_fast(data, needle):
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        preprocess(data, 16, 3, 280)
    assert time.perf_counter() - t0 < 1.0
    assert needle in str(e.value) and "\n" not in str(e.value)
