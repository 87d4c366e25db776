"""Opening the offload engine for a model: the policy by name, the budget, the fit split."""

from moespec.errors import SettingError, setting


def open_engine(
    model,
    policy: str,
    budget_ratio: float | None = None,
    draft_length: int = 0,
    *,
    budget_bytes: int | None = None,
    device: str = "auto",
    fit_trace=None,
    disk: bool = False,
):
    """An OffloadEngine over the model's MoE blocks run by the named policy, under a cache
    budget of `budget_ratio` of all expert bytes (or `budget_bytes`), for speculative steps
    of `draft_length` drafted tokens (0: no speculation), started on `fit_trace` (a path to
    a routing trace) when given, else fitted on the prompt as it runs. None when the budget
    holds every expert: the model then runs in memory (`holds_every_expert` says so).
    With `disk`, the experts stay in the converted model's file and `budget_bytes` is the RAM
    cache's (`moespec.offload.engine.disk`, `disk_budget`)."""
    from moespec.offload.engine.executor import OffloadEngine, fits_in_memory

    chosen = checked_policy(policy, speculative=draft_length > 0)
    if disk:
        engine = open_disk_engine(model, chosen, budget_bytes, draft_length)
    else:
        budget, total = cache_budget(model, budget_ratio, budget_bytes)
        if fits_in_memory(budget, total):
            return None
        engine = OffloadEngine.for_model(
            model, chosen, budget, draft_length=draft_length, device=device
        )
    if fit_trace is not None:
        from moespec.routing import read_trace

        try:
            engine.start(read_trace(fit_trace))
        except BaseException:
            engine.close()
            raise
    return engine


def open_disk_engine(model, policy, budget_bytes: int, draft_length: int):
    """The engine over the disk tier of a converted model, with a RAM cache of `budget_bytes`."""
    from moespec.offload.engine.disk import DiskStore
    from moespec.offload.engine.executor import OffloadEngine

    store = DiskStore.for_model(model)
    try:
        return OffloadEngine.for_model(
            model, policy, budget_bytes, draft_length=draft_length, store=store
        )
    except BaseException:
        store.close()
        raise


def cache_budget(model, ratio: float | None = None, nbytes: int | None = None) -> tuple[int, int]:
    """(the expert cache's budget in bytes, all expert bytes) of a model."""
    from moespec.offload.engine.executor import expert_cache_budget, model_expert_bytes

    total, one = model_expert_bytes(model)
    return expert_cache_budget(total, one, ratio=ratio, nbytes=nbytes), total


def holds_every_expert(model, ratio: float | None = None, nbytes: int | None = None) -> bool:
    from moespec.offload.engine.executor import fits_in_memory

    return fits_in_memory(*cache_budget(model, ratio, nbytes))


def checked_policy(policy: str, speculative: bool):
    """The named policy, refused when it plans for decoding without a draft and the decoding
    speculates."""
    from moespec.offload import make_policy

    chosen = make_policy(policy)
    if speculative and not chosen.speculative:
        raise SettingError(
            f"{setting('offload', policy)} plans for decoding without a draft: add "
            f"{setting('draft', 'none')}"
        )
    return chosen
