"""The engine's garbage-collection policy for what it builds at start-up."""

from __future__ import annotations

import atexit
import gc


def freeze_start_up_heap() -> None:
    """What exists once an engine is built (model, tokenizer, torch and numpy internals)
    lives as long as the engine: frozen, it is no longer scanned by every full collection,
    which otherwise cost ~0.4 s of a 1.8 s ``LLM.generate`` of 1024 requests (collections
    triggered while the requests are created). Frozen objects are still freed by reference
    counting; at exit they are unfrozen so that the interpreter's last collections see
    them (extensions that count their objects at exit would report them as leaked)."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False
