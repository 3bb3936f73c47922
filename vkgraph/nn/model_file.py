"""A model as the user names it, opened once.

A run reads one model several ways: its weights, its tokenizer, its chat template, whether it is the random
demo model. For a GGUF file each of those reads the header and the metadata (a real vocabulary is ~100k strings
and merges, seconds of parsing), so the file is opened here once and the `ModelFile` is handed to every loader
(`load_weights`, `Tokenizer.load`, `ChatTemplate.load`, `is_random_model`), which also take a plain path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelFormatError
from .headers import TruncatedFileError, check_gguf


@dataclass(frozen=True)
class ModelFile:
    path: Path  # as given: a .gguf file, a Hugging Face folder, or a file inside one
    gguf: Any | None  # the open `gguf.GGUFReader` of a .gguf file (its tensors map the file); None otherwise

    @property
    def folder(self) -> Path:
        """Where a Hugging Face model's files lie: the path itself, or the folder of a file inside one."""
        return self.path if self.path.is_dir() else self.path.parent


ModelSource = str | Path | ModelFile


def open_model(source: ModelSource) -> ModelFile:
    """The model at `source`, a GGUF file's header and metadata parsed (and checked) once; a ModelFile as it is."""
    if isinstance(source, ModelFile):
        return source
    p = Path(source)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
    return ModelFile(p, open_gguf(p) if p.suffix == ".gguf" else None)


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader`, with truncation and corruption turned into clear errors."""
    from gguf import GGUFReader

    p = Path(path)
    check_gguf(p)  # every count and size bounds-checked first: the reader trusts them
    try:
        reader = GGUFReader(p)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelFormatError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise TruncatedFileError(f"{p}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}")
    return reader
