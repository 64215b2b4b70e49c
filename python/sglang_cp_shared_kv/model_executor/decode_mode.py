"""How a shared-KV server decodes: per owner (the default, where served) or through the page gather.

``SGLANG_CP_SHARED_KV_DECODE`` = ``per_owner`` (default) | ``gather``. Set in the launching
environment, so every rank inherits the same value. Checked twice: by the server-args validation
in the launching process (a bad value stops the launch before anything is spawned) and where
per-owner decode attaches (``per_owner_decode.attach``), which reads it once. No heavy imports: the
launcher imports this module.
"""

from __future__ import annotations

import os

DECODE_MODE_ENV = "SGLANG_CP_SHARED_KV_DECODE"
DECODE_PER_OWNER, DECODE_GATHER = "per_owner", "gather"
DECODE_MODES = (DECODE_PER_OWNER, DECODE_GATHER)


def configured_decode_mode() -> str:
    """``DECODE_MODE_ENV``'s value (unset: ``per_owner``); ``ValueError`` naming it otherwise."""
    raw = os.environ.get(DECODE_MODE_ENV)
    if raw is None:
        return DECODE_PER_OWNER
    mode = raw.strip().lower()
    if mode not in DECODE_MODES:
        raise ValueError(f"{DECODE_MODE_ENV} must be one of {', '.join(DECODE_MODES)}; got {raw!r}")
    return mode
