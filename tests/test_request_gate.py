"""The request gate (issue 21 item 1, ``fastsched.request_gate``) and the request-validation
bits of issue 22: one check per field, every size bounded before work proportional to it,
and what the gate lets through is what reaches the engine."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from fastsched.frontend.request_log import RequestLogger
from fastsched.inputs import ContextLengthError, TokenizedText
from fastsched.limits import LimitError, RequestLimits
from fastsched.request_gate import RequestGate, ValidRequest
from fastsched.sampling_params import SamplingParams

VOCAB = 1000


class _Tokenizer:
    """One token per character (BOS 1 first unless told not to); records the threads it runs on."""

    max_token_chars = 2

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        return ([1] if add_special_tokens else []) + [ord(c) % VOCAB for c in text]


def _gate(max_model_len: int = 64, **limits: float) -> RequestGate:
    return RequestGate(_Tokenizer(), max_model_len, VOCAB, RequestLimits(**limits))


def test_a_request_comes_out_tokenized_once_and_checked() -> None:
    gate = _gate()
    valid = gate.request("r1", "hi", SamplingParams(max_tokens=4), priority=3)
    assert valid == ValidRequest("r1", "hi", [1, ord("h"), ord("i")], valid.params, 3)
    assert gate.request("r2", [5, 6], SamplingParams(max_tokens=4)).prompt_token_ids == [5, 6]


@pytest.mark.parametrize(
    "prompt, params, error, words",
    [
        ([], SamplingParams(), ValueError, "at least one token"),
        ([1, VOCAB], SamplingParams(), ValueError, f"token id {VOCAB} is out of range"),
        ([1] * 60, SamplingParams(max_tokens=5), ContextLengthError, "max_model_len (64)"),
        (
            "x" * 129,
            SamplingParams(),
            LimitError,
            "129 characters",
        ),  # 64 tokens x 2 characters: refused untokenized
        ("hi", SamplingParams(n=200), LimitError, "--max-n"),
        ("hi", SamplingParams(stop_token_ids=list(range(129))), LimitError, "--max-stop-token-ids"),
        ("hi", SamplingParams(stop=["a"] * 33), LimitError, "--max-stop-sequences"),
    ],
)
def test_the_gate_refuses_naming_the_field(prompt, params, error, words) -> None:
    gate = _gate()
    with pytest.raises(error, match=None) as info:
        gate.request("r", prompt, params)
    assert words in str(info.value)
    assert not gate.tokenizer.threads or isinstance(prompt, str) and len(prompt) <= 128


@pytest.mark.parametrize("request_id", ["a\nb", "a b", "é", "x" * 300])
def test_request_ids_are_bounded_printable_ascii(request_id: str) -> None:
    """Issue 22: ids are logged and echoed; a newline would forge a log line."""
    with pytest.raises(LimitError) as info:
        _gate().request(request_id, "hi", SamplingParams())
    assert info.value.field == "request_id"


def test_an_output_constraint_is_bounded_then_compiled_off_the_event_loop() -> None:
    built: list[threading.Thread] = []

    def build() -> SamplingParams:
        built.append(threading.current_thread())
        return SamplingParams(structured_outputs={"choice": ["a", "b"]})

    async def run() -> tuple[ValidRequest, threading.Thread]:
        return await gate.request_async(
            "r", "x" * 5000, build, ("choice", ["a", "b"])
        ), threading.current_thread()

    gate = _gate(max_model_len=6000, max_structured_outputs_chars=100, max_structured_outputs_choices=3)
    valid, loop_thread = asyncio.run(run())
    assert valid.params.structured_outputs is not None and built and built[0] is not loop_thread
    assert (
        gate.tokenizer.threads and loop_thread not in gate.tokenizer.threads
    )  # 5000 characters: off the loop
    for constraint, flag in (
        (("choice", ["a"] * 4), "--max-structured-outputs-choices"),
        (("regex", "a" * 101), "--max-structured-outputs-chars"),
    ):
        built.clear()
        with pytest.raises(LimitError, match=flag):
            asyncio.run(gate.request_async("r", "hi", build, constraint))
        assert not built


def test_work_past_the_prepare_timeout_is_refused() -> None:
    gate = _gate(prepare_timeout=0.05)
    release = threading.Event()

    def slow() -> SamplingParams:
        release.wait(5)
        return SamplingParams()

    with pytest.raises(LimitError, match="--prepare-timeout"):
        asyncio.run(gate.request_async("r", "hi", slow, ("regex", "a")))
    release.set()
    gate.shutdown()


def test_a_session_chunk_text_is_tokenized_without_bos_and_off_the_loop_when_long() -> None:
    gate = _gate(max_model_len=20_000)

    async def run() -> tuple[object, threading.Thread]:
        return await gate.prepare("y" * 5000, held=10), threading.current_thread()

    prepared, loop_thread = asyncio.run(run())
    assert isinstance(prepared, TokenizedText) and prepared.token_ids[0] == ord("y")
    assert loop_thread not in gate.tokenizer.threads
    assert gate.chunk("s", prepared, 1, False, held=10, num_chunks=1).token_ids == prepared.token_ids


def test_max_log_len_cuts_everything_a_request_sent(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 22: --max-log-len cut the prompt but not the parameters (stop strings, a schema)."""
    params = SamplingParams(stop=["s" * 200], stop_token_ids=list(range(100)))
    with caplog.at_level(logging.INFO, logger="fastsched.requests"):
        RequestLogger(10).received("r", "p" * 100, list(range(100)), params, 0)
    line = caplog.records[-1].getMessage()
    assert "s" * 11 not in line and "p" * 11 not in line and ", 10," not in line, line


def test_cached_tokens_are_reported_only_with_enable_prompt_tokens_details() -> None:
    """vLLM's --enable-prompt-tokens-details: without it, usage has no prompt_tokens_details."""
    from fastsched.gateway.openai_protocol import ParsedRequest, ResponseFormatter
    from fastsched.proto_gen import import_stubs

    pb, _ = import_stubs()
    req = ParsedRequest("completion", ["hi"], pb.SamplingParams(), 0, False, False)
    for enabled in (False, True):
        formatter = ResponseFormatter(req, "m", None, enabled)
        formatter.consume(
            0, pb.GenerateResponse(usage=pb.Usage(prompt_tokens=40, completion_tokens=1, cached_tokens=32))
        )
        usage = formatter.usage()
        assert ("prompt_tokens_details" in usage) is enabled, usage
        assert not enabled or usage["prompt_tokens_details"] == {"cached_tokens": 32}


@pytest.mark.parametrize(
    "content_type, refused",
    [
        ("text/plain", True),
        ("application/x-www-form-urlencoded", True),
        ("multipart/form-data; boundary=x", True),
        ("application/json", False),
        ("application/json; charset=utf-8", False),
        ("application/merge-patch+json", False),
        (None, False),
    ],
)
def test_json_routes_refuse_a_body_declared_as_something_else(
    content_type: str | None, refused: bool
) -> None:
    """Issue 22: a JSON body sent as text/plain (which any web page may send without asking)
    was parsed: a page could drive a keyless local server. It is 415 now."""
    from fastsched.gateway.openai_protocol import ApiError, check_json_content_type

    if refused:
        with pytest.raises(ApiError) as info:
            check_json_content_type(content_type)
        assert info.value.status == 415
    else:
        check_json_content_type(content_type)


@pytest.mark.parametrize(
    "params, words",
    [
        (SamplingParams(max_tokens=1), "max_tokens 0, got n=1, max_tokens=1"),
        (SamplingParams(max_tokens=0, n=2), "got n=2"),
        (SamplingParams(max_tokens=0, logprobs=2), "logprobs"),
        (SamplingParams(max_tokens=0, prompt_logprobs=3), "prompt_logprobs, got 3"),
    ],
)
def test_s20_a_pooling_request_is_prefill_only_and_reports_nothing_else(params, words) -> None:
    gate = _gate()
    valid = asyncio.run(gate.request_async("e", [5, 6], lambda: SamplingParams(max_tokens=0), pooling=True))
    assert valid.pooling and valid.params.max_tokens == 0
    with pytest.raises(ValueError) as info:
        asyncio.run(gate.request_async("e", [5, 6], lambda: params, pooling=True))
    assert words in str(info.value)
