"""``--kv-transfer-config`` (vLLM's JSON) and ``LLM(kv_transfer_config=...)``: parsed where
flags are read, every mistake named by its field and value."""

from __future__ import annotations

import json

import pytest

from fastsched.config import EngineConfig
from fastsched.entrypoints.cli import build_parser
from fastsched.kv_transfer import KVTransferConfig

VLLM_EXAMPLE = {
    "kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/mnt/kv"},
}


def test_the_flag_takes_vllms_json():
    args = build_parser().parse_args(["serve", "--kv-transfer-config", json.dumps(VLLM_EXAMPLE)])
    config = EngineConfig.from_kwargs(kv_transfer_config=args.kv_transfer_config)
    assert config.kv_transfer_config == KVTransferConfig(**VLLM_EXAMPLE)
    assert config.kv_transfer_config.shared_storage_path == "/mnt/kv"
    assert build_parser().parse_args(["serve"]).kv_transfer_config is None


@pytest.mark.parametrize("value", [VLLM_EXAMPLE, json.dumps(VLLM_EXAMPLE), KVTransferConfig(**VLLM_EXAMPLE)])
def test_the_offline_api_takes_a_dict_json_or_the_config(value):
    assert EngineConfig.from_kwargs(kv_transfer_config=value).kv_transfer_config == KVTransferConfig(
        **VLLM_EXAMPLE
    )


@pytest.mark.parametrize(
    ("role", "produces", "consumes"),
    [("kv_both", True, True), ("kv_producer", True, False), ("kv_consumer", False, True)],
)
def test_roles(role, produces, consumes):
    config = KVTransferConfig(**{**VLLM_EXAMPLE, "kv_role": role})
    assert (config.is_producer, config.is_consumer) == (produces, consumes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kv_connector": "LMCacheConnectorV1"},
            "kv_connector must be one of SharedStorageConnector; got 'LMCache",
        ),
        (
            {"kv_role": "kv_sometimes"},
            "kv_role must be one of kv_producer, kv_consumer, kv_both; got 'kv_sometimes'",
        ),
        ({"kv_connector_extra_config": {}}, "shared_storage_path must be a non-empty string"),
        ({"kv_connector_extra_config": []}, "kv_connector_extra_config must be an object"),
        ({"kv_buffer_size": 1}, r"unknown fields \['kv_buffer_size'\]"),
    ],
)
def test_a_bad_field_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_transfer_config={**VLLM_EXAMPLE, **change})


def test_bad_json_on_the_command_line_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-transfer-config", "{not json"])
    err = capsys.readouterr().err
    assert "--kv-transfer-config" in err and "not valid JSON" in err


def test_the_connector_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig.from_kwargs(kv_transfer_config=VLLM_EXAMPLE, enable_prefix_caching=False)
