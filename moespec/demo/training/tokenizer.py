"""The byte-level BPE tokenizer both demo models share, and the token windows they train on."""

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
)

from moespec.demo.training.corpus import EOS_TOKEN, Document


def train_tokenizer(texts: Sequence[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) with a single special token, id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # the full byte alphabet up front, so no input byte is ever unknown
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer saved with the checkpoints (EOS doubles as padding)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, model_max_length=1024
    )


def encode_documents(tok: Tokenizer, docs: Sequence[Document]) -> torch.Tensor:
    """One int64 token stream: each document's tokens followed by the EOS separator."""
    eos = tok.token_to_id(EOS_TOKEN)
    stream: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        stream.extend(enc.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.long)


def chunk_stream(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus shifted labels).

    Consecutive windows share one token so every token is predicted once; the tail that does
    not fill a window is dropped.
    """
    n = (stream.numel() - 1) // seq_len
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()
