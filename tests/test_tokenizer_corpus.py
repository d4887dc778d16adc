"""The tokenizer trained on the protocol's own text (scene/corpus.py + model/tokenizer_build.py):
determinism, no dev scenes in the corpus, exact round trips, a saturated protocol vocabulary,
a prefix-preserving chat template for our turn structure, and loading through AutoTokenizer."""
import json

import pytest

from jscenegen.model.tokenizer.build import train_bpe_tokenizer
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.scene.actions import format_action
from jscenegen.scene.corpus import protocol_texts
from jscenegen.scene.expert import run_scripted_episode
from jscenegen.scene.generator import make_scene_set

from chat_fixtures import dev_records

N_SCENES = 8


@pytest.fixture(scope="module")
def texts():
    return list(protocol_texts(N_SCENES))


@pytest.fixture(scope="module")
def tokenizer(texts):
    return train_bpe_tokenizer(texts, vocab_size=8192)


@pytest.fixture(scope="module")
def dev_transcript():
    return run_scripted_episode(dev_records()[0])[1]


def test_corpus_is_deterministic_and_uses_training_scenes_only(texts):
    assert list(protocol_texts(2)) == texts[: len(list(protocol_texts(2)))]
    joined = "\n".join(texts)
    for record in make_scene_set("train", N_SCENES):
        assert record.scene.prompt in joined
    for record in dev_records():
        assert record.scene.prompt not in joined, record.scene.scene_id
    # system prompt, designer actions, critic grades and judge prompts are all there
    assert texts[0].startswith("You furnish rooms.")
    assert '{"ops": [{"op": "add_object"' in joined
    assert '"grades": {"realism":' in joined
    assert "strict, consistent judge" in joined


def test_protocol_vocabulary_saturates(tokenizer, texts):
    # BPE stops before 8192 entries because every pre-token of the protocol is already one
    # token: the protocol has about 1.3k distinct words and symbols, not 8k.
    assert 1000 < len(tokenizer) < 2000
    # every pre-token (Qwen split pattern + byte-level) of the protocol text is one token
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    for text in (texts[0], texts[1], texts[4]):  # system prompt, first user message, designer turn
        pieces = pre.pre_tokenize_str(text)
        assert len(tokenizer.encode(text, add_special_tokens=False)) == len(pieces)
    assert len(texts[0]) / len(pre.pre_tokenize_str(texts[0])) > 2.0
    # Qwen's split pattern keeps digits single: numbers cost one token per digit and symbol
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("3.1447", add_special_tokens=False)) == [
        "3", ".", "1", "4", "4", "7"]


def test_round_trips_protocol_text_exactly(tokenizer, dev_transcript):
    samples = [m["content"] for m in dev_transcript]
    samples += [
        format_action({"ops": [{"op": "move_object", "id": "double_bed_1", "position": [-0.125, 3.0e-3],
                                "yaw": 272.5}]}, "Move the bed 1.25 m left; keep 0.60 m clear."),
        json.dumps({"critique": "ünïcödé 床 🛏 — tabs\tand\r\nCRLF", "grades": {"realism": 10}}),
        "  leading spaces, trailing spaces  \n\n\n",
    ]
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_chat_template_is_prefix_preserving_for_episodes(tokenizer, dev_transcript):
    chat = ChatTokenizer(tokenizer, source="protocol tokenizer")  # probes the template
    assert chat.eot_token == "<|im_end|>"
    conv, tokens = chat.start(dev_transcript[0]["content"], dev_transcript[1]["content"])
    for m in dev_transcript[2:]:
        if m["role"] == "assistant":
            tokens += chat.encode(m["content"]) + [chat.eot_id]
            conv.add_assistant(m["content"], True)
        else:
            tokens += conv.user_segment(m["content"])
    messages = [{"role": m["role"], "content": m["content"]} for m in dev_transcript]
    # appending segment by segment gives exactly the template's rendering of the whole episode
    assert chat.decode(tokens) + "\n" == chat.render(messages, add_generation_prompt=False)
    # and the same tokens as tokenising that rendering in one go
    assert tokens == chat.encode(chat.render(messages, add_generation_prompt=False))[:len(tokens)]


def test_saved_tokenizer_loads_with_autotokenizer(tokenizer, tmp_path, dev_transcript):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = dev_transcript[3]["content"]
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    rendered = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
