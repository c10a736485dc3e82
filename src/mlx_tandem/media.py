"""Images in chat messages: find them, read them, check them. Caller's thread, no mlx.

Accepted sources for an image part (``image``, ``image_url`` or ``input_image``):
bytes, a PIL image, a data URI, a bare base64 string (standard or URL-safe, line breaks
allowed), a local path (or ``file://`` URI), and
``http(s)://`` URLs only when the engine option ``allow_remote_images`` is on (off by
default: a prompt must not make the engine fetch arbitrary URLs). Every image is decoded
here, so a bad or oversized image fails its own request at the call site, before anything
is queued.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Iterable

from .errors import InvalidRequestError, UnsupportedContentError
from .messages import CallTurns, hoisted_order

IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image"})
# The processor attributes that name the strings it expands into media features.
_MARKER_ATTRIBUTES = ("image_token", "boi_token", "video_token", "audio_token")
_REMOTE_TIMEOUT_S = 20
_REMOTE_MAX_BYTES = 32 * 2**20


def _source_of(part: dict) -> Any:
    for key in ("image", "image_url", "url", "data"):
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, dict):  # OpenAI: {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    raise InvalidRequestError(f"image part without data: keys {sorted(part)}")


def _read_remote(url: str) -> bytes:
    # The socket timeout bounds each read; the deadline bounds the whole download, so a
    # server that drips bytes cannot hold the caller's thread.
    deadline = time.monotonic() + _REMOTE_TIMEOUT_S
    chunks, size = [], 0
    with urllib.request.urlopen(url, timeout=_REMOTE_TIMEOUT_S) as resp:  # noqa: S310 - opt-in
        while chunk := resp.read(1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > _REMOTE_MAX_BYTES:
                raise InvalidRequestError(f"image at {url} is larger than {_REMOTE_MAX_BYTES} bytes")
            if time.monotonic() > deadline:
                raise InvalidRequestError(f"image at {url} took more than {_REMOTE_TIMEOUT_S} s to fetch")
    return b"".join(chunks)


def _b64decode(text: str) -> bytes:
    """Standard or URL-safe base64, with or without line breaks (MIME) and padding."""
    compact = "".join(text.split()).translate(_URLSAFE)
    return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)


_URLSAFE = str.maketrans("-_", "+/")


def _local_path(source: str) -> str:
    """A path from a plain path or a ``file://`` URI (percent-encoded, host empty or localhost)."""
    if not source.startswith("file://"):
        return source
    url = urllib.parse.urlparse(source)
    if url.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"file URI on another host: {source}")
    return urllib.request.url2pathname(url.path)


def _bytes_of(source: Any, *, allow_remote: bool) -> Any:
    """Raw bytes, or a PIL image as is."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if type(source).__module__.startswith("PIL."):
        return source
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise InvalidRequestError(f"unsupported image source of type {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            return urllib.parse.unquote_to_bytes(payload)
        source = payload
    elif source[:8].lower().startswith(("http://", "https://")):  # schemes are case-insensitive
        if not allow_remote:
            raise UnsupportedContentError(
                "remote image URLs are disabled; pass the image inline (base64, bytes, path) or "
                "create the engine with allow_remote_images=True")
        try:
            return _read_remote(source)
        except (OSError, ValueError) as exc:  # ValueError: a malformed URL
            raise InvalidRequestError(f"could not fetch image {source}: {exc}") from exc
    else:
        path = _local_path(source)
        if len(path) < 4096 and os.path.isfile(path):
            with open(path, "rb") as f:
                return f.read()
        if source.startswith("file://"):
            raise InvalidRequestError(f"no such image file: {path}")
    try:
        return _b64decode(source)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            "image is not bytes, a data URI, base64, an existing file or an http(s) URL") from None


#: Pillow's lazy ``load()`` reads the image's file and decoder state and is not thread-safe:
#: a caller's image passed to several requests at once (one ``Image.open`` object) failed
#: some ("broken PNG file", "I/O operation on closed file") and gave others wrong pixels.
_PIL_LOCK = threading.Lock()


def load_image(source: Any, *, allow_remote: bool = False, max_pixels: int = 4096 * 4096):
    """A decoded RGB PIL image from any accepted source, turned upright by its EXIF orientation."""
    from PIL import Image, ImageOps

    data = _bytes_of(source, allow_remote=allow_remote)
    if isinstance(data, Image.Image):
        img = data
    else:
        # Pillow's format plugins raise many types on malformed input (OSError, ValueError,
        # SyntaxError, NotImplementedError, struct.error, ...; fuzzed with Pillow 12): any of
        # them is a bad image, the caller's fault, never the engine's.
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:  # its header claims over ~179M pixels
            raise InvalidRequestError(f"image is too large: {exc} (engine option max_image_pixels "
                                      f"is {max_pixels})") from exc
        except Exception as exc:  # noqa: BLE001 - see above
            raise InvalidRequestError(f"could not decode image: {type(exc).__name__}: {exc}") from exc
    w, h = img.size
    if w * h > max_pixels:  # checked before decoding the pixels: no decompression bombs
        raise InvalidRequestError(f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels} "
                                  "(engine option max_image_pixels)")
    if w < 1 or h < 1:
        raise InvalidRequestError(f"image has no pixels ({w}x{h})")
    try:
        if img is data:  # the caller's own object: decoded once, under the lock, then a copy of ours
            with _PIL_LOCK:
                img.load()
                img = img.copy()
        else:
            img.load()
        # Upright, as a phone's portrait photo is shown (its pixels are stored sideways with an
        # EXIF orientation): what transformers' and mlx-vlm's load_image give the model.
        return ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:  # noqa: BLE001 - as for Image.open above
        raise InvalidRequestError(f"could not decode image: {type(exc).__name__}: {exc}") from exc


def load_images(messages: Iterable[dict], *, allow_remote: bool, max_pixels: int,
                turns: CallTurns = CallTurns()) -> list:
    """The images of a conversation in the order the chat template renders them: system (and
    developer) messages first, as ``normalize_messages`` hoists them (with the template's
    ``turns``). Errors name the caller's message index."""
    images = []
    for i, m in hoisted_order(list(messages), turns):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind in IMAGE_PART_TYPES:
                try:
                    images.append(load_image(_source_of(part), allow_remote=allow_remote, max_pixels=max_pixels))
                except InvalidRequestError as exc:
                    raise type(exc)(f"messages[{i}].content[{j}]: {exc}") from exc.__cause__
            elif kind in ("video", "video_url", "audio", "input_audio"):
                raise UnsupportedContentError(
                    f"messages[{i}].content[{j}]: {kind} parts are not supported yet (images are)")
    return images


def media_markers(processor: Any) -> tuple[str, ...]:
    """The placeholder strings a vision processor turns into media features (Qwen's
    ``<|image_pad|>``, Gemma's ``<start_of_image>``)."""
    found = (getattr(processor, a, None) for a in _MARKER_ATTRIBUTES)
    return tuple(dict.fromkeys(m for m in found if isinstance(m, str) and m))


def _strings(obj: Any, where: str) -> Iterable[tuple[str, str]]:
    if isinstance(obj, str):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{where}[{i}]")


def refuse_media_markers(messages: list[dict], tools: Any, markers: Iterable[str]) -> None:
    """A request's own text must not hold a media placeholder.

    The processor finds images by these strings in the rendered prompt, so a literal one in
    the text is taken for an image. mlx-vlm 0.7.10's Qwen processor then drops the *first*
    surplus markers, which are the template's own, and splices the image's features where
    the text's literal stands, without its vision_start/vision_end; other processors fail or
    misalign the same way. Text-only requests never reach a processor: on the text lane a
    literal is tokens, as in a Hugging Face template.
    """
    markers = tuple(markers)
    if not markers:
        return
    for where, text in _strings({"messages": messages, "tools": tools or []}, ""):
        for marker in markers:
            if marker in text:
                raise InvalidRequestError(
                    f"{where} contains {marker!r}, the model's media placeholder; in a request with "
                    "images the processor would take it for an image. Remove it from the text.")
