/* moespec's native products for passes of a few rows: out[r, o] = sum_j x[r, j] W[o, j].
 *
 * x bf16 [R, I], out bf16 [R, O], rounded once to nearest even; W bf16 or int8 (with a bf16
 * scale per output row) in the pair layout (moespec_*_pairs*: the engine's paths), or bf16 /
 * int8 [O, I] row by row (candidates). bf16 accumulates in fp32; int8 quantizes each input row
 * to int16 and accumulates in int32 blocks, then fp32. Each output element is one dot product
 * in one fixed order whatever R is, and no accumulation crosses rows, so a pass of n rows
 * gives every row the bits of a one-row pass (batch-invariant by construction). Output rows
 * are split over the threads in contiguous blocks (OpenMP, static), so each thread streams its
 * part of W once. The one-row attention of a decode step is here too (the end of the file).
 *
 * Each ISA's functions carry their own target attribute: one build runs on any x86-64 CPU
 * and the caller chooses the functions the CPU has (moespec/kernels/native.py).
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int moespec_native_version(void) { return 4; }

/* Every exported function checks the integers its loops trust before it reads or writes a byte
 * (O(1), or O(n) over a batch's products): one out of bounds returns minus its position in the
 * call, counted from 1, so that moespec/kernels/native.py raises a ValueError naming it where a
 * bad call used to crash the process. Pointers cannot be checked: the callers pass tensors of
 * the sizes these integers describe. */
#define REFUSE(bad, position)                                                                \
    do {                                                                                     \
        if (bad) return -(position);                                                         \
    } while (0)
/* the same, for a check that gives the refused position itself (0: none refused) */
#define REFUSE_AT(position)                                                                  \
    do {                                                                                     \
        int refused_ = (position);                                                           \
        if (refused_) return -refused_;                                                      \
    } while (0)

/* A single product's shapes (O, I, R, threads at positions at + 1 .. at + 4): the position of
 * the first out of bounds, or 0. */
static int product_refused(int64_t O, int64_t I, int64_t R, int threads, int at) {
    return O < 0 ? at + 1 : I < 1 ? at + 2 : R < 0 ? at + 3 : threads < 1 ? at + 4 : 0;
}

/* A batch's shapes and every product's rows within its input (the bf16 batches' positions;
 * the int8 ones hold the scales at 3, so `at` 1 shifts the positions past it): the position of
 * the first out of bounds, or 0. The output rows are the caller's to size (`batch_products`
 * checks them against the tensor it allocates). */
static int batch_refused(int64_t n, int64_t x_rows, const int64_t *xrow, const int64_t *count,
                         const int64_t *orow, int64_t O, int64_t I, int threads, int at) {
    if (n < 0) return 1;
    if (x_rows < 0) return 4 + at;
    if (O < 0) return 9 + at;
    if (I < 1) return 10 + at;
    if (threads < 1) return 11 + at;
    for (int64_t k = 0; k < n; k++) {
        if (count[k] < 0) return 6 + at;
        if (xrow[k] < 0 || xrow[k] > x_rows - count[k]) return 5 + at;
        if (orow[k] < 0) return 8 + at;
    }
    return 0;
}

/* The attention's shapes, refused at the positions in `at` (H, G, L, D, Dv, the four strides,
 * threads): H query heads in groups of G per key head, at least one position. */
static int attend_refused(int64_t H, int64_t G, int64_t L, int64_t D, int64_t Dv, int64_t k_head,
                          int64_t k_row, int64_t v_head, int64_t v_row, int threads,
                          const int at[10]) {
    int64_t bad[10] = {H < 1,      G < 1 || (H >= 1 && H % G), L < 1,      D < 1, Dv < 1,
                       k_head < 0, k_row < 0,                  v_head < 0, v_row < 0,
                       threads < 1};
    for (int i = 0; i < 10; i++)
        if (bad[i]) return at[i];
    return 0;
}


#define TILE 4 /* input rows per tile of the row-by-row candidates */
#define PAIR_GROUP 64 /* output rows per group of the pair and group layouts */
#define PAIR_ROWS 6   /* input rows per AVX-512 sweep: 24 accumulators, 4 weights, 1 input */
#define HALF_ROWS 2   /* input rows per AVX2 sweep of half a group: 8 accumulators */

/* The row-by-row candidates: the row is cut in chunks of one vector, chunk c goes to
 * accumulator c % 2, a ragged last chunk is masked (or, on AVX2, summed in scalar order after),
 * and the two accumulators are added, then their lanes. Inputs are taken in tiles of up to
 * TILE rows, interleaved chunk by chunk so a tile's loads are contiguous.
 *
 * The tiles' inputs, chunk-interleaved: rows t..t+n-1 of x (n = min(TILE, R - t)) as
 * [chunks][n][lanes] at offset t * chunks * lanes, in bf16 (wide = 0) or fp32 (wide = 1), the
 * ragged last chunk zero-padded. One allocation per call; NULL when out of memory. */
static void *interleave(const uint16_t *x, int64_t R, int64_t I, int lanes, int wide) {
    int64_t chunks = (I + lanes - 1) / lanes, size = R * chunks * lanes * (wide ? 4 : 2);
    void *buf = aligned_alloc(64, (size_t)(size + 64) / 64 * 64); /* not 0 bytes: R may be 0 */
    if (!buf) return NULL;
    if (I % lanes) memset(buf, 0, (size_t)size);
    for (int64_t t = 0; t < R; t += TILE) {
        int64_t n = R - t < TILE ? R - t : TILE, base = t * chunks * lanes;
        for (int64_t r = 0; r < n; r++)
            for (int64_t c = 0; c < chunks; c++) {
                const uint16_t *from = x + (t + r) * I + c * lanes;
                int64_t count = I - c * lanes < lanes ? I - c * lanes : lanes;
                int64_t at = base + (c * n + r) * lanes;
                if (!wide) {
                    memcpy((uint16_t *)buf + at, from, (size_t)count * 2);
                } else {
                    float *to = (float *)buf + at;
                    for (int64_t k = 0; k < count; k++) to[k] = from_bf16(from[k]);
                }
            }
    }
    return buf;
}

/* One function per tile height (the accumulators of a constant height live in registers),
 * chosen per tile through a table. */
#define TILE_FUNCTION(NAME, TARGET, WTYPE, XTYPE, N)                                         \
    TARGET __attribute__((noinline)) static void NAME##_##N(const WTYPE *w, int64_t I,        \
                                                            const XTYPE *xt, float *sums) {   \
        NAME(w, I, xt, N, sums);                                                             \
    }
#define TILE_FUNCTIONS(NAME, TARGET, WTYPE, XTYPE)                                            \
    TILE_FUNCTION(NAME, TARGET, WTYPE, XTYPE, 1)                                             \
    TILE_FUNCTION(NAME, TARGET, WTYPE, XTYPE, 2)                                             \
    TILE_FUNCTION(NAME, TARGET, WTYPE, XTYPE, 3)                                             \
    TILE_FUNCTION(NAME, TARGET, WTYPE, XTYPE, 4)                                             \
    static void (*const NAME##_by_rows[TILE + 1])(const WTYPE *, int64_t, const XTYPE *,     \
                                                   float *) = {NULL, NAME##_1, NAME##_2,     \
                                                               NAME##_3, NAME##_4};

/* Every output row against every tile of inputs; output rows split over the threads. */
#define PRODUCT(TILE_FN, WTYPE, XTYPE, LANES, SCALE)                                         \
    int64_t chunks = (I + LANES - 1) / LANES;                                                \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
    for (int64_t o = 0; o < O; o++) {                                                        \
        const WTYPE *w = (const WTYPE *)W + o * I;                                           \
        float sums[TILE];                                                                    \
        for (int64_t t = 0; t < R; t += TILE) {                                              \
            int n = (int)(R - t < TILE ? R - t : TILE);                                      \
            TILE_FN##_by_rows[n](w, I, (const XTYPE *)xi + t * chunks * LANES, sums);        \
            for (int r = 0; r < n; r++) out[(t + r) * O + o] = to_bf16(sums[r] SCALE);       \
        }                                                                                    \
    }

/* x bf16 [R, I] -> fp32 [R, xs] (zero-padded past I), NULL without memory */
static float *widen_rows(const uint16_t *x, int64_t R, int64_t I, int64_t xs) {
    float *xf = (float *)calloc((size_t)(R * xs) + 1, 4); /* + 1: R may be 0 */
    if (xf)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < I; j++) xf[r * xs + j] = from_bf16(x[r * I + j]);
    return xf;
}

/* ---------------------------------------------------------------- int8 pairs, int16 inputs */
#define Q_MAX 32767
#define Q_BLOCK 128 /* pairs per int32 block: 128 * 2 * 32767 * 127 < 2^31 */

/* x bf16 [R, I] -> int16 [R, xs] (zero-padded past I) and a scale per row: q = round(x / s),
 * s = max|x| / 32767 (0 for an all-zero row; NaN for a row holding a NaN or an infinity, so
 * that its outputs are NaN and the fault shows). NULL without memory. */
static int16_t *quantize_rows(const uint16_t *x, int64_t R, int64_t I, int64_t xs, float *scale) {
    int16_t *q = (int16_t *)calloc((size_t)(R * xs) + 1, 2); /* + 1: R may be 0 */
    if (!q) return NULL;
    for (int64_t r = 0; r < R; r++) {
        float m = 0.0f;
        int finite = 1;
        for (int64_t j = 0; j < I; j++) {
            float a = fabsf(from_bf16(x[r * I + j]));
            finite &= a <= FLT_MAX; /* false for NaN and infinity */
            m = a > m ? a : m;
        }
        if (!finite) {
            scale[r] = NAN; /* the row's q stay 0 */
            continue;
        }
        scale[r] = m / Q_MAX;
        float inv = m > 0.0f ? Q_MAX / m : 0.0f;
        for (int64_t j = 0; j < I; j++) {
            float v = nearbyintf(from_bf16(x[r * I + j]) * inv);
            q[r * xs + j] = (int16_t)(v > Q_MAX ? Q_MAX : v < -Q_MAX ? -Q_MAX : v);
        }
    }
    return q;
}

/* The int8 batches' inputs: X quantized (`quantize_rows`) into rows of xs = I rounded up to
 * even, their scales in *scale. NULL (nothing left allocated) without memory. */
static int16_t *quantized_input(const uint16_t *X, int64_t x_rows, int64_t I, float **scale) {
    *scale = (float *)malloc((size_t)x_rows * 4 + 4);
    int16_t *xq = *scale ? quantize_rows(X, x_rows, I, (I + 1) / 2 * 2, *scale) : NULL;
    if (!xq) free(*scale);
    return xq;
}

#ifndef MOESPEC_NO_AVX512
/* ---------------------------------------------------------------- AVX-512 */
/* The AVX-512 pair sweeps prefetch the weights AHEAD_BYTES ahead of the loads (16 bf16 or 32
 * int8 pairs of a group): the hardware prefetchers alone kept too few lines in flight on an
 * Intel host with AMX (a 2-core KVM guest), where one [2048, 2048] product streamed from
 * memory went from 11.4 to 15.4 GB/s in bf16 at one row and 1 thread (21.3 to 28.8 at 2
 * threads, 5.7 to 8.0 at 9 rows) and from 10.6 to 13.1 in int8 (5.7 to 7.5 at 9 rows), of
 * 16-18 GB/s a plain read gets (`benchmarks/cpu_paths.py --rows R --threads T --before-rev
 * REV`). Of 0.5, 1, 2, 4 and 8 KiB ahead, 4 KiB was the best, or within 4% of it, at 1, 2,
 * 6 and 9 rows and at 1 and 2 threads there; the demo's weights, which stay in the cache,
 * lost nothing. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 4096
#endif

#define DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define F5_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

/* int8 weights, fp32 inputs, FMA: chunks of 16 weights, one weight row per tile. (This and the
 * AVX2 loops below are candidates benchmarks/cpu_paths.py times, not paths the engine takes.) */
F5_TARGET INLINE void f5_tile(const int8_t *w, int64_t I, const float *xt, const int RT,
                              float *sums) {
    __m512 a[TILE], b[TILE];
    for (int r = 0; r < RT; r++) a[r] = b[r] = _mm512_setzero_ps();
    int64_t full = I / 16, c = 0;
#define WIDEN8(ptr) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(ptr))))
    for (; c + 2 <= full; c += 2) {
        __m512 w0 = WIDEN8(w + c * 16), w1 = WIDEN8(w + c * 16 + 16);
        for (int r = 0; r < RT; r++) {
            a[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt + (c * RT + r) * 16), a[r]);
            b[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + ((c + 1) * RT + r) * 16), b[r]);
        }
    }
    int left = (int)(I - c * 16); /* 0..31: chunk c (to a), then chunk c + 1 (to b) */
    for (int half = 0; half < 2 && left > 0; half++, c++, left -= 16) {
        __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w + c * 16)));
        for (int r = 0; r < RT; r++) {
            __m512 xv = _mm512_loadu_ps(xt + (c * RT + r) * 16);
            if (half == 0) a[r] = _mm512_fmadd_ps(wv, xv, a[r]);
            else b[r] = _mm512_fmadd_ps(wv, xv, b[r]);
        }
    }
    for (int r = 0; r < RT; r++) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r], b[r]));
}
TILE_FUNCTIONS(f5_tile, F5_TARGET, int8_t, float)

/* bf16 weights in the pair-interleaved layout `vdpbf16ps` multiplies ("VNNI"), in groups of 64
 * output rows: each group is [I/2][64][2], so that one 64-byte load holds a pair of weights for
 * 16 outputs, one broadcast pair of inputs multiplies them, and a group streams from memory
 * as one contiguous run. Each output is one chain over the pairs j = 0, 2, 4, ... in order
 * (one accumulator lane), whatever R and the row tiling: batch-invariant. The conversion to
 * this layout is moespec/kernels/native.py's `pack_pairs`; rows and columns are zero-padded to
 * 64 and 2. */

DP_TARGET INLINE void pairs_sweep(const uint16_t *P, int64_t JP, const uint16_t *x, int64_t xs,
                                  const int NR, uint16_t *out, int64_t O, int64_t o0) {
    __m512 acc[PAIR_ROWS][4];
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < 4; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < JP; jp++) {
        const uint16_t *pw = P + jp * 2 * PAIR_GROUP;
        for (int l = 0; l < 4; l++) /* the pair's 256 bytes, AHEAD_BYTES on */
            _mm_prefetch((const char *)pw + AHEAD_BYTES + l * 64, _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(pw), w1 = (__m512bh)_mm512_loadu_si512(pw + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(pw + 64), w3 = (__m512bh)_mm512_loadu_si512(pw + 96);
        for (int r = 0; r < NR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * jp, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xv);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xv);
        }
    }
    for (int b = 0; b < 4; b++) {
        int64_t o = o0 + 16 * b, left = O - o;
        if (left <= 0) break;
        __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < NR; r++)
            _mm256_mask_storeu_epi16(out + r * O + o, m, (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
    }
}

#define SWEEP(NR_)                                                                           \
    DP_TARGET __attribute__((noinline)) static void sweep_##NR_(                             \
        const uint16_t *P, int64_t JP, const uint16_t *x, int64_t xs, uint16_t *out, int64_t O, \
        int64_t o0) {                                                                        \
        pairs_sweep(P, JP, x, xs, NR_, out, O, o0);                                          \
    }
SWEEP(1) SWEEP(2) SWEEP(3) SWEEP(4) SWEEP(5) SWEEP(6)

typedef void (*sweep_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *,
                         int64_t, int64_t);
static const sweep_fn SWEEPS[PAIR_ROWS] = {sweep_1, sweep_2, sweep_3, sweep_4, sweep_5, sweep_6};

/* A batch of n products of one shape (a layer's experts): product k multiplies rows
 * xrow[k] .. xrow[k] + count[k] - 1 of X by weight k into rows orow[k] .. of out. One parallel
 * loop over every (product, group) in order, so a layer's products cost one fork and join,
 * and each product's outputs are what a call of its own gives. The single-product functions
 * are batches of one. Returns 1 without memory, 2 on an odd width (pairs only; the caller
 * pads such inputs itself, see moespec_bf16_pairs). */
#define BATCH_LOOP(ITEM)                                                                     \
    int64_t groups = (O + PAIR_GROUP - 1) / PAIR_GROUP;                                      \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
    for (int64_t item = 0; item < n * groups; item++) {                                      \
        int64_t k = item / groups, g = item % groups;                                        \
        for (int64_t t = 0; t < count[k]; t += ROWS_PER_SWEEP) {                             \
            int nr = (int)(count[k] - t < ROWS_PER_SWEEP ? count[k] - t : ROWS_PER_SWEEP);   \
            ITEM;                                                                            \
        }                                                                                    \
    }

#define ROWS_PER_SWEEP PAIR_ROWS
DP_TARGET int moespec_bf16_pairs_batch(int64_t n, const uint64_t *weights, const uint16_t *X,
                                       int64_t x_rows, const int64_t *xrow, const int64_t *count,
                                       uint16_t *out, const int64_t *orow, int64_t O, int64_t I,
                                       int threads) {
    REFUSE_AT(batch_refused(n, x_rows, xrow, count, orow, O, I, threads, 0));
    if (I % 2) return 2;
    int64_t JP = I / 2;
    BATCH_LOOP(SWEEPS[nr - 1]((const uint16_t *)weights[k] + g * JP * 2 * PAIR_GROUP, JP,
                              X + (xrow[k] + t) * I, I, out + (orow[k] + t) * O, O,
                              g * PAIR_GROUP))
    return 0;
}
#undef ROWS_PER_SWEEP

DP_TARGET int moespec_bf16_pairs(const uint16_t *P, const uint16_t *x, uint16_t *out, int64_t O,
                                 int64_t I, int64_t R, int threads) {
    REFUSE_AT(product_refused(O, I, R, threads, 3));
    uint16_t *xp = NULL;
    if (I % 2) { /* the pair broadcast reads x two at a time: pad each row with a zero */
        xp = (uint16_t *)calloc((size_t)(R * (I + 1)), 2);
        if (!xp) return 1;
        for (int64_t r = 0; r < R; r++) memcpy(xp + r * (I + 1), x + r * I, (size_t)I * 2);
        x = xp;
        I += 1; /* the padded layout holds the zero column too */
    }
    uint64_t w = (uint64_t)(uintptr_t)P;
    int64_t zero = 0;
    int rc = moespec_bf16_pairs_batch(1, &w, x, R, &zero, &R, out, &zero, O, I, threads);
    free(xp);
    return rc;
}

F5_TARGET int moespec_int8_avx512(const int8_t *W, const uint16_t *scales, const uint16_t *x,
                                  uint16_t *out, int64_t O, int64_t I, int64_t R, int threads) {
    REFUSE_AT(product_refused(O, I, R, threads, 4));
    void *xi = interleave(x, R, I, 16, 1);
    if (!xi) return 1;
    PRODUCT(f5_tile, int8_t, float, 16, *from_bf16(scales[o]))
    free(xi);
    return 0;
}

/* int8 weights in the pair layout (`pack_pairs` of the int8 values: groups of 64 output rows,
 * [I/2][64][2]), inputs quantized per row to int16 (`quantize_rows`): one 32-byte load holds a
 * pair of weights for 16 outputs, widened to int16, and `vpmaddwd` (`vpdpwssd` with VNNI)
 * multiplies them by a broadcast pair of inputs and adds each output's two products in int32,
 * exactly. Each block of Q_BLOCK pairs is summed in int32 (no overflow: see Q_BLOCK), and the
 * blocks in order in fp32; the sum is times the weight row's scale, then the input row's. */
#define QPAIRS_SWEEP(NAME, TARGET, MADD)                                                     \
    TARGET INLINE void NAME(const int8_t *P, int64_t JP, const int16_t *x, int64_t xs,        \
                            const float *xscale, const int NR, const uint16_t *wscale,        \
                            uint16_t *out, int64_t O, int64_t o0) {                           \
        __m512 f[PAIR_ROWS][4];                                                              \
        for (int r = 0; r < NR; r++)                                                         \
            for (int b = 0; b < 4; b++) f[r][b] = _mm512_setzero_ps();                       \
        for (int64_t b0 = 0; b0 < JP; b0 += Q_BLOCK) {                                       \
            int64_t b1 = JP - b0 < Q_BLOCK ? JP : b0 + Q_BLOCK;                              \
            __m512i acc[PAIR_ROWS][4];                                                       \
            for (int r = 0; r < NR; r++)                                                     \
                for (int b = 0; b < 4; b++) acc[r][b] = _mm512_setzero_si512();              \
            for (int64_t jp = b0; jp < b1; jp++) {                                           \
                const int8_t *pw = P + jp * 2 * PAIR_GROUP;                                  \
                for (int l = 0; l < 2; l++) /* the pair's 128 bytes, AHEAD_BYTES on */     \
                    _mm_prefetch((const char *)pw + AHEAD_BYTES + l * 64, _MM_HINT_T0);      \
                __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)pw));      \
                __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(pw + 32))); \
                __m512i w2 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(pw + 64))); \
                __m512i w3 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)(pw + 96))); \
                for (int r = 0; r < NR; r++) {                                               \
                    int32_t pair;                                                            \
                    memcpy(&pair, x + r * xs + 2 * jp, 4);                                   \
                    __m512i xv = _mm512_set1_epi32(pair);                                    \
                    acc[r][0] = MADD(acc[r][0], w0, xv);                                     \
                    acc[r][1] = MADD(acc[r][1], w1, xv);                                     \
                    acc[r][2] = MADD(acc[r][2], w2, xv);                                     \
                    acc[r][3] = MADD(acc[r][3], w3, xv);                                     \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < NR; r++)                                                     \
                for (int b = 0; b < 4; b++)                                                  \
                    f[r][b] = _mm512_add_ps(f[r][b], _mm512_cvtepi32_ps(acc[r][b]));         \
        }                                                                                    \
        for (int b = 0; b < 4; b++) {                                                        \
            int64_t o = o0 + 16 * b, left = O - o;                                           \
            if (left <= 0) break;                                                            \
            __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);              \
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(                                \
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, wscale + o)), 16));         \
            for (int r = 0; r < NR; r++) {                                                   \
                float v[16];                                                                 \
                _mm512_storeu_ps(v, _mm512_mul_ps(_mm512_mul_ps(f[r][b], s),                 \
                                                  _mm512_set1_ps(xscale[r])));               \
                for (int k = 0; k < (left < 16 ? left : 16); k++)                            \
                    out[r * O + o + k] = to_bf16(v[k]);                                      \
            }                                                                                \
        }                                                                                    \
    }

#define VN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define MADD_BW(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#define MADD_VNNI(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
QPAIRS_SWEEP(qpairs_sweep, F5_TARGET, MADD_BW)
QPAIRS_SWEEP(qpairs_vnni_sweep, VN_TARGET, MADD_VNNI)

#define QSWEEP(NAME, TARGET, NR_)                                                            \
    TARGET __attribute__((noinline)) static void NAME##_##NR_(                               \
        const int8_t *P, int64_t JP, const int16_t *x, int64_t xs, const float *xscale,       \
        const uint16_t *wscale, uint16_t *out, int64_t O, int64_t o0) {                      \
        NAME(P, JP, x, xs, xscale, NR_, wscale, out, O, o0);                                 \
    }
#define QSWEEPS(NAME, TARGET)                                                                \
    QSWEEP(NAME, TARGET, 1) QSWEEP(NAME, TARGET, 2) QSWEEP(NAME, TARGET, 3)                  \
    QSWEEP(NAME, TARGET, 4) QSWEEP(NAME, TARGET, 5) QSWEEP(NAME, TARGET, 6)                  \
    static const qsweep_fn NAME##_table[PAIR_ROWS] = {NAME##_1, NAME##_2, NAME##_3,          \
                                                      NAME##_4, NAME##_5, NAME##_6};
typedef void (*qsweep_fn)(const int8_t *, int64_t, const int16_t *, int64_t, const float *,
                          const uint16_t *, uint16_t *, int64_t, int64_t);
QSWEEPS(qpairs_sweep, F5_TARGET)
QSWEEPS(qpairs_vnni_sweep, VN_TARGET)

/* The int8 pair batches: inputs quantized once per call, then as the bf16 pair batch. */
#define QPAIRS_BATCH(NAME, TARGET, TABLE)                                                    \
    TARGET int NAME(int64_t n, const uint64_t *weights, const uint64_t *scales,              \
                    const uint16_t *X, int64_t x_rows, const int64_t *xrow,                  \
                    const int64_t *count, uint16_t *out, const int64_t *orow, int64_t O,     \
                    int64_t I, int threads) {                                                \
        REFUSE_AT(batch_refused(n, x_rows, xrow, count, orow, O, I, threads, 1));           \
        int64_t JP = (I + 1) / 2, xs = 2 * JP;                                               \
        float *xsc;                                                                          \
        int16_t *xq = quantized_input(X, x_rows, I, &xsc);                                   \
        if (!xq) return 1;                                                                   \
        BATCH_LOOP(TABLE[nr - 1]((const int8_t *)weights[k] + g * JP * 2 * PAIR_GROUP, JP,   \
                                 xq + (xrow[k] + t) * xs, xs, xsc + xrow[k] + t,             \
                                 (const uint16_t *)scales[k], out + (orow[k] + t) * O, O,    \
                                 g * PAIR_GROUP))                                            \
        free(xq);                                                                            \
        free(xsc);                                                                           \
        return 0;                                                                            \
    }
#define ROWS_PER_SWEEP PAIR_ROWS
QPAIRS_BATCH(moespec_int8_pairs_avx512_batch, F5_TARGET, qpairs_sweep_table)
QPAIRS_BATCH(moespec_int8_pairs_vnni_batch, VN_TARGET, qpairs_vnni_sweep_table)
#undef ROWS_PER_SWEEP

F5_TARGET int moespec_int8_pairs_avx512(const int8_t *P, const uint16_t *scales,
                                        const uint16_t *x, uint16_t *out, int64_t O, int64_t I,
                                        int64_t R, int threads) {
    uint64_t w = (uint64_t)(uintptr_t)P, s = (uint64_t)(uintptr_t)scales;
    int64_t zero = 0;
    REFUSE_AT(product_refused(O, I, R, threads, 4));
    return moespec_int8_pairs_avx512_batch(1, &w, &s, x, R, &zero, &R, out, &zero, O, I, threads);
}

VN_TARGET int moespec_int8_pairs_vnni(const int8_t *P, const uint16_t *scales, const uint16_t *x,
                                      uint16_t *out, int64_t O, int64_t I, int64_t R,
                                      int threads) {
    uint64_t w = (uint64_t)(uintptr_t)P, s = (uint64_t)(uintptr_t)scales;
    int64_t zero = 0;
    REFUSE_AT(product_refused(O, I, R, threads, 4));
    return moespec_int8_pairs_vnni_batch(1, &w, &s, x, R, &zero, &R, out, &zero, O, I, threads);
}
#endif /* MOESPEC_NO_AVX512 */

/* ---------------------------------------------------------------- AVX2 + FMA: 8 fp32 lanes */
#define V2_TARGET __attribute__((target("avx2,fma")))

V2_TARGET INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

V2_TARGET INLINE __m256 widen_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}

V2_TARGET INLINE __m256 widen_int8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p)));
}

/* kind 0: bf16 weights, 1: int8. Chunks of 8; a ragged tail (I % 8) summed in scalar order
 * and added after the lanes. 16 ymm registers: one weight row per tile. */
V2_TARGET INLINE void v2_tile(const void *wrow, const int kind, int64_t I, const float *xt,
                              const int RT, float *sums) {
    __m256 a[TILE], b[TILE];
    for (int r = 0; r < RT; r++) a[r] = b[r] = _mm256_setzero_ps();
    const uint16_t *wb = (const uint16_t *)wrow;
    const int8_t *wq = (const int8_t *)wrow;
    int64_t full = I / 8, c = 0;
    for (; c + 2 <= full; c += 2) {
        __m256 w0 = kind ? widen_int8x8(wq + c * 8) : widen_bf16x8(wb + c * 8);
        __m256 w1 = kind ? widen_int8x8(wq + c * 8 + 8) : widen_bf16x8(wb + c * 8 + 8);
        for (int r = 0; r < RT; r++) {
            a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt + (c * RT + r) * 8), a[r]);
            b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + ((c + 1) * RT + r) * 8), b[r]);
        }
    }
    if (c < full) { /* an odd last full chunk: to a */
        __m256 w0 = kind ? widen_int8x8(wq + c * 8) : widen_bf16x8(wb + c * 8);
        for (int r = 0; r < RT; r++)
            a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt + (c * RT + r) * 8), a[r]);
        c++;
    }
    for (int r = 0; r < RT; r++) {
        float tail = 0.0f;
        for (int64_t j = c * 8; j < I; j++)
            tail += (kind ? (float)wq[j] : from_bf16(wb[j])) * xt[(c * RT + r) * 8 + (j - c * 8)];
        sums[r] = hsum8(_mm256_add_ps(a[r], b[r])) + tail;
    }
}

V2_TARGET static int v2_product(const void *W, const int kind, const uint16_t *scales,
                                const uint16_t *x, uint16_t *out, int64_t O, int64_t I,
                                int64_t R, int threads) {
    float *xi = (float *)interleave(x, R, I, 8, 1);
    if (!xi) return 1;
    int64_t chunks = (I + 7) / 8;
    size_t row_bytes = (size_t)I * (kind ? 1 : 2);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < O; o++) {
        const void *w = (const char *)W + o * row_bytes;
        float s = scales ? from_bf16(scales[o]) : 1.0f, sums[TILE];
        for (int64_t t = 0; t < R; t += TILE) {
            int n = (int)(R - t < TILE ? R - t : TILE);
            const float *xt = xi + t * chunks * 8;
            switch (n) {
            case 1: v2_tile(w, kind, I, xt, 1, sums); break;
            case 2: v2_tile(w, kind, I, xt, 2, sums); break;
            case 3: v2_tile(w, kind, I, xt, 3, sums); break;
            default: v2_tile(w, kind, I, xt, 4, sums); break;
            }
            for (int r = 0; r < n; r++)
                out[(t + r) * O + o] = to_bf16(scales ? sums[r] * s : sums[r]);
        }
    }
    free(xi);
    return 0;
}

int moespec_bf16_avx2(const uint16_t *W, const uint16_t *x, uint16_t *out, int64_t O, int64_t I,
                      int64_t R, int threads) {
    REFUSE_AT(product_refused(O, I, R, threads, 3));
    return v2_product(W, 0, NULL, x, out, O, I, R, threads);
}

int moespec_int8_avx2(const int8_t *Q, const uint16_t *scales, const uint16_t *x, uint16_t *out,
                      int64_t O, int64_t I, int64_t R, int threads) {
    REFUSE_AT(product_refused(O, I, R, threads, 4));
    return v2_product(Q, 1, scales, x, out, O, I, R, threads);
}

/* AVX2 on the same pair layout (bf16) and group layout (int8): 16 ymm registers hold a sweep
 * of half a group (32 outputs) for up to two rows, or a whole group for one row. Pairs are
 * split into their even and odd weights (a shift, a mask) and multiplied by the broadcast
 * inputs, even then odd: each output is one fp32 chain over j in order, as on AVX-512 (the
 * rounding differs between the two ISAs: vdpbf16ps adds a pair at once). The loops are
 * unrolled by pragma so that the accumulators live in registers (left to itself, gcc kept
 * them in a stack array, stored each step) and each row's pair of inputs is broadcast once per
 * pair, not once per vector; the weights AHEAD pairs ahead are prefetched (see V2_AHEAD).
 * On an AVX2-only host (Zen 3) that made a [2048, 2048] product streamed from memory on one
 * thread 1.25x (bf16) and 1.53x (int8) as fast at 2 rows, 1.20x and 1.35x at 9, paired
 * medians; one row moved within the noise, 1.02x and 0.99x
 * (`benchmarks/cpu_paths.py --rows N --before-rev 4314d1c`). */
#ifndef V2_AHEAD
#define V2_AHEAD 16 /* pairs of inputs the half-group AVX2 sweeps prefetch ahead (0: none) */
#endif
/* The whole-group one-row sweep (a decode step's products) prefetches 4 pairs (1 KiB) ahead:
 * on an AVX2-only host (Zen 3) a [2048, 2048] product streamed from memory on one thread ran
 * 1.20x (bf16) and 1.21x (int8) as fast as at 16 pairs, paired medians of 9 rounds, while at
 * 2 rows (the half-group sweeps) 4 pairs ran 0.88x and 0.93x as fast as 16
 * (`benchmarks/cpu_paths.py --rows N --before-rev REV`). */
#ifndef V2_AHEAD_ONE
#define V2_AHEAD_ONE 4
#endif
#ifndef V2_HINT
#define V2_HINT _MM_HINT_T0 /* T2, NTA and 64 pairs ahead moved one row within the noise */
#endif
V2_TARGET INLINE void v2_pairs_sweep(const uint16_t *P, int64_t JP, const float *x, int64_t xs,
                                     const int NR, const int NV, const int AHEAD, int64_t half,
                                     uint16_t *out, int64_t O, int64_t o0) {
    __m256 acc[HALF_ROWS][8];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t jp = 0; jp < JP; jp++) {
        const uint16_t *pw = P + jp * 2 * PAIR_GROUP + half * 64;
#pragma GCC unroll 4
        for (int l = 0; l < (AHEAD ? NV / 2 : 0); l++)
            _mm_prefetch((const char *)(pw + AHEAD * 2 * PAIR_GROUP) + l * 64, V2_HINT);
        __m256 x0[HALF_ROWS], x1[HALF_ROWS]; /* the row's pair of inputs, broadcast once */
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            x0[r] = _mm256_broadcast_ss(x + r * xs + 2 * jp);
            x1[r] = _mm256_broadcast_ss(x + r * xs + 2 * jp + 1);
        }
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            __m256i pair = _mm256_loadu_si256((const __m256i *)(pw + v * 16));
            __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
            __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pair, hi));
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                acc[r][v] = _mm256_fmadd_ps(even, x0[r], acc[r][v]);
                acc[r][v] = _mm256_fmadd_ps(odd, x1[r], acc[r][v]);
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r][v]);
            int64_t o = o0 + half * 32 + v * 8;
            for (int k = 0; k < 8 && o + k < O; k++) out[r * O + o + k] = to_bf16(lanes[k]);
        }
}

#define V2SWEEPS(NR_, NV_)                                                                   \
    V2_TARGET __attribute__((noinline)) static void v2p_##NR_##_##NV_(                       \
        const uint16_t *P, int64_t JP, const float *x, int64_t xs, int64_t half, uint16_t *out, \
        int64_t O, int64_t o0) {                                                             \
        v2_pairs_sweep(P, JP, x, xs, NR_, NV_, NV_ == 8 ? V2_AHEAD_ONE : V2_AHEAD, half, out, O, \
                       o0);                                                                  \
    }
V2SWEEPS(1, 8) V2SWEEPS(1, 4) V2SWEEPS(2, 4)


/* One AVX2 work item: a whole group for one row, else half groups two rows at a time. */
#define V2_ITEM(FULL, HALF1, HALF2)                                                          \
    if (count[k] == 1) {                                                                     \
        FULL;                                                                                \
    } else {                                                                                 \
        for (int64_t half = 0; half < 2; half++)                                             \
            for (int64_t t = 0; t < count[k]; t += HALF_ROWS) {                              \
                if (count[k] - t >= 2) HALF2;                                                \
                else HALF1;                                                                  \
            }                                                                                \
    }
#define V2_BATCH_LOOP(ITEM)                                                                  \
    int64_t groups = (O + PAIR_GROUP - 1) / PAIR_GROUP;                                      \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
    for (int64_t item = 0; item < n * groups; item++) {                                      \
        int64_t k = item / groups, g = item % groups;                                        \
        ITEM                                                                                 \
    }

V2_TARGET int moespec_bf16_pairs_avx2_batch(int64_t n, const uint64_t *weights,
                                            const uint16_t *X, int64_t x_rows,
                                            const int64_t *xrow, const int64_t *count,
                                            uint16_t *out, const int64_t *orow, int64_t O,
                                            int64_t I, int threads) {
    REFUSE_AT(batch_refused(n, x_rows, xrow, count, orow, O, I, threads, 0));
    int64_t JP = (I + 1) / 2, xs = 2 * JP;
    float *xf = widen_rows(X, x_rows, I, xs);
    if (!xf) return 1;
#define PG ((const uint16_t *)weights[k] + g * JP * 2 * PAIR_GROUP)
    V2_BATCH_LOOP(V2_ITEM(
        v2p_1_8(PG, JP, xf + xrow[k] * xs, xs, 0, out + orow[k] * O, O, g * PAIR_GROUP),
        v2p_1_4(PG, JP, xf + (xrow[k] + t) * xs, xs, half, out + (orow[k] + t) * O, O,
                g * PAIR_GROUP),
        v2p_2_4(PG, JP, xf + (xrow[k] + t) * xs, xs, half, out + (orow[k] + t) * O, O,
                g * PAIR_GROUP)))
#undef PG
    free(xf);
    return 0;
}

V2_TARGET int moespec_bf16_pairs_avx2(const uint16_t *P, const uint16_t *x, uint16_t *out,
                                      int64_t O, int64_t I, int64_t R, int threads) {
    uint64_t w = (uint64_t)(uintptr_t)P;
    int64_t zero = 0;
    REFUSE_AT(product_refused(O, I, R, threads, 3));
    return moespec_bf16_pairs_avx2_batch(1, &w, x, R, &zero, &R, out, &zero, O, I, threads);
}


/* int8 pairs on AVX2 (as on AVX-512, see qpairs_sweep): 8 outputs per `vpmaddwd`, a whole
 * group for one row or half a group for up to two rows, as the bf16 pair sweeps. */
V2_TARGET INLINE void v2_qpairs_sweep(const int8_t *P, int64_t JP, const int16_t *x, int64_t xs,
                                      const float *xscale, const int NR, const int NV,
                                      const int AHEAD, int64_t half, const uint16_t *wscale,
                                      uint16_t *out, int64_t O, int64_t o0) {
    __m256 f[HALF_ROWS][8];
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) f[r][v] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < JP; b0 += Q_BLOCK) {
        int64_t b1 = JP - b0 < Q_BLOCK ? JP : b0 + Q_BLOCK;
        __m256i acc[HALF_ROWS][8];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_si256();
        for (int64_t jp = b0; jp < b1; jp++) {
            const int8_t *pw = P + jp * 2 * PAIR_GROUP + half * 64;
#pragma GCC unroll 2
            for (int l = 0; l < (AHEAD ? NV / 4 : 0); l++) /* as many bytes ahead as bf16 */
                _mm_prefetch((const char *)(pw + 2 * AHEAD * 2 * PAIR_GROUP) + l * 64,
                             V2_HINT);
            __m256i xp[HALF_ROWS]; /* the row's pair of inputs, broadcast once */
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                int32_t pair;
                memcpy(&pair, x + r * xs + 2 * jp, 4);
                xp[r] = _mm256_set1_epi32(pair);
            }
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) {
                __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(pw + v * 16)));
#pragma GCC unroll 2
                for (int r = 0; r < NR; r++)
                    acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(w, xp[r]));
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++)
                f[r][v] = _mm256_add_ps(f[r][v], _mm256_cvtepi32_ps(acc[r][v]));
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, f[r][v]);
            int64_t o = o0 + half * 32 + v * 8;
            for (int k = 0; k < 8 && o + k < O; k++)
                out[r * O + o + k] = to_bf16(lanes[k] * from_bf16(wscale[o + k]) * xscale[r]);
        }
}

#define V2QSWEEP(NR_, NV_)                                                                   \
    V2_TARGET __attribute__((noinline)) static void v2q_##NR_##_##NV_(                       \
        const int8_t *P, int64_t JP, const int16_t *x, int64_t xs, const float *xscale,       \
        int64_t half, const uint16_t *wscale, uint16_t *out, int64_t O, int64_t o0) {         \
        v2_qpairs_sweep(P, JP, x, xs, xscale, NR_, NV_, NV_ == 8 ? V2_AHEAD_ONE : V2_AHEAD, half, \
                        wscale, out, O, o0);                                                 \
    }
V2QSWEEP(1, 8) V2QSWEEP(1, 4) V2QSWEEP(2, 4)

V2_TARGET int moespec_int8_pairs_avx2_batch(int64_t n, const uint64_t *weights,
                                            const uint64_t *scales, const uint16_t *X,
                                            int64_t x_rows, const int64_t *xrow,
                                            const int64_t *count, uint16_t *out,
                                            const int64_t *orow, int64_t O, int64_t I,
                                            int threads) {
    REFUSE_AT(batch_refused(n, x_rows, xrow, count, orow, O, I, threads, 1));
    int64_t JP = (I + 1) / 2, xs = 2 * JP;
    float *xsc;
    int16_t *xq = quantized_input(X, x_rows, I, &xsc);
    if (!xq) return 1;
#define QP ((const int8_t *)weights[k] + g * JP * 2 * PAIR_GROUP)
#define SC ((const uint16_t *)scales[k])
    V2_BATCH_LOOP(V2_ITEM(
        v2q_1_8(QP, JP, xq + xrow[k] * xs, xs, xsc + xrow[k], 0, SC, out + orow[k] * O, O,
                g * PAIR_GROUP),
        v2q_1_4(QP, JP, xq + (xrow[k] + t) * xs, xs, xsc + xrow[k] + t, half, SC,
                out + (orow[k] + t) * O, O, g * PAIR_GROUP),
        v2q_2_4(QP, JP, xq + (xrow[k] + t) * xs, xs, xsc + xrow[k] + t, half, SC,
                out + (orow[k] + t) * O, O, g * PAIR_GROUP)))
#undef QP
#undef SC
    free(xq);
    free(xsc);
    return 0;
}

V2_TARGET int moespec_int8_pairs_avx2(const int8_t *P, const uint16_t *scales, const uint16_t *x,
                                      uint16_t *out, int64_t O, int64_t I, int64_t R,
                                      int threads) {
    uint64_t w = (uint64_t)(uintptr_t)P, s = (uint64_t)(uintptr_t)scales;
    int64_t zero = 0;
    REFUSE_AT(product_refused(O, I, R, threads, 4));
    return moespec_int8_pairs_avx2_batch(1, &w, &s, x, R, &zero, &R, out, &zero, O, I, threads);
}

/* ---------------------------------------------------------------- decode attention
 * Query rows over the cached positions: out[h] = softmax(scale q[h] . K[h / G]^T) V[h / G] for
 * H query heads, G of them per key head. q bf16 [H, D] per row; K, V bf16, position l of key
 * head c at k + c * k_head + l * k_row (D contiguous values), likewise V (Dv values); out bf16
 * [H, Dv] per row. Scores, softmax and the weighted sum of V in fp32, in position order; each
 * output rounded once. A sweep takes up to QMAX queries of one key head (the heads of a key
 * head, and of a pass's rows, `_rows`), so each key and value vector is read and widened once
 * for all of them; a query's arithmetic is the same whichever queries share its sweep (its
 * own length bounds its max, exponentials and sums: the scores past it are computed and left
 * unread), so its bits do not depend on H, G, the rows of the pass or the threads. Work items
 * (a key head's sweeps) are split over the threads where the work is large enough. Returns 1
 * without memory.
 *
 * A verification pass of 9 rows used to call the one-row attention per row (one read of the
 * keys and values, and a malloc, per row and sweep of 4 heads); the rows' sweep reads them once
 * per 8 queries (AVX-512; 4 on AVX2, whose 16 registers hold 4 queries' sums) and keeps its
 * scores on the stack up to ATT_STACK floats. */
#define ATT_STACK 4096
#define ATTEND(NAME, TARGET, VEC, LANES, QMAX, ZERO, LOADW, LOADF, FMA, HSUM, SET1, STOREU)   \
    TARGET INLINE void NAME##_sweep(const uint16_t *const *q, uint16_t *const *out,            \
                                    const int64_t *Ls, const uint16_t *k, const uint16_t *v,  \
                                    int64_t L, int64_t D, int64_t Dv, int64_t k_row,          \
                                    int64_t v_row, float scale, float *qf, float *s,          \
                                    const int NG) {                                          \
        int64_t DP = (D + LANES - 1) / LANES * LANES, lo = L; /* L: the longest query's */    \
        for (int g = 0; g < NG; g++) {                                                       \
            lo = Ls[g] < lo ? Ls[g] : lo;                                                    \
            for (int64_t d = 0; d < DP; d++)                                                 \
                qf[g * DP + d] = d < D ? from_bf16(q[g][d]) : 0.0f;                          \
        }                                                                                    \
        float m[QMAX], total[QMAX];                                                          \
        for (int g = 0; g < NG; g++) m[g] = -INFINITY, total[g] = 0.0f;                      \
        for (int64_t l = 0; l < L; l++) {                                                    \
            const uint16_t *kr = k + l * k_row;                                              \
            VEC acc[QMAX];                                                                   \
            for (int g = 0; g < NG; g++) acc[g] = ZERO;                                      \
            int64_t d = 0;                                                                   \
            for (; d + LANES <= D; d += LANES) {                                             \
                VEC kv = LOADW(kr + d);                                                      \
                for (int g = 0; g < NG; g++) acc[g] = FMA(kv, LOADF(qf + g * DP + d), acc[g]); \
            }                                                                                \
            for (int g = 0; g < NG; g++) {                                                   \
                float tail = 0.0f;                                                           \
                for (int64_t j = d; j < D; j++) tail += from_bf16(kr[j]) * qf[g * DP + j];   \
                s[g * L + l] = (HSUM(acc[g]) + tail) * scale;                                \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < NG; g++) {                                                       \
            for (int64_t l = 0; l < Ls[g]; l++) {                                            \
                float z = s[g * L + l];                                                      \
                m[g] = z > m[g] ? z : m[g];                                                  \
            }                                                                                \
            for (int64_t l = 0; l < Ls[g]; l++) {                                            \
                s[g * L + l] = expf(s[g * L + l] - m[g]);                                    \
                total[g] += s[g * L + l];                                                    \
            }                                                                                \
        }                                                                                    \
        int64_t d0 = 0;                                                                      \
        for (; d0 + 2 * LANES <= Dv; d0 += 2 * LANES) {                                      \
            VEC a[QMAX][2];                                                                  \
            for (int g = 0; g < NG; g++) a[g][0] = a[g][1] = ZERO;                           \
            int64_t l = 0;                                                                   \
            for (; l < lo; l++) { /* positions every query sees */                           \
                const uint16_t *vr = v + l * v_row + d0;                                     \
                VEC v0 = LOADW(vr), v1 = LOADW(vr + LANES);                                  \
                for (int g = 0; g < NG; g++) {                                               \
                    VEC p = SET1(s[g * L + l]);                                              \
                    a[g][0] = FMA(v0, p, a[g][0]);                                           \
                    a[g][1] = FMA(v1, p, a[g][1]);                                           \
                }                                                                            \
            }                                                                                \
            for (; l < L; l++) { /* the later rows' own positions */                         \
                const uint16_t *vr = v + l * v_row + d0;                                     \
                VEC v0 = LOADW(vr), v1 = LOADW(vr + LANES);                                  \
                for (int g = 0; g < NG; g++)                                                 \
                    if (l < Ls[g]) {                                                         \
                        VEC p = SET1(s[g * L + l]);                                          \
                        a[g][0] = FMA(v0, p, a[g][0]);                                       \
                        a[g][1] = FMA(v1, p, a[g][1]);                                       \
                    }                                                                        \
            }                                                                                \
            for (int g = 0; g < NG; g++) {                                                   \
                float lanes[2 * LANES], inv = 1.0f / total[g];                               \
                STOREU(lanes, a[g][0]);                                                      \
                STOREU(lanes + LANES, a[g][1]);                                              \
                for (int j = 0; j < 2 * LANES; j++)                                          \
                    out[g][d0 + j] = to_bf16(lanes[j] * inv);                                \
            }                                                                                \
        }                                                                                    \
        for (; d0 < Dv; d0++) /* a ragged end of Dv: in scalar, in the same order */         \
            for (int g = 0; g < NG; g++) {                                                   \
                float acc = 0.0f;                                                            \
                for (int64_t l = 0; l < Ls[g]; l++)                                          \
                    acc = fmaf(from_bf16(v[l * v_row + d0]), s[g * L + l], acc);              \
                out[g][d0] = to_bf16(acc * (1.0f / total[g]));                               \
            }                                                                                \
    }                                                                                        \
    ATT_SWEEPS_##QMAX(NAME, TARGET)                                                          \
    /* rows t = 0 .. T - 1: q at q + t q_row, out at out + t o_row, row t sees L0 + t        \
     * positions (a pass's rows: each sees itself and the rows before it) */                 \
    TARGET int NAME##_rows(const uint16_t *q, int64_t q_row, int64_t T, const uint16_t *k,    \
                           const uint16_t *v, uint16_t *out, int64_t o_row, int64_t H,        \
                           int64_t G, int64_t L0, int64_t D, int64_t Dv, int64_t k_head,      \
                           int64_t k_row, int64_t v_head, int64_t v_row, float scale,         \
                           int threads) {                                                    \
        static const int at[10] = {8, 9, 10, 11, 12, 13, 14, 15, 16, 18};                    \
        REFUSE_AT(q_row < 0 ? 2 : T < 0 ? 3 : o_row < 0 ? 7 : 0);                            \
        REFUSE_AT(attend_refused(H, G, L0, D, Dv, k_head, k_row, v_head, v_row, threads, at)); \
        int64_t per = (T * G + QMAX - 1) / QMAX, items = H / G * per;                         \
        int64_t DP = (D + LANES - 1) / LANES * LANES;                                        \
        int fail = 0;                                                                        \
        int use = items > 1 && H * (L0 + T - 1) * (D + Dv) >= (1 << 16) ? threads : 1;       \
        (void)use; /* unused in a build without OpenMP */                                    \
        _Pragma("omp parallel for schedule(static) num_threads(use) reduction(| : fail)")    \
        for (int64_t item = 0; item < items; item++) {                                       \
            int64_t c = item / per, first = item % per * QMAX; /* queries (t, g), t-major */ \
            int ng = (int)(T * G - first < QMAX ? T * G - first : QMAX);                     \
            const uint16_t *qs[QMAX];                                                        \
            uint16_t *outs[QMAX];                                                            \
            int64_t Ls[QMAX], L = 0;                                                         \
            for (int g = 0; g < ng; g++) {                                                   \
                int64_t t = (first + g) / G, h = c * G + (first + g) % G;                    \
                qs[g] = q + t * q_row + h * D;                                               \
                outs[g] = out + t * o_row + h * Dv;                                          \
                Ls[g] = L0 + t;                                                              \
                L = Ls[g] > L ? Ls[g] : L;                                                   \
            }                                                                                \
            float stack[ATT_STACK], *buf = stack;                                            \
            size_t need = (size_t)(ng * (DP + L));                                           \
            if (need > ATT_STACK && !(buf = (float *)malloc(need * 4))) {                    \
                fail = 1;                                                                    \
                continue;                                                                    \
            }                                                                                \
            NAME##_by_queries[ng - 1](qs, outs, Ls, k + c * k_head, v + c * v_head, L, D, Dv, \
                                      k_row, v_row, scale, buf, buf + ng * DP);              \
            if (buf != stack) free(buf);                                                     \
        }                                                                                    \
        return fail;                                                                         \
    }                                                                                        \
    TARGET int NAME(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,   \
                    int64_t H, int64_t G, int64_t L, int64_t D, int64_t Dv, int64_t k_head,   \
                    int64_t k_row, int64_t v_head, int64_t v_row, float scale, int threads) { \
        static const int at[10] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 15};                       \
        REFUSE_AT(attend_refused(H, G, L, D, Dv, k_head, k_row, v_head, v_row, threads, at)); \
        return NAME##_rows(q, 0, 1, k, v, out, 0, H, G, L, D, Dv, k_head, k_row, v_head,      \
                           v_row, scale, threads);                                           \
    }

#define ATT_ARGS                                                                             \
    const uint16_t *const *q, uint16_t *const *out, const int64_t *Ls, const uint16_t *k,    \
        const uint16_t *v, int64_t L, int64_t D, int64_t Dv, int64_t k_row, int64_t v_row,   \
        float scale, float *qf, float *s
#define ATT_PASS q, out, Ls, k, v, L, D, Dv, k_row, v_row, scale, qf, s
#define ATT_SWEEP(NAME, TARGET, NG)                                                          \
    TARGET __attribute__((noinline)) static void NAME##_##NG(ATT_ARGS) {                     \
        NAME##_sweep(ATT_PASS, NG);                                                          \
    }
#define ATT_SWEEPS_4(NAME, TARGET)                                                           \
    ATT_SWEEP(NAME, TARGET, 1) ATT_SWEEP(NAME, TARGET, 2) ATT_SWEEP(NAME, TARGET, 3)         \
    ATT_SWEEP(NAME, TARGET, 4)                                                               \
    static void (*const NAME##_by_queries[4])(ATT_ARGS) = {NAME##_1, NAME##_2, NAME##_3,     \
                                                          NAME##_4};
#define ATT_SWEEPS_8(NAME, TARGET)                                                           \
    ATT_SWEEP(NAME, TARGET, 1) ATT_SWEEP(NAME, TARGET, 2) ATT_SWEEP(NAME, TARGET, 3)         \
    ATT_SWEEP(NAME, TARGET, 4) ATT_SWEEP(NAME, TARGET, 5) ATT_SWEEP(NAME, TARGET, 6)         \
    ATT_SWEEP(NAME, TARGET, 7) ATT_SWEEP(NAME, TARGET, 8)                                    \
    static void (*const NAME##_by_queries[8])(ATT_ARGS) = {                                  \
        NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
#ifndef MOESPEC_NO_AVX512
#define W16(p)                                                                               \
    _mm512_castsi512_ps(                                                                     \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(p))), 16))
ATTEND(moespec_attend_bf16_avx512, F5_TARGET, __m512, 16, 8, _mm512_setzero_ps(), W16,
       _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_ps, _mm512_storeu_ps)
#endif
ATTEND(moespec_attend_bf16_avx2, V2_TARGET, __m256, 8, 4, _mm256_setzero_ps(), widen_bf16x8,
       _mm256_loadu_ps, _mm256_fmadd_ps, hsum8, _mm256_set1_ps, _mm256_storeu_ps)

/* The read-bandwidth probe: the sum of n bytes (a multiple of 128) read as 32-byte vectors into
 * four independent accumulators, in items of 512 KiB; each thread streams one contiguous run
 * of items, as the products stream their weights (OpenMP, static). Loads and integer adds
 * only: a read at the rate the memory gives, the ceiling of a product reading these bytes
 * once. Returns the sum, so the loads cannot be dropped. */
#define READ_ITEM 4096 /* 128-byte lines per item */
V2_TARGET int moespec_read_sum(const uint8_t *p, int64_t n, int threads, uint64_t *sum) {
    REFUSE(n < 0 || n % 128, 2);
    REFUSE(threads < 1, 3);
    int64_t lines = n / 128, items = (lines + READ_ITEM - 1) / READ_ITEM;
    uint64_t total = 0;
    (void)threads; /* unused in a build without OpenMP */
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int64_t item = 0; item < items; item++) {
        const __m256i *q = (const __m256i *)p + item * READ_ITEM * 4;
        int64_t left = lines - item * READ_ITEM, count = left < READ_ITEM ? left : READ_ITEM;
        __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
        for (int64_t i = 0; i < count; i++, q += 4) {
            a = _mm256_add_epi64(a, _mm256_loadu_si256(q));
            b = _mm256_add_epi64(b, _mm256_loadu_si256(q + 1));
            c = _mm256_add_epi64(c, _mm256_loadu_si256(q + 2));
            d = _mm256_add_epi64(d, _mm256_loadu_si256(q + 3));
        }
        uint64_t lanes[4];
        __m256i s = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
        _mm256_storeu_si256((__m256i *)lanes, s);
        total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
    *sum = total;
    return 0;
}

/* The pair layout made at load (moespec/kernels/native.py: pack_pairs): W [G * 64][P] units
 * (a unit = two consecutive inputs: 4 bytes of bf16, 2 of int8), row stride P, into
 * [G][P][64]. A tile of 64 rows by 16 units is read row by row and written unit-column by
 * unit-column, so both sides stay within a few cache lines; groups are split over the threads.
 * The same bytes, moved: 2-3x the rate of the strided tensor copy it replaces. */
#define PACK_TILE 16
#define PACK_PAIRS(NAME, T)                                                                    \
    int NAME(const T *W, T *out, int64_t G, int64_t P, int threads) {                         \
        REFUSE_AT(G < 0 ? 3 : P < 0 ? 4 : threads < 1 ? 5 : 0);                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                        \
        for (int64_t g = 0; g < G; g++) {                                                      \
            const T *src = W + g * PAIR_GROUP * P;                                             \
            T *dst = out + g * PAIR_GROUP * P;                                                 \
            for (int64_t p0 = 0; p0 < P; p0 += PACK_TILE) {                                    \
                int64_t n = P - p0 < PACK_TILE ? P - p0 : PACK_TILE;                           \
                for (int64_t r = 0; r < PAIR_GROUP; r++)                                       \
                    for (int64_t p = 0; p < n; p++)                                            \
                        dst[(p0 + p) * PAIR_GROUP + r] = src[r * P + p0 + p];                  \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }
PACK_PAIRS(moespec_pack_pairs32, uint32_t)
PACK_PAIRS(moespec_pack_pairs16, uint16_t)

/* int8 quantization at load (moespec/kernels/quant.py: quantize_int8), straight into the pair
 * layout: for each row of a bf16 W [O][I], scale = bf16(max |w| / 127) and q = round(w / scale)
 * (half to even, clipped to +-127; a zero row keeps scale 0 and q 0), the same arithmetic in
 * fp32 as the tensor reference, so the bits agree. `pairs` is [ceil(O / 64)][ceil(I / 2)][64][2]
 * zero-filled by the caller (the padding stays zero); `scales` [O] bf16. No fp32 copy of W is
 * made: the tensor reference holds four. Rows are split over the threads. */
V2_TARGET int moespec_quantize_pairs_bf16(const uint16_t *W, int64_t O, int64_t I,
                                          int8_t *pairs, uint16_t *scales, int threads) {
    REFUSE_AT(O < 0 ? 2 : I < 1 ? 3 : threads < 1 ? 6 : 0); /* I >= 1: the row's last pair */
    int64_t units = (I + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        int8_t row[2 * units]; /* one row's q (the last pair zero-padded), scattered in pairs */
        row[2 * units - 1] = 0;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < O; r++) {
            const uint16_t *w = W + r * I;
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 tops = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= I; j += 8) {
                __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + j)));
                __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
                tops = _mm256_max_ps(tops, _mm256_andnot_ps(sign, x));
            }
            float lanes[8], top = 0.0f;
            _mm256_storeu_ps(lanes, tops);
            for (int k = 0; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
            for (; j < I; j++) {
                float a = fabsf(from_bf16(w[j]));
                top = a > top ? a : top;
            }
            uint16_t scale = to_bf16(top / 127.0f);
            float s = from_bf16(scale);
            if (s < FLT_MIN) s = FLT_MIN;
            scales[r] = scale;
            const __m256 div = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.0f);
            const __m256 lo = _mm256_set1_ps(-127.0f);
            for (j = 0; j + 8 <= I; j += 8) {
                __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + j)));
                __m256 x = _mm256_div_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), div);
                x = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
                __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q),
                                              _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i *)(row + j), _mm_packs_epi16(q16, q16));
            }
            for (; j < I; j++) {
                float q = nearbyintf(from_bf16(w[j]) / s);
                row[j] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
            }
            int16_t *dst = (int16_t *)pairs + (r / PAIR_GROUP) * units * PAIR_GROUP
                           + r % PAIR_GROUP;
            for (int64_t u = 0; u < units; u++) {
                int16_t pair;
                memcpy(&pair, row + 2 * u, 2);
                dst[u * PAIR_GROUP] = pair;
            }
        }
    }
    return 0;
}
