import pytest
from hypothesis import settings

from tests.checkpoints import FAMILIES, hf_model, save_checkpoint

# Property tests are judged by their assertions, not their speed: a loaded 2-core machine
# makes single examples slow, and a deadline would fail them for it.
settings.register_profile("moespec", deadline=None)
settings.load_profile("moespec")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(family) -> (directory, transformers model): written once per session."""
    cache = {}

    def make(family: str):
        if family not in cache:
            model = hf_model(family)
            directory = save_checkpoint(model, tmp_path_factory.mktemp(family))
            cache[family] = (directory, model)
        return cache[family]

    return make


@pytest.fixture(scope="session")
def converted(checkpoint_dir, tmp_path_factory):
    """converted(weights) -> a converted directory of the tiny qwen3_moe (`moespec convert`),
    written once per session; tests that change files under it copy it first."""
    from moespec.models.converted import convert

    made = {}

    def make(weights: str):
        if weights not in made:
            out = tmp_path_factory.mktemp("converted") / weights
            convert(checkpoint_dir("qwen3_moe")[0], out, weights=weights)
            made[weights] = out
        return made[weights]

    return make


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def remembered_measurements(tmp_path, monkeypatch):
    """Each test remembers measurements in a file of its own (never the user's cache)."""
    path = tmp_path / "measurements.json"
    monkeypatch.setenv("MOESPEC_MEASUREMENTS", str(path))
    return path
