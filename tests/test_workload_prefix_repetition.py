"""``bench serve --dataset-name prefix_repetition`` (vLLM's): tenants' shared prefixes and short turns."""

from __future__ import annotations

import pytest

from fastsched.tools.workload import COMPLETIONS, PrefixRepetition, build_workload


def workload(shape: PrefixRepetition, n: int = 40, seed: int = 0, max_model_len: int | None = None) -> list:
    return build_workload(
        "prefix_repetition",
        None,
        n,
        0,
        4,
        seed,
        (10, 250),
        0.0,
        max_model_len,
        None,
        None,
        COMPLETIONS,
        shape,
    )


def test_every_prompt_is_one_of_the_prefixes_plus_its_own_suffix() -> None:
    shape = PrefixRepetition(prefix_len=16, suffix_len=3, num_prefixes=4)
    requests = workload(shape)
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in requests}
    assert len(prefixes) == 4
    assert all(len(r.prompt_token_ids) == 19 and r.max_tokens == 4 for r in requests)
    assert len({tuple(r.prompt_token_ids[16:]) for r in requests}) > 30  # suffixes are the requests' own


def test_the_same_seed_gives_the_same_requests_and_another_seed_other_prefixes() -> None:
    shape = PrefixRepetition(prefix_len=8, suffix_len=2, num_prefixes=2)
    assert [r.prompt_token_ids for r in workload(shape)] == [r.prompt_token_ids for r in workload(shape)]
    assert {tuple(r.prompt_token_ids[:8]) for r in workload(shape, seed=1)} != {
        tuple(r.prompt_token_ids[:8]) for r in workload(shape)
    }


def test_a_bad_shape_names_its_flag() -> None:
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes must be at least 1, got 0"):
        PrefixRepetition(num_prefixes=0)


def test_a_prompt_longer_than_the_server_takes_is_refused() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        workload(PrefixRepetition(prefix_len=512, suffix_len=32), max_model_len=512)
