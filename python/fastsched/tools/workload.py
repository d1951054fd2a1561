"""The requests a benchmark sends, shared by ``fastsched bench serve`` and ``fastsched simulate``
so the same flags give the same requests at the same instants in both: random prompts of
token ids with lengths spread around a mean, Poisson arrival times, a ShareGPT file, or
vLLM's ``prefix_repetition`` shape (a few shared prefixes, each request one of them plus
its own suffix: system prompts of several tenants and short user turns)."""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# vLLM's ShareGPT filter (vllm/benchmarks/datasets.py, is_valid_sequence).
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048

DEFAULT_RANGE_RATIO = 0.5


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    text: str | None = None  # sent instead of the ids when set (ShareGPT, or a chat prompt)


# ------------------------------------------------------------------ workloads


def make_requests(
    num_requests: int,
    prompt_len: int,
    output_len: int,
    seed: int,
    token_id_range: tuple[int, int],
    range_ratio: float = DEFAULT_RANGE_RATIO,
) -> list[BenchRequest]:
    """Lengths uniform in [mean·(1 − ratio), mean·(1 + ratio)] (rounded, at least 1); ids
    uniform in the range. The default ratio, 0.5, is fastsched's ±50 % of old."""
    rng = random.Random(seed)
    lo_id, hi_id = token_id_range
    out = []
    for _ in range(num_requests):
        p = rng.randint(*_spread(prompt_len, range_ratio))
        o = rng.randint(*_spread(output_len, range_ratio))
        out.append(BenchRequest([rng.randrange(lo_id, hi_id) for _ in range(p)], o))
    return out


@dataclass(frozen=True)
class PrefixRepetition:
    """``--dataset-name prefix_repetition`` (vLLM's flags): ``num_prefixes`` random prefixes of
    ``prefix_len`` tokens; each request takes one of them at random and adds ``suffix_len``
    random tokens of its own."""

    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10

    def __post_init__(self) -> None:
        for name in ("prefix_len", "suffix_len", "num_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--prefix-repetition-{name.replace('_', '-')} must be at least 1, "
                    f"got {getattr(self, name)}"
                )

    def requests(
        self,
        num_requests: int,
        output_len: int,
        seed: int,
        token_id_range: tuple[int, int],
        range_ratio: float = DEFAULT_RANGE_RATIO,
    ) -> list[BenchRequest]:
        """Output lengths as :func:`make_requests`'."""
        rng = random.Random(seed)
        lo_id, hi_id = token_id_range
        prefixes = [
            [rng.randrange(lo_id, hi_id) for _ in range(self.prefix_len)] for _ in range(self.num_prefixes)
        ]
        return [
            BenchRequest(
                rng.choice(prefixes) + [rng.randrange(lo_id, hi_id) for _ in range(self.suffix_len)],
                rng.randint(*_spread(output_len, range_ratio)),
            )
            for _ in range(num_requests)
        ]


def _spread(mean: int, range_ratio: float = DEFAULT_RANGE_RATIO) -> tuple[int, int]:
    return max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))


def arrival_times(num_requests: int, qps: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps of mean 1/qps (all at 0 for qps=inf)."""
    if math.isinf(qps):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(qps)
        times.append(t)
    return times


def load_sharegpt(
    path: str | Path,
    num_requests: int,
    tokenizer: Any,
    seed: int,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """``num_requests`` prompts of a ShareGPT file (see the module docstring), in a seeded
    shuffle; drawn again (seeded) when the file has fewer valid ones, as vLLM oversamples."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            continue
        pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, completion in pairs:
        if len(requests) == num_requests:
            break
        ids = tokenizer.encode(prompt)
        out = (
            output_len
            if output_len is not None
            else len(tokenizer.encode(completion, add_special_tokens=False))
        )
        too_short = len(ids) < SHAREGPT_MIN_LEN or (output_len is None and out < SHAREGPT_MIN_LEN)
        too_long = len(ids) > SHAREGPT_MAX_PROMPT_LEN or len(ids) + out > SHAREGPT_MAX_TOTAL_LEN
        if too_short or too_long or (max_model_len is not None and len(ids) + out > max_model_len):
            continue
        requests.append(BenchRequest(ids, out, text=prompt))
    if not requests:
        raise ValueError(f"{path}: no conversation has a prompt and a reply of usable lengths")
    if len(requests) < num_requests:
        rng = random.Random(seed + 1)
        requests += [rng.choice(requests) for _ in range(num_requests - len(requests))]
    return requests


def build_workload(
    dataset_name: str,
    dataset_path: str | None,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    seed: int,
    token_id_range: tuple[int, int],
    range_ratio: float,
    max_model_len: int | None,
    tokenizer: Any,
    sharegpt_output_len: int | None,
    endpoint: str,
    prefix_repetition: PrefixRepetition | None = None,
) -> list[BenchRequest]:
    if dataset_name == "sharegpt":
        if dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        return load_sharegpt(dataset_path, num_requests, tokenizer, seed, sharegpt_output_len, max_model_len)
    if dataset_name not in ("random", "prefix_repetition"):
        raise ValueError(
            f"--dataset-name must be random, sharegpt or prefix_repetition, got {dataset_name!r}"
        )
    if dataset_path is not None:
        raise ValueError(
            f"--dataset-path is for --dataset-name sharegpt; the {dataset_name} workload is generated"
        )
    shape = prefix_repetition if dataset_name == "prefix_repetition" else None
    if shape is not None:
        prompt_len, range_ratio_prompt = shape.prefix_len + shape.suffix_len, 0.0
    else:
        range_ratio_prompt = range_ratio
    longest = _spread(prompt_len, range_ratio_prompt)[1] + _spread(output_len, range_ratio)[1]
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(
            f"the longest request ({_spread(prompt_len, range_ratio_prompt)[1]} prompt + "
            f"{_spread(output_len, range_ratio)[1]} output tokens) would exceed the server's "
            f"max_model_len ({max_model_len}); lower --prompt-len or --output-len"
        )
    requests: list[BenchRequest]
    if shape is not None:
        requests = shape.requests(num_requests, output_len, seed, token_id_range, range_ratio)
    else:
        requests = make_requests(num_requests, prompt_len, output_len, seed, token_id_range, range_ratio)
    if endpoint == CHAT_COMPLETIONS:  # a chat message is text: the same ids, decoded
        for r in requests:
            r.text = tokenizer.decode(r.prompt_token_ids)
    return requests


# ------------------------------------------------------------------ command line


def add_workload_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The random workload's flags, shared by ``bench serve`` and ``simulate``: the same
    values give the same requests at the same instants in both (``make_requests``,
    ``arrival_times``). vLLM's ``bench serve`` names are accepted as aliases."""
    group.add_argument(
        "--qps",
        "--request-rate",
        dest="qps",
        type=float,
        nargs="+",
        default=[1.0],
        help="Poisson request rates, run in turn (requests/s; 'inf' sends all at once)",
    )
    group.add_argument(
        "--num-requests",
        "--num-prompts",
        dest="num_requests",
        type=int,
        default=100,
        help="requests sent at each rate",
    )
    group.add_argument(
        "--prompt-len",
        "--random-input-len",
        "--input-len",
        dest="prompt_len",
        type=int,
        default=128,
        help="mean prompt length in tokens (uniform within ±--random-range-ratio)",
    )
    group.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=64,
        help="mean output length in tokens (uniform within ±--random-range-ratio, EOS ignored)",
    )
    group.add_argument(
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=DEFAULT_RANGE_RATIO,
        help="lengths are uniform in [len·(1 − R), len·(1 + R)], 0 <= R < 1 "
        f"(default {DEFAULT_RANGE_RATIO}: ±50 %%; vLLM's default is 0, every length exact)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of lengths, prompt token ids and arrival times"
    )
    group.add_argument(
        "--token-id-range",
        default="10:250",
        help="prompt token ids are drawn from LO:HI (HI excluded; default 10:250)",
    )


def parse_token_id_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or int(lo) >= int(hi):
        raise ValueError(f"--token-id-range must be LO:HI with 0 <= LO < HI, got {text!r}")
    return int(lo), int(hi)


def check_range_ratio(ratio: float) -> float:
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return ratio
