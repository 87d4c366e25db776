"""Small hand-made routing traces and a brute-force reading of the reuse definitions."""

import numpy as np

from moespec.routing import RoutingTrace


def make_trace(documents, num_experts: int, *, expert_bytes=None, weights=False) -> RoutingTrace:
    """documents: {name: token sets} with token sets [T_d, L, m], or [T_d] when L = m = 1."""
    arrays = []
    id_dtype = np.int16 if num_experts <= 32768 else np.int32
    for ids in documents.values():
        ids = np.asarray(ids, id_dtype)
        arrays.append(ids.reshape(len(ids), 1, 1) if ids.ndim == 1 else ids)
    ids = np.concatenate(arrays)
    layers = ids.shape[1]
    gate = None
    if weights:
        gate = np.random.default_rng(0).random(ids.shape, dtype=np.float32)
    return RoutingTrace(
        expert_ids=ids,
        doc_starts=np.concatenate([[0], np.cumsum([len(a) for a in arrays])]),
        doc_names=list(documents),
        num_experts=num_experts,
        expert_bytes=list(expert_bytes or [1] * layers),
        layer_indices=list(range(layers)),
        gate_weights=gate,
    )


def brute_force(trace: RoutingTrace, max_n: int):
    """(rho_hat [L, n_max], U_hat [L, n_max]) straight from the definitions, window by window."""
    layers, m = trace.num_layers, trace.top_k
    reused = np.zeros((layers, max_n))
    distinct = np.zeros((layers, max_n))
    windows = np.zeros(max_n)
    for _, ids in trace.documents():
        for n in range(1, max_n + 1):
            for t in range(len(ids) - n + 1):
                windows[n - 1] += 1
                for layer in range(layers):
                    sets = [set(ids[u, layer].tolist()) for u in range(t, t + n)]
                    earlier = set().union(*sets[:-1])
                    reused[layer, n - 1] += len(sets[-1] & earlier)
                    distinct[layer, n - 1] += len(set().union(*sets))
    with np.errstate(invalid="ignore"):
        return reused / (m * windows), distinct / windows
