"""daemon.http.core.images: format and size from the header, on images written here by
hand, and on truncated and hostile headers (which must raise ImageHeaderError,
never anything else)."""

from __future__ import annotations

import random
import struct
import zlib

import pytest

from daemon.http.core.images import ImageHeaderError, ImageInfo, read_header


def png(width: int, height: int, pixels: bool = True) -> bytes:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    rows = b"".join(b"\x00" + bytes(3 * width) for _ in range(height)) if pixels else b""
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def bmp(width: int, height: int, header_size: int = 40, pixels: bool = True) -> bytes:
    stride = (3 * width + 3) // 4 * 4
    data = bytes(stride * abs(height)) if pixels else b""
    if header_size == 12:
        info = struct.pack("<IHHHH", 12, width, height, 1, 24)
    else:
        info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(data), 2835, 2835, 0, 0)
        info = struct.pack("<I", header_size) + info[4:] + bytes(header_size - 40)
    offset = 14 + len(info)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + info + data


def gif(width: int, height: int) -> bytes:
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0)  # global colour table of 2 entries
    palette = b"\x00\x00\x00\xff\xff\xff"
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    lzw = b"\x02\x02\x4c\x01\x00"  # minimum code size 2, one tiny sub-block, terminator
    return b"GIF89a" + screen + palette + image + lzw + b"\x3b"


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def jpeg(width: int, height: int, sof: int = 0xC0, before: bytes = b"") -> bytes:
    """SOI, an APP0 (JFIF) segment, anything in `before`, a frame header, a
    scan header and EOI: enough for a header reader (not for a decoder)."""
    app0 = segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    frame = segment(sof, struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01")
    scan = segment(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00")
    return b"\xff\xd8" + app0 + before + frame + scan + b"\x00" * 8 + b"\xff\xd9"


@pytest.mark.parametrize(
    "data,expected",
    [
        (png(3, 2), ImageInfo("png", 3, 2)),
        (png(640, 480, pixels=False), ImageInfo("png", 640, 480)),
        (bmp(5, 4), ImageInfo("bmp", 5, 4)),
        (bmp(5, -4), ImageInfo("bmp", 5, 4)),  # top-down rows
        (bmp(7, 3, header_size=12), ImageInfo("bmp", 7, 3)),
        (bmp(7, 3, header_size=124), ImageInfo("bmp", 7, 3)),
        (gif(9, 8), ImageInfo("gif", 9, 8)),
        (jpeg(320, 200), ImageInfo("jpeg", 320, 200)),
        (jpeg(320, 200, sof=0xC2), ImageInfo("jpeg", 320, 200)),  # progressive
        # An EXIF segment, a quantisation table, fill bytes and a restart marker before the frame.
        (jpeg(17, 11, before=segment(0xE1, b"Exif\x00\x00" + bytes(3000)) + segment(0xDB, bytes(65))
              + b"\xff\xff\xff" + b"\xff\xd0"), ImageInfo("jpeg", 17, 11)),
    ],
)
def test_reads_format_and_size(data, expected):
    assert read_header(data) == expected


def test_hostile_declared_size_is_read_not_allocated():
    for data in (png(100_000, 100_000, pixels=False), jpeg(65535, 65535), gif(65535, 65535), bmp(100_000, 100_000, pixels=False)):
        info = read_header(data)
        assert info.pixels >= 65535 * 65535


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"", "not a supported image format (supported: PNG, JPEG, GIF, BMP)"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "supported: PNG, JPEG, GIF, BMP"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "not a supported image format"),
        (png(3, 2)[:20], "truncated"),
        (png(0, 5), "empty image (0x5)"),
        (png(5, 0), "empty image"),
        (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IDAT" + bytes(17), "IHDR"),
        (gif(0, 0), "empty image"),
        (b"GIF89a\x01", "truncated"),
        (bmp(4, 4)[:20], "truncated"),
        (bmp(0, 4), "empty image"),
        (b"BM" + bytes(12) + struct.pack("<I", 9999) + bytes(16), "BMP info header of 9999 bytes"),
        (b"\xff\xd8", "truncated"),
        (b"\xff\xd8\xff", "truncated"),
        (b"\xff\xd8\xff\xe0\x00", "truncated"),
        (b"\xff\xd8\xff\xe0\x00\x01", "impossible length"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "truncated"),  # segment runs past the end
        (b"\xff\xd8" + segment(0xDA, b"\x00") + b"\xff\xd9", "no frame header"),  # scan before frame
        (b"\xff\xd8\xff\xd9", "no frame header"),
        (b"\xff\xd8ABCD", "corrupt"),
        (jpeg(0, 10), "empty image"),  # height/width 0 (DNL-defined height) is not decodable
        (jpeg(10, 0), "empty image"),
        (jpeg(10, 10, sof=0xC3), "SOF3"),  # lossless
        (jpeg(10, 10, sof=0xC9), "SOF9"),  # arithmetic
        (jpeg(10, 10)[:-40], "truncated"),
    ],
)
def test_refuses_bad_headers_with_its_own_error(data, needle):
    with pytest.raises(ImageHeaderError) as info:
        read_header(data)
    assert needle in str(info.value)


def test_never_raises_anything_else_on_garbage_and_truncations():
    rng = random.Random(9)
    samples = [png(3, 2), bmp(5, 4), bmp(2, 2, header_size=12), gif(9, 8), jpeg(17, 11)]
    inputs = [s[:n] for s in samples for n in range(len(s) + 1)]
    for _ in range(3000):
        sample = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 8)):  # flip bytes, keeping the signature half the time
            sample[rng.randrange(2 if rng.random() < 0.5 else 0, len(sample))] = rng.randrange(256)
        inputs.append(bytes(sample))
    for prefix in (b"\x89PNG\r\n\x1a\n", b"\xff\xd8", b"GIF89a", b"BM"):
        inputs += [prefix + rng.randbytes(rng.randint(0, 64)) for _ in range(500)]
    inputs.append(b"\xff\xd8" + b"\xff" * 100_000)  # fill bytes and nothing else
    inputs.append(b"\xff\xd8" + b"\xff\xd0" * 50_000)  # restart markers and nothing else
    for data in inputs:
        try:
            info = read_header(data)
        except ImageHeaderError:
            continue
        assert info.width > 0 and info.height > 0


def test_a_text_message_is_not_walked_for_images():
    """A message whose content is a string has no images, and finding that out
    must not iterate the string (a 6 MB message was 6 million steps on the
    event loop: 0.57 s during which no stream got a token)."""
    from daemon.http.core.conversation import ChatMessageIn

    class Unwalkable(str):
        def __iter__(self):
            raise AssertionError("walked the text character by character")

    message = ChatMessageIn.model_construct(role="user", content=Unwalkable("lorem ipsum " * 1000))
    assert message.images() == []
    assert message.to_protocol(lambda part: b"").content == "lorem ipsum " * 1000
