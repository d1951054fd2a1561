"""Prompt logprobs through the whole serving path (gateway → gRPC frontend → engine process,
the tiny model in fp32), against ``fastsched.LLM``'s offline prompt logprobs of the same
checkpoint: the legacy completions form (``echo`` + ``logprobs``, ``max_tokens: 0``) parsed
by the official ``openai`` client, vLLM's ``prompt_logprobs`` field, the 400s, and a real
evaluation harness, lm-evaluation-harness's ``local-completions`` model, scoring
loglikelihood requests built here (its task datasets would need a hub).

Tolerance 1e-5: the served engine and the offline one run the same fp32 kernels on the same
rows; only the batch around a row may differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")

from engine_stack import ipc_dir, launch, teardown  # noqa: E402
from loop_thread import LoopThread, free_port  # noqa: E402

from fastsched import LLM, SamplingParams  # noqa: E402
from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402

MODEL = "tiny"
TOLERANCE = 1e-5
PROMPT = list(range(40, 75))  # 35 ordinary token ids


@pytest.fixture(scope="module")
def url(engine_config: dict, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    engines = launch(engine_config, ipc_dir(tmp_path_factory, "ipc"), num_engines=1, num_frontends=1)
    loop = LoopThread()
    llm = loop.call(
        AsyncLLM.start(
            engines.input_addrs,
            engines.output_addrs[0],
            frontend_index=0,
            settings=FrontendSettings(ready_timeout=60),
        )
    )
    port = free_port()
    server = loop.call(serve_frontend(llm, "127.0.0.1", port))
    try:
        tokenizer = load_tokenizer(str(tiny_model_dir))
        yield loop.start_gateway(create_app([f"127.0.0.1:{port}"], MODEL, tokenizer))
    finally:
        loop.stop_stack([server], [llm])
        teardown(engines)


@pytest.fixture(scope="module")
def offline(engine_config: dict):
    """``offline(prompt, k)``: fastsched.LLM's prompt logprobs (top ``k``) of ``prompt``."""
    llm = LLM(
        **{k: v for k, v in engine_config.items() if k != "kv_cache_memory"},
        num_gpu_blocks=64,
        max_model_len=256,
        max_num_seqs=4,
    )

    def run(prompt: list[int], k: int = 1):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=k), use_tqdm=False)
        return out.prompt_logprobs

    return run


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_echo_logprobs_max_tokens_0_returns_the_prompts_logprobs(client, offline, tiny_model_dir) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    (choice,) = response.choices
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert choice.finish_reason == "length"
    assert choice.text == tokenizer.decode(PROMPT)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = offline(PROMPT)
    for i in range(1, len(PROMPT)):
        assert abs(lp.token_logprobs[i] - expected[i][PROMPT[i]].logprob) < TOLERANCE, i
        assert len(lp.top_logprobs[i]) in (1, 2)  # the top token, and the prompt token when it is another
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(PROMPT))]
    assert response.usage.completion_tokens == 0


def test_echo_logprobs_with_output_put_the_prompt_first(client, offline) -> None:
    response = client.completions.create(
        model=MODEL, prompt=[PROMPT, PROMPT[:10]], echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    for choice, prompt in zip(response.choices, [PROMPT, PROMPT[:10]]):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 3
        assert lp.token_logprobs[0] is None
        expected = offline(prompt, 2)
        assert all(
            abs(lp.token_logprobs[i] - expected[i][prompt[i]].logprob) < TOLERANCE
            for i in range(1, len(prompt))
        )
        assert all(v is not None for v in lp.token_logprobs[len(prompt) :])
        assert lp.text_offset == sorted(lp.text_offset)


def test_vllms_prompt_logprobs_field_on_both_endpoints(url, offline) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    expected = offline(PROMPT, 3)
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert {int(t) for t in got[i]} == set(expected[i])
        for t, entry in got[i].items():
            assert abs(entry["logprob"] - expected[i][int(t)].logprob) < TOLERANCE
            assert entry["rank"] == expected[i][int(t)].rank
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
        timeout=60,
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_streamed_echo_logprobs_start_with_the_prompt(client) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=2, temperature=0, stream=True
        )
    )
    first = next(c for c in chunks if c.choices)
    assert first.choices[0].logprobs.token_logprobs[0] is None
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert len(tokens) == len(PROMPT) + 2


@pytest.mark.parametrize(
    "path, body, message",
    [
        (
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 0},
            "max_tokens must be at least 1 (0 only with echo)",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens must be at least 1",
        ),
        (
            "/v1/completions",
            {"prompt": PROMPT, "echo": True, "logprobs": 21, "max_tokens": 0},
            "logprobs must be in",
        ),
        (
            "/v1/completions",
            {"prompt": PROMPT, "prompt_logprobs": 21},
            "prompt_logprobs must be in [0, 20], got 21",
        ),
    ],
)
def test_out_of_bounds_requests_are_400_naming_the_field(url, path: str, body: dict, message: str) -> None:
    response = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_lm_evaluation_harness_local_completions_loglikelihood(url, offline, tiny_model_dir) -> None:
    pytest.importorskip("lm_eval", reason="lm_eval is not installed (requirements-nodeps.txt)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=url + "/v1/completions",
        model=MODEL,
        tokenizer=str(tiny_model_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        max_retries=1,
    )
    pairs = [
        ("def hello(world):", " return world"),
        ("The quick brown fox", " jumps over"),
        ("1, 2, 3,", " 4"),
    ]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    results = lm.loglikelihood(requests)
    assert len(results) == len(pairs)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results):
        # lm_eval's split: the whole text tokenized, the context's tokens first.
        ctx = tokenizer.encode(context, add_special_tokens=False)
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        assert whole[: len(ctx)] == ctx
        scores = offline(whole)
        expected = [scores[i][whole[i]] for i in range(len(ctx), len(whole))]
        assert math.isclose(logprob, sum(e.logprob for e in expected), abs_tol=1e-4)
        assert is_greedy == all(e.rank == 1 for e in expected)
