"""Sampling defaults from the model's generation config: read from ``generation_config.json``
(or GGUF ``general.sampling.*``), applied to what a request leaves out, never to what it
sets; ``--generation-config vllm`` turns them off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastsched.model_loader.generation_defaults import load_generation_defaults
from fastsched.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_defaults_come_from_generation_config_json(model: Path):
    assert load_generation_defaults(model) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
    }
    assert load_generation_defaults(model, "vllm") == {}
    assert load_generation_defaults(None) == {}  # the embedded GGUF carries no general.sampling.* keys


def test_a_directory_given_must_hold_the_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        load_generation_defaults(None, str(tmp_path))


def test_grpc_requests_take_the_defaults_only_for_what_they_leave_out():
    pytest.importorskip("grpc")
    from fastsched.frontend.grpc_server import pb, sampling_params_from_proto

    defaults = {"temperature": 0.6, "top_k": 20}
    params = sampling_params_from_proto(pb.SamplingParams(max_tokens=5), defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 5)
    explicit = sampling_params_from_proto(pb.SamplingParams(temperature=0.0), defaults)
    assert (explicit.temperature, explicit.top_k) == (0.0, 20)


def test_the_offline_llm_uses_them_when_no_params_are_given(model: Path):
    from fastsched.entrypoints.llm import LLM

    llm = LLM(model=str(model), device="cpu", dtype="float32", num_gpu_blocks=64, max_model_len=128)
    assert llm.engine.sampling_defaults["temperature"] == 0.6
    off = LLM(
        model=str(model),
        device="cpu",
        dtype="float32",
        num_gpu_blocks=64,
        max_model_len=128,
        generation_config="vllm",
    )
    assert off.engine.sampling_defaults == {}
