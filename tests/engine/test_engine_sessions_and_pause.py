"""EngineCore's pause states (S13) and streaming-input sessions (S15) on the tiny model.

A session's segments are checked against transformers' greedy decoding of the whole
history so far (every earlier prompt chunk and output, then the new chunk): that holds
only if the session kept its KV and its runner row stayed valid between segments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.sampling_params import SamplingParams

SEGMENT_TOKENS = 5
# The ``greedy_reference`` fixture (tests/engine/conftest.py): transformers' greedy tokens per prompt.
GreedyReference = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[int]]]


def make_core(model_dir: Path, async_scheduling: bool, **engine_args: object) -> EngineCore:
    return EngineCore(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            log_stats_interval=0,
            device="cpu",
            dtype="float32",
            async_scheduling=async_scheduling,
            **engine_args,
        )
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_segment(core: EngineCore, request_id: str) -> list[int]:
    """Steps until the session's segment ends; its tokens."""
    tokens: list[int] = []
    for _ in range(100):
        for out in core.step():
            if out.request_id == request_id:
                assert out.finish_reason is None, (
                    f"the session finished ({out.finish_reason}) instead of waiting"
                )
                tokens += out.new_token_ids
                if out.segment_ended:
                    return tokens
    raise AssertionError("the segment never ended")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s15_session_segments_match_greedy_on_the_whole_history_and_hold_kv_between_chunks(
    tiny_model_dir: Path,
    greedy_reference: GreedyReference,
    random_prompt: Callable[[int, int], list[int]],
    async_scheduling: bool,
) -> None:
    core = make_core(tiny_model_dir, async_scheduling, max_num_seqs=4)
    chunks = [random_prompt(21, seed=1), random_prompt(9, seed=2), random_prompt(17, seed=3)]
    core.add_request(EngineCoreRequest("s", chunks[0], greedy(SEGMENT_TOKENS), streaming=True))
    history: list[int] = []
    for k, chunk in enumerate(chunks):
        if k:
            core.add_stream_input("s", chunk, SEGMENT_TOKENS, is_last=k == len(chunks) - 1)
        history += chunk
        segment = run_segment(core, "s") if k < len(chunks) - 1 else None
        if segment is None:  # the last chunk ends the session
            segment = []
            while core.has_unfinished_requests():
                for out in core.step():
                    segment += out.new_token_ids
                    last = out
            assert last.finish_reason == "length"
        assert segment == greedy_reference([history], [SEGMENT_TOKENS])[0], f"segment {k}"
        history += segment
        if k < len(chunks) - 1:
            # Between chunks: the session holds its KV (and its runner row) and waits for input.
            handle = core.scheduler.handle_of("s")
            info = core.scheduler.request_info(handle)
            assert info["status"] == "waiting_for_streaming_req"
            assert len(info["blocks"]) == -(-len(history) // core.scheduler.config.block_size)
            assert core.scheduler.num_waiting_for_streaming_input == 1
            assert core.runner.batch.row_of_handle[handle] >= 0
            assert not core.has_unfinished_requests(), "a waiting session gives the engine nothing to do"
    assert core.scheduler.num_waiting_for_streaming_input == 0
    core.shutdown()


def test_s15_close_stream_ends_a_waiting_session_and_frees_its_slot(
    tiny_model_dir: Path, random_prompt: Callable[[int, int], list[int]]
) -> None:
    core = make_core(tiny_model_dir, False, max_num_seqs=2)
    core.add_request(EngineCoreRequest("s", random_prompt(10, seed=4), greedy(3), streaming=True))
    run_segment(core, "s")
    free_before = core.scheduler.num_free_blocks
    last = core.close_stream("s")
    assert last is not None and last.finish_reason == "stop" and last.new_token_ids == []
    assert core.close_stream("s") is None
    core.step()  # reports the finish: the runner gives its row up
    assert core.runner.batch.row_of_handle.max() < 0
    assert core.scheduler.num_waiting_for_streaming_input == 0
    assert core.scheduler.num_free_blocks > free_before
    core.shutdown()


def test_s15_stream_input_outside_the_vocabulary_or_empty_is_refused_naming_it(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, False)
    core.add_request(EngineCoreRequest("s", [5, 6, 7], greedy(2), streaming=True))
    run_segment(core, "s")
    with pytest.raises(ValueError, match="token id 999999"):
        core.add_stream_input("s", [999999], 2)
    with pytest.raises(ValueError, match="at least one token"):
        core.add_stream_input("s", [], 2)
    core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_s13_pause_all_stops_every_request_and_resume_goes_on_with_their_kv(
    tiny_model_dir: Path,
    greedy_reference: GreedyReference,
    random_prompt: Callable[[int, int], list[int]],
    async_scheduling: bool,
) -> None:
    core = make_core(tiny_model_dir, async_scheduling)
    prompt = random_prompt(12, seed=5)
    core.add_request(EngineCoreRequest("a", prompt, greedy(8)))
    tokens: list[int] = []
    while len(tokens) < 3:
        tokens += [t for o in core.step() for t in o.new_token_ids]
    core.pause("all")
    tokens += [t for _ in range(3) for o in core.step() for t in o.new_token_ids]  # the step in flight lands
    held = tokens[:]
    assert not core.has_unfinished_requests()
    assert core.step().request_ids == []
    assert len(core.scheduler.request_info(core.scheduler.handle_of("a"))["blocks"]) > 0
    core.resume()
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert len(held) < 8
    assert tokens == greedy_reference([prompt], [8])[0]
    core.shutdown()


def test_s13_pause_new_finishes_running_requests_and_holds_new_ones(
    tiny_model_dir: Path, random_prompt: Callable[[int, int], list[int]]
) -> None:
    core = make_core(tiny_model_dir, False)
    core.add_request(EngineCoreRequest("running", random_prompt(8, seed=6), greedy(4)))
    core.step()
    core.pause("new")
    core.add_request(EngineCoreRequest("queued", random_prompt(8, seed=7), greedy(4)))
    finished = {o.request_id for _ in range(10) for o in core.step() if o.finish_reason}
    assert finished == {"running"}
    assert core.scheduler.request_info(core.scheduler.handle_of("queued"))["status"] == "waiting"
    core.resume()
    finished = {o.request_id for _ in range(10) for o in core.step() if o.finish_reason}
    assert finished == {"queued"}
    with pytest.raises(ValueError, match="pause mode must be one of"):
        core.pause("everything")
    core.shutdown()


def test_s15_s6_session_with_a_request_waiting_behind_it_stays_exact_under_async_scheduling(
    tiny_model_dir: Path, greedy_reference: GreedyReference, random_prompt: Callable[[int, int], list[int]]
) -> None:
    """A request waiting behind the session (its active slot, S6) makes the async engine schedule
    the session one step past its segment's end; that step's token must be dropped, and input
    given before that step is collected must not be taken for it."""
    core = make_core(tiny_model_dir, True, max_num_seqs=2, max_num_active_seqs=1)
    chunks = [random_prompt(7, seed=8), random_prompt(3, seed=9), random_prompt(5, seed=10)]
    core.add_request(EngineCoreRequest("s", chunks[0], greedy(4), streaming=True))
    history = list(chunks[0])
    history += run_segment(core, "s")
    core.add_request(EngineCoreRequest("blocked", random_prompt(3, seed=11), greedy(3)))
    for chunk in chunks[1:]:
        core.add_stream_input("s", chunk, 4)  # at once: the step scheduled ahead is still in flight
        history += chunk
        segment = run_segment(core, "s")
        assert segment == greedy_reference([history], [4])[0]
        history += segment
    assert core.scheduler.request_info(core.scheduler.handle_of("blocked"))["status"] == "waiting"
    core.shutdown()


def test_s13_offline_llm_refuses_to_generate_while_paused_and_resumes(tiny_model_dir: Path) -> None:
    from fastsched import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", log_stats_interval=0)
    llm.pause()
    assert llm.is_paused()
    with pytest.raises(RuntimeError, match="paused_all.*resume"):
        llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
    llm.resume()
    assert not llm.is_paused()
    (out,) = llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    llm.engine.shutdown()


def test_s13_weights_reload_only_while_paused_all_and_only_weights_that_fit(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fastsched.engine.core import NotPausedError

    core = make_core(tiny_model_dir, False)
    for pause in (None, "new"):
        if pause is not None:
            core.pause(pause)
        with pytest.raises(NotPausedError, match="only while paused with mode all"):
            core.reload_weights(str(tiny_model_dir))
    core.pause("all")
    with pytest.raises((ValueError, OSError)):
        core.reload_weights(str(tmp_path))  # no checkpoint there
    core.reload_weights(str(tiny_model_dir))
    core.shutdown()


def test_s13_a_4_bit_engine_reloads_its_packed_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Packed 4-bit layers are not in a state dict: a reload replaces them layer by layer,
    so the next step computes with the new weights (here a checkpoint with one layer zeroed)."""
    from safetensors.torch import load_file, save_file

    from fastsched.models.quant_linear import QuantLinear

    core = make_core(tiny_model_dir, False, quantization="int4")
    layer = core.runner.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear)
    before = layer.weight_packed
    changed = tmp_path / "model"
    changed.mkdir()
    for file in tiny_model_dir.iterdir():
        if file.suffix != ".safetensors":
            (changed / file.name).write_bytes(file.read_bytes())
    for file in tiny_model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        name = "model.layers.0.mlp.down_proj.weight"
        if name in tensors:
            tensors[name] = torch.zeros_like(tensors[name])
        save_file(tensors, changed / file.name)
    core.pause("all")
    core.reload_weights(str(changed))
    after = core.runner.model.layers[0].mlp.down_proj
    assert after is layer and after.weight_packed is not before
    x = torch.randn(2, after.in_features)
    torch.testing.assert_close(after(x), torch.zeros(2, after.out_features))
    core.shutdown()
