"""The whole serving path on real processes (docs/design.md §1, §9): the official ``openai``
client → gateway → two gRPC frontends (real AsyncLLMs) → two engine processes on the
tiny model. Greedy output must equal the offline ``fastsched.LLM``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")

from loop_thread import LoopThread, free_port, wait_for  # noqa: E402
from promtool import lint_problems  # noqa: E402

from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402
from fastsched.sampling_params import SamplingParams  # noqa: E402
from fastsched.tools.metrics_snapshot import parse_metrics  # noqa: E402

if TYPE_CHECKING:
    from engine_stack import Engines

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MODEL = "tiny"


@dataclass
class Stack:
    loop: LoopThread
    llms: list[AsyncLLM]
    url: str
    tokenizer: Any


@pytest.fixture(scope="module")
def stack(engines: Engines, tiny_model_dir: Any) -> Iterator[Stack]:
    loop = LoopThread()
    llms = [
        loop.call(
            AsyncLLM.start(
                engines.input_addrs,
                engines.output_addrs[i],
                frontend_index=i,
                settings=FrontendSettings(ready_timeout=60),
            )
        )
        for i in range(2)
    ]
    addrs = [f"127.0.0.1:{free_port()}" for _ in llms]
    servers = [
        loop.call(serve_frontend(llm, "127.0.0.1", int(a.rsplit(":", 1)[1]))) for llm, a in zip(llms, addrs)
    ]
    tokenizer = load_tokenizer(str(tiny_model_dir))
    url = loop.start_gateway(create_app(addrs, MODEL, tokenizer))
    try:
        yield Stack(loop, llms, url, tokenizer)
    finally:
        loop.stop_stack(servers, llms)


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def engines_idle(stack: Stack) -> bool:
    stats = [llm.stats() for llm in stack.llms]
    return all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0 for s in stats)


def test_e2e_completion_equals_offline_llm(client: openai.OpenAI, oracle: Any) -> None:
    prompt = "def main():\n    return"
    want = oracle.generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    for _ in range(2):  # both frontends (round-robin)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert out.choices[0].text == want.outputs[0].text
        assert out.usage.prompt_tokens == len(want.prompt_token_ids) and out.usage.completion_tokens == 12


def test_e2e_chat_stream_equals_offline_llm_on_the_templated_prompt(
    client: openai.OpenAI, stack: Stack, oracle: Any
) -> None:
    messages = [{"role": "user", "content": "Write a queue class."}]
    prompt_ids = stack.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = oracle.generate(
        prompt_ids, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2), use_tqdm=False
    )[0]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: want.outputs[0].text, 1: want.outputs[1].text}
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_e2e_errors_prompt_over_max_model_len_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert "1000000" in str(info.value)


def test_e2e_errors_disconnect_mid_stream_frees_the_engines(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        body = {
            "prompt": "class Queue:",
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    assert wait_for(lambda: engines_idle(stack), timeout=10), [llm.stats() for llm in stack.llms]


def test_e2e_metrics_metrics_count_each_engine_once(stack: Stack, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="import os", max_tokens=5, **GREEDY)

    def engine_total() -> int:  # what the engines counted, as the freshest frontend heard it
        return max(llm.stats()["generation_tokens_total"] for llm in stack.llms)

    assert wait_for(
        lambda: scrape(stack).value("fastsched:generation_tokens_total", model_name=MODEL) == engine_total(),
        timeout=5,
    )
    assert scrape(stack).histograms["fastsched:time_to_first_token_seconds"].count >= 1


def scrape(stack: Stack) -> Any:
    """``/metrics`` as a ``Snapshot``: ``value(name, **labels)`` sums the series that have ``labels``."""
    return parse_metrics(httpx.get(stack.url + "/metrics", timeout=10).text, 0.0)


def family_total(snapshot: Any, name: str, suffix: str) -> float:
    """A counter's total, or a histogram's ``_count`` or ``_sum``, over every series."""
    if suffix:
        h = snapshot.histograms.get(f"fastsched:{name}")
        return 0.0 if h is None else (h.count if suffix == "_count" else h.sum)
    return snapshot.value(f"fastsched:{name}", model_name=MODEL) or 0.0


def test_e2e_metrics_vllm_families_per_engine(stack: Stack, client: openai.OpenAI) -> None:
    """Issue 13 part 4: vLLM's families, with model_name and engine, from real frontends and engines."""
    histograms = (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    )
    before = scrape(stack)
    client.completions.create(model=MODEL, prompt="import os", max_tokens=5, **GREEDY)
    client.completions.create(model=MODEL, prompt="import os", max_tokens=3, n=2, **GREEDY)
    after = scrape(stack)

    def grew(name: str, suffix: str = "_count") -> float:
        return family_total(after, name, suffix) - family_total(before, name, suffix)

    # Three completions, all ended by max_tokens, each counted once (on the frontend that served it).
    assert grew("request_success_total", "") == 3
    assert (
        after.value("fastsched:request_success_total", finished_reason="length")
        - (before.value("fastsched:request_success_total", finished_reason="length") or 0)
        == 3
    )
    for name in histograms:
        assert grew(name) == 3, name
    assert grew("request_generation_tokens", "_sum") == 5 + 3 + 3
    assert (grew("request_params_n"), grew("request_params_n", "_sum")) == (2, 3)
    assert grew("request_params_max_tokens", "_sum") == 5 + 3
    assert grew("request_decode_time_seconds", "_sum") > 0
    assert grew("iteration_tokens_total") >= 2  # at least a prefill and a decode step
    # A step's tokens: the prompts' once, and one per generated token after the first.
    assert grew("iteration_tokens_total", "_sum") >= grew("request_prompt_tokens", "_sum")
    engines = {s.labels["engine"] for s in after.samples["fastsched:cache_config_info"]}
    assert engines == {"0", "1"}
    info = after.samples["fastsched:cache_config_info"][0]
    assert info.value == 1 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    assert info.labels["enable_prefix_caching"] in ("True", "False") and info.labels["model_name"] == MODEL
    for name, samples in after.samples.items():
        if name.startswith("fastsched:"):
            assert all(s.labels.get("model_name") == MODEL for s in samples), name
    # Every process, from the engines' heartbeats (every 0.5 s here).
    expected = {("gateway", "0"), ("frontend", "0"), ("frontend", "1"), ("engine", "0"), ("engine", "1")}
    assert wait_for(
        lambda: (
            {
                (s.labels["process"], s.labels["index"])
                for s in scrape(stack).samples.get("process_cpu_seconds_total", ())
            }
            == expected
        ),
        timeout=5,
    )
    resident = scrape(stack).samples["process_resident_memory_bytes"]
    assert len(resident) == 5 and all(s.value > 0 for s in resident)


def test_e2e_metrics_pass_promtool(stack: Stack, client: openai.OpenAI) -> None:
    """The live page passes ``promtool check metrics`` but for vLLM's own names (see promtool.py)."""
    client.completions.create(model=MODEL, prompt="import os", max_tokens=3, **GREEDY)
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    assert lint_problems(text) == []


def test_e2e_gate_telemetry_says_which_gate_stopped_each_engine(stack: Stack, client: openai.OpenAI) -> None:
    """Issue 5 gate telemetry on /metrics: scan stops by gate, skips by reason, and each
    engine's last stop as at most one 1 among its gates (none before its first step)."""
    client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)

    def gate_lines() -> list[str]:
        text = httpx.get(stack.url + "/metrics", timeout=10).text
        return [line for line in text.splitlines() if line.startswith("fastsched:scheduler_")]

    wait_for(
        lambda: any(line.startswith("fastsched:scheduler_scan_stops_total{") for line in gate_lines()),
        timeout=10,
    )
    lines = gate_lines()
    stops: dict[str, float] = {}  # by gate, summed over engines
    for line in lines:
        if line.startswith("fastsched:scheduler_scan_stops_total{"):
            gate = line.split('gate="')[1].split('"')[0]
            stops[gate] = stops.get(gate, 0.0) + float(line.rsplit(" ", 1)[1])
    assert {"token_budget", "no_waiting", "kv_blocks", "active_seqs"} <= set(stops)
    assert sum(stops.values()) > 0
    assert any(line.startswith("fastsched:scheduler_skips_total{") for line in lines)
    last = [line for line in lines if line.startswith("fastsched:scheduler_last_scan_stop{")]
    ones_per_engine = [
        sum(1 for line in last if f'engine="{engine}"' in line and line.endswith(" 1.0"))
        for engine in {line.split('engine="')[1].split('"')[0] for line in last}
    ]
    assert ones_per_engine and max(ones_per_engine) == 1 and all(n <= 1 for n in ones_per_engine), last


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30, trust_env=False)


def test_e2e_tokenize_and_detokenize_in_vllms_shapes(stack: Stack) -> None:
    text = "Hello world, what is 2 + 2?"
    reply = _post(stack, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == stack.tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    messages = [{"role": "user", "content": text}]
    chat = _post(stack, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == stack.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    assert chat["token_strs"] is None
    back = _post(stack, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == stack.tokenizer.decode(body["tokens"], False)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [1, -3]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_e2e_errors_tokenize_refuses_what_it_does_not_implement(
    stack: Stack, path: str, body: dict, param: str
) -> None:
    reply = _post(stack, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_e2e_version_and_ping(stack: Stack) -> None:
    from importlib.metadata import version

    assert httpx.get(stack.url + "/version", trust_env=False).json() == {"version": version("fastsched")}
    assert httpx.get(stack.url + "/ping", trust_env=False).status_code == 200
    assert httpx.post(stack.url + "/ping", trust_env=False).status_code == 200
