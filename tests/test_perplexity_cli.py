"""``fastsched perplexity`` on the tiny model: its table and its ``--json``, and that a model
compared with itself (the same dtype and quantization) has no divergence at all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fastsched.entrypoints.cli import main
from fastsched.tools.tiny_model import make_tiny_model

TEXT = Path(__file__).parent / "models" / "data" / "perplexity.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("ppl") / "model"))


def test_json_against_itself_has_zero_divergence_and_full_agreement(tiny: str, capsys) -> None:
    code = main(
        [
            "perplexity",
            str(TEXT),
            "--model",
            tiny,
            "--ctx",
            "32",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--kl-divergence",
            "--reference-quantization",
            "none",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_windows"] >= 2 and report["num_scored"] == report["num_windows"] * 15
    assert math.isclose(report["ppl"], report["reference_ppl"], rel_tol=1e-6)
    assert report["mean_kld"] < 1e-9 and report["top1_agreement"] == 1.0
    assert report["ppl"] > 1.0


def test_table_names_the_figures(tiny: str, capsys) -> None:
    assert main(["perplexity", str(TEXT), "--model", tiny, "--ctx", "32", "--device", "cpu", "--decode"]) == 0
    out = capsys.readouterr().out
    assert "mode decode" in out and out.splitlines()[1].startswith("PPL ")
    assert "Mean KLD" not in out  # no reference asked for
