"""The files of an HF model directory besides its weights, in one place.

`ASSET_FILES` are what a model needs to be used and re-published: config, generation config,
tokenizer, chat template and the processor files a multimodal checkpoint (Qwen3.5) ships.
Checkpoints carry exactly these (`hf/`); conversions carry every file that is not a weight
file (`is_weight_file`), so a README or licence travels too.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

ASSET_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
)
# the chat template files, the ones `sampling.chat_template_path` replaces
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# the ASSET_FILES that do not decide how text becomes tokens and back: the architecture
# (compared on its own) and the multimodal processors' settings
NOT_TOKENISATION_FILES = ("config.json", "preprocessor_config.json",
                          "video_preprocessor_config.json", "processor_config.json")
# every other asset file decides it: the tokenizer, the chat template and the end ids of
# generation_config.json (a resume refuses a model directory whose copies of these differ from
# the ones its checkpoint carries); derived, so an asset file added later is compared unless
# it is named above
TOKENISATION_FILES = tuple(name for name in ASSET_FILES if name not in NOT_TOKENISATION_FILES)
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


MAX_ASSET_FILE_BYTES = 1 << 28   # Qwen's tokenizer.json, the largest, is ~11 MB
JSON_OBJECT_ASSETS = tuple(n for n in ASSET_FILES if n.endswith(".json") and n != "tokenizer.json")


def refuse_irregular_assets(src: str | Path, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the file when one of `src`'s `ASSET_FILES` is there but is not a
    regular file (a named pipe, a directory, a broken symbolic link): a copy would leave it
    out without a word, and a reader (transformers' tokenizer loader) would wait on a pipe."""
    from jscenegen.paths import not_a_file

    for name in ASSET_FILES:
        f = Path(src) / name
        if os.path.lexists(f) and (why := not_a_file(f)):
            raise error(f"{f}: {why}; the model's {name} must be a regular file (or absent)")


def check_asset_files(src: str | Path, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the file when one of `src`'s `ASSET_FILES` is not a regular file
    (`refuse_irregular_assets`) or is beyond MAX_ASSET_FILE_BYTES, when one of its JSON files
    (`JSON_OBJECT_ASSETS`: generation config, tokenizer config, processor configs, ...) is not
    a JSON object (`paths.read_json_object`), or when `tokenizer.json` is not one the
    tokenizers library reads: a converted or exported model carries them as they are, and one
    that does not load is otherwise found only by its users (transformers' `from_pretrained`)."""
    import tokenizers

    from jscenegen.paths import read_json_object

    refuse_irregular_assets(src, error)
    present = [f for f in (Path(src) / name for name in ASSET_FILES) if f.is_file()]
    for path in present:
        if path.stat().st_size > MAX_ASSET_FILE_BYTES:
            raise error(f"{path}: {path.stat().st_size:,} bytes, more than a model's "
                        f"{path.name} holds (at most {MAX_ASSET_FILE_BYTES:,}: "
                        "jscenegen.model.assets.MAX_ASSET_FILE_BYTES)")
    for path in present:
        if path.name in JSON_OBJECT_ASSETS:
            read_json_object(path, error)
    tokenizer = Path(src) / "tokenizer.json"
    if tokenizer.is_file():
        try:
            tokenizers.Tokenizer.from_file(str(tokenizer))
        except Exception as err:   # the library raises its own Exception subclass
            raise error(f"{tokenizer}: not a tokenizer that tokenizers "
                        f"{tokenizers.__version__} reads ({str(err)[:200]})") from None


def copy_non_weights(src: str | Path, dst: str | Path, *, skip: tuple[str, ...] = ()) -> list[Path]:
    """Copy every regular file of `src` that is not a weight file nor named in `skip` into
    `dst`; returns the sources. Subdirectories are not copied; any other entry that is not a
    regular file (a named pipe, a broken link) is named in a warning, and so, in one warning,
    are the symbolic links other than `ASSET_FILES` that resolve outside `src` (a
    `notes.txt -> /tmp/secret.txt` would carry a file from elsewhere into a published model;
    the model's own files may link out). In a Hugging Face cache snapshot
    (`models--ORG--NAME/snapshots/REV/`, every file a link into `../../blobs`) outside means
    outside the repository's folder `models--ORG--NAME`."""
    from jscenegen.paths import not_a_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    root = Path(src).resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        root = root.parent.parent
    copied, outside = [], []
    for p in sorted(Path(src).iterdir()):
        if is_weight_file(p.name) or p.name in skip or p.is_dir():
            continue
        if why := not_a_file(p):
            log.warning("%s: %s; not copied", p, why)
            continue
        if p.is_symlink() and p.name not in ASSET_FILES and not p.resolve().is_relative_to(root):
            outside.append(p)
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p)
    if outside:
        log.warning("%s: not copied: symbolic links to files outside %s", ", ".join(
            f"{p} -> {p.resolve()}" for p in outside), root)
    return copied
