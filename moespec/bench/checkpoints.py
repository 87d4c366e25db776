"""Random checkpoints of real shapes for the benchmark scripts, written by transformers, with
the demo pair's text tokenizer (machine and version facts: `moespec.provenance`)."""

from pathlib import Path

import torch

# Random-weight shapes (time does not depend on the values). Expert shapes are the real models';
# `layers` is cut so the checkpoint fits a few GB.
SHAPES = {
    "olmoe": {
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "num_hidden_layers": 4,
    },
    "small": {
        "model_type": "olmoe",
        "hidden_size": 1024,
        "intermediate_size": 512,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_hidden_layers": 4,
    },
}


def random_checkpoint(shape: str, directory: Path, layers: int | None = None) -> Path:
    """A bf16 checkpoint of random weights written by transformers (reused if present), with a
    real text tokenizer (`write_text_tokenizer`)."""
    import transformers

    settings = dict(SHAPES[shape])
    if layers is not None:
        settings["num_hidden_layers"] = layers
    model_type = settings.pop("model_type")
    target = directory / f"{shape}-{settings['num_hidden_layers']}L"
    if (target / "config.json").exists():
        if not has_text_tokenizer(target):  # written before checkpoints had one
            write_text_tokenizer(target)
        return target
    config = transformers.AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.02)  # routers start at zero; give them real logits
    tmp = directory / f".{target.name}.tmp"
    model.save_pretrained(tmp)
    write_text_tokenizer(tmp)
    tmp.rename(target)
    return target


def write_text_tokenizer(directory: Path) -> None:
    """The demo pair's byte-level BPE (4,096 tokens, trained on the standard library's
    training files), so that text becomes a real token stream and routes as text does: a
    random-weight model of a real shape then sees the same workload in its trace, its
    benchmark windows and its verify passes. Ids stay below 4,096, within every shape's
    vocabulary."""
    import json
    import shutil

    from moespec.demo import demo_paths

    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    if vocab < 4096:
        raise ValueError(
            f"{directory}: a vocabulary of {vocab} is too small for the text tokenizer"
        )
    shutil.copy(demo_paths()[0] / "tokenizer.json", directory / "tokenizer.json")


def has_text_tokenizer(directory: Path) -> bool:
    import json

    path = directory / "tokenizer.json"
    return path.exists() and json.loads(path.read_text())["model"]["type"] == "BPE"
