"""``fastsched serve --speculative-config`` as a user runs it: the tiny model drafting for
itself behind the OpenAI API. Greedy completions, streamed or not, with a stop string or a
``max_tokens`` inside an accepted run, equal the offline engine's without drafts, and
``/metrics`` carries vLLM's ``spec_decode_*`` counters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from serve_process import ServeProcess, metric_samples, start_serve  # noqa: E402

from fastsched.sampling_params import SamplingParams  # noqa: E402

MODEL = "model"  # the tiny checkpoint's directory name: the served model name
K = 3
PROMPT = "def main():"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    spec = json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": K})
    server = start_serve(
        tiny_model_dir, tmp_path_factory.mktemp("serve-spec") / "serve.log", "--speculative-config", spec
    )
    try:
        yield server
    finally:
        server.close()


def client(server: ServeProcess) -> Any:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


def test_served_completions_with_drafts_equal_the_offline_engine_without(
    server: ServeProcess, oracle: Any
) -> None:
    c = client(server)
    base = oracle.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False
    )[0]
    for max_tokens in (14, 6):  # 1 + 4 + 4 + ...: 6 ends inside an accepted run
        want = base.outputs[0].token_ids[:max_tokens]
        out = c.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == max_tokens and out.choices[0].finish_reason == "length"
        chunks = list(
            c.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == out.choices[0].text
        assert out.choices[0].text == oracle.tokenizer.decode(want)


def test_served_stop_string_inside_an_accepted_run_ends_the_text_there(
    server: ServeProcess, oracle: Any
) -> None:
    c = client(server)
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.0)
    full = c.completions.create(**params).choices[0].text
    stop = full[6:9]
    want = oracle.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=stop), use_tqdm=False)[0]
    out = c.completions.create(**params, stop=stop)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want.outputs[0].text, "stop")
    assert out.usage.completion_tokens == len(want.outputs[0].token_ids)
    chunks = list(c.completions.create(**params, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.outputs[0].text


def test_served_metrics_count_drafts_and_accepted_tokens_by_position(server: ServeProcess) -> None:
    client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0.0, extra_body={"ignore_eos": True}
    )
    samples = metric_samples(server.url)
    drafts = samples["fastsched:spec_decode_num_drafts_total"]
    assert drafts > 0
    # The target drafting for itself: every greedy draft is accepted, at every position.
    assert (
        samples["fastsched:spec_decode_num_accepted_tokens_total"]
        == samples["fastsched:spec_decode_num_draft_tokens_total"]
        == K * drafts
    )
    for position in range(K):
        assert (
            samples[f'fastsched:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}}']
            == drafts
        )
    assert "speculative decoding: draft_model, 3 tokens per step; async scheduling is off" in server.log()
