"""Several sequences in one model pass: batched decoding, each sequence exactly as if alone.

`batch_pass` feeds B sequences their next tokens (a decode step's one, a verification's k + 1,
a prompt) at the ends of their own caches, of any lengths and positions, and returns each
sequence's logits. Where the native pass runs (moespec.models.native_step), their rows go
through one native call (`NativeStep.batch`: step.c's `moespec_step_batch`): the norms,
projections, router, experts and head take all the rows at once, so every weight is read once
for the batch and the deduplicating expert order reads each distinct expert once for all
sequences (the union of their experts: what makes a batch of an MoE model cheaper per token
than its sequences one by one), while each sequence's rows are rotated at its own positions,
written to its own cache and attend over its own positions only. The native products and
attention give every row its one-row bits whatever else a pass holds, so each sequence's
logits are bit for bit those of its own pass.

A sequence the native pass would not run alone (no native pass, fp32, a kernel it does not
compute, a captured one-token step, more than MAX_TOKENS tokens) runs alone, through the
model's own forward, and so does a sequence left on its own (a batch of one, or the last of
a batch split past MAX_TOKENS): the batch then changes nothing but the order of the passes.
"""

import torch

from moespec.models.native_step import MAX_TOKENS


def batch_pass(
    model, feeds, caches, *, kernel: str, all_logits: bool = False, sinks=None
) -> list[torch.Tensor]:
    """Logits of B sequences' next passes: feeds[b] (a 1-D int64 tensor or a list of token
    ids, at least one) fed at the end of caches[b] (one cache per sequence, batch 1). Returns
    per sequence float32 logits [T_b, V] (all_logits) or [1, V] (its last row), each equal to
    `model(feeds[b][None], caches[b], kernel=kernel, all_logits=all_logits)[0]`, and advances
    each cache by T_b. kernel: the expert kernel (the caller picks it for the pass's total
    tokens). sinks: None, or per sequence a routing sink (or None), called per MoE layer with
    that sequence's expert ids and weights. Bad input raises before any cache is touched."""
    feeds = [_tokens(feed, b) for b, feed in enumerate(feeds)]
    _check(feeds, caches, sinks)
    sinks = sinks if sinks is not None else [None] * len(feeds)
    native = [b for b, f in enumerate(feeds) if model.native_for(len(f), kernel) is not None]
    groups = [g for g in _groups(native, [len(f) for f in feeds]) if len(g) > 1]
    # a group of one is the single path's pass (less to set up): it runs as alone
    alone = sorted(set(range(len(feeds))) - {b for group in groups for b in group})
    if len(groups) + len(alone) > 1:  # a later pass's bad token must not find earlier ones run
        _check_vocabulary(model, feeds)
    try:
        return _passes(model, feeds, caches, groups, alone, kernel, all_logits, sinks)
    except IndexError:  # one pass refused a token before it wrote: say which sequence's
        _check_vocabulary(model, feeds)
        raise


def _passes(model, feeds, caches, groups, alone, kernel, all_logits, sinks) -> list:
    """Each group's sequences in one native pass, the others each alone."""
    out = [None] * len(feeds)
    for group in groups:
        logits = model.native_step().batch(
            [feeds[b] for b in group],
            [caches[b] for b in group],
            kernel=kernel,
            all_logits=all_logits,
            sinks=[sinks[b] for b in group],
        )
        for b, x in zip(group, logits, strict=True):
            out[b] = x
    for b in alone:  # as the model runs it alone
        pass_ = model(
            feeds[b][None], caches[b], kernel=kernel, all_logits=all_logits, routing_sink=sinks[b]
        )
        out[b] = pass_[0]  # [T_b or 1, V]
    return out


def _tokens(feed, b: int) -> torch.Tensor:
    """Sequence b's feed as a contiguous int64 [T_b]."""
    if (  # as a decode loop gives it: taken as it is
        isinstance(feed, torch.Tensor)
        and feed.dtype == torch.int64
        and feed.dim() == 1
        and feed.numel()
        and feed.is_contiguous()
    ):
        return feed
    tokens = torch.as_tensor(feed)
    if tokens.dim() != 1 or tokens.numel() < 1:
        raise ValueError(
            f"sequence {b}: a feed is a 1-D run of at least one token, got {tuple(tokens.shape)}"
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"sequence {b}: token ids are integers, got {tokens.dtype}")
    return tokens.to(torch.int64).contiguous()


def _check(feeds: list[torch.Tensor], caches, sinks) -> None:
    """Refuse a batch the passes would get wrong, before any cache is touched."""
    if len(feeds) != len(caches) or (sinks is not None and len(sinks) != len(feeds)):
        raise ValueError(
            f"one cache (and sink) per sequence: {len(feeds)} feeds, {len(caches)} caches"
            + ("" if sinks is None else f", {len(sinks)} sinks")
        )
    if len({id(c) for c in caches}) != len(caches):  # two feeds would write one position
        raise ValueError("each sequence needs its own cache: a cache appears twice in the batch")
    for b, cache in enumerate(caches):
        if cache.keys[0].shape[0] != 1:
            raise ValueError(
                f"sequence {b}: a cache of batch 1 per sequence, got a batch of "
                f"{cache.keys[0].shape[0]}"
            )


def _check_vocabulary(model, feeds: list[torch.Tensor]) -> None:
    """Refuse token ids outside the vocabulary, naming the first sequence with one."""
    vocab = model.config.vocab_size
    low, high = torch.aminmax(torch.cat(feeds))  # one check for all
    if int(low) < 0 or int(high) >= vocab:
        b = next(b for b, f in enumerate(feeds) if f.min() < 0 or f.max() >= vocab)
        raise IndexError(
            f"sequence {b}: token ids outside the vocabulary (0-{vocab - 1}) in {feeds[b]}"
        )


def _groups(sequences: list[int], lengths: list[int]) -> list[list[int]]:
    """The sequences in order, in runs of at most MAX_TOKENS tokens: one native pass each."""
    groups, tokens = [], MAX_TOKENS + 1
    for b in sequences:
        if tokens + lengths[b] > MAX_TOKENS:
            groups.append([])
            tokens = 0
        groups[-1].append(b)
        tokens += lengths[b]
    return groups
