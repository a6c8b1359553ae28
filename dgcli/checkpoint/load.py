"""The one place that asks "which format?": a path given as a model is a checkpoint directory (checkpoint/
directory.py), a GGUF file (checkpoint/gguf_model.py) or, where a config alone will do (`dgemma info`), a
config.json file. Every command and the library open checkpoints through here: `format_of` and its error lines,
each format's config, generation config, tokenizer and weights. Must not: parse a format itself (its module does)
or import torch at module level (`dgemma info` reads configs without it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgcli.checkpoint.config import directory_config, parse_config, read_json
from dgcli.errors import UserError
from dgcli.model.config import ModelConfig

DIRECTORY, GGUF, CONFIG_FILE = "directory", "gguf", "config.json"
CHECKPOINT_HOLDS = "config.json, model*.safetensors and tokenizer.json"


def format_of(path: str | Path, *, flag: str | None = None, file_ok: bool = True) -> str:
    """What `path` holds: DIRECTORY (with its config.json), GGUF (named .gguf, or starting with the GGUF magic) or,
    with `file_ok`, CONFIG_FILE (a config.json itself); anything else is one line naming the problem and the fix
    (`flag`, e.g. "--model", labels the path)."""
    path = Path(path)
    label = f"{flag} {path}" if flag else str(path)
    if not path.exists():
        if path.suffix.lower() == ".gguf":  # a file was meant: say so, not "directory"
            raise UserError(f"{label}: no such file; check the path of the GGUF file (or pass a checkpoint directory)")
        raise UserError(f"{label}: no such checkpoint directory; pass the directory that holds {CHECKPOINT_HOLDS}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{label}: not a checkpoint directory (no config.json); pass the directory that holds "
                            f"{CHECKPOINT_HOLDS}")
        return DIRECTORY
    if path.is_file() and (path.suffix.lower() == ".gguf" or _starts_with(path, b"GGUF")):
        return GGUF
    if not (file_ok and path.suffix.lower() == ".json"):
        raise UserError(f"{label} is a file; pass the checkpoint directory that holds {CHECKPOINT_HOLDS}")
    return CONFIG_FILE


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def load_config(path: str | Path, *, flag: str | None = None, file_ok: bool = True) -> ModelConfig:
    """The model config of a checkpoint directory, a GGUF file or (`file_ok`) a config.json file."""
    path = Path(path)
    kind = format_of(path, flag=flag, file_ok=file_ok)
    if kind == GGUF:
        from dgcli.checkpoint.gguf_model import config_dict, open_gguf

        try:
            return parse_config(config_dict(open_gguf(path)), source=str(path))
        except UserError as e:  # name the option the path came from, as every other --model error does
            if flag and str(e).startswith(str(path)):
                raise UserError(f"{flag} {e}") from None
            raise
    cfg_path = path / "config.json" if kind == DIRECTORY else path
    return parse_config(directory_config(path) if kind == DIRECTORY else read_json(cfg_path), source=str(cfg_path))


def load_generation_config(path: str | Path) -> dict | None:
    """The raw generation_config.json of a checkpoint directory (a GGUF file: the dict its metadata gives),
    or None when it has none."""
    path = Path(path)
    if format_of(path) == GGUF:
        from dgcli.checkpoint.gguf_model import generation_dict, open_gguf

        return generation_dict(open_gguf(path))
    p = path / "generation_config.json"
    return read_json(p) if p.exists() else None


def load_tokenizer(path: str | Path, required: bool = True) -> Any:
    """A checkpoint's tokenizer: a GGUF file's own, else the directory's tokenizer.json; None where there is none
    and none is `required` (bench and sweep run on ids)."""
    path = Path(path)
    if format_of(path, file_ok=False) == GGUF:
        from dgcli.checkpoint.gguf_model import load_gguf_tokenizer

        return load_gguf_tokenizer(path, required=required)
    from dgcli.text.tokenizer import load_tokenizer as from_directory

    return from_directory(path) if required or (path / "tokenizer.json").exists() else None


def load_model(path: str | Path, device: Any = "cpu", dtype: Any = None):
    """A DiffusionGemma with a checkpoint's weights (a directory, plain or FP8; or a GGUF file) on `device`.
    dtype None = the checkpoint's (its embedding's dtype; a quantized GGUF embedding: bfloat16)."""
    path = Path(path)
    if format_of(path, file_ok=False) == GGUF:
        from dgcli.checkpoint.gguf_model import load_gguf_model

        return load_gguf_model(path, device=device, dtype=dtype)
    from dgcli.checkpoint.directory import load_directory

    return load_directory(path, device=device, dtype=dtype)
