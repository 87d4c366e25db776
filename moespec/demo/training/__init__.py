"""Training the embedded demo pair (run by scripts/train_demo.py; never imported at start-up).

corpus.py     the interpreter's standard-library sources, training and held-out files
tokenizer.py  the shared byte-level BPE and the token windows
configs.py    the target (tiny Qwen3-MoE) and draft (dense Qwen3) configurations, seeded
loop.py       the training loop: schedule, losses, deterministic kernels, the run's log
saving.py     Hugging Face checkpoints with the tokenizer
measure.py    held-out loss, the target's expert reuse, the draft's greedy acceptance
cards.py      the model cards
pipeline.py   the whole run, and the replay of a logged run's first steps
"""

from moespec.demo.training.configs import (
    build_model,
    file_sha256,
    make_draft_config,
    make_target_config,
)
from moespec.demo.training.corpus import build_corpus
from moespec.demo.training.loop import TrainSpec, deterministic_torch, train
from moespec.demo.training.pipeline import (
    OUTPUT_NAMES,
    environment,
    install_outputs,
    replay,
    train_and_evaluate,
)
from moespec.demo.training.saving import save_checkpoint
from moespec.demo.training.tokenizer import (
    chunk_stream,
    encode_documents,
    train_tokenizer,
    wrap_tokenizer,
)

__all__ = [
    "OUTPUT_NAMES",
    "TrainSpec",
    "build_corpus",
    "build_model",
    "chunk_stream",
    "deterministic_torch",
    "encode_documents",
    "environment",
    "file_sha256",
    "install_outputs",
    "make_draft_config",
    "make_target_config",
    "replay",
    "save_checkpoint",
    "train",
    "train_and_evaluate",
    "train_tokenizer",
    "wrap_tokenizer",
]
