"""S7 ``remote_kv`` end to end: the SharedStorageConnector (``--kv-transfer-config``) with
the tiny checkpoint. Prompt KV saved by one engine is loaded by another (a restart, a
second engine) asynchronously: the scheduler skips the loading request while others
run, the tokens are those computed without a store, and a damaged file is a miss.

The store's hardening (issue 22): private files created without following symlinks, a
size cap, token ids compared on load, an identity that covers the weights, timed-out
reads, ``cache_salt`` tenants and ``--prefix-caching-hash-algo sha256``.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fastsched import SamplingParams, _core
from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.kv_connector import SharedStorageConnector
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.tools.tiny_model import make_tiny_model

BLOCK_SIZE = 16
PROMPT_LENGTHS = (70, 37, 16, 5)  # 4, 2, 0 (the last token is computed) and 0 full blocks to load
MAX_TOKENS = 6


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_core(
    model_dir: Path,
    store: Path,
    async_scheduling: bool = False,
    extra: dict | None = None,
    **engine_args: object,
) -> EngineCore:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store), **(extra or {})},
    }
    return EngineCore(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            log_stats_interval=0,
            block_size=BLOCK_SIZE,
            async_scheduling=async_scheduling,
            kv_transfer_config=kv,
            **engine_args,
        )
    )


def generate(core: EngineCore, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Runs the prompts to the end and shuts the engine down (its saves are then on disk)."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), list(prompt), greedy()))
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    core.shutdown()
    return list(tokens.values())


def block_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.kv"))


@pytest.fixture
def prompts(random_prompt: Callable[[int, int], list[int]]) -> list[list[int]]:
    return [random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s7_cold_and_warm_store_give_the_greedy_tokens_of_transformers(
    tiny_model_dir, prompts, greedy_reference, tmp_path, async_scheduling: bool
) -> None:
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    cold = make_core(tiny_model_dir, tmp_path, async_scheduling)
    assert generate(cold, prompts) == expected
    assert cold.kv_transfer.stats["blocks_loaded"] == 0
    # Full blocks of prompts and outputs, each once: 70+6 -> 4, 37+6 -> 2, 16+6 -> 1.
    assert cold.kv_transfer.stats["blocks_saved"] == len(block_files(tmp_path)) == 7
    warm = make_core(tiny_model_dir, tmp_path, async_scheduling)
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 4 + 2  # never the block holding the last prompt token
    assert warm.kv_transfer.stats["hits"] == 3


def test_s7_gemma3_cold_and_warm_store_give_the_greedy_tokens_of_transformers(
    gemma3_model_dir, prompts, gemma3_greedy_reference, tmp_path
) -> None:
    """Loaded blocks serve the tiny Gemma 3's sliding-window layers (16 tokens) and its global one."""
    expected = gemma3_greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    assert generate(make_core(gemma3_model_dir, tmp_path), prompts) == expected
    warm = make_core(gemma3_model_dir, tmp_path)
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 4 + 2


def test_s7_a_4_bit_bf16_engine_saves_and_loads_its_bf16_blocks(tiny_model_dir, prompts, tmp_path) -> None:
    """4-bit weights, bf16 activations and KV: the warm engine loads the blocks the cold one
    saved (bf16 block files) and, from them, generates the cold engine's tokens."""
    weights = dict(quantization="int4", dtype="bfloat16")
    cold = make_core(tiny_model_dir, tmp_path, **weights)
    expected = generate(cold, prompts)
    assert cold.kv_transfer.stats["blocks_saved"] == len(block_files(tmp_path)) == 7
    warm = make_core(tiny_model_dir, tmp_path, **weights)
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 4 + 2


def test_s7_warm_restart_prefills_only_what_the_store_lacks(tiny_model_dir, prompts, tmp_path) -> None:
    cold = make_core(tiny_model_dir, tmp_path)
    generate(cold, prompts)
    warm = make_core(tiny_model_dir, tmp_path)
    generate(warm, prompts)
    loaded_tokens = (4 + 2) * BLOCK_SIZE
    computed = cold.stats.iteration_tokens_sum, warm.stats.iteration_tokens_sum
    assert computed[1] == computed[0] - loaded_tokens
    assert warm.scheduler.stats()["prefix_cache_hits"] == 0, (
        "the tokens came from the store, not the local cache"
    )


def test_s7_two_live_engines_share_a_prefix_through_the_store(
    tiny_model_dir, random_prompt, greedy_reference, tmp_path
) -> None:
    system = random_prompt(48, seed=1)
    first, second = system + random_prompt(9, seed=2), system + random_prompt(12, seed=3)
    a, b = make_core(tiny_model_dir, tmp_path), make_core(tiny_model_dir, tmp_path)
    a_tokens = generate_one(a, first)
    a.kv_transfer.connector.close()  # waits for a's saves; a itself stays up
    assert generate_one(b, second) == greedy_reference([second], [MAX_TOKENS])[0]
    assert a_tokens == greedy_reference([first], [MAX_TOKENS])[0]
    assert b.kv_transfer.stats["blocks_loaded"] == 3  # the shared 48-token system prompt


def generate_one(core: EngineCore, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    core.add_request(EngineCoreRequest("r", prompt, greedy(max_tokens)))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty"])
def test_s7_a_damaged_block_file_is_a_miss_and_is_saved_again(
    tiny_model_dir, prompts, greedy_reference, tmp_path, damage: str
) -> None:
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    generate(make_core(tiny_model_dir, tmp_path), prompts)
    victim = next(p for p in block_files(tmp_path) if p.stat().st_size > 0)
    data = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        victim.write_bytes(b"")
    warm = make_core(tiny_model_dir, tmp_path)
    assert generate(warm, prompts) == expected
    stats = warm.kv_transfer.stats
    assert stats["load_failures"] >= 1
    assert stats["blocks_loaded"] + stats["load_failures"] == 6
    assert victim.read_bytes() == data, "the recomputed block replaces the damaged file"


def test_s7_a_slow_load_is_skipped_as_remote_kv_while_other_requests_run(
    tiny_model_dir, prompts, greedy_reference, tmp_path, monkeypatch
) -> None:
    expected = greedy_reference(prompts[:2], [MAX_TOKENS] * 2)
    generate(make_core(tiny_model_dir, tmp_path), prompts[:1])
    release = threading.Event()
    read_block = SharedStorageConnector._read_block

    def slow_read(self, *args):  # the injected delay: the store answers when released
        release.wait(timeout=60)
        return read_block(self, *args)

    monkeypatch.setattr(SharedStorageConnector, "_read_block", slow_read)
    core = make_core(tiny_model_dir, tmp_path)
    core.add_request(EngineCoreRequest("stored", prompts[0], greedy()))
    core.add_request(EngineCoreRequest("other", prompts[1], greedy()))
    tokens: dict[str, list[int]] = {"stored": [], "other": []}
    while len(tokens["other"]) < MAX_TOKENS:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["stored"] == [], "the loading request waited"
    assert core.scheduler.stats()["skips_total"]["remote_kv"] >= MAX_TOKENS - 1
    release.set()
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    core.shutdown()
    assert [tokens["stored"], tokens["other"]] == expected
    assert core.kv_transfer.stats["blocks_loaded"] == 4


def test_s7_a_request_aborted_while_loading_leaves_its_load_unused(
    tiny_model_dir, prompts, tmp_path, monkeypatch
) -> None:
    generate(make_core(tiny_model_dir, tmp_path), prompts[:1])
    release = threading.Event()
    read_block = SharedStorageConnector._read_block
    monkeypatch.setattr(
        SharedStorageConnector,
        "_read_block",
        lambda self, *args: release.wait(timeout=60) and read_block(self, *args),
    )
    core = make_core(tiny_model_dir, tmp_path)
    core.add_request(EngineCoreRequest("stored", prompts[0], greedy()))
    core.step()
    core.abort_requests(["stored"])
    release.set()
    core.add_request(EngineCoreRequest("next", prompts[1], greedy()))
    while core.has_unfinished_requests():
        core.step()
    core.shutdown()
    assert core.scheduler.num_free_blocks == core.scheduler.config.num_gpu_blocks - 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s7_blocks_filled_by_generated_tokens_are_saved_with_their_kv(
    tiny_model_dir, random_prompt, greedy_reference, tmp_path, async_scheduling: bool
) -> None:
    """The conversation's next turn (prompt + answer + more) loads the block the answer
    completed: its KV is the one the decode steps wrote, whatever step saved it."""
    prompt = random_prompt(43, seed=7)  # 2 full blocks; answer tokens 43..47 fill the third
    first = make_core(tiny_model_dir, tmp_path, async_scheduling)
    answer = generate_one(first, prompt, max_tokens=10)
    first.shutdown()
    assert first.kv_transfer.stats["blocks_saved"] == 3
    follow_up = prompt + answer + random_prompt(5, seed=8)
    second = make_core(tiny_model_dir, tmp_path, async_scheduling)
    assert generate_one(second, follow_up) == greedy_reference([follow_up], [MAX_TOKENS])[0]
    assert second.kv_transfer.stats["blocks_loaded"] == 3


# ---------------------------------------------------------------- hardening (issue 22)


def test_the_store_is_private_to_its_owner(tiny_model_dir, prompts, tmp_path) -> None:
    """Directories 0700 and files 0600, whatever the umask: KV reveals the prompts."""
    old_umask = os.umask(0o022)
    try:
        generate(make_core(tiny_model_dir, tmp_path / "store"), prompts)
    finally:
        os.umask(old_umask)
    files = block_files(tmp_path / "store")
    assert files
    directories = {p.parent for p in files} | {p.parent.parent for p in files}
    assert {stat.S_IMODE(d.stat().st_mode) for d in directories} == {0o700}
    identity = next((tmp_path / "store").glob("*/identity.json"))
    assert {stat.S_IMODE(p.stat().st_mode) for p in [*files, identity]} == {0o600}


def test_a_symlink_planted_in_the_store_is_not_followed(
    tiny_model_dir, prompts, greedy_reference, tmp_path
) -> None:
    """A block path that is a symlink (to a file its owner cannot vouch for) is a miss."""
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    store = tmp_path / "store"
    generate(make_core(tiny_model_dir, store), prompts)
    first = f"{_block_hashes(prompts[0])[0]:016x}"
    victim = next(p for p in block_files(store) if p.stem == first)
    elsewhere = tmp_path / "elsewhere.kv"
    shutil.move(victim, elsewhere)
    victim.symlink_to(elsewhere)
    warm = make_core(tiny_model_dir, store)
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 2, "the first prompt's 4 blocks start with the symlink"


class _Inline:
    """An executor that runs what it is given at once, in the calling thread."""

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        fn(*args)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def test_a_block_file_is_created_exclusively_and_never_through_a_symlink(
    tiny_model_dir, random_prompt, tmp_path, monkeypatch
) -> None:
    """Symlinks planted at the temporary names a writer could use (the process and thread
    ids, or a guessed random part) are never written through (``O_EXCL|O_NOFOLLOW``): the
    save fails and their targets are left alone."""
    import secrets

    target = tmp_path / "target"
    target.write_bytes(b"precious")
    core = make_core(tiny_model_dir, tmp_path / "store")
    connector = core.kv_transfer.connector
    connector._saves = _Inline()  # saves run in this thread, whose id is then known
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: "guessed")
    prompt = random_prompt(40, seed=15)
    for block_hash in _block_hashes(prompt):
        path = connector.path_of(block_hash)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        for name in (f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp", f".{path.name}.guessed.tmp"):
            (path.parent / name).symlink_to(target)
    generate(core, [prompt])
    assert target.read_bytes() == b"precious"
    assert core.kv_transfer.stats["blocks_saved"] == 0


def test_the_store_keeps_under_max_size_by_evicting_the_least_recently_used(
    tiny_model_dir, prompts, greedy_reference, tmp_path
) -> None:
    generate(make_core(tiny_model_dir, tmp_path / "sizing"), prompts[:1])
    file_bytes = block_files(tmp_path / "sizing")[0].stat().st_size
    max_size = 4 * file_bytes
    store = tmp_path / "store"
    core = make_core(tiny_model_dir, store, extra={"max_size": max_size})
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    assert generate(core, prompts) == expected
    assert sum(p.stat().st_size for p in block_files(store)) <= max_size
    stats = core.kv_transfer.stats
    assert stats["blocks_saved"] == 7
    assert stats["blocks_evicted"] >= 3


def test_max_size_takes_a_size_with_a_unit_and_refuses_nonsense(tmp_path) -> None:
    from fastsched.kv_transfer import KVTransferConfig

    def config(**extra: object) -> KVTransferConfig:
        return KVTransferConfig(
            "SharedStorageConnector", "kv_both", {"shared_storage_path": str(tmp_path), **extra}
        )

    assert config().max_size == 64 * 2**30
    assert config(max_size="2GiB").max_size == 2 * 2**30
    for bad in (0, -1, "lots", True, 1.5):
        with pytest.raises(ValueError, match="max_size must be a positive number of bytes"):
            config(max_size=bad)
    with pytest.raises(ValueError, match="load_timeout_s must be a number of seconds"):
        config(load_timeout_s=0)
    with pytest.raises(ValueError, match=r"unknown fields \['max_bytes'\]"):
        config(max_bytes=1)


def _forge(store: Path, source: Path, block_hash: int) -> Path:
    """A copy of block file ``source`` under the name and header hash of ``block_hash``:
    what a writer with access to the store could plant (its checksum still holds)."""
    data = bytearray(source.read_bytes())
    data[24:32] = struct.pack("<Q", block_hash)  # after the magic (8) and the identity key (16)
    name = f"{block_hash:016x}"
    path = source.parent.parent / name[:2] / f"{name}.kv"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(bytes(data))
    return path


def _block_hashes(prompt: list[int], **request: object) -> list[int]:
    scheduler = _core.Scheduler(_core.SchedulerConfig(block_size=BLOCK_SIZE))
    return scheduler.block_hashes(scheduler.add_request("r", prompt, 1, **request)).tolist()


def test_a_block_whose_tokens_are_not_the_requests_is_a_counted_miss(
    tiny_model_dir, random_prompt, greedy_reference, tmp_path
) -> None:
    """The store is named by hash, but a hash proves nothing: the token ids stored with a
    block are compared with the request's, as the in-memory prefix cache does."""
    store = tmp_path / "store"
    stored, other = random_prompt(40, seed=11), random_prompt(40, seed=12)
    generate(make_core(tiny_model_dir, store), [stored])
    source = next(p for p in block_files(store) if p.stem == f"{_block_hashes(stored)[0]:016x}")
    _forge(store, source, _block_hashes(other)[0])
    warm = make_core(tiny_model_dir, store)
    assert generate(warm, [other]) == greedy_reference([other], [MAX_TOKENS])
    assert warm.kv_transfer.stats["blocks_loaded"] == 0
    assert warm.kv_transfer.stats["token_mismatches"] == 1


def test_a_load_past_a_local_prefix_hit_checks_each_blocks_parent(
    tiny_model_dir, prompts, greedy_reference, tmp_path
) -> None:
    """Blocks loaded after a local hit are checked against the hash of the block before
    them too (the first block of a prompt has no parent to compare)."""
    generate(make_core(tiny_model_dir, tmp_path), prompts[:1])
    core = make_core(tiny_model_dir, tmp_path)
    head = prompts[0][: 2 * BLOCK_SIZE + 1]
    assert generate_one(core, head) == greedy_reference([head], [MAX_TOKENS])[0]
    assert generate_one(core, prompts[0]) == greedy_reference(prompts[:1], [MAX_TOKENS])[0]
    core.shutdown()
    stats = core.kv_transfer.stats
    assert stats["blocks_loaded"] == 4 and stats["token_mismatches"] == 0 and stats["load_failures"] == 0
    assert core.scheduler.stats()["prefix_cache_hits"] > 0, "the second request's first blocks were local"


def test_weights_replaced_in_place_do_not_read_the_old_weights_blocks(random_prompt, tmp_path) -> None:
    """The store's identity covers a fingerprint of the weights, not only their path."""
    model = make_tiny_model(tmp_path / "model", seed=0)
    store = tmp_path / "store"
    prompt = random_prompt(40, seed=13)
    old = make_core(model, store)
    generate(old, [prompt])
    make_tiny_model(model, seed=1)  # retrained, written over the old checkpoint
    new = make_core(model, store)
    tokens = generate(new, [prompt])
    assert new.kv_transfer.connector.identity.key != old.kv_transfer.connector.identity.key
    assert new.kv_transfer.stats["blocks_loaded"] == 0
    plain = EngineCore(
        EngineConfig.from_kwargs(model=str(model), log_stats_interval=0, block_size=BLOCK_SIZE)
    )
    assert tokens == generate(plain, [prompt])
    copy = make_core(shutil.copytree(model, tmp_path / "copy"), store)
    generate(copy, [prompt])
    assert copy.kv_transfer.stats["blocks_loaded"] == 2, (
        "a copy of the same weights elsewhere shares the blocks"
    )


def test_a_load_that_takes_too_long_is_given_up_and_computed(
    tiny_model_dir, prompts, greedy_reference, tmp_path, monkeypatch
) -> None:
    expected = greedy_reference(prompts[:1], [MAX_TOKENS])
    store = tmp_path / "store"
    generate(make_core(tiny_model_dir, store), prompts[:1])
    release = threading.Event()
    read_block = SharedStorageConnector._read_block

    def hung_read(self, *args):  # a network filesystem that stopped answering
        release.wait(timeout=20)
        return read_block(self, *args)

    monkeypatch.setattr(SharedStorageConnector, "_read_block", hung_read)
    core = make_core(tiny_model_dir, store, extra={"load_timeout_s": 0.2})
    try:
        assert generate(core, prompts[:1]) == expected
    finally:
        release.set()
    assert core.kv_transfer.stats["load_timeouts"] == 1
    assert core.kv_transfer.stats["blocks_loaded"] == 0


def test_a_lookup_that_takes_too_long_is_a_miss(
    tiny_model_dir, prompts, greedy_reference, tmp_path, monkeypatch
) -> None:
    expected = greedy_reference(prompts[:1], [MAX_TOKENS])
    store = tmp_path / "store"
    generate(make_core(tiny_model_dir, store), prompts[:1])
    release = threading.Event()
    count_present = SharedStorageConnector._count_present

    def hung_lookup(self, hashes):
        release.wait(timeout=20)
        return count_present(self, hashes)

    monkeypatch.setattr(SharedStorageConnector, "_count_present", hung_lookup)
    core = make_core(tiny_model_dir, store, extra={"lookup_timeout_s": 0.1})
    try:
        assert generate(core, prompts[:1]) == expected
    finally:
        release.set()
    assert core.kv_transfer.stats["lookup_timeouts"] == 1
    assert core.kv_transfer.stats["hits"] == 0


def test_saves_a_slow_store_cannot_take_are_dropped_not_queued(
    tiny_model_dir, prompts, greedy_reference, tmp_path, monkeypatch
) -> None:
    """Each waiting save holds its blocks' KV in memory: past MAX_PENDING_SAVES they are dropped."""
    from fastsched.engine.kv_connector import shared_storage

    monkeypatch.setattr(shared_storage, "MAX_PENDING_SAVES", 0)
    core = make_core(tiny_model_dir, tmp_path / "store")
    assert generate(core, prompts) == greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    assert core.kv_transfer.stats["blocks_saved"] == 0 and core.kv_transfer.stats["saves_dropped"] >= 1
    assert block_files(tmp_path / "store") == []


def test_s8_cache_salt_separates_tenants_in_the_prefix_cache_and_the_store(
    tiny_model_dir, random_prompt, greedy_reference, tmp_path
) -> None:
    prompt = random_prompt(40, seed=14)
    expected = greedy_reference([prompt], [MAX_TOKENS])
    store = tmp_path / "store"

    def run(core: EngineCore, request_id: str, salt: str | None) -> int:
        """The request's tokens are the reference's; returns its locally cached tokens."""
        core.add_request(EngineCoreRequest(request_id, prompt, greedy(), cache_salt=salt))
        tokens, cached = [], None
        while core.has_unfinished_requests():
            for out in core.step():
                tokens += out.new_token_ids
                cached = out.num_cached_tokens if out.num_cached_tokens is not None else cached
        assert [tokens] == expected
        return cached or 0

    core = make_core(tiny_model_dir, store)
    assert run(core, "a1", "tenant-a") == 0
    assert run(core, "a2", "tenant-a") == 2 * BLOCK_SIZE, "the same tenant shares its prefix"
    assert run(core, "b1", "tenant-b") == 0, "another tenant does not"
    assert run(core, "none", None) == 0, "nor does a request without a salt"
    core.shutdown()
    warm = make_core(tiny_model_dir, store)
    assert run(warm, "c1", "tenant-c") == 0
    assert warm.kv_transfer.stats["blocks_loaded"] == 0, (
        "the store does not hand tenant-a's blocks to tenant-c"
    )
    assert run(warm, "a3", "tenant-a") == 2 * BLOCK_SIZE
    assert warm.kv_transfer.stats["blocks_loaded"] == 2, "but does to tenant-a"


def test_sha256_block_hashes_are_sha256_and_keep_a_store_of_their_own(
    tiny_model_dir, prompts, greedy_reference, tmp_path
) -> None:
    import hashlib

    prompt = prompts[0]
    scheduler = _core.Scheduler(
        _core.SchedulerConfig(block_size=BLOCK_SIZE, prefix_caching_hash_algo="sha256")
    )
    hashes = scheduler.block_hashes(scheduler.add_request("r", prompt, 1)).tolist()
    second = hashlib.sha256(
        struct.pack(f"<QQ{BLOCK_SIZE}I", hashes[0], BLOCK_SIZE, *prompt[BLOCK_SIZE : 2 * BLOCK_SIZE])
    ).digest()
    assert hashes[1] == int.from_bytes(second[:8], "little")
    assert hashes != _block_hashes(prompt)
    expected = greedy_reference(prompts, [MAX_TOKENS] * len(prompts))
    store = tmp_path / "store"
    generate(make_core(tiny_model_dir, store), prompts)
    cold = make_core(tiny_model_dir, store, prefix_caching_hash_algo="sha256")
    assert generate(cold, prompts) == expected
    assert cold.kv_transfer.stats["blocks_loaded"] == 0, "builtin hashes name other blocks: another store"
    warm = make_core(tiny_model_dir, store, prefix_caching_hash_algo="sha256")
    assert generate(warm, prompts) == expected
    assert warm.kv_transfer.stats["blocks_loaded"] == 6
