"""Image sources in chat messages (media.py): every accepted form decodes to the same pixels,
bad ones are typed errors, and images come in the order the chat template renders them."""

from __future__ import annotations

import base64
import io
import struct
import zlib
import urllib.request

import numpy as np
import pytest

from mlx_tandem import media
from mlx_tandem.errors import InvalidRequestError, UnsupportedContentError
from mlx_tandem.media import load_image, load_images


def _image(seed: int, size: int = 24):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8"))


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _pixels(img) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


def test_every_accepted_source_gives_the_same_pixels(tmp_path):
    img = _image(1)
    data = _png(img)
    b64 = base64.b64encode(data).decode()
    path = tmp_path / "my image.png"
    path.write_bytes(data)
    sources = {
        "bytes": data,
        "memoryview": memoryview(data),
        "PIL": img,
        "data URI": "data:image/png;base64," + b64,
        "base64": b64,
        "MIME base64 (line breaks)": base64.encodebytes(data).decode(),
        "data URI with line breaks": "data:image/png;base64," + base64.encodebytes(data).decode(),
        "URL-safe base64, unpadded": base64.urlsafe_b64encode(data).decode().rstrip("="),
        "path": str(path),
        "pathlib": path,
        "file URI, percent-encoded": path.as_uri(),
        "file URI on localhost": "file://localhost" + urllib.request.pathname2url(str(path)),
    }
    for name, source in sources.items():
        np.testing.assert_array_equal(_pixels(load_image(source)), _pixels(img), err_msg=name)


@pytest.mark.parametrize("source", [
    "this is neither a path nor base64!",
    "data:image/png;base64,bm90IGFuIGltYWdl",  # "not an image"
    "file:///no/such/image.png",
    "file://elsewhere.example/image.png",
    b"",
    5,
])
def test_bad_sources_are_typed_errors(source):
    with pytest.raises(InvalidRequestError):
        load_image(source)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png_header(w: int, h: int, idat: bytes) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + idat


_ROWS = zlib.compress(b"".join(b"\0" + bytes(range(12)) for _ in range(4)))  # 4x4 RGB pixels


# Malformed images on which Pillow raises other types than OSError (found by fuzzing).
@pytest.mark.parametrize("data", [
    _png_header(20000, 20000, _chunk(b"IDAT", _ROWS)),  # DecompressionBombError, before any check of ours
    b"P6\n12 x\n255\n" + bytes(64),  # ValueError
    b"DDS " + struct.pack("<I", 124) + struct.pack("<IIII", 0x1007, 4, 4, 0) + bytes(168),  # NotImplementedError
    # SyntaxError while decoding: a chunk with a broken header after the first piece of data
    _png_header(4, 4, _chunk(b"IDAT", _ROWS[:5]) + struct.pack(">I", 4201710138) + b"\x11\x92\0\0" + _ROWS[5:]),
], ids=["bomb", "ppm", "dds", "png-chunk"])
def test_malformed_images_are_typed_errors(data):
    with pytest.raises(InvalidRequestError, match="image"):
        load_image(data, max_pixels=10**12)


def test_malformed_and_slow_remote_urls_are_typed_errors(monkeypatch):
    with pytest.raises(InvalidRequestError, match="could not fetch"):
        load_image("http://[::1/a.png", allow_remote=True)  # urllib raises ValueError

    class Drip:  # a server that sends a byte at a time, each read within the socket timeout
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, n):
            return b"x"

    clock = iter(range(0, 10_000, 1))
    monkeypatch.setattr(media.urllib.request, "urlopen", lambda url, timeout: Drip())
    monkeypatch.setattr(media.time, "monotonic", lambda: next(clock))
    with pytest.raises(InvalidRequestError, match="took more than"):
        load_image("https://example.com/slow.png", allow_remote=True)


def test_a_photo_is_turned_upright_by_its_exif_orientation_as_mlx_vlm_loads_it(tmp_path):
    """A phone's portrait photo is stored sideways with an EXIF orientation; mlx-vlm's and
    transformers' load_image turn it upright, and so does ours (the model saw it sideways),
    from a file and from a PIL image alike."""
    from mlx_vlm.utils import load_image as vlm_load_image
    from PIL import Image

    pixels = (np.random.default_rng(0).random((32, 96, 3)) * 255).astype("uint8")  # 96 wide
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = tmp_path / "portrait.png"  # lossless, so pixels compare exactly
    Image.fromarray(pixels).save(path, exif=exif.tobytes())
    theirs = vlm_load_image(str(path))
    assert theirs.size == (32, 96)
    for source in (str(path), Image.open(path)):
        ours = load_image(source)
        assert ours.size == theirs.size and np.array_equal(np.asarray(ours), np.asarray(theirs.convert("RGB")))


def test_one_lazily_opened_pil_image_shared_by_threads_decodes_the_same_in_each(tmp_path):
    """A caller may pass one ``Image.open`` object to several requests at once; Pillow's lazy
    load is not thread-safe, so most of them failed ("broken PNG file", "I/O operation on
    closed file") and some got wrong pixels."""
    import threading

    from PIL import Image

    path = tmp_path / "shared.png"
    Image.fromarray((np.random.default_rng(1).random((64, 64, 3)) * 255).astype("uint8")).save(path)
    expected = np.asarray(load_image(str(path)))
    for _ in range(10):
        shared, barrier, results = Image.open(path), threading.Barrier(8), []

        def work():
            barrier.wait()
            try:
                results.append(np.array_equal(np.asarray(load_image(shared)), expected))
            except InvalidRequestError as exc:
                results.append(exc)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 8, results


def test_remote_schemes_are_read_in_any_case():
    with pytest.raises(UnsupportedContentError, match="remote image URLs are disabled"):
        load_image("HTTPS://example.com/cat.png")


def test_images_come_in_the_templates_order_with_system_messages_first():
    a, b, c = _image(1), _image(2), _image(3)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "what?"}]},
        {"role": "developer", "content": [{"type": "image", "image": b}, {"type": "text", "text": "ref"}]},
        {"role": "user", "content": [{"type": "image", "image": c}]},
    ]
    got = load_images(messages, allow_remote=False, max_pixels=10**6)
    assert [_pixels(g).tolist() for g in got] == [_pixels(x).tolist() for x in (b, a, c)]
    messages[2]["content"][0]["image"] = "not an image"
    with pytest.raises(InvalidRequestError, match=r"messages\[2\]\.content\[0\]"):  # the caller's index
        load_images(messages, allow_remote=False, max_pixels=10**6)
