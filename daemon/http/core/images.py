"""Image headers: format and size, read without decoding a pixel.

The worker decodes images with stb_image (through mtmd), which allocates
width x height x channels before it looks at the data. So the daemon reads
the declared size from the header first and refuses an image that is too big
(or not one of the formats stb_image is built for here) before anything is
handed to the worker. Only the header is read; a header that lies about its
pixels still fails later, in the worker, with a 400.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SUPPORTED = ("PNG", "JPEG", "GIF", "BMP")

# Start-of-frame markers; stb_image decodes baseline (C0), extended (C1) and
# progressive (C2) frames only. The other SOFn are lossless, hierarchical or
# arithmetic-coded JPEGs.
_SOF_DECODED = frozenset({0xC0, 0xC1, 0xC2})
_SOF_OTHER = frozenset({0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
# Markers without a length field: TEM, RST0-7 (SOI and EOI are handled apart).
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
# BMP info header sizes stb_image reads (core, info, v2/v3 with masks, v4, v5).
_BMP_HEADERS = frozenset({12, 40, 52, 56, 108, 124})


class ImageHeaderError(ValueError):
    """Not an image of a supported format, or a header that cannot be true."""


@dataclass(frozen=True)
class ImageInfo:
    format: str  # "png", "jpeg", "gif" or "bmp"
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def read_header(data: bytes) -> ImageInfo:
    """The format and declared size of an image; raises ImageHeaderError only."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        info = _png(data)
    elif data.startswith(b"\xff\xd8"):
        info = _jpeg(data)
    elif data.startswith((b"GIF87a", b"GIF89a")):
        info = _gif(data)
    elif data.startswith(b"BM"):
        info = _bmp(data)
    else:
        raise ImageHeaderError(f"not a supported image format (supported: {', '.join(SUPPORTED)})")
    if info.width <= 0 or info.height <= 0:
        raise ImageHeaderError(f"{info.format.upper()} header declares an empty image ({info.width}x{info.height})")
    return info


def _unpack(fmt: str, data: bytes, offset: int, what: str) -> tuple[int, ...]:
    if offset + struct.calcsize(fmt) > len(data):
        raise ImageHeaderError(f"{what} header is truncated")
    return struct.unpack_from(fmt, data, offset)


def _png(data: bytes) -> ImageInfo:
    # The first chunk must be IHDR: length 13, then width and height (big-endian).
    length, kind, width, height = _unpack(">I4sII", data, 8, "PNG")
    if kind != b"IHDR" or length != 13:
        raise ImageHeaderError("PNG does not start with an IHDR chunk")
    return ImageInfo("png", width, height)


def _gif(data: bytes) -> ImageInfo:
    width, height = _unpack("<HH", data, 6, "GIF")  # the logical screen: the canvas stb_image allocates
    return ImageInfo("gif", width, height)


def _bmp(data: bytes) -> ImageInfo:
    (header_size,) = _unpack("<I", data, 14, "BMP")
    if header_size not in _BMP_HEADERS:
        raise ImageHeaderError(f"BMP info header of {header_size} bytes is not supported")
    if header_size == 12:
        width, height = _unpack("<HH", data, 18, "BMP")
    else:
        width, height = _unpack("<ii", data, 18, "BMP")
        height = abs(height)  # negative: rows stored top-down
    return ImageInfo("bmp", width, height)


def _jpeg(data: bytes) -> ImageInfo:
    """Walk the marker segments after SOI until the start of frame."""
    pos = 2
    end = len(data)
    while True:
        # A marker is 0xFF, any number of 0xFF fill bytes, then the marker code.
        if pos >= end or data[pos] != 0xFF:
            raise ImageHeaderError("JPEG is truncated or corrupt before its frame header")
        while pos < end and data[pos] == 0xFF:
            pos += 1
        if pos >= end:
            raise ImageHeaderError("JPEG is truncated before its frame header")
        marker = data[pos]
        pos += 1
        if marker in _STANDALONE:
            continue
        if marker in (0x00, 0xD8, 0xD9, 0xDA):  # stuffed byte, SOI again, EOI or scan data before any frame
            raise ImageHeaderError("JPEG has no frame header before its image data")
        (length,) = _unpack(">H", data, pos, "JPEG")
        if length < 2:
            raise ImageHeaderError("JPEG segment with an impossible length")
        if marker in _SOF_DECODED:
            height, width = _unpack(">xHH", data, pos + 2, "JPEG")  # after the length: precision, height, width
            return ImageInfo("jpeg", width, height)
        if marker in _SOF_OTHER:
            raise ImageHeaderError(f"JPEG coding SOF{marker - 0xC0} (lossless, hierarchical or arithmetic) is not "
                                   "supported; baseline and progressive are")
        pos += length
