"""A libp2p peer id's text as every message, record and config checks it (no key code needed)."""

from __future__ import annotations

PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{20,128}$"
"""base58 of a multihash: RSA ids are 46 characters, Ed25519 ones 52."""

MAX_VERIFIERS = 8
"""Verifier daemons a learner's head may list (wire/records.py `HeadRecord.verifiers`)."""
