"""Random ``vllm-diff-trace/2`` traces in the spirit of the suite's generator
(``vllm/v2/README.md``: the ``spec``, ``lora``, ``pause`` and ``mixed2`` kinds, and
the generator's guarantees), for property checks of the replay on many seeds.

One more kind, ``interval_preempt``, is ours: the priority policy, a prefill
interval of 3 and a small KV pool, with long low-urgency prompts admitted ahead of
urgent requests that then decode. Their prefill chunks sit ahead of growing decodes
in ``running``, so they are the priority victims of preemptions on steps that hold
prefill (victims the scan passed over) and on release steps (victims whose row is
taken back): the S3 scan-position and S12 interval rules of docs/scheduler.md.

There is no vLLM here to record reference decisions for them: the tests check
what the README promises of every trace (see ``test_v2_properties.py``).
"""

from __future__ import annotations

import random
from typing import Any

KINDS = ("spec", "lora", "pause", "mixed2")
INTERVAL_PREEMPT = "interval_preempt"
VOCAB_SIZE, EOS = 1000, 2


def generate(kind: str, seed: int, num_steps: int = 120) -> dict[str, Any]:
    """One trace of ``kind`` (one of ``KINDS`` or ``INTERVAL_PREEMPT``) from ``seed``."""
    if kind == INTERVAL_PREEMPT:
        return generate_interval_preempt(seed, num_steps)
    rng = random.Random(f"{kind}:{seed}")
    bs = 16
    k = 0
    max_loras = 0
    interval = 1
    threshold = 0
    active = None
    chunked = True
    policy = rng.choice(["fcfs", "priority"])
    max_model_len = 1024
    max_num_seqs = rng.choice([8, 16])
    budget = rng.choice([128, 256])
    usable = 400
    pauses = False
    if kind == "spec":
        k = rng.randint(1, 4)
        usable = rng.randint(23, 33)
        budget = 128
        max_num_seqs = 8
    elif kind == "lora":
        max_loras = rng.randint(1, 3)
    elif kind == "pause":
        pauses = True
        usable = rng.randint(20, 60)
    else:
        k = rng.randint(1, 4) if rng.random() < 0.75 else 0
        max_loras = rng.randint(1, 3) if rng.random() < 0.65 else 0
        pauses = rng.random() < 0.7
        interval = rng.choice([1, 1, 3])
        threshold = rng.choice([0, 0, 16, 32])
        active = rng.choice([None, None, max_num_seqs // 2])
        usable = rng.randint(30, 300)
        max_model_len = 512
        if rng.random() < 0.2:
            chunked = False
            budget = max_model_len
    if 0 < threshold <= k:
        threshold = k + 1  # the generator's guarantee: 0 or > k
    adapters = list(range(1, rng.randint(4, 8) + 1))
    shared_prefix = [rng.randrange(VOCAB_SIZE) for _ in range(3 * bs)]
    prompts: list[list[int]] = []
    room = min(max_model_len, usable * bs) - k

    def new_request(i: int, step: int, j: int) -> dict[str, Any]:
        shape = rng.random()
        if prompts and shape < 0.15:
            tokens = list(rng.choice(prompts))  # an exact duplicate
        elif shape < 0.3:
            tokens = [rng.randrange(VOCAB_SIZE) for _ in range(bs * rng.randint(0, 4) + 1)]  # 16n + 1
        elif shape < 0.45:
            tokens = shared_prefix[: bs * rng.randint(1, 3)] + [
                rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 40))
            ]
        else:
            tokens = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 150))]
        tokens = tokens[: room - 1]
        prompts.append(tokens)
        max_tokens = max(1, min(rng.randint(1, 80), room - len(tokens)))
        lora = None
        if max_loras and rng.random() >= 0.2:
            lora = rng.choice(adapters)
        return {
            "request_id": f"r{i:04d}",
            "prompt_token_ids": tokens,
            "max_tokens": max_tokens,
            "priority": rng.randint(0, 3) if policy == "priority" else 0,
            "arrival_time": 1000 + step + (j + 1) / 64,
            "eos_token_id": EOS,
            "stop_at": rng.randrange(max_tokens) if rng.random() < 0.3 else None,
            "lora_id": lora,
        }

    events = []
    ids: list[str] = []
    pause_until = -1
    for step in range(num_steps):
        event: dict[str, Any] = {"step": step, "add": [], "abort": []}
        if step < num_steps * 2 // 3:
            for j in range(rng.choice([0, 0, 0, 1, 1, 2, 3, 6])):
                event["add"].append(new_request(len(ids), step, j))
                ids.append(event["add"][-1]["request_id"])
        if ids and rng.random() < 0.06:
            event["abort"].append(rng.choice(ids))
        if pauses:
            if step == pause_until:
                event["pause"] = "unpaused"
            elif step > pause_until and rng.random() < 0.05:
                event["pause"] = rng.choice(["new", "all"])
                pause_until = step + rng.randint(2, 26)
            elif step < pause_until and rng.random() < 0.1:
                event["pause"] = rng.choice(["new", "all"])  # switching mode inside a window
        if event["add"] or event["abort"] or "pause" in event:
            events.append(event)
    return {
        "format": "vllm-diff-trace/2",
        "kind": kind,
        "seed": seed,
        "description": "fastsched tracegen.py (no vLLM reference)",
        "num_steps": num_steps,
        "config": {
            "max_num_seqs": max_num_seqs,
            "max_num_active_seqs": active,
            "max_num_batched_tokens": max(budget, max_num_seqs),
            "long_prefill_token_threshold": threshold,
            "long_prefill_token_threshold_adaptive": False,
            "enable_chunked_prefill": chunked,
            "policy": policy,
            "block_size": bs,
            "num_blocks": usable + 1,
            "enable_prefix_caching": True,
            "max_model_len": max_model_len,
            "prefill_schedule_interval": interval,
            "scheduler_reserve_full_isl": True,
            "watermark": 0.0,
            "async_scheduling": False,
            "num_speculative_tokens": k,
            "max_loras": max_loras,
        },
        "model": {"vocab_size": VOCAB_SIZE, "token_fn": "fnv1a64-v1", "draft_fn": "fnv1a64-draft-v1"},
        "events": events,
    }


def generate_interval_preempt(seed: int, num_steps: int = 160) -> dict[str, Any]:
    """The ``interval_preempt`` kind: priority, ``prefill_schedule_interval`` 3,
    4-token blocks, a pool of 10 to 16 blocks, a small budget and a per-request
    cap. Each burst starts on an empty engine: one long prompt of priority 3
    (the least urgent) admitted alone, then two or three urgent prompts
    (priority 0 or 1) that join it on its second chunk and decode while it
    prefills behind the interval, and a short prompt or two arriving later.
    The long one's chunks and the decodes grow into the last free blocks, so
    a decode's growth preempts it on held steps (ahead of the scan, no row)
    and on release steps (its chunk's row taken back)."""
    rng = random.Random(f"{INTERVAL_PREEMPT}:{seed}")
    bs, max_model_len = 4, 256
    usable = rng.randint(10, 16)
    room = usable * bs
    budget = rng.randint(16, 24)
    threshold = rng.randint(5, 8)
    adds: dict[int, list[dict[str, Any]]] = {}

    def arrive(step: int, length: int, priority: int, max_tokens: int) -> None:
        tokens = [rng.randrange(VOCAB_SIZE) for _ in range(min(length, room - 2))]
        at = adds.setdefault(step, [])
        at.append({
            "request_id": "",
            "prompt_token_ids": tokens,
            "max_tokens": max(1, min(max_tokens, room - len(tokens))),
            "priority": priority,
            "arrival_time": 1000 + step + (len(at) + 1) / 64,
            "eos_token_id": EOS,
            "stop_at": None,
            "lora_id": None,
        })  # fmt: skip

    step = 0
    while step < num_steps - 45:
        arrive(step, rng.randint(24, 40), 3, rng.randint(2, 6))
        for _ in range(rng.randint(2, 3)):
            arrive(step + 1, rng.randint(3, 8), rng.randint(0, 1), rng.randint(12, 30))
        for _ in range(rng.randint(1, 2)):
            arrive(step + rng.randint(2, 9), rng.randint(3, 8), 2, rng.randint(2, 6))
        step += 45  # long enough for the burst to drain
    events = [{"step": k, "add": adds[k], "abort": []} for k in sorted(adds)]
    for i, r in enumerate(r for e in events for r in e["add"]):
        r["request_id"] = f"r{i:04d}"  # numbered in file order
    return {
        "format": "vllm-diff-trace/2",
        "kind": INTERVAL_PREEMPT,
        "seed": seed,
        "description": "fastsched tracegen.py (no vLLM reference): priority, prefill interval 3, preemptions",
        "num_steps": num_steps,
        "config": {
            "max_num_seqs": 8,
            "max_num_active_seqs": None,
            "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": threshold,
            "long_prefill_token_threshold_adaptive": False,
            "enable_chunked_prefill": True,
            "policy": "priority",
            "block_size": bs,
            "num_blocks": usable + 1,
            "enable_prefix_caching": True,
            "max_model_len": max_model_len,
            "prefill_schedule_interval": 3,
            "scheduler_reserve_full_isl": True,
            "watermark": 0.0,
            "async_scheduling": False,
            "num_speculative_tokens": 0,
            "max_loras": 0,
        },
        "model": {"vocab_size": VOCAB_SIZE, "token_fn": "fnv1a64-v1", "draft_fn": "fnv1a64-draft-v1"},
        "events": events,
    }
