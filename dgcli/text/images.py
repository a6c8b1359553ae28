"""Image preprocessing as the reference's Gemma-4 processor does it: decode (Pillow, the optional `[vision]` extra),
RGB, an aspect-preserving bicubic resize to at most `soft_tokens · k²` patches with sides a multiple of k·patch,
rescale to [0, 1], patches in row-major order with their (x, y) grid positions; soft tokens = patches / k².
Owns: the limits an image must meet (LIMITS) and their one-line refusals. Must not: import torch or know the model.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np

from dgcli.errors import UserError

LIMITS = {"images": 16, "bytes": 20 << 20, "pixels": 50_000_000}  # per request: images, bytes and pixels per image


@dataclass(frozen=True)
class Image:
    patches: np.ndarray  # [n, 3·p²] float32 in [0, 1]
    positions: np.ndarray  # [n, 2] int64 (x, y)
    soft_tokens: int
    digest: str  # the decoded pixels' content hash: prefix caching keys image spans by it


def target_size(h: int, w: int, patch: int, max_patches: int, k: int) -> tuple[int, int]:
    """The reference's `get_aspect_ratio_preserving_size`: the largest sides, multiples of k·patch, in budget."""
    factor, side = math.sqrt(max_patches * patch ** 2 / (h * w)), k * patch
    th, tw = int(math.floor(factor * h / side)) * side, int(math.floor(factor * w / side)) * side
    longest = (max_patches // k ** 2) * side
    if th == 0 and tw == 0:
        raise UserError(f"image {w}x{h} cannot be resized to a whole number of {side}-pixel cells")
    if th == 0:
        th, tw = side, min(int(math.floor(w / h)) * side, longest)
    elif tw == 0:
        tw, th = side, min(int(math.floor(h / w)) * side, longest)
    return th, tw


def patchify(pixels: np.ndarray, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """[3, H, W] -> patches [n, p·p·3] (row, column, channel inside a patch, as the reference) and (x, y) [n, 2]."""
    c, h, w = pixels.shape
    ph, pw = h // patch, w // patch
    out = pixels.reshape(c, ph, patch, pw, patch).transpose(1, 3, 2, 4, 0).reshape(ph * pw, -1)
    gx, gy = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
    return out.astype(np.float32), np.stack([gx, gy], -1).reshape(-1, 2).astype(np.int64)


def read_files(paths: list[str], flag: str) -> list[bytes]:
    """Image files' bytes (not decoded yet), or one line naming the first that cannot be read."""
    if len(paths) > LIMITS["images"]:
        raise UserError(f"{len(paths)} images; at most {LIMITS['images']} per prompt")
    out = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                out.append(f.read(LIMITS["bytes"] + 1))
        except OSError as e:
            raise UserError(f"{flag} {p}: cannot read it ({e.strerror or e}); give an image file") from None
    return out


def decode(data: bytes, what: str = "image"):
    """Bytes -> an RGB Pillow image, or one line naming why not (limits before decoding the pixels)."""
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise UserError("images need Pillow: pip install 'dgemma[vision]'") from None
    if len(data) > LIMITS["bytes"]:
        raise UserError(f"{what} is {len(data)} bytes; the limit is {LIMITS['bytes']}")
    try:
        img = PILImage.open(io.BytesIO(data))
        if img.width * img.height > LIMITS["pixels"]:
            raise UserError(f"{what} is {img.width}x{img.height} pixels; the limit is {LIMITS['pixels']} pixels")
        img.load()
        if "A" in img.getbands() or img.info.get("transparency") is not None:  # onto white, as the reference
            img = img.convert("RGBA")
            return PILImage.alpha_composite(PILImage.new("RGBA", img.size, (255, 255, 255, 255)), img).convert("RGB")
        return img.convert("RGB")
    except UserError:
        raise
    except PILImage.DecompressionBombError:
        raise UserError(f"{what} has more than {LIMITS['pixels']} pixels; send a smaller image") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a bad file
        raise UserError(f"{what} is not a readable image ({type(e).__name__}: {e}); send a PNG, JPEG, GIF or "
                        "WebP") from None


def preprocess(data: bytes, patch: int, k: int, soft_tokens: int, what: str = "image") -> Image:
    from PIL import Image as PILImage

    img = decode(data, what)
    th, tw = target_size(img.height, img.width, patch, soft_tokens * k * k, k)
    if (th, tw) != (img.height, img.width):
        img = img.resize((tw, th), resample=PILImage.Resampling.BICUBIC)
    arr = np.asarray(img, dtype=np.uint8)
    pixels = (arr.transpose(2, 0, 1).astype(np.float64) * (1 / 255)).astype(np.float32)
    patches, pos = patchify(pixels, patch)
    digest = hashlib.sha256(arr.tobytes() + str(arr.shape).encode()).hexdigest()
    return Image(patches, pos, len(patches) // (k * k), digest)
