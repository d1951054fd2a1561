"""Cost of the wire (``fastsched.engine.protocol``) per message: encode + decode of the hot
messages, an ADD (one request, as a frontend sends it) and an OUTPUTS (one engine step's
batch with the engine's stats, as a frontend receives it), in process.

    PYTHONPATH=python .venv/bin/python bench/protocol_codec.py [--rows 256] [--against REV]

``--against REV`` also measures the protocol module of git revision REV (read with
``git show``), alternating rounds of the two so that a noisy machine weighs on both alike.
Prints microseconds per message (best of the rounds) and the encoded size in bytes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fastsched.engine import protocol
from fastsched.sampling_params import SamplingParams


def reference_protocol(rev: str) -> types.ModuleType:
    """``engine/protocol.py`` as it was at ``rev``, imported under another name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.check_output(
        ["git", "-C", str(root), "show", f"{rev}:python/fastsched/engine/protocol.py"], text=True
    )
    module = types.ModuleType(f"protocol_at_{rev}")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{rev}:protocol.py", "exec"), module.__dict__)
    return module


def add_message(p: Any, prompt_len: int) -> Any:
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, stop=["\n\n"], seed=1)
    return p.AddRequest(
        p.EngineCoreRequest("cmpl-0123456789abcdef-0", list(range(prompt_len)), params, 1.0), 0
    )


def outputs_message(p: Any, rows: int) -> Any:
    """A decode step: one token per row, one row in 64 finished, stats as an engine sends them."""
    reasons = np.zeros(rows, dtype=np.uint8)
    reasons[::64] = 2
    columns: dict[str, Any] = dict(
        request_ids=[f"cmpl-{i:016x}-0" for i in range(rows)],
        token_offsets=np.arange(rows + 1, dtype=np.int64),
        token_ids=np.arange(rows, dtype=np.int64) % 50_000,
        finish_reasons=reasons,
        num_cached_tokens=np.full(rows, -1, dtype=np.int64),
        first_token=np.zeros(rows, dtype=bool),
        clients=np.zeros(rows, dtype=np.int64),
    )
    if "handles" in p.OutputBatch.__dataclass_fields__:
        columns["handles"] = np.arange(rows, dtype=np.int64)
    stats = p.EngineStats(
        num_running=rows,
        num_waiting=3,
        kv_cache_usage=0.4,
        scan_stops_total={"kv_blocks": 3},
        skips_total={"lora": 1},
        iteration_tokens=[0] * 14,
        iteration_tokens_sum=1000,
    )
    timings = [p.RequestTiming("cmpl-0000000000000000-0", 0.01, 0.02, 0.5)]
    return p.Outputs(0, p.OutputBatch(**columns), stats, timings)


def _seconds(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="rows of the OUTPUTS batch")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of the ADD")
    parser.add_argument("--repeat", type=int, default=1000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--against", metavar="REV", help="also measure the protocol module of this git revision"
    )
    args = parser.parse_args()
    codecs = {"this tree": protocol}
    if args.against:
        codecs[args.against] = reference_protocol(args.against)
    for kind in ("add", "outputs"):
        cases = {}
        for name, p in codecs.items():
            msg = add_message(p, args.prompt_len) if kind == "add" else outputs_message(p, args.rows)
            cases[name] = (p, msg, p.encode(msg))
        best = {name: [float("inf"), float("inf")] for name in cases}
        for _ in range(args.rounds):
            for name, (p, msg, data) in cases.items():
                best[name][0] = min(best[name][0], _seconds(lambda: p.encode(msg), args.repeat))
                best[name][1] = min(best[name][1], _seconds(lambda: p.decode(data), args.repeat))
        for name, (enc, dec) in best.items():
            print(
                f"{kind:8s} {name:12s} encode {enc * 1e6:8.2f} us  decode {dec * 1e6:8.2f} us  "
                f"total {(enc + dec) * 1e6:8.2f} us  {len(cases[name][2])} bytes"
            )


if __name__ == "__main__":
    main()
