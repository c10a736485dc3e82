"""What the owner thread builds once the model is loaded: the lanes (with the MTP head, the
prefix cache and the SpecPrefill draft) and the memory ledger that admission reads.

Owner thread only: loading and probing make mlx arrays.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx

from .errors import ModelLoadError
from .lanes import Lane, TextLane
from .memory import CacheFootprint, MemoryLedger, derive_budget, device_memory_bytes, probe_footprint
from .model_loader import LoadedModel, load_mtp_head, load_text_model, resolve_model_path
from .options import EngineOptions
from .prefix_cache import PrefixCache
from .specprefill import SpecPrefillConfig

logger = logging.getLogger(__name__)


def build_lanes(loaded: LoadedModel, opts: EngineOptions, lanes: dict[str, Lane]):
    """Fill ``lanes`` (text, and vision for a vision checkpoint); the MTP head or None."""
    if opts.max_model_len and loaded.context_length and opts.max_model_len > loaded.context_length:
        # Allowed (a model with RoPE scaling may hold more than its config says), not silent.
        logger.warning("max_model_len=%d is beyond the %d positions %s was configured for; answers past "
                       "them may degrade", opts.max_model_len, loaded.context_length, loaded.path.name)
    mtp_head = load_mtp_head(loaded, opts.mtp, opts.mtp_drafter)
    lanes["text"] = TextLane(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        max_batch_size=opts.max_batch_size,
        prefill_batch_size=opts.prefill_batch_size,
        prefill_step_size=opts.prefill_step_size,
        mtp_head=mtp_head,
        mtp_mode=opts.mtp,
        mtp_depth=opts.mtp_depth,
        prefix_cache=(PrefixCache(opts.prefix_cache_bytes, min_tokens=opts.prefix_cache_min_tokens)
                      if opts.prefix_cache_bytes else None),
        specprefill=_load_specprefill(loaded, opts),
        wait_for_shared_prefill=opts.prefix_cache_wait_for_prefill,
        shared_points=opts.prefix_cache_shared,
    )
    if loaded.vlm is not None:
        from .lanes.vision import VisionLane
        from .lanes.vision_cache import VisionPrefixCache

        lanes["vision"] = VisionLane(
            loaded.vlm, loaded.processor,
            eos_token_ids=loaded.eos_token_ids,
            max_batch_size=opts.max_batch_size,
            prefill_batch_size=opts.prefill_batch_size,
            prefill_step_size=opts.prefill_step_size,
            context_length=opts.max_model_len or loaded.context_length,
            prefix_cache=(VisionPrefixCache(opts.vision_cache_bytes, min_tokens=opts.prefix_cache_min_tokens)
                          if opts.vision_cache_bytes else None),
        )
    return mtp_head


def _load_specprefill(loaded: LoadedModel, opts: EngineOptions) -> Optional[SpecPrefillConfig]:
    if opts.specprefill_draft is None:
        return None
    draft = load_text_model(resolve_model_path(opts.specprefill_draft), show_progress=opts.show_progress)
    # Scores index prompt positions, so both models must cut text into the same tokens.
    if draft.tokenizer._tokenizer.get_vocab() != loaded.tokenizer._tokenizer.get_vocab():
        raise ModelLoadError(
            f"SpecPrefill draft {draft.path.name} has a different tokenizer from {loaded.path.name}")
    return SpecPrefillConfig(draft=draft.model, threshold=opts.specprefill_threshold,
                             keep_pct=opts.specprefill_keep_pct, chunk_size=opts.specprefill_chunk_size,
                             lookahead=opts.specprefill_lookahead)


def make_ledger(loaded: LoadedModel, opts: EngineOptions, lanes: dict[str, Lane], mtp_head) -> MemoryLedger:
    """Probe one row's cache and set the running requests' budget (after every model,
    head and draft is loaded, so that they count as memory in use)."""
    try:
        base = probe_footprint(loaded.model)
    except Exception:  # noqa: BLE001 - an exotic model: serve it, bounded by batch slots alone
        logger.warning("could not probe %s's cache size; memory-aware admission is off",
                       loaded.path.name, exc_info=True)
        base = CacheFootprint(0)
    prefix_cache = getattr(lanes["text"], "prefix_cache", None)
    if prefix_cache is not None and base.complete:
        prefix_cache.learn_floor(base.held_bytes)  # snapshots too large for it, known at once
    # Text rows may speculate; vision rows (the same backbone, no head) never do.
    footprint = base.speculating(head_layers=len(mtp_head.layers), depth=opts.mtp_depth) if mtp_head else base
    footprints = {"text": footprint, **({"vision": base} if "vision" in lanes else {})}
    specprefill = getattr(lanes["text"], "specprefill", None)
    if specprefill is not None:
        try:
            footprints["draft"] = probe_footprint(specprefill.draft)
        except Exception:  # noqa: BLE001 - as for the target: its draft cache goes uncounted
            logger.warning("could not probe the SpecPrefill draft's cache size", exc_info=True)
    prefix_bytes = opts.prefix_cache_bytes
    if opts.specprefill_draft is not None:
        prefix_bytes += prefix_bytes // 8  # the draft's own snapshots (lanes/text.py)
    if "vision" in lanes:
        prefix_bytes += opts.vision_cache_bytes
    budget = derive_budget(opts.request_memory_bytes, opts.memory_fraction, in_use=mx.get_active_memory(),
                           prefix_cache_bytes=prefix_bytes, device_bytes=device_memory_bytes())
    ledger = MemoryLedger(footprints, budget)
    full_context = ledger.alone_bytes("text", opts.max_model_len or loaded.context_length)
    logger.info("request memory budget %.1f MiB: a row costs %d B/token + %d B of state; "
                "%d full-context rows fit", budget / 2**20, footprint.kv_bytes_per_token,
                footprint.state_bytes_per_row, budget // max(full_context, 1))
    # Per lane: a vision row (no MTP head, no verify copies) may fit where a text row does not.
    short = [lane for lane in ("text", "vision") if lane in lanes and budget < ledger.alone_bytes(lane, 1)]
    if short:
        remedy = ("raise request_memory_bytes" if opts.request_memory_bytes is not None
                  else "lower prefix_cache_bytes or set request_memory_bytes")
        who = "every request" if len(short) == len(lanes) else f"every {short[0]} request"
        logger.warning("the request memory budget (%d B) cannot hold one row's cache: %s will fail; %s",
                       budget, who, remedy)
    return ledger
