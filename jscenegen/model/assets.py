"""The files of an HF model directory besides its weights, in one place.

`ASSET_FILES` are what a model needs to be used and re-published: config, generation config,
tokenizer, chat template and the processor files a multimodal checkpoint (Qwen3.5) ships.
Checkpoints carry exactly these (`hf/`); conversions carry every file that is not a weight
file (`is_weight_file`), so a README or licence travels too.
"""
from __future__ import annotations

import shutil
from pathlib import Path

ASSET_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
)
# a model directory needs one of these (a checkpoint's hf/ carries only ASSET_FILES, so a
# SentencePiece-only tokenizer.model could not be saved with a run)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def is_weight_file(name: str) -> bool:
    """True for weight shards and their index files (what conversions rewrite, never copy)."""
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES


def copy_assets(src: str | Path, dst: str | Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the `ASSET_FILES` that exist in `src` (except `skip`) into `dst`; returns their names."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in ASSET_FILES:
        f = Path(src) / name
        if name not in skip and f.is_file():
            shutil.copy2(f, dst / name)
            copied.append(name)
    return copied


MAX_TOKENIZER_FILE_BYTES = 1 << 28   # Qwen's tokenizer.json is ~11 MB


def check_tokenizer_files(src: str | Path, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the file when `src`'s `tokenizer.json` is not one the tokenizers
    library reads, or its `tokenizer_config.json` is not a JSON object (`paths.read_json_object`), or
    either is beyond MAX_TOKENIZER_FILE_BYTES: a converted or exported model carries them as
    they are, and one whose tokenizer does not load is otherwise found only by its users."""
    import tokenizers

    from jscenegen.paths import read_json_object

    tokenizer, config = Path(src) / "tokenizer.json", Path(src) / "tokenizer_config.json"
    for path in (tokenizer, config):
        if path.is_file() and path.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
            raise error(f"{path}: {path.stat().st_size:,} bytes, more than a tokenizer file "
                        f"holds (at most {MAX_TOKENIZER_FILE_BYTES:,}: "
                        "jscenegen.model.assets.MAX_TOKENIZER_FILE_BYTES)")
    if tokenizer.is_file():
        try:
            tokenizers.Tokenizer.from_file(str(tokenizer))
        except Exception as err:   # the library raises its own Exception subclass
            raise error(f"{tokenizer}: not a tokenizer that tokenizers "
                        f"{tokenizers.__version__} reads ({str(err)[:200]})") from None
    if config.is_file():
        read_json_object(config, error)


def copy_non_weights(src: str | Path, dst: str | Path) -> list[Path]:
    """Copy every regular file of `src` that is not a weight file into `dst`; returns the sources."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and not is_weight_file(p.name):
            shutil.copy2(p, dst / p.name)
            copied.append(p)
    return copied
