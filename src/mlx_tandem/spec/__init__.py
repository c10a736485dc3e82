"""Speculative decoding with the checkpoint's own multi-token-prediction (MTP) head.

``mtp_head`` loads the head, ``mtp_cache`` carries its state in each row's cache,
``verify`` runs the verify forward and per-row rollback, ``acceptance`` drafts and accepts
under each request's sampling settings, ``policy`` decides when speculation pays, and
``batch`` ties them into mlx-lm's continuous batch. Owner thread only (except ``policy``'s
mode parsing, which is plain Python).
"""
