"""The suffix drafter: its index finds every earlier match a scan finds, proposals continue the
match (round a loop), the counts set the survival and so the draft length, the corpus index
agrees with the context's, bad corpora are refused in one line, and greedy output is plain's."""

import random

import numpy as np
import pytest

from moespec.cli import main
from moespec.decoding import DraftLengthPolicy, generate
from moespec.decoding.draft_policy import RunningMedians
from moespec.decoding.suffix import (
    LEVELS,
    OCCURRENCES,
    ContextIndex,
    CorpusIndex,
    LevelPrior,
    NativeIndex,
    SuffixDrafter,
    _hash_levels,
)
from moespec.demo import demo_paths
from moespec.models import load_model


def scan_longest(tokens):
    """(level, earlier ends newest first) of the longest level whose n-gram ending `tokens`
    occurs earlier, found by a scan; (None, [])."""
    for level in range(len(LEVELS) - 1, -1, -1):
        n = LEVELS[level]
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tail]
        if ends:
            return level, ends[::-1]
    return None, []


def native_index():
    from moespec.kernels.native import native
    from tests.native import needs_library

    needs_library()  # skipped with the machine's reason only: a failed build fails
    assert native().has("moespec_suffix_new")
    return NativeIndex(native().lib)


INDEXES = {"python": ContextIndex, "native": native_index}


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("seed", range(4))
def test_index_finds_the_longest_earlier_match_and_its_occurrences_as_a_scan_does(seed, kind):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(20)]
    index = INDEXES[kind]()
    index.extend(tokens)
    for step in range(300):
        # text that repeats stretches of itself, with small alphabets for short matches
        if rng.random() < 0.5 and len(tokens) > 40:
            start = rng.randrange(len(tokens) - 40)
            new = tokens[start : start + rng.randrange(1, 40)]
        else:
            new = [rng.randrange(6 if rng.random() < 0.5 else 1000) for _ in range(3)]
        tokens += new
        index.extend(new)
        level, ends = scan_longest(tokens)
        assert index.longest() == level, step
        if level is not None:
            assert index.occurrences(level, OCCURRENCES) == ends[:OCCURRENCES], step


def test_the_native_index_is_the_python_index():
    """Same keys, matches and chains over a long sequence fed in uneven chunks (its tables and
    chains grow past their first capacity)."""
    rng = random.Random(7)
    python, native = ContextIndex(), native_index()
    tokens = []
    while len(tokens) < 6000:
        chunk = (
            tokens[-rng.randrange(1, 300) :][: rng.randrange(1, 12)]
            if tokens and rng.random() < 0.6
            else [rng.randrange(50_000) for _ in range(rng.randrange(1, 12))]
        )
        tokens += chunk
        python.extend(chunk)
        native.extend(chunk)
        level = python.longest()
        assert native.longest() == level
        for n in (1, 3, 32):
            if n <= len(tokens):
                assert native.suffix_hash(n) == python.suffix_hash(n)
        if level is not None:
            assert native.occurrences(level, OCCURRENCES) == python.occurrences(level, OCCURRENCES)
    assert native.tokens == python.tokens == tokens


def test_a_repeated_phrase_is_continued_and_a_loop_goes_round():
    drafter = SuffixDrafter()
    phrase = [10, 11, 12, 13, 14, 15, 16, 17]
    context = [1, 2] + phrase + [3, 4] + phrase[:3]
    draft = drafter.propose(context, 5)
    assert draft.tokens == phrase[3:8]
    # a loop of period 3 drafts past the context's end, round the loop
    loop = [7, 8, 9] * 4
    assert SuffixDrafter().propose(loop, 8).tokens == [7, 8, 9, 7, 8, 9, 7, 8]
    assert SuffixDrafter().propose([1, 2, 3], 4).tokens == []  # nothing repeats
    assert SuffixDrafter().propose([5], 4).tokens == []  # shorter than any match
    assert SuffixDrafter().propose([], 4).tokens == []


def test_survival_follows_how_often_the_continuation_followed():
    prior = LevelPrior()
    # "a b" was followed by "c" four times and by "x" once: the first draft is "c", likely
    context = [5, 6, 7, 0] * 4 + [5, 6, 99, 0] + [5, 6]
    draft = SuffixDrafter(prior=prior).propose(context, 3)
    assert draft.tokens == [7, 0, 5]
    s = draft.survival
    assert 1 > s[0] > s[1] > s[2] > 0
    # a continuation seen once is less likely than one seen four times out of four
    once = SuffixDrafter(prior=LevelPrior()).propose([5, 6, 7, 0, 1, 5, 6], 1).survival[0]
    four = SuffixDrafter(prior=LevelPrior()).propose([5, 6, 7, 0] * 4 + [5, 6], 1).survival[0]
    assert four > once
    # disagreement among the occurrences lowers the first position's survival
    split = [5, 6, 7, 1, 5, 6, 8, 1, 5, 6, 7, 1, 5, 6, 8, 1, 5, 6]
    assert SuffixDrafter(prior=LevelPrior()).propose(split, 1).survival[0] < four


def test_a_level_learns_its_acceptance_from_outcomes():
    prior = LevelPrior()
    before = prior.mean(0)
    for _ in range(20):
        prior.observe(0, 0, 1)
    assert prior.mean(0) < 0.1 < before
    restored = LevelPrior()
    restored.restore(prior.remember(8.0))
    assert restored.mean(0) == pytest.approx(prior.mean(0))
    assert sum(restored.remember(8.0)[0]) <= 8.0 + 1e-9


def test_a_level_whose_counts_overpromise_is_calibrated_down():
    drafter = SuffixDrafter()
    context = [5, 6, 7, 0, 1, 2, 3, 4, 6]  # "6" was followed by "7" once
    first = drafter.propose(context, 1).survival[0]
    for _ in range(30):  # ... and every such draft is rejected
        drafter.propose(context, 1)
        drafter.learn(0, 1)
    assert drafter.propose(context, 1).survival[0] < first / 3
    # a level whose drafts are accepted keeps its chances
    kept = SuffixDrafter()
    for _ in range(30):
        kept.propose(context, 1)
        kept.learn(1, 0)
    assert kept.propose(context, 1).survival[0] >= first


def test_the_draft_length_follows_the_survival():
    times = [1.0, 1.2, 1.4, 1.6, 1.8]  # V(k)
    policy = DraftLengthPolicy("auto", max_draft_length=4, step_times=times)
    # sure drafts: all four; (1 + 4) / 1.8 > 1 / 1
    assert policy.plan(4, [1.0, 1.0, 1.0, 1.0]).draft_length == 4
    # a first draft accepted one time in ten: (1 + 0.1) / 1.2 < 1: no draft
    assert policy.plan(4, [0.1, 0.01, 0.001, 0.0001]).draft_length == 0
    # two likely tokens, then unlikely ones: two
    assert policy.plan(4, [0.9, 0.8, 0.01, 0.001]).draft_length == 2
    # the throughput compared with other drafters is (1 + S_1 + ... + S_k) / V(k)
    plan = policy.plan(4, [0.9, 0.8, 0.01, 0.001])
    assert plan.throughput == pytest.approx((1 + 0.9 + 0.8) / 1.4)


def test_corpus_hashes_are_the_context_index_hashes():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5000, 200)
    hashes = _hash_levels(tokens)
    index = ContextIndex()
    index.extend(tokens.tolist())
    for n in LEVELS:
        for start in (0, 17, 200 - n):
            sub = ContextIndex()
            sub.extend(tokens[: start + n].tolist())
            assert int(hashes[n][start]) == sub.suffix_hash(n), (n, start)


class Words:
    """A tokenizer of whitespace-separated integers (what the corpus reader needs)."""

    def encode(self, text):
        return [int(w) for w in text.split()]


def test_corpus_matches_draft_what_followed_in_the_files(tmp_path):
    (tmp_path / "a.txt").write_text("1 2 3 4 5 6 7 8 9\n")
    corpus = CorpusIndex.from_files([tmp_path / "a.txt"], Words())
    drafter = SuffixDrafter(corpus)
    assert drafter.propose([50, 51, 3, 4, 5], 3).tokens == [6, 7, 8]
    assert drafter.last.source == "corpus"
    # the corpus ends: the draft stops there
    assert drafter.propose([7, 8], 5).tokens == [9]
    # a longer match in the context wins over a shorter one in the corpus
    context = [3, 4, 5, 40, 41, 42, 3, 4, 5]
    assert drafter.propose(context, 2).tokens == [40, 41]
    assert drafter.last.source == "context"


def test_a_corpus_past_the_limit_is_indexed_up_to_it_and_says_so(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("\n".join(" ".join(map(str, range(i, i + 10))) for i in range(5000)))
    corpus = CorpusIndex.from_files([path], Words(), max_tokens=1000)
    assert len(corpus.tokens) == 1000
    assert "limit" in corpus.note and "1,000 tokens" in corpus.note


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: (d / "empty.txt").write_text("") and d / "empty.txt", "empty"),
        (lambda d: (d / "bin.dat").write_bytes(b"1 2\0 3") and d / "bin.dat", "binary"),
        (lambda d: (d / "latin.txt").write_bytes(b"1 2 \xe9 3") and d / "latin.txt", "UTF-8"),
    ],
)
def test_a_bad_corpus_is_refused_naming_it(tmp_path, make, message):
    path = make(tmp_path)
    path = path if path else tmp_path
    with pytest.raises(ValueError, match=message):
        CorpusIndex.from_files([path], Words())


def test_cli_refuses_a_missing_corpus_in_one_line(tmp_path, capsys):
    assert main(["generate", "def f():", "--draft", f"suffix:{tmp_path / 'nope'}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0] and "nope" in err[0]


@pytest.fixture(scope="module")
def demo_target():
    model, tokenizer = load_model(demo_paths()[0])
    return model, tokenizer


def tokens_of(records):
    return [t for r in records for t in r.tokens]


@pytest.mark.parametrize(
    "text", ["def fibonacci(n):", "import os\nimport sys\nimport os\nimport sys\nimport"]
)
def test_suffix_drafting_is_exact_and_drafts_on_repeats(demo_target, text, tmp_path):
    model, tokenizer = demo_target
    prompt = tokenizer.encode(text)
    plain = tokens_of(generate(model, prompt, max_tokens=96))
    corpus_file = tmp_path / "corpus.py"
    corpus_file.write_text(text + tokenizer.decode(plain[:40]))
    corpus = CorpusIndex.from_files([corpus_file], tokenizer)
    for drafter in (SuffixDrafter(), SuffixDrafter(corpus)):
        records = list(generate(model, prompt, max_tokens=96, drafter=drafter))
        assert tokens_of(records) == plain
        assert sum(r.accepted for r in records) > 0


def test_verify_times_seeded_from_memory_count_as_measured():
    medians = RunningMedians()
    medians.seed({1: 1.0, 2: 1.5})
    assert medians.known() == {1: 1.0, 2: 1.5}
    medians.add(1, 2.0)  # counted, not dropped as a first sample: the median moves
    assert medians.known()[1] == pytest.approx(1.5)
