"""A tiny Qwen3 model directory with a real ChatML tokenizer trained on scripted-episode text
(built once per test process; shared by the tokenizer, sampler and rollout tests)."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

TINY_MODEL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                  num_attention_heads=4, num_key_value_heads=2)


@functools.cache
def dev_records():
    from jscenegen.scene.sceneset import read_scene_set

    return read_scene_set(Path(__file__).resolve().parents[1] / "data" / "scenes" / "dev.jsonl")


@functools.cache
def scripted_texts() -> tuple[str, ...]:
    from jscenegen.scene.expert import run_scripted_episode

    texts = []
    for record in dev_records()[:2]:
        _, chat = run_scripted_episode(record)
        texts += [m["content"] for m in chat]
    return tuple(texts)


@functools.cache
def chat_model_dir() -> Path:
    from jscenegen.model.init_model import init_model_dir

    root = Path(tempfile.mkdtemp(prefix="jscenegen-chat-"))
    atexit.register(shutil.rmtree, root, True)
    return init_model_dir(root / "tiny", arch="qwen3", texts=scripted_texts(), vocab_size=2048,
                          seed=0, **TINY_MODEL)


@functools.cache
def nfc_chat_model_dir() -> Path:
    """`chat_model_dir` with the NFC normaliser that Qwen2/2.5/3's tokenizer.json declare
    (`"normalizer": {"type": "NFC"}`; the fixture tokenizer itself has none)."""
    import json

    root = Path(tempfile.mkdtemp(prefix="jscenegen-chat-nfc-"))
    atexit.register(shutil.rmtree, root, True)
    target = Path(shutil.copytree(chat_model_dir(), root / "tiny"))
    spec = json.loads((target / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "NFC"}
    (target / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return target


# A tiny Qwen3.5 (3 Gated DeltaNet layers + 1 gated attention layer, a carried vision tower and
# MTP head) with the same protocol tokenizer: the trainer's Qwen3.5 tests.
TINY_QWEN35 = dict(hidden_size=64, intermediate_size=128, head_dim=16, num_attention_heads=4,
                   num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16)


@functools.cache
def qwen35_chat_model_dir() -> Path:
    from jscenegen.model.init_model import init_model_dir

    root = Path(tempfile.mkdtemp(prefix="jscenegen-chat35-"))
    atexit.register(shutil.rmtree, root, True)
    return init_model_dir(root / "tiny35", arch="qwen3_5", preset="micro", texts=scripted_texts(),
                          vocab_size=2048, seed=0, **TINY_QWEN35)
