"""Put a checkpoint's MTP head back beside a converted copy of it.

mlx-lm's and mlx-vlm's converters (0.32 / 0.7.10) drop every ``mtp.*`` tensor but keep
``mtp_num_hidden_layers`` in the config, so a quantized community checkpoint has no head to
speculate with. This copies the original's head tensors, unchanged and unquantized (a
quantized head accepts almost no drafts), into ``model-mtp.safetensors`` in the converted
directory, with the original's safetensors ``format``: the engine reads the norm convention
from it (``mtp_head._head_is_zero_centred``), so HF's tensors load right beside an
mlx-converted backbone.

    python -m mlx_tandem.spec.add_head ORIGINAL_DIR CONVERTED_DIR
    mlx-tandem-add-mtp-head ORIGINAL_DIR CONVERTED_DIR

Only the original's shards that hold the head are read (its ``model.safetensors.index.json``
says which), so ``ORIGINAL_DIR`` needs just those and the index.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from ..errors import ModelLoadError
from .mtp_head import MTP_PREFIXES, is_quantized

logger = logging.getLogger(__name__)

HEAD_FILE = "model-mtp.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def _head_shards(source: Path) -> list[Path]:
    index = source / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({source / f for k, f in weight_map.items() if k.startswith(MTP_PREFIXES)})
    return sorted(source.glob("*.safetensors"))


def _tensor_names(shard: Path) -> list[str]:
    """A safetensors file's tensor names, from its header alone (no tensor is read)."""
    try:
        with open(shard, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_HEADER_BYTES:  # an LFS pointer or junk reads as any length
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ModelLoadError(f"{shard} is not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{shard} is not a readable safetensors file")
    return [k for k in header if k != "__metadata__"]


def add_mtp_head(source: str | Path, dest: str | Path) -> Optional[Path]:
    """Copy ``source``'s MTP head into ``dest`` (a converted copy of it); returns the file,
    or None where ``dest``'s own weights already hold a head (nothing is written)."""
    import mlx.core as mx

    source, dest = Path(source), Path(dest)
    if not source.is_dir():
        raise ModelLoadError(f"{source} is not a directory")
    if not (dest / "config.json").exists():
        raise ModelLoadError(f"{dest} is not a checkpoint directory (no config.json)")
    head, formats = {}, set()
    for shard in _head_shards(source):
        if not shard.exists():
            raise ModelLoadError(f"{shard} holds part of the MTP head but is missing")
        arrays, metadata = mx.load(str(shard), return_metadata=True)
        found = {k: v for k, v in arrays.items() if k.startswith(MTP_PREFIXES)}
        if found:
            head.update(found)
            formats.add((metadata or {}).get("format") or "")
    if not head:
        raise ModelLoadError(f"{source} has no mtp.* tensors")
    if is_quantized(head):
        raise ModelLoadError(f"{source}: its MTP head is quantized; use the unquantized original")
    if len(formats) > 1:
        raise ModelLoadError(f"{source}: the head's shards disagree on their format ({sorted(formats)})")
    fmt = formats.pop()
    own = [f for f in dest.glob("*.safetensors") if f.name != HEAD_FILE]
    if any(k.startswith(MTP_PREFIXES) for f in own for k in _tensor_names(f)):
        logger.info("%s already holds its MTP head in its weights; nothing to add", dest)
        return None
    out = dest / HEAD_FILE
    # Written whole or not at all: a half-written shard would be loaded as weights. The
    # temporary file is in a directory of its own (MLX appends ".safetensors" to any name,
    # and the loaders read every *.safetensors beside config.json).
    try:
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            part = Path(tmp) / HEAD_FILE
            mx.save_safetensors(str(part), head, metadata={"format": fmt} if fmt else None)
            os.replace(part, out)
        _declare_layers(source, dest, head)
    except (OSError, RuntimeError) as exc:  # MLX reports a file it cannot open as RuntimeError
        raise ModelLoadError(f"cannot write the MTP head into {dest}: {exc}") from None
    logger.info("wrote %d MTP tensors to %s", len(head), out)
    return out


def _declare_layers(source: Path, dest: Path, head: dict) -> None:
    """The converted config keeps ``mtp_num_hidden_layers`` (mlx-lm 0.32 does); where it was
    lost, the original's value is written back, so the head is not ignored."""
    config = json.loads((dest / "config.json").read_text())
    text = config.get("text_config") or config
    if text.get("mtp_num_hidden_layers"):
        return
    original = json.loads((source / "config.json").read_text()) if (source / "config.json").exists() else {}
    declared = (original.get("text_config") or original).get("mtp_num_hidden_layers")
    if declared:
        text["mtp_num_hidden_layers"] = declared
        part = dest / "config.json.partial"
        part.write_text(json.dumps(config, indent=2))
        os.replace(part, dest / "config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("original", help="the original checkpoint directory (with mtp.* tensors)")
    parser.add_argument("converted", help="the converted (e.g. quantized) checkpoint directory to add them to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        add_mtp_head(args.original, args.converted)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
