"""A random `LayerTiming` for a placed layer: what the decision tests feed the driver's finish."""

from moespec.offload.policies.base import LayerTiming


def random_timing(rng, layer, placed, row, *, rest=False) -> LayerTiming:
    """Seconds drawn from `rng` for the placed layer's tiers (each 0 where it computed no
    expert), and for a random copy count; rest: add a draw of time outside both tiers."""
    cpu, acc = rng.random(2) * 1e-3
    seconds = float(cpu + acc + rng.random() * 1e-4) if rest else float(cpu + acc)
    return LayerTiming(
        layer,
        seconds,
        float(cpu) if len(placed.cpu) else 0.0,
        int(row[placed.cpu].sum()),
        len(placed.cpu),
        float(acc) if len(placed.accelerator) else 0.0,
        len(placed.accelerator),
        float(rng.random()) * 1e-3,
        int(rng.integers(0, 3)),
    )
