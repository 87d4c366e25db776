"""The embedded demo pair, trained by scripts/train_demo.py and shipped with moespec:
a small Qwen3-MoE target (`target/`) and a dense Qwen3 draft (`draft/`) sharing one tokenizer,
so `moespec generate "..."` runs speculative MoE decoding on a fresh machine."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent


def demo_paths() -> tuple[Path, Path]:
    """(target checkpoint, draft checkpoint) directories of the embedded demo pair."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    for path in (target, draft):
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded demo model is missing from this installation ({path}); "
                "name a checkpoint directory instead"
            )
    return target, draft


def describe(path) -> str:
    """How to name a checkpoint in results: the demo pair by its place in the package
    ("moespec/demo/target"), anything else as given."""
    path = Path(path)
    try:
        return str(Path("moespec/demo") / path.resolve().relative_to(DEMO_DIR))
    except ValueError:
        return str(path)
