"""Write a Llama-style model with random weights (Hugging Face files and GGUF): `vkgraph.nn.tiny_model`'s command.

    .venv/bin/python scripts/make_tiny_model.py OUT_DIR [--gguf F32,Q8_0,Q4_0] ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs it without installing

from vkgraph.nn.tiny_model import main  # noqa: E402

if __name__ == "__main__":
    main()
