"""PNG bytes of an 8-bit image, filtered and deflated in bands on several threads.

PIL writes a PNG on one core: a 1024² image took 0.12 s (noisy content, as random weights draw) to 0.04 s
(smooth) on one core of the development machine, at zlib level 4, after every image a user waits for. Here the
rows are cut into bands of a fixed height (`BAND_ROWS`, so the bytes depend on the image alone, not on the
machine's core count), and each band is filtered and deflated on a thread of its own: numpy and zlib release
the GIL for the work. A PNG's image data is one zlib stream, so the bands are joined as pigz does: each band is
raw deflate primed with the 32 KiB of filtered bytes before it (`zdict`) and ended by a sync flush (the last by
the stream's end), behind one zlib header and before the Adler-32 of the whole. Any inflater reads it as one
stream; the pixels are the image's, bit for bit.

Each row takes, as PNG encoders commonly choose (PIL picks per row too), the one of PNG's five filters (none,
sub, up, average, Paeth) whose bytes, read as signed, have the smallest sum of magnitudes. Modes other than L, RGB and
RGBA go through PIL (`encode_png` returns None for them).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

SIGNATURE = b"\x89PNG\r\n\x1a\n"
# mode -> (PNG colour type, bytes a pixel)
COLOR_TYPES = {"L": (0, 1), "RGB": (2, 3), "RGBA": (6, 4)}
BAND_ROWS = 64  # rows a band: 64 of a 1024-wide RGB image are 192 KiB, 16 bands a 1024² image
WINDOW = 32 * 1024  # deflate's window: what a band's dictionary holds of the bytes before it
ZLIB_HEADER = (
    b"\x78\x9c"  # deflate, 32 KiB window, no preset dictionary (the check bits make it divisible by 31)
)
MAX_THREADS = 16


def chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data and the CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def text_chunk(key: str, value: str) -> bytes:
    """`value` under `key` as PIL's `PngInfo.add_text` writes it: tEXt when it is Latin-1, else iTXt (UTF-8,
    uncompressed)."""
    try:
        return chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1"))
    except UnicodeEncodeError:
        return chunk(b"iTXt", key.encode("latin-1") + b"\0\0\0\0\0" + value.encode("utf-8"))


def filter_rows(rows: np.ndarray, above: np.ndarray, bpp: int) -> np.ndarray:
    """`rows` (R, W * bpp) uint8 filtered row by row, each with its filter type byte first: (R, 1 + W * bpp).
    `above`: the row before the first (zeros for the image's first row)."""
    x = rows.astype(np.int16)
    up = np.concatenate([above[None].astype(np.int16), x[:-1]])
    left = np.zeros_like(x)
    left[:, bpp:] = x[:, :-bpp]
    upleft = np.zeros_like(x)
    upleft[:, bpp:] = up[:, :-bpp]
    p = left + up - upleft
    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - upleft)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
    candidates = np.stack([x, x - left, x - up, x - ((left + up) >> 1), x - paeth]).astype(np.uint8)
    cost = np.abs(candidates.view(np.int8).astype(np.int16)).sum(axis=2, dtype=np.int64)  # (5, R)
    best = cost.argmin(axis=0)  # the first of equal sums, as PIL takes it
    out = np.empty((rows.shape[0], rows.shape[1] + 1), dtype=np.uint8)
    out[:, 0] = best
    out[:, 1:] = candidates[best, np.arange(rows.shape[0])]
    return out


def _deflate(band: bytes, before: bytes, level: int, last: bool) -> bytes:
    z = (
        zlib.compressobj(level, zlib.DEFLATED, -15, zdict=before)
        if before
        else zlib.compressobj(level, zlib.DEFLATED, -15)
    )
    return z.compress(band) + z.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def idat_stream(filtered: Sequence[bytes], level: int, pool: ThreadPoolExecutor | None) -> bytes:
    """One zlib stream of the bands' bytes in order, each band deflated apart (see the module)."""
    n = len(filtered)
    befores, tail = [], b""
    for band in filtered:
        befores.append(tail)
        tail = (tail + band)[-WINDOW:]
    jobs = [
        (band, before, level, i == n - 1)
        for i, (band, before) in enumerate(zip(filtered, befores, strict=True))
    ]
    parts = (
        list(pool.map(lambda job: _deflate(*job), jobs)) if pool is not None else [_deflate(*j) for j in jobs]
    )
    check = 1
    for band in filtered:
        check = zlib.adler32(band, check)
    return ZLIB_HEADER + b"".join(parts) + struct.pack(">I", check)


def encode_png(image: Image.Image, text: Sequence[tuple[str, str]], level: int) -> bytes | None:
    """`image` as PNG bytes with `text` chunks (key, value) before its data, deflated at zlib `level`; None for a
    mode this writer does not take (then PIL writes it)."""
    if image.mode not in COLOR_TYPES:
        return None
    color, bpp = COLOR_TYPES[image.mode]
    width, height = image.size
    pixels = np.asarray(image, dtype=np.uint8).reshape(height, width * bpp)
    starts = list(range(0, height, BAND_ROWS))
    zero = np.zeros(width * bpp, dtype=np.uint8)

    def filtered(r0: int) -> bytes:
        return filter_rows(pixels[r0 : r0 + BAND_ROWS], pixels[r0 - 1] if r0 else zero, bpp).tobytes()

    threads = min(len(starts), MAX_THREADS, os.cpu_count() or 1)
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="flux-png") as pool:
            bands = list(pool.map(filtered, starts))
            data = idat_stream(bands, level, pool)
    else:
        data = idat_stream([filtered(r0) for r0 in starts], level, None)
    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"".join(
        [
            SIGNATURE,
            chunk(b"IHDR", header),
            *(text_chunk(k, v) for k, v in text),
            chunk(b"IDAT", data),
            chunk(b"IEND", b""),
        ]
    )
