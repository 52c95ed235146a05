#!/usr/bin/env python3
"""Trains data/tokenizer.json, the demo's tokenizer, on the King James Bible.

A byte-level BPE laid out as Qwen2/Qwen3 ship theirs: NFC normalizer, the Qwen
Split regex (isolated) followed by ByteLevel without its own regex, ByteLevel
post-processor and decoder, and <|endoftext|> (the end-of-document token that
moetrain tokenize appends) plus <|im_start|> / <|im_end|> as special tokens;
4,096 ids in all. The corpus is
read the way data/make_kjv_corpus.py writes it (Debian's bible-kjv), so the two
agree on the text.

Run: python3 data/make_tokenizer.py [OUT.json]   (needs: pip install tokenizers)
"""
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_kjv_corpus import GROUPS, chapters  # noqa: E402

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen_style(vocab_size, texts):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def kjv_texts():
    for _, first, last in GROUPS:
        for heading, verses in chapters(first, last):
            yield heading + "\n\n" + "\n".join(verses) + "\n"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                               "tokenizer.json")
    tok = qwen_style(4096, list(kjv_texts()))
    tok.save(out)
    print(f"make_tokenizer: {tok.get_vocab_size()} ids -> {out}")


if __name__ == "__main__":
    main()
