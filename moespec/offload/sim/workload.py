"""What the simulator replays: a routing trace, its fit split, and the bytes outside the experts.

`synthetic_workload` builds a full-size trace for a named model shape from the locality process
fitted to a target rho(2) (the published value of the shape by default, with the popularity
skew that also gives the published rho(9), refitted at the local-popularity share asked for;
another target gets skew 0.5); `trace_workload` reads a recorded trace. A synthetic trace's fit
split is documents of its own (`fit_documents`), before the replayed ones (`documents`): a
placement is profiled on other requests than the one it serves, and with local popularity
(routing.synthetic) that is what it misses.

Dense bytes per layer (read once per pass, on the accelerator): the shared experts of the shape
plus an attention estimate of 4 d^2 bf16 weights (q, k, v, o at full width; grouped-query
attention reads less, so this errs towards slower passes for everyone).
"""

from dataclasses import dataclass

from moespec.routing import RoutingTrace

ATTENTION_BYTES_PER_HIDDEN2 = 4 * 2  # 4 d x d projections in bf16


@dataclass
class Workload:
    name: str
    trace: RoutingTrace
    fit_tokens: int  # the trace's first tokens: the fit split, not replayed
    dense_bytes_per_layer: float = 0.0
    hidden_size: int = 0

    def fit_trace(self) -> RoutingTrace:
        """The fit split as a trace of its own (for `policy.fit`)."""
        return self.trace.first_tokens(self.fit_tokens)


def synthetic_workload(
    model: str,
    *,
    tokens: int,
    fit_tokens: int = 512,
    reuse2: float | None = None,
    popularity_skew: float | None = None,
    documents: int = 1,
    fit_documents: int = 1,
    local_popularity: float = 0.0,
    seed: int = 0,
) -> Workload:
    from moespec.errors import SettingError, setting
    from moespec.routing.shapes import get_shape
    from moespec.routing.synthetic import (
        LocalityProcess,
        document_lengths,
        fit_popularity_skew,
        synthetic_trace,
    )

    shape = get_shape(model)
    target = reuse2 if reuse2 is not None else shape.published_reuse2
    if target is None:
        raise SettingError(f"{model} has no published rho(2): pass {setting('reuse2')}")
    published = target == shape.published_reuse2
    if popularity_skew is None and published and local_popularity == 0:
        popularity_skew = shape.popularity_skew  # fitted to rho(2) and rho(9) at beta = 0
    if popularity_skew is None and published and shape.published_reuse9 is not None:
        popularity_skew, _ = fit_popularity_skew(
            shape.num_experts,
            shape.top_k,
            target,
            shape.published_reuse9,
            seed=seed,
            local_popularity=local_popularity,
        )
    process = LocalityProcess(
        shape.num_experts,
        shape.top_k,
        popularity_skew=0.5 if popularity_skew is None else popularity_skew,
        local_popularity=local_popularity,
    ).fit(target, seed=seed)
    lengths = document_lengths(fit_tokens, fit_documents) + document_lengths(tokens, documents)
    trace = synthetic_trace(
        process,
        num_layers=shape.num_layers,
        lengths=lengths,
        expert_bytes=shape.expert_bytes,
        layer_indices=list(shape.layer_indices),
        model=model,
        seed=seed,
    )
    trace.metadata["target_reuse2"] = target
    # D_l of an MoE layer: attention and shared experts, plus its share of the dense layers'
    # MLPs (a step reads them once, like the rest of D).
    dense = ATTENTION_BYTES_PER_HIDDEN2 * shape.hidden_size**2 + shape.shared_expert_bytes
    dense += shape.dense_mlp_bytes / shape.num_layers
    return Workload(f"{model} rho2={target:g}", trace, fit_tokens, dense, shape.hidden_size)


def trace_workload(path, *, fit_fraction: float = 0.2) -> Workload:
    """A recorded trace: its first `fit_fraction` of tokens is the fit split."""
    from moespec.routing.store import read_trace

    if not 0 < fit_fraction < 1:
        raise ValueError(f"fit fraction must be in (0, 1), got {fit_fraction}")
    trace = read_trace(path)
    if trace.num_tokens < 2:
        raise ValueError(f"{path}: a trace of {trace.num_tokens} tokens is too short to replay")
    fit_tokens = max(1, int(trace.num_tokens * fit_fraction))
    return Workload(str(trace.model or path), trace, fit_tokens)
