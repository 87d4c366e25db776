/* The suffix drafter's index in C (moespec/decoding/suffix.py's ContextIndex, the reference).
 *
 * Hashed n-grams of a growing token sequence at a few lengths ("levels"): per level, the latest
 * end of each n-gram's hash and, per position, the previous end of the n-gram ending there (a
 * chain of occurrences, newest first). An n-gram is indexed once the token after it is known.
 * The hash is the polynomial of moespec.decoding.suffix (h(t_0..t_i) = h(..t_{i-1}) B + t_i + 1,
 * wrapping mod 2^64; the n-gram ending at e is prefix[e + 1] - prefix[e + 1 - n] B^n), so the
 * corpus index (numpy) and both context indexes agree on every key.
 *
 * Why C: on the demo target a decode step takes 0.35-0.45 ms and streams the caches out, and
 * the Python index cost 6-7 us a token there and a proposal 40-65 us, a tenth of a step; here
 * a token costs a few hash-table probes.
 *
 * Per level, an open-addressing table (linear probing, power-of-two capacity, at most half
 * full) of (hash, latest end). Plain C: no ISA of its own.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LEVELS 16
#define BASE 0x9E3779B97F4A7C15ull

typedef struct {
    uint64_t *keys;
    int64_t *ends; /* -1: empty */
    int64_t capacity, used;
    int64_t *chain; /* chain[end]: the previous end of the n-gram ending at end, or -1 */
} Level;

typedef struct {
    int64_t n_levels, levels[MAX_LEVELS];
    uint64_t powers[MAX_LEVELS];
    uint64_t *prefix; /* prefix[i]: the hash of tokens[:i] */
    int64_t length, capacity, indexed;
    Level level[MAX_LEVELS];
} Index;

int moespec_suffix_version(void) { return 1; }

static uint64_t mix(uint64_t h) { /* the table's slot of a hash (its low bits are weak) */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static int grow_table(Level *L) {
    int64_t capacity = L->capacity ? 2 * L->capacity : 1024;
    uint64_t *keys = (uint64_t *)malloc((size_t)capacity * 8);
    int64_t *ends = (int64_t *)malloc((size_t)capacity * 8);
    if (!keys || !ends) {
        free(keys), free(ends);
        return 1;
    }
    for (int64_t i = 0; i < capacity; i++) ends[i] = -1;
    for (int64_t i = 0; i < L->capacity; i++) {
        if (L->ends[i] < 0) continue;
        int64_t slot = (int64_t)(mix(L->keys[i]) & (uint64_t)(capacity - 1));
        while (ends[slot] >= 0) slot = (slot + 1) & (capacity - 1);
        keys[slot] = L->keys[i], ends[slot] = L->ends[i];
    }
    free(L->keys), free(L->ends);
    L->keys = keys, L->ends = ends, L->capacity = capacity;
    return 0;
}

/* The slot of `key` in the level's table: where it is, or the empty slot where it would go. */
static int64_t find(const Level *L, uint64_t key) {
    int64_t mask = L->capacity - 1, slot = (int64_t)(mix(key) & (uint64_t)mask);
    while (L->ends[slot] >= 0 && L->keys[slot] != key) slot = (slot + 1) & mask;
    return slot;
}

void moespec_suffix_free(Index *x) {
    if (!x) return;
    for (int64_t l = 0; l < x->n_levels; l++) {
        free(x->level[l].keys), free(x->level[l].ends), free(x->level[l].chain);
    }
    free(x->prefix);
    free(x);
}

/* A new index over the n-gram lengths levels[0 .. n_levels - 1] (ascending); NULL on bad
 * arguments or without memory. */
Index *moespec_suffix_new(int64_t n_levels, const int64_t *levels) {
    if (n_levels < 1 || n_levels > MAX_LEVELS) return NULL;
    Index *x = (Index *)calloc(1, sizeof(Index));
    if (!x) return NULL;
    x->n_levels = n_levels;
    for (int64_t l = 0; l < n_levels; l++) {
        if (levels[l] < 1 || (l && levels[l] <= levels[l - 1])) {
            free(x);
            return NULL;
        }
        uint64_t p = 1;
        for (int64_t i = 0; i < levels[l]; i++) p *= BASE;
        x->levels[l] = levels[l], x->powers[l] = p;
    }
    x->capacity = 1024;
    x->prefix = (uint64_t *)malloc((size_t)(x->capacity + 1) * 8);
    int bad = !x->prefix;
    for (int64_t l = 0; l < n_levels && !bad; l++) {
        x->level[l].chain = (int64_t *)malloc((size_t)x->capacity * 8);
        bad = !x->level[l].chain || grow_table(&x->level[l]);
    }
    if (bad) {
        moespec_suffix_free(x);
        return NULL;
    }
    x->prefix[0] = 0;
    return x;
}

/* Append n tokens and index the n-grams that now have a next token. Returns 0, 1 without
 * memory (the index then holds what it held before the call's unindexed positions). */
int moespec_suffix_extend(Index *x, const int64_t *tokens, int64_t n) {
    if (x->length + n > x->capacity) {
        int64_t capacity = x->capacity;
        while (capacity < x->length + n) capacity *= 2;
        uint64_t *prefix = (uint64_t *)realloc(x->prefix, (size_t)(capacity + 1) * 8);
        if (!prefix) return 1;
        x->prefix = prefix;
        for (int64_t l = 0; l < x->n_levels; l++) {
            int64_t *chain = (int64_t *)realloc(x->level[l].chain, (size_t)capacity * 8);
            if (!chain) return 1;
            x->level[l].chain = chain;
        }
        x->capacity = capacity;
    }
    for (int64_t i = 0; i < n; i++) {
        x->prefix[x->length + 1] = x->prefix[x->length] * BASE + (uint64_t)tokens[i] + 1;
        x->length++;
    }
    for (int64_t end = x->indexed; end < x->length - 1; end++) {
        uint64_t after = x->prefix[end + 1];
        for (int64_t l = 0; l < x->n_levels; l++) {
            Level *L = &x->level[l];
            int64_t size = x->levels[l];
            if (size > end + 1) {
                L->chain[end] = -1;
                continue;
            }
            if (2 * (L->used + 1) > L->capacity && grow_table(L)) return 1;
            uint64_t key = after - x->prefix[end + 1 - size] * x->powers[l];
            int64_t slot = find(L, key);
            if (L->ends[slot] >= 0) {
                L->chain[end] = L->ends[slot];
            } else {
                L->chain[end] = -1;
                L->keys[slot] = key;
                L->used++;
            }
            L->ends[slot] = end;
        }
        x->indexed = end + 1;
    }
    return 0;
}

int64_t moespec_suffix_length(const Index *x) { return x->length; }

/* The hash of the sequence's last n tokens (0 when n is not in 1 .. its length). */
uint64_t moespec_suffix_hash(const Index *x, int64_t n) {
    if (n < 1 || n > x->length) return 0;
    uint64_t p = 1;
    for (int64_t i = 0; i < n; i++) p *= BASE;
    return x->prefix[x->length] - x->prefix[x->length - n] * p;
}

static int64_t latest(const Index *x, int64_t l) {
    int64_t n = x->levels[l];
    uint64_t key = x->prefix[x->length] - x->prefix[x->length - n] * x->powers[l];
    const Level *L = &x->level[l];
    return L->ends[find(L, key)];
}

/* The highest level (an index into levels) whose n-gram ending the sequence occurred before,
 * or -1. A match at a level implies one at every shorter level: a binary search. */
int64_t moespec_suffix_longest(const Index *x) {
    int64_t low = 0, high = x->n_levels - 1, found = -1;
    while (low <= high) {
        int64_t mid = (low + high) / 2;
        if (x->levels[mid] < x->length && latest(x, mid) >= 0)
            found = mid, low = mid + 1;
        else
            high = mid - 1;
    }
    return found;
}

/* The ends of the latest `limit` earlier occurrences of the level's n-gram ending the sequence,
 * newest first, into out; returns how many. */
int64_t moespec_suffix_occurrences(const Index *x, int64_t l, int64_t limit, int64_t *out) {
    if (l < 0 || l >= x->n_levels || x->levels[l] >= x->length) return 0;
    int64_t count = 0;
    for (int64_t end = latest(x, l); end >= 0 && count < limit; end = x->level[l].chain[end])
        out[count++] = end;
    return count;
}
