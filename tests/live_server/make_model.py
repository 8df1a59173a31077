"""Make a tiny Llama checkpoint that vLLM can serve, without any model hub.

    python make_model.py DIR

Random weights from a fixed seed (so greedy answers are the same on every run and
at every tensor-parallel size), saved with save_pretrained, and a word-level
tokenizer built with the `tokenizers` package. Runs with the server's Python,
which has torch and transformers as vLLM's own dependencies. About 5 s.
"""
from __future__ import annotations

import json
import os
import sys

WORDS = 1000  # vocabulary: enough distinct tokens that a wrong answer shows


def make_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": len(vocab) + i for i in range(WORDS - len(vocab))})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)


def make_weights(directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=WORDS,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)


def main(argv: list[str]) -> int:
    [directory] = argv
    os.makedirs(directory, exist_ok=True)
    make_weights(directory)
    make_tokenizer(directory)
    with open(os.path.join(directory, "config.json")) as f:
        json.load(f)  # a torn save would fail here, not inside the server
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
