"""Train a small byte-level BPE tokenizer with ChatML special tokens (for tiny models).

Pre-tokenisation uses Qwen2's split pattern (tokenizers' `Split` + `ByteLevel`, as Qwen's
tokenizer.json declares), special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, and a
ChatML chat template, so `transformers.AutoTokenizer.from_pretrained` loads the result.
Real Qwen model directories keep their own tokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE_FILE = Path(__file__).with_name("templates") / "chatml.jinja"
QWEN35_PROTOCOL_TEMPLATE = Path(__file__).with_name("templates") / "qwen3_5_protocol.jinja"
# The Qwen3.5 tokenizer's special tokens that its config and chat template refer to (vision
# placeholders for the config's image/video token ids), and its added (non-special) tokens.
QWEN35_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN35_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                       "</tool_response>")


def chatml_template() -> str:
    """The ChatML chat template (jinja) jscenegen's trained tokenizers carry."""
    return CHAT_TEMPLATE_FILE.read_text(encoding="utf-8").strip()


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """A `transformers.PreTrainedTokenizerFast` trained on `texts` (byte-level BPE, ChatML).

    The vocabulary holds the 256 byte symbols, the merges learnt (up to `vocab_size` in all)
    and the three special tokens. eos = `<|im_end|>` (end of turn), pad = `<|endoftext|>`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = chatml_template()
    return fast


def train_qwen35_tokenizer(texts: Iterable[str], vocab_size: int = 8192):
    """`train_bpe_tokenizer` plus the Qwen3.5 special and added tokens (`QWEN35_*`), with the
    prefix-preserving Qwen3.5 protocol template (templates/qwen3_5_protocol.jinja) as its chat
    template: the tokenizer `jscenegen init-model --arch qwen3_5` writes."""
    tok = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *QWEN35_SPECIAL_TOKENS]})
    tok.add_tokens(list(QWEN35_ADDED_TOKENS), special_tokens=False)
    tok.chat_template = QWEN35_PROTOCOL_TEMPLATE.read_text(encoding="utf-8")
    return tok
