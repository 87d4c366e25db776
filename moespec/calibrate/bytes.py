"""A model's bytes per pass, split as seed 000 splits them (§1, eq. 5): routed expert bytes,
which a deduplicating kernel reads once per distinct expert of the pass, and the dense bytes D
that every pass reads once whatever the routing (attention, norms, routers, the output head,
shared experts, and the MLPs of dense layers). The plan records them beside its times."""

import numpy as np

from moespec.costmodel import pass_bytes, slot_expert_bytes, union_expert_bytes


def model_bytes(model, unions: np.ndarray) -> dict:
    """Bytes of a loaded model's passes of n = 1..n_max tokens, without the KV cache (whose
    bytes per cached position are given apart). unions: [L, n_max], U_l(n) per MoE layer."""
    sizes = model.parameter_bytes()
    expert_bytes = [block.experts.bytes_per_expert for block in model.moe_blocks.values()]
    total, top_k, dense = sum(expert_bytes), model.config.top_k, sizes["dense"]
    passes = range(1, unions.shape[1] + 1)
    cache = model.new_cache(capacity=1)
    return {
        "expert_bytes": expert_bytes,
        "total_expert_bytes": total,
        "dense_bytes": dense,
        "shared_expert_bytes": sizes["shared_experts"],
        "dense_mlp_bytes": sizes["dense_mlp"],
        "kv_bytes_per_position": cache.layer_bytes(1) * model.config.num_layers,
        "pass_bytes": {
            # exact integers; the mean unions make the deduplicated bytes fractional
            "slot": [int(pass_bytes(slot_expert_bytes(total, top_k, n), dense)) for n in passes],
            "dedup": [
                float(pass_bytes(union_expert_bytes(list(unions[:, n - 1]), expert_bytes), dense))
                for n in passes
            ],
        },
    }
