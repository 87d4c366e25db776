"""Saving a trained model with its tokenizer as a Hugging Face checkpoint, and loading one."""

import copy
import json
from pathlib import Path

import torch
import transformers
from transformers import (
    PreTrainedTokenizerFast,
)


def save_checkpoint(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Write a bf16 Hugging Face checkpoint folder (weights, config, generation config,
    tokenizer). The experts are written per expert (``mlp.experts.E.gate_proj.weight`` ...),
    transformers 5's default layout, and safetensors metadata is only ``{"format": "pt"}``."""
    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors arrive 0600 from transformers' temp-file write


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into ``out``."""
    tokenizer.save_pretrained(out)
    set_tokenizer_class(out / "tokenizer_config.json")


def set_tokenizer_class(path: Path) -> None:
    """Name the class ``PreTrainedTokenizerFast``: transformers 5 writes its new backend name,
    which transformers 4 cannot load; the old name loads the same tokenizer.json in both."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_shipped(path: Path) -> torch.nn.Module:
    """Load a saved checkpoint for evaluation: bf16-rounded weights, computed in fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
