"""A base model (a GGUF file without ``tokenizer.chat_template``) served: chat is a 400 that
names ``--chat-template`` while completions work; with ``serve --chat-template`` chat renders
that template; ``/tokenize`` and ``/detokenize`` give transformers' ids for its SentencePiece
vocabulary; ``LLM.chat(chat_template=...)`` and ``generate --chat-template`` do the same offline.

The model is the tiny Llama-2-style GGUF of ``fastsched.tools.tiny_gguf`` (random weights)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess, launch, wait_healthy
from transformers import AutoTokenizer

from fastsched.entrypoints.cli import main
from fastsched.entrypoints.llm import LLM
from fastsched.sampling_params import SamplingParams
from fastsched.tools.tiny_gguf import make_tiny_gguf

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2? Answer: 日本語 👍🏽"}]
TEXTS = [
    "Hello world",
    "  two  spaces\tand a tab\n",
    "naïve café 日本語 👨‍👩‍👧",
    "<s>x</s> <|user|>hi <tool>",
]


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("base") / "tiny-base.gguf")


@pytest.fixture(scope="module")
def servers(base_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServeProcess]]:
    """The model served without a chat template and with ``--chat-template FILE``, started together."""
    logs = tmp_path_factory.mktemp("logs")
    template_file = logs / "template.jinja"
    template_file.write_text(TEMPLATE)
    started = {
        "plain": launch(base_gguf, logs / "plain.log"),
        "templated": launch(base_gguf, logs / "templated.log", "--chat-template", str(template_file)),
    }
    try:
        for server in started.values():
            wait_healthy(server)
        yield started
    finally:
        for server in started.values():
            server.close()


@pytest.fixture(scope="module")
def reference(base_gguf: Path):
    return AutoTokenizer.from_pretrained(str(base_gguf.parent), gguf_file=base_gguf.name)


def _post(server: ServeProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": "tiny-base", **body}, timeout=60, trust_env=False)


def test_chat_without_a_chat_template_is_a_400_naming_the_flag(servers: dict[str, ServeProcess]) -> None:
    plain = servers["plain"]
    for route, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
        ("/tokenize", {"messages": MESSAGES}),
    ):
        response = _post(plain, route, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
        assert error["param"] == "messages"


def test_completions_work_without_a_chat_template(servers: dict[str, ServeProcess], reference) -> None:
    response = _post(
        servers["plain"], "/v1/completions", {"prompt": "Hello world", "max_tokens": 6, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(reference.encode("Hello world"))
    assert body["usage"]["completion_tokens"] == 6


def test_tokenize_and_detokenize_give_the_reference_ids(servers: dict[str, ServeProcess], reference) -> None:
    for text in TEXTS:
        tokens = _post(servers["plain"], "/tokenize", {"prompt": text}).json()["tokens"]
        assert tokens == reference.encode(text), text
        prompt = _post(servers["plain"], "/detokenize", {"tokens": tokens}).json()["prompt"]
        assert prompt == reference.decode(tokens)


def test_serve_chat_template_flag_renders_chat_for_a_base_model(
    servers: dict[str, ServeProcess], reference
) -> None:
    templated = servers["templated"]
    expected_text = reference.apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    expected = reference.encode(expected_text, add_special_tokens=False)
    assert expected[:2] == [reference.bos_token_id, reference.convert_tokens_to_ids("<|user|>")]
    assert _post(templated, "/tokenize", {"messages": MESSAGES}).json()["tokens"] == expected
    response = _post(
        templated, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_llm_chat_takes_a_chat_template(base_gguf: Path, reference, capsys: pytest.CaptureFixture) -> None:
    llm = LLM(model=str(base_gguf), device="cpu", dtype="float32", kv_cache_memory=8 * 1024 * 1024)
    try:
        with pytest.raises(ValueError, match="--chat-template"):
            llm.chat(MESSAGES, use_tqdm=False)
        out = llm.chat(
            MESSAGES, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False, chat_template=TEMPLATE
        )
    finally:
        llm.shutdown()
    expected_text = reference.apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert out[0].prompt_token_ids == reference.encode(expected_text, add_special_tokens=False)
    common = [
        "generate",
        "--model",
        str(base_gguf),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(8 * 1024 * 1024),
        "--max-tokens",
        "2",
        "-p",
        "hi",
    ]
    assert main(common) == 2
    assert "--chat-template" in capsys.readouterr().err
    assert main([*common, "--chat-template", TEMPLATE]) == 0
    assert "### hi" in capsys.readouterr().out
