"""A6 SharedAdmissionStats (docs/design.md §6) across real processes.

Frontends are separate processes started with the ``spawn`` context, as the
server's frontends are, so the counters are really shared through the segment
file and not through inherited memory. Every test uses a fresh segment name
(pid + uuid) and removes whatever file it leaves.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import sys
import uuid
from collections.abc import Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from fastsched._core import SharedAdmissionStats

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="A6 segments live in /dev/shm and use /proc"
)

SHM = Path("/dev/shm")
TIMEOUT_S = 60
CRASHED = 17  # exit code of a creator that got as far as crashing on purpose


@pytest.fixture
def name() -> Iterator[str]:
    name = f"fastsched-test-{os.getpid()}-{uuid.uuid4().hex}"
    yield name
    (SHM / name).unlink(missing_ok=True)


def _frontend(name: str, slot: int, delta: int, ready: Queue[tuple[int, int]], done: Event) -> None:
    """One frontend process: attach to its slot, count, and stay alive until
    the parent has read the total."""
    stats = SharedAdmissionStats.open(name, slot)
    stats.add(delta)
    ready.put((slot, stats.own()))
    done.wait(TIMEOUT_S)


def _crashing_creator(name: str) -> None:
    """A launcher that creates the segment, counts, and dies without cleanup."""
    creator = SharedAdmissionStats.create(name, 2)  # kept alive: dropping it would unlink
    SharedAdmissionStats.open(name, 0).add(5)
    assert creator.total() == 5
    os._exit(CRASHED)  # no destructors: the segment file stays behind


def test_a6_total_sums_the_slots_of_two_frontend_processes(name: str) -> None:
    ctx = mp.get_context("spawn")
    creator = SharedAdmissionStats.create(name, 3)
    ready, done = ctx.Queue(), ctx.Event()
    frontends = [
        ctx.Process(target=_frontend, args=(name, slot, delta, ready, done))
        for slot, delta in [(0, 7), (2, 11)]
    ]
    for p in frontends:
        p.start()
    try:
        owns = dict(ready.get(timeout=TIMEOUT_S) for _ in frontends)
        assert owns == {0: 7, 2: 11}
        assert creator.total() == 18
        assert SharedAdmissionStats.open(name, 1).total() == 18
    finally:
        done.set()
        for p in frontends:
            p.join(TIMEOUT_S)
    assert [p.exitcode for p in frontends] == [0, 0]
    creator.unlink()


def test_a6_stale_segment_of_a_crashed_creator_is_cleaned_on_next_create(name: str) -> None:
    ctx = mp.get_context("spawn")
    crashed = ctx.Process(target=_crashing_creator, args=(name,))
    crashed.start()
    crashed.join(TIMEOUT_S)
    assert crashed.exitcode == CRASHED
    assert (SHM / name).exists(), "the crashed launcher left its segment"
    assert SharedAdmissionStats.open(name, 1).total() == 5

    creator = SharedAdmissionStats.create(name, 4)

    assert creator.num_slots == 4
    assert creator.total() == 0
    creator.unlink()


def test_a6_create_while_the_creator_is_alive_raises_naming_its_pid(name: str) -> None:
    creator = SharedAdmissionStats.create(name, 1)
    with pytest.raises(OSError, match=rf"live process {os.getpid()}\b"):
        SharedAdmissionStats.create(name, 1)
    assert (SHM / name).exists()
    creator.unlink()


def test_a6_segment_is_mode_0600(name: str) -> None:
    creator = SharedAdmissionStats.create(name, 2)
    assert creator.path == str(SHM / name)
    assert stat.S_IMODE(os.stat(creator.path).st_mode) == 0o600
    creator.unlink()


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../etc/passwd", "has space", "ü", "x" * 256])
def test_a6_bad_segment_names_are_rejected_naming_the_value(bad: str) -> None:
    with pytest.raises(ValueError, match="segment name"):
        SharedAdmissionStats.create(bad, 1)
    with pytest.raises(ValueError, match="segment name"):
        SharedAdmissionStats.open(bad, 0)


def test_a6_bad_slot_and_creator_writes_are_rejected(name: str) -> None:
    creator = SharedAdmissionStats.create(name, 2)
    with pytest.raises(ValueError, match="slot 2 is out of range"):
        SharedAdmissionStats.open(name, 2)
    with pytest.raises(ValueError, match="slot"):
        SharedAdmissionStats.open(name, -1)
    with pytest.raises(ValueError, match="num_slots"):
        SharedAdmissionStats.create(name + "-zero", 0)
    with pytest.raises(OSError, match="no slot"):
        creator.add(1)
    with pytest.raises(OSError):
        SharedAdmissionStats.open(name + "-missing", 0)
    assert creator.slot is None
    assert creator.name == name
    creator.unlink()


def test_a6_frontend_handle_counts_its_own_slot(name: str) -> None:
    creator = SharedAdmissionStats.create(name, 2)
    frontend = SharedAdmissionStats.open(name, 1)
    frontend.add(3)
    frontend.add(-1)
    assert (frontend.own(), frontend.total(), frontend.slot, frontend.num_slots) == (2, 2, 1, 2)
    frontend.set(9)
    assert creator.total() == 9
    creator.unlink()


def test_a6_unlink_leaves_no_file_and_is_idempotent(name: str) -> None:
    creator = SharedAdmissionStats.create(name, 1)
    frontend = SharedAdmissionStats.open(name, 0)
    creator.unlink()
    creator.unlink()
    assert not (SHM / name).exists()
    frontend.add(1)  # mappings outlive the name
    assert creator.total() == 1


def test_a6_dropping_the_creator_handle_unlinks(name: str) -> None:
    creator = SharedAdmissionStats.create(name, 1)
    del creator
    assert not (SHM / name).exists()
