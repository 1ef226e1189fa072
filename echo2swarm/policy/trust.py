"""Which learner key a follower trusts: pinned by `--trust`, or pinned on first use in the state dir."""

from __future__ import annotations

from pathlib import Path

from echo2swarm.wire.records import HeadRecord
from echo2swarm.wire.signing import KeyFileError, PublicKey
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
TOFU_FILE = "trusted_learner.pub"


class TrustAnchor:
    """Selects the head to follow among all heads announced in the swarm.

    >>> anchor = TrustAnchor(state_dir, pinned=load_trusted_key("learner.key.pub"))
    >>> head = anchor.select(heads, swarm="demo")   # None when no trusted head is there
    """

    def __init__(self, state_dir: Path, pinned: PublicKey | None):
        self.file = Path(state_dir) / TOFU_FILE
        self.key: PublicKey | None = pinned
        self.source = "--trust"
        self._warned_ambiguous = False
        stored = self._stored()
        if pinned is not None:
            if stored is not None and stored != pinned:
                logger.warning("--trust %s overrides the key pinned earlier in %s", pinned.fingerprint, self.file)
        elif stored is not None:
            self.key, self.source = stored, f"pinned on first use ({self.file})"

    def _stored(self) -> PublicKey | None:
        if not self.file.is_file():
            return None
        try:
            return PublicKey.parse(self.file.read_text())
        except (KeyFileError, OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"{self.file} is corrupt ({e}); delete it or pass --trust") from None

    def select(self, heads: list[HeadRecord], swarm: str) -> HeadRecord | None:
        if self.key is not None:
            mine = [h for h in heads if h.public_key == self.key.text and h.swarm == swarm and h.signature_ok()]
            return max(mine, key=lambda h: h.version) if mine else None
        signers = {h.public_key for h in heads if h.swarm == swarm and h.signature_ok()}
        if len(signers) > 1:
            if not self._warned_ambiguous:
                logger.error(
                    "%d different keys announce policy heads in swarm %r; refusing to guess. "
                    "Pass --trust with the learner's KEY.pub", len(signers), swarm,
                )
                self._warned_ambiguous = True
            return None
        if not signers:
            return None
        self.key = PublicKey.parse(signers.pop())
        self.source = f"pinned on first use ({self.file})"
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.file.write_text(self.key.text + "\n")
        logger.warning(
            "TRUST ON FIRST USE: pinned learner key %s from the swarm and stored it in %s. Anyone who "
            "announced first could have been trusted; pass --trust KEY.pub to pin the real learner's key.",
            self.key.text, self.file,
        )
        return self.select(heads, swarm)
