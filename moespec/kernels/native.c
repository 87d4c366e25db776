/* moespec's native products for passes of a few rows: out[r, o] = sum_j x[r, j] W[o, j].
 *
 * x bf16 [R, I], out bf16 [R, O], accumulated in fp32 and rounded once to nearest even; W bf16
 * in the pair layout (moespec_bf16_pairs: the engine's bf16 path on AVX-512-BF16), or bf16 /
 * int8 [O, I] row by row (candidates). Each output element is one dot product in one fixed
 * order whatever R is, and no accumulation crosses rows, so a pass of n rows gives every row
 * the bits of a one-row pass (batch-invariant by construction). Output rows are split over the
 * threads in contiguous blocks (OpenMP, static), so each thread streams its part of W once.
 *
 * Each ISA's functions carry their own target attribute: one build runs on any x86-64 CPU
 * and the caller chooses the functions the CPU has (moespec/kernels/native.py).
 */
#include <immintrin.h>
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

int moespec_native_version(void) { return 2; }


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
    void *buf = aligned_alloc(64, (size_t)(size + 63) / 64 * 64);
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
    float *xf = (float *)calloc((size_t)(R * xs), 4);
    if (xf)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < I; j++) xf[r * xs + j] = from_bf16(x[r * I + j]);
    return xf;
}

#ifndef MOESPEC_NO_AVX512
/* ---------------------------------------------------------------- AVX-512 */
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
    (void)x_rows; /* read in place: bf16 inputs need no widening */
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
    void *xi = interleave(x, R, I, 16, 1);
    if (!xi) return 1;
    PRODUCT(f5_tile, int8_t, float, 16, *from_bf16(scales[o]))
    free(xi);
    return 0;
}

/* int8 weights in groups of 64 output rows, each [I][64] (`pack_groups` in native.py): one
 * 16-byte load holds input j's weights for 16 outputs, widened to fp32 and multiplied by the
 * broadcast input. Each output is one fp32 chain over j in order, then times its row's scale:
 * batch-invariant, like the pair layout. Inputs are widened to fp32 once per call. */
F5_TARGET INLINE void groups_sweep(const int8_t *G, int64_t I, const float *x, int64_t xs,
                                   const int NR, const uint16_t *scales, uint16_t *out,
                                   int64_t O, int64_t o0) {
    __m512 acc[PAIR_ROWS][4];
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < 4; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < I; j++) {
        const int8_t *gw = G + j * PAIR_GROUP;
        __m512 w0 = WIDEN8(gw), w1 = WIDEN8(gw + 16), w2 = WIDEN8(gw + 32), w3 = WIDEN8(gw + 48);
        for (int r = 0; r < NR; r++) {
            __m512 xv = _mm512_set1_ps(x[r * xs + j]);
            acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(w2, xv, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(w3, xv, acc[r][3]);
        }
    }
    for (int b = 0; b < 4; b++) {
        int64_t o = o0 + 16 * b, left = O - o;
        if (left <= 0) break;
        __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, scales + o)), 16));
        for (int r = 0; r < NR; r++) {
            float v[16];
            _mm512_storeu_ps(v, _mm512_mul_ps(acc[r][b], s));
            for (int k = 0; k < (left < 16 ? left : 16); k++) out[r * O + o + k] = to_bf16(v[k]);
        }
    }
}

#define GSWEEP(NR_)                                                                          \
    F5_TARGET __attribute__((noinline)) static void gsweep_##NR_(                            \
        const int8_t *G, int64_t I, const float *x, int64_t xs, const uint16_t *scales,       \
        uint16_t *out, int64_t O, int64_t o0) {                                              \
        groups_sweep(G, I, x, xs, NR_, scales, out, O, o0);                                  \
    }
GSWEEP(1) GSWEEP(2) GSWEEP(3) GSWEEP(4) GSWEEP(5) GSWEEP(6)

typedef void (*gsweep_fn)(const int8_t *, int64_t, const float *, int64_t, const uint16_t *,
                          uint16_t *, int64_t, int64_t);
static const gsweep_fn GSWEEPS[PAIR_ROWS] = {gsweep_1, gsweep_2, gsweep_3,
                                             gsweep_4, gsweep_5, gsweep_6};

#define ROWS_PER_SWEEP PAIR_ROWS
F5_TARGET int moespec_int8_groups_avx512_batch(int64_t n, const uint64_t *weights,
                                               const uint64_t *scales, const uint16_t *X,
                                               int64_t x_rows, const int64_t *xrow,
                                               const int64_t *count, uint16_t *out,
                                               const int64_t *orow, int64_t O, int64_t I,
                                               int threads) {
    float *xf = widen_rows(X, x_rows, I, I);
    if (!xf) return 1;
    BATCH_LOOP(GSWEEPS[nr - 1]((const int8_t *)weights[k] + g * I * PAIR_GROUP, I,
                               xf + (xrow[k] + t) * I, I, (const uint16_t *)scales[k],
                               out + (orow[k] + t) * O, O, g * PAIR_GROUP))
    free(xf);
    return 0;
}
#undef ROWS_PER_SWEEP

F5_TARGET int moespec_int8_groups_avx512(const int8_t *G, const uint16_t *scales,
                                         const uint16_t *x, uint16_t *out, int64_t O, int64_t I,
                                         int64_t R, int threads) {
    uint64_t w = (uint64_t)(uintptr_t)G, s = (uint64_t)(uintptr_t)scales;
    int64_t zero = 0;
    return moespec_int8_groups_avx512_batch(1, &w, &s, x, R, &zero, &R, out, &zero, O, I, threads);
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
    return v2_product(W, 0, NULL, x, out, O, I, R, threads);
}

int moespec_int8_avx2(const int8_t *Q, const uint16_t *scales, const uint16_t *x, uint16_t *out,
                      int64_t O, int64_t I, int64_t R, int threads) {
    return v2_product(Q, 1, scales, x, out, O, I, R, threads);
}

/* AVX2 on the same pair layout (bf16) and group layout (int8): 16 ymm registers hold a sweep
 * of half a group (32 outputs) for up to two rows, or a whole group for one row. Pairs are
 * split into their even and odd weights (a shift, a mask) and multiplied by the broadcast
 * inputs, even then odd: each output is one fp32 chain over j in order, as on AVX-512 (the
 * rounding differs between the two ISAs: vdpbf16ps adds a pair at once). */
V2_TARGET INLINE void v2_pairs_sweep(const uint16_t *P, int64_t JP, const float *x, int64_t xs,
                                     const int NR, const int NV, int64_t half, uint16_t *out,
                                     int64_t O, int64_t o0) {
    __m256 acc[HALF_ROWS][8];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t jp = 0; jp < JP; jp++) {
        const uint16_t *pw = P + jp * 2 * PAIR_GROUP + half * 64;
        for (int v = 0; v < NV; v++) {
            __m256i pair = _mm256_loadu_si256((const __m256i *)(pw + v * 16));
            __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
            __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pair, hi));
            for (int r = 0; r < NR; r++) {
                acc[r][v] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x + r * xs + 2 * jp), acc[r][v]);
                acc[r][v] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x + r * xs + 2 * jp + 1), acc[r][v]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r][v]);
            int64_t o = o0 + half * 32 + v * 8;
            for (int k = 0; k < 8 && o + k < O; k++) out[r * O + o + k] = to_bf16(lanes[k]);
        }
}

V2_TARGET INLINE void v2_groups_sweep(const int8_t *G, int64_t I, const float *x, int64_t xs,
                                      const int NR, const int NV, int64_t half,
                                      const uint16_t *scales, uint16_t *out, int64_t O,
                                      int64_t o0) {
    __m256 acc[HALF_ROWS][8];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < I; j++) {
        const int8_t *gw = G + j * PAIR_GROUP + half * 32;
        for (int v = 0; v < NV; v++) {
            __m256 w = widen_int8x8(gw + v * 8);
            for (int r = 0; r < NR; r++)
                acc[r][v] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + r * xs + j), acc[r][v]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r][v]);
            int64_t o = o0 + half * 32 + v * 8;
            for (int k = 0; k < 8 && o + k < O; k++)
                out[r * O + o + k] = to_bf16(lanes[k] * from_bf16(scales[o + k]));
        }
}

#define V2SWEEPS(NR_, NV_)                                                                   \
    V2_TARGET __attribute__((noinline)) static void v2p_##NR_##_##NV_(                       \
        const uint16_t *P, int64_t JP, const float *x, int64_t xs, int64_t half, uint16_t *out, \
        int64_t O, int64_t o0) {                                                             \
        v2_pairs_sweep(P, JP, x, xs, NR_, NV_, half, out, O, o0);                            \
    }                                                                                        \
    V2_TARGET __attribute__((noinline)) static void v2g_##NR_##_##NV_(                       \
        const int8_t *G, int64_t I, const float *x, int64_t xs, int64_t half,                 \
        const uint16_t *scales, uint16_t *out, int64_t O, int64_t o0) {                      \
        v2_groups_sweep(G, I, x, xs, NR_, NV_, half, scales, out, O, o0);                    \
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
    return moespec_bf16_pairs_avx2_batch(1, &w, x, R, &zero, &R, out, &zero, O, I, threads);
}

V2_TARGET int moespec_int8_groups_avx2_batch(int64_t n, const uint64_t *weights,
                                             const uint64_t *scales, const uint16_t *X,
                                             int64_t x_rows, const int64_t *xrow,
                                             const int64_t *count, uint16_t *out,
                                             const int64_t *orow, int64_t O, int64_t I,
                                             int threads) {
    float *xf = widen_rows(X, x_rows, I, I);
    if (!xf) return 1;
#define GG ((const int8_t *)weights[k] + g * I * PAIR_GROUP)
#define SC ((const uint16_t *)scales[k])
    V2_BATCH_LOOP(V2_ITEM(
        v2g_1_8(GG, I, xf + xrow[k] * I, I, 0, SC, out + orow[k] * O, O, g * PAIR_GROUP),
        v2g_1_4(GG, I, xf + (xrow[k] + t) * I, I, half, SC, out + (orow[k] + t) * O, O,
                g * PAIR_GROUP),
        v2g_2_4(GG, I, xf + (xrow[k] + t) * I, I, half, SC, out + (orow[k] + t) * O, O,
                g * PAIR_GROUP)))
#undef GG
#undef SC
    free(xf);
    return 0;
}

V2_TARGET int moespec_int8_groups_avx2(const int8_t *G, const uint16_t *scales,
                                       const uint16_t *x, uint16_t *out, int64_t O, int64_t I,
                                       int64_t R, int threads) {
    uint64_t w = (uint64_t)(uintptr_t)G, s = (uint64_t)(uintptr_t)scales;
    int64_t zero = 0;
    return moespec_int8_groups_avx2_batch(1, &w, &s, x, R, &zero, &R, out, &zero, O, I, threads);
}
