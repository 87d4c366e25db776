"""Stopping a degenerate loop: output that ends in one n-gram repeated many times in a row.

A small model decoded greedily often falls into a cycle (`c_c_c_c_...`) that it never leaves;
every further token is the same few tokens again. `stop_repetition` wraps a record stream
(moespec.decoding.generate) and ends it once the emitted tokens end in `repeats` copies of one
n-gram (n = 1..max_ngram) spanning at least `min_tokens` tokens, with finish_reason
"repetition". The output is cut at the very token that completes the loop, whatever the
record sizes, so a speculative run stops on the same token as a plain run of the same tokens.
"""

from collections.abc import Iterator, Sequence

MAX_NGRAM = 32
MIN_TOKENS = 24


def repeated_tail(tokens: Sequence[int], max_ngram: int = MAX_NGRAM) -> tuple[int, int]:
    """(n, copies): the n-gram of 1..max_ngram tokens that the most consecutive copies end
    `tokens` with, by the span it covers (n * copies); (0, 0) for no tokens."""
    best = (0, 0)
    for n in range(1, min(max_ngram, len(tokens) // 2) + 1):
        # count how far back tokens[i] == tokens[i - n] holds from the end
        run = 0
        i = len(tokens) - 1
        while i - n >= 0 and tokens[i] == tokens[i - n]:
            run += 1
            i -= 1
        copies = (run + n) // n
        if copies >= 2 and n * copies > best[0] * best[1]:
            best = (n, copies)
    return best


def is_loop(tokens: Sequence[int], repeats: int, min_tokens: int = MIN_TOKENS) -> bool:
    """True when `tokens` end in `repeats` or more copies of one n-gram over >= min_tokens."""
    n, copies = repeated_tail(tokens[-(MAX_NGRAM * max(repeats, 2) + min_tokens) :])
    return copies >= repeats and n * copies >= min_tokens


def stop_repetition(records: Iterator, repeats: int, min_tokens: int = MIN_TOKENS) -> Iterator:
    """The records of `records` until the output loops (see module docstring); the last
    one then carries finish_reason "repetition" and the underlying generator is closed.
    repeats = 0 passes every record through."""
    if repeats < 0:
        raise ValueError(f"repeats must be >= 0, got {repeats}")
    emitted: list[int] = []
    for record in records:
        before = len(emitted)
        emitted.extend(record.tokens)
        if repeats and record.finish_reason is None and is_loop(emitted, repeats, min_tokens):
            end = next(
                i
                for i in range(before + 1, len(emitted) + 1)
                if is_loop(emitted[:i], repeats, min_tokens)
            )
            record.tokens = record.tokens[: end - before]
            record.finish_reason = "repetition"
            yield record
            close = getattr(records, "close", None)
            if close is not None:
                close()
            return
        yield record
