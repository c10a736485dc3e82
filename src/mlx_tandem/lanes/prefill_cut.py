"""Cutting a row's prompt that is still being prefilled, so its prefill ends a chunk there.

Why: the text lane snapshots a row's cache where a prefill chunk ends (mlx-lm reports
``end_of_segment``), and the segments are fixed when the row is inserted. A request that
arrives alone about a document is inserted with no point inside it; the requests about the
same document that arrive a moment later would each prefill it again. Cut at the point they
share, the row stores it on the way and they start from it.

How (mlx-lm 0.32's ``BatchGenerator`` internals, read and changed only here): a row not
yet in the prompt batch is an entry of ``_unprocessed_sequences`` whose second item is its
list of segments; a row in the prompt batch has an entry ``[segments, fed, total]`` in
``_currently_processing``, in the order of ``_prompt_batch.uids``, whose first segment
loses the tokens each step feeds. Splitting one segment in two, in place, is all it takes:
each step feeds at most the first segment, and its end is reported.
"""

from __future__ import annotations

from typing import Any, Optional


def _pending_segments(gen: Any, uid: int) -> Optional[tuple[list[list[int]], int]]:
    """The row's segments still to feed and how many prompt tokens it fed before them."""
    batch = getattr(gen, "_prompt_batch", None)
    uids = getattr(batch, "uids", None) or []
    if uid in uids:
        segments, fed, _ = gen._currently_processing[uids.index(uid)]
        return segments, fed
    for entry in gen._unprocessed_sequences:
        if entry[0] == uid:
            return entry[1], 0
    return None


def cut_pending_prompt(gen: Any, uid: int, offset: int) -> bool:
    """Make the row's prefill end a chunk ``offset`` tokens into its segments (counted from
    where its prefill started). True when such an end is now ahead of it; False when it has
    fed that far already, or the row is not in prefill."""
    found = _pending_segments(gen, uid)
    if found is None:
        return False
    segments, fed = found
    at = offset - fed
    for i, segment in enumerate(segments):
        if at <= 0:
            return at == 0 and i > 0  # on a boundary still ahead of it
        if at < len(segment):
            segments[i:i + 1] = [segment[:at], segment[at:]]
            return True
        at -= len(segment)
    return False
