"""Chat template controls like transformers' and vLLM's: ``add_generation_prompt``,
``continue_final_message`` (the last turn left open: the same prompt tokens as
transformers' ``apply_chat_template(..., continue_final_message=True)``; both together is
a 400), ``chat_template_kwargs``, ``echo`` for chat, and ``serve --chat-template``."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest

from fastsched.entrypoints.cli import build_parser
from fastsched.gateway.openai_protocol import ApiError, parse_chat
from fastsched.gateway.tokenize import tokenize
from fastsched.limits import RequestLimits
from fastsched.model_loader import load_tokenizer
from fastsched.model_loader.tokenizer import resolve_chat_template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "One, two,"},
]
# A template that trims what it writes (as many do): the open message loses its trailing space.
TRIMMING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WITH_KWARGS = (
    "{% if greeting %}{{ greeting }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "\n{% endfor %}"
)


@pytest.fixture
def tokenizer(tiny_model_dir: Path):
    """A test's own: tests replace its chat template."""
    return load_tokenizer(str(tiny_model_dir))


def chat_ids(tokenizer, **body: object) -> list[int]:
    return parse_chat({"model": "m", "messages": CONVERSATION, **body}, tokenizer, 256, "r").prompts[0]


@pytest.mark.parametrize("template", [None, TRIMMING], ids=["checkpoint", "trimming"])
@pytest.mark.parametrize("last", ["One, two,", "One, two, "], ids=["plain", "trailing-space"])
def test_continue_final_message_gives_the_prompt_tokens_of_transformers(
    tiny_model_dir: Path, tokenizer, template: str | None, last: str
) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    if template is not None:
        tokenizer.chat_template = hf.chat_template = template
    messages = [*CONVERSATION[:-1], {"role": "assistant", "content": last}]
    expected_text = hf.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    ids = parse_chat(
        {"model": "m", "messages": messages, "continue_final_message": True, "add_generation_prompt": False},
        tokenizer,
        256,
        "r",
    ).prompts[0]
    assert ids == hf(expected_text, add_special_tokens=False)["input_ids"]
    assert (
        tokenizer.decode(ids, skip_special_tokens=False).rstrip().endswith("<|im_start|>assistant\nOne, two,")
    )
    tokenized = tokenize(
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
        tokenizer,
        256,
        RequestLimits(),
    )
    assert tokenized["tokens"] == ids  # /tokenize renders a chat as the chat endpoint does


def test_continue_final_message_with_add_generation_prompt_is_a_400(tokenizer) -> None:
    with pytest.raises(ApiError) as error:
        chat_ids(tokenizer, continue_final_message=True)  # add_generation_prompt defaults to true
    assert error.value.status == 400 and error.value.param == "continue_final_message"


def test_add_generation_prompt_false_ends_with_the_last_turn_closed(tokenizer) -> None:
    closed = tokenizer.decode(chat_ids(tokenizer, add_generation_prompt=False), skip_special_tokens=False)
    opened = tokenizer.decode(chat_ids(tokenizer), skip_special_tokens=False)
    assert closed.endswith("One, two,<|im_end|>\n") and opened == closed + "<|im_start|>assistant\n"


def test_chat_template_kwargs_reach_the_template_and_cannot_set_reserved_names(tokenizer) -> None:
    tokenizer.chat_template = WITH_KWARGS
    text = tokenizer.decode(
        chat_ids(tokenizer, chat_template_kwargs={"greeting": "Hello!"}), skip_special_tokens=False
    )
    assert text.startswith("Hello!\nsystem: Be brief.")
    for bad in ({"add_generation_prompt": False}, ["greeting"]):
        with pytest.raises(ApiError) as error:
            chat_ids(tokenizer, chat_template_kwargs=bad)
        assert error.value.param == "chat_template_kwargs"


def test_chat_echo_puts_the_open_message_before_the_answer(tokenizer) -> None:
    parsed = parse_chat(
        {
            "model": "m",
            "messages": CONVERSATION,
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        tokenizer,
        256,
        "r",
    )
    assert parsed.echo and parsed.chat_echo == "One, two,"
    user_last = parse_chat({"model": "m", "messages": CONVERSATION[:2], "echo": True}, tokenizer, 256, "r")
    assert user_last.chat_echo == ""  # a new assistant turn continues nothing


def test_serve_chat_template_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TRIMMING)
    assert resolve_chat_template(str(path)) == TRIMMING
    assert resolve_chat_template(WITH_KWARGS) == WITH_KWARGS
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        resolve_chat_template("{% for m in messages %}")
    args = build_parser().parse_args(["serve", "--chat-template", str(path)])
    assert args.chat_template == str(path)
