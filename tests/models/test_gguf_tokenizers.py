"""GGUF SentencePiece tokenizers (``tokenizer.ggml.model = llama``, model_loader/gguf_tokenizer.py)
against transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), the
reference: the real Gemma 3 270M file and tiny Llama-2-style and Phi-3 files written here with
``gguf``'s writer (``fastsched.tools.tiny_gguf``), on texts that probe whitespace, byte fallback,
special-token strings and the flags ``add_space_prefix`` / ``add_bos_token``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fastsched.engine.protocol import EngineCoreOutput
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.gateway.tokenize import detokenize, tokenize
from fastsched.limits import RequestLimits
from fastsched.model_loader import load_tokenizer
from fastsched.model_loader.export import export_tokenizer
from fastsched.outputs import CompletionOutput, RequestOutput
from fastsched.sampling_params import SamplingParams
from fastsched.tools.tiny_gguf import make_tiny_gguf

TEXTS = [
    "Hello world",
    "",
    " ",
    "   ",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple    spaces   between     words",
    "\ttab\tseparated\t\tcolumns",
    "line one\nline two\n\nline four\r\nwindows line\n",
    "\n\n\nleading newlines",
    "Crème brûlée, naïve café, Ångström, façade, jalapeño",
    "e\u0301 combining accent vs é precomposed",
    "日本語のテキスト、中文句子，한국어 문장",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, ❤️",
    "3.14159 1234567890 007 1,000,000 -42 2e10",
    "https://example.com/path/to/page?query=a&b=c#fragment",
    "def square(x: int) -> int:\n    return x ** 2  # note\n\n\tif x != 0: {y = [1, 2]}",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>starts with bos",
    "ends with eos<eos>",
    "text <bos> in <pad> the middle <unk> <mask>",
    "<s>llama bos</s> and <unk>",
    "<|user|>hi<|assistant|>hello<tool> x <tool>",
    "literal byte tokens <0x41><0xE6> and ▁metaspace ▁▁",
    "<start_of_turn",  # half a special token is text
    "ßẞ ΣΑΣ σας ﬁ ① ½ ™",
]


def _transformers_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("spm")
    return {
        "llama": make_tiny_gguf(out / "tiny-llama-spm.gguf"),
        "phi3": make_tiny_gguf(out / "tiny-phi3-spm.gguf", architecture="phi3"),
        "llama-no-space-prefix": make_tiny_gguf(out / "tiny-llama-spm-nsp.gguf", add_space_prefix=False),
    }


@pytest.fixture(scope="module", params=["gemma3", "llama", "phi3"])
def pair(request: pytest.FixtureRequest, tiny_files: dict[str, Path]):
    """(ours, transformers') tokenizers of one file."""
    path = request.getfixturevalue("gemma3_gguf") if request.param == "gemma3" else tiny_files[request.param]
    return load_tokenizer(path), _transformers_tokenizer(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_sentencepiece_gguf_ids_equal_transformers(pair, add_special_tokens: bool) -> None:
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == theirs.encode(
            text, add_special_tokens=add_special_tokens
        ), text


def test_sentencepiece_gguf_decodes_as_transformers(pair) -> None:
    """The texts' ids, and random id runs (byte tokens that split or break UTF-8 characters,
    special tokens anywhere), decode to transformers' text, with and without special tokens."""
    ours, theirs = pair
    rng = random.Random(0)
    runs = [theirs.encode(text) for text in TEXTS]
    runs += [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 24))] for _ in range(200)]
    byte_ids = [ours.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    runs += [[rng.choice(byte_ids) for _ in range(rng.randrange(1, 8))] for _ in range(100)]
    for ids in runs:
        for skip in (True, False):
            expected = theirs.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected, ids


def test_sentencepiece_decode_round_trips_the_text(pair) -> None:
    """Decoding a text's ids gives the text back wherever transformers does (Phi-3's prefix
    space, for one, comes back after a special token)."""
    ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        if theirs.decode(ids, skip_special_tokens=False) == text:
            assert ours.decode(ids, skip_special_tokens=False) == text


def _streamed(tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    """The text deltas a stream releases, the ids coming one a step."""
    processor = OutputProcessor(tokenizer, stream=True)
    parent = RequestOutput("r", "", [], [CompletionOutput(index=0)])
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip_special_tokens)
    processor.add_request("r", parent, 0, params)
    deltas = []
    for i, token in enumerate(ids):
        finished = "length" if i == len(ids) - 1 else None
        processor.process([EngineCoreOutput("r", [token], finish_reason=finished)])
        deltas.append(parent.outputs[0].text)
    return [b[len(a) :] for a, b in zip(["", *deltas], deltas)]


def test_incremental_detokenization_equals_whole_decoding(pair) -> None:
    """Streamed one token a step, the deltas add up to the whole decode, and no delta holds
    half a character: a character split over byte-fallback tokens comes out whole, once.

    Random runs count where their whole decode is valid text: a run of byte tokens that is
    not valid UTF-8 decodes, whole, to one U+FFFD per byte (tokenizers' byte fallback), of
    which a stream may already have released a valid start (an ASCII byte)."""
    ours, _ = pair
    rng = random.Random(1)
    runs = [ours.encode(text) for text in TEXTS if text]
    runs += [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 24))] for _ in range(100)]
    checked = 0
    for ids in runs:
        for skip in (True, False):
            whole = ours.decode(ids, skip_special_tokens=skip)
            if "\ufffd" not in whole:
                assert "".join(_streamed(ours, ids, skip)) == whole, ids
                checked += 1
    assert checked > len(TEXTS)
    text = "日本語 👨‍👩‍👧 ok"
    split = ours.encode(text, add_special_tokens=False)
    deltas = [d for d in _streamed(ours, split, True) if d]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_tiny_llama_file_spells_cjk_with_byte_tokens(tiny_files: dict[str, Path]) -> None:
    """The tiny vocabulary has no CJK pieces: 日 is its three UTF-8 bytes, which decode back."""
    tokenizer = load_tokenizer(tiny_files["llama"])
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert [tokenizer.backend.id_to_token(t) for t in ids][-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tokenizer.decode(ids) == "日"


def test_add_bos_token_flag_puts_bos_first(tiny_files: dict[str, Path], gemma3_gguf: Path) -> None:
    for path in (tiny_files["llama"], gemma3_gguf):
        tokenizer = load_tokenizer(path)
        assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id
        assert tokenizer.bos_token_id not in tokenizer.encode("hi", add_special_tokens=False)


def test_add_space_prefix_false_prepends_no_space(tiny_files: dict[str, Path]) -> None:
    """The file's flag is followed (as llama.cpp does): "Hello" is not spelled "▁Hello"."""
    with_prefix = load_tokenizer(tiny_files["llama"])
    without = load_tokenizer(tiny_files["llama-no-space-prefix"])
    pieces = [without.backend.id_to_token(t) for t in without.encode("Hello world", add_special_tokens=False)]
    assert not pieces[0].startswith("▁") and any(p.startswith("▁") for p in pieces[1:])
    first = with_prefix.encode("Hello", add_special_tokens=False)[0]
    assert with_prefix.backend.id_to_token(first).startswith("▁")
    for text in (t for t in TEXTS if "▁" not in t):  # a literal ▁ comes back a space
        ids = without.encode(text, add_special_tokens=False)
        assert without.decode(ids, skip_special_tokens=False) == text


def test_gemma3_control_tokens_match_whole_and_are_skipped(gemma3_gguf: Path) -> None:
    tokenizer = load_tokenizer(gemma3_gguf)
    ids = tokenizer.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False)
    assert ids[0] == tokenizer.token_to_id("<start_of_turn>")
    assert ids[-1] == tokenizer.token_to_id("<end_of_turn>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert tokenizer.chat_template is None  # a base model: chat needs --chat-template


def test_tokenize_endpoints_give_the_reference_ids(pair) -> None:
    """/tokenize and /detokenize bodies (gateway/tokenize.py) with this tokenizer."""
    ours, theirs = pair
    for text in TEXTS:
        body = tokenize({"prompt": text}, ours, 32768, RequestLimits())
        assert body["tokens"] == theirs.encode(text) and body["count"] == len(body["tokens"])
        assert detokenize({"tokens": body["tokens"]}, ours, None)["prompt"] == theirs.decode(body["tokens"])


def test_exported_sentencepiece_tokenizer_keeps_the_ids(tiny_files: dict[str, Path], tmp_path: Path) -> None:
    """The launcher hands frontends this export instead of the GGUF file: same ids, BOS included,
    and transformers reads the export alike."""
    for name in ("llama", "llama-no-space-prefix"):
        out = export_tokenizer(tiny_files[name], tmp_path / name)
        original, exported = load_tokenizer(tiny_files[name]), load_tokenizer(out)
        hf_exported = AutoTokenizer.from_pretrained(str(out))
        for text in TEXTS:
            ids = original.encode(text)
            assert exported.encode(text) == ids == hf_exported.encode(text), (name, text)
            decoded = original.decode(ids, skip_special_tokens=False)
            assert exported.decode(ids, skip_special_tokens=False) == decoded
