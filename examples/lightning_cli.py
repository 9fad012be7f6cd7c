"""LightMem configured from YAML through LightningCLI: every flag is a plain type.

    pip install -e ".[cli]"
    python examples/lightning_cli.py fit --config examples/lightmem_cli.yaml
"""

from __future__ import annotations

import os
import sys

from pytorch_lightning.cli import LightningCLI

sys.path.insert(0, os.path.dirname(__file__))
from gpt_model import GPT, CountingData


def main() -> None:
    LightningCLI(GPT, CountingData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
