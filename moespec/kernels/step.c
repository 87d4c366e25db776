/* moespec's native model pass: a decode step or a verification pass of a few tokens in one call.
 *
 * A small model's decode step is nearly all fixed time when it runs as library calls: some 800
 * of them per token on the demo target, each a few microseconds of dispatch, for well under a
 * millisecond of bytes. Here the whole pass (embedding, every layer's norms, projections, q/k
 * norms, rotary embedding, cache writes, attention, router, experts or dense MLP, and the
 * output head) is one call; the products and the attention are native.c's loops, reached
 * through the function pointers the caller passes (the CPU's family: `moespec_bf16_pairs_batch`
 * or its AVX2 twin, the int8 ones, `moespec_attend_bf16_*`), so this file needs no ISA of its
 * own and its elementwise work is plain C.
 *
 * Several sequences can share a pass (`moespec_step_batch`): their rows are concatenated, each
 * sequence (a `Segment`) with its own cache, positions and rotary rows; everything but the
 * attention takes all rows at once, so a batch reads each weight, and with the deduplicating
 * order each distinct expert, once. `moespec_step` is the batch of one.
 *
 * bf16 activations (the eager pass's rounding points: the residual stream, each product's
 * output, each norm, the rotation and the SwiGLU are rounded to bf16; norms, softmax and the
 * expert combine compute in fp32). Every row of a pass of T tokens is computed as a pass of
 * its own would compute it: the products give each row its one-row bits, each row attends
 * over exactly the positions it sees, and everything else is row-wise. So a verification pass
 * reproduces the bits of one-token steps, each sequence of a batch the bits of its own pass,
 * and the slot and deduplicating expert orders (which only change which rows share a weight's
 * read) give the same bits.
 *
 * A pass's buffers are kept from pass to pass (`Scratch`: it used to malloc some 15), a layer's
 * attention takes all the pass's rows in one call (native.c's `_rows`: one read of the keys and
 * values per 8 queries), and the elementwise loops (norms, rotation, SwiGLU with its own
 * vectorisable exponential, residual adds, the expert combine) are plain C compiled once per
 * instruction set (`STEP_VARIANT`: SSE2, AVX2, AVX-512, the same bits). On the demo target
 * (`python benchmarks/native_pass.py --threads N`, before and after in one sitting) a
 * one-token pass went from 0.385 to 0.340 ms at 1 thread (0.376 to 0.333 at 2), a pass of 9
 * from 1.68 to 1.34 ms (slot) and 1.46 to 1.16 (dedup) at 1 thread, 1.43 to 1.04 and 1.47 to
 * 1.07 at 2; the demo draft's step from 0.284 to 0.244 ms (0.303 to 0.239 at 2 threads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int moespec_step_version(void) { return 3; }

/* A call with an integer out of bounds returns minus its position in the call (from 1) before
 * anything is read or written, as native.c's entry points do: the caller raises a ValueError
 * naming it (moespec/kernels/native.py: `refused`). */
#define REFUSE(bad, position)                                                                \
    do {                                                                                     \
        if (bad) return -(position);                                                         \
    } while (0)

typedef int (*bf16_batch_fn)(int64_t n, const uint64_t *weights, const uint16_t *X,
                             int64_t x_rows, const int64_t *xrow, const int64_t *count,
                             uint16_t *out, const int64_t *orow, int64_t O, int64_t I,
                             int threads);
typedef int (*int8_batch_fn)(int64_t n, const uint64_t *weights, const uint64_t *scales,
                             const uint16_t *X, int64_t x_rows, const int64_t *xrow,
                             const int64_t *count, uint16_t *out, const int64_t *orow, int64_t O,
                             int64_t I, int threads);
typedef int (*attend_fn)(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                         int64_t H, int64_t G, int64_t L, int64_t D, int64_t Dv, int64_t k_head,
                         int64_t k_row, int64_t v_head, int64_t v_row, float scale, int threads);

typedef int (*attend_rows_fn)(const uint16_t *q, int64_t q_row, int64_t T, const uint16_t *k,
                              const uint16_t *v, uint16_t *out, int64_t o_row, int64_t H,
                              int64_t G, int64_t L0, int64_t D, int64_t Dv, int64_t k_head,
                              int64_t k_row, int64_t v_head, int64_t v_row, float scale,
                              int threads);

/* A weight in the pair layout: bf16 (scales NULL) or int8 values with a bf16 scale per row. */
typedef struct {
    uint64_t weight, scales;
    int64_t out, in, bytes;
} Product;

typedef struct {
    uint64_t input_norm, post_norm; /* bf16 [H] */
    Product qkv, o;
    uint64_t q_norm, k_norm; /* bf16 [D] (per head), [N D] / [K D] (projection), or 0 */
    int64_t qk_norm;         /* 0 none, 1 per head, 2 over the whole projection */
    int64_t experts, top_k, renormalize; /* experts 0: a dense MLP */
    Product router;                      /* [E, H] */
    uint64_t gate_up, down; /* Product [E] (experts), or one Product each (dense) */
} Layer;

/* A pass's buffers, kept from pass to pass (`moespec_scratch_free` releases them): a decode
 * step used to malloc and free some 15 of them. One pass at a time holds it (`busy`); a pass
 * that finds it held (two threads in one model's passes) takes buffers of its own. */
typedef struct {
    void *p;
    int64_t bytes, busy;
} Scratch;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, rotary, vocab;
    float eps, scale;
    uint64_t embed, norm; /* bf16 [V, H], [H] */
    Product head;
    const Layer *layer;
    uint64_t bf16_batch, int8_batch, attend; /* native.c's functions for this CPU */
    int64_t small_bytes; /* below this many bytes a product runs on one thread */
    uint64_t attend_rows; /* native.c's attention of a pass's rows (`attend`'s family) */
    int64_t isa;          /* the elementwise loops' instructions: 0 SSE2, 1 AVX2, 2 AVX-512 */
    uint64_t scratch;     /* a Scratch, or 0: buffers per pass */
} Model;

#define P(u) ((const void *)(uintptr_t)(u))
#define INLINE static inline __attribute__((always_inline))

/* Round to nearest even, NaN kept quiet; branch-free, so that the loops vectorise. */
INLINE uint16_t bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t nan = (u >> 16) | 0x40u, r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

INLINE float fl(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n products of one shape: product k takes rows xrow[k] .. of X (count[k] of them) into rows
 * orow[k] .. of out. Weights given as Product pointers (all bf16 or all int8). */
INLINE int products(const Model *m, int64_t n, const Product *const *w, const uint16_t *X,
                    int64_t x_rows, const int64_t *xrow, const int64_t *count, uint16_t *out,
                    const int64_t *orow, int threads, int64_t rows_for_threads) {
    uint64_t stack_w[64], stack_s[64];
    uint64_t *ws = n <= 64 ? stack_w : (uint64_t *)malloc((size_t)n * 8);
    uint64_t *ss = n <= 64 ? stack_s : (uint64_t *)malloc((size_t)n * 8);
    if (!ws || !ss) {
        if (n > 64) free(ws), free(ss);
        return 1;
    }
    int64_t bytes = 0;
    for (int64_t k = 0; k < n; k++) {
        ws[k] = w[k]->weight;
        ss[k] = w[k]->scales;
        bytes += w[k]->bytes;
    }
    int use = bytes * rows_for_threads >= m->small_bytes ? threads : 1;
    int rc;
    if (w[0]->scales)
        rc = ((int8_batch_fn)P(m->int8_batch))(n, ws, ss, X, x_rows, xrow, count, out, orow,
                                              w[0]->out, w[0]->in, use);
    else
        rc = ((bf16_batch_fn)P(m->bf16_batch))(n, ws, X, x_rows, xrow, count, out, orow,
                                              w[0]->out, w[0]->in, use);
    if (n > 64) free(ws), free(ss);
    return rc < 0 ? 2 : rc; /* a loop refusing an argument: shapes this pass got wrong */
}

/* One product of all T rows of X [T, in] into out [T, out]. */
INLINE int product(const Model *m, const Product *w, const uint16_t *X, int64_t T, uint16_t *out,
                   int threads) {
    int64_t zero = 0;
    return products(m, 1, &w, X, T, &zero, &T, out, &zero, threads, T);
}

/* The elementwise loops below are plain C written so that they vectorise (no branches, lanes
 * that do not depend on each other); each is compiled three times, for SSE2, AVX2 and AVX-512
 * (`STEP_VARIANT`), and every variant gives the same bits: the lanes' arithmetic is the scalar
 * arithmetic (the build contracts no a * b + c into an FMA: -std=c11, FP_CONTRACT off). */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
#define LANES 16 /* the partial sums of a norm's sum of squares */

/* out = w * bf16(x / rms(x)), the eager RMSNorm's rounding points; x and out may alias. The
 * sum of squares is 16 partial sums (element i to sum i % 16) added in a fixed tree: a chain
 * of n dependent adds was 5% of a 9-token pass. */
INLINE void rms_norm(const uint16_t *x, const uint16_t *w, int64_t n, float eps, uint16_t *out) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) part[j] += fl(x[i + j]) * fl(x[i + j]);
    for (int j = 0; i + j < n; j++) part[j] += fl(x[i + j]) * fl(x[i + j]);
    for (int half = LANES / 2; half; half /= 2)
        for (int j = 0; j < half; j++) part[j] += part[j + half];
    float r = 1.0f / sqrtf(part[0] / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = bf(fl(w[i]) * fl(bf(fl(x[i]) * r)));
}

/* x * cos + roll(x, R / 2) * sin over the first R of D dimensions, with the signed tables of
 * moespec.models.layers.Rotary (bf16, rounded as the eager rotation rounds). */
INLINE void rotate(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t R) {
    uint16_t tmp[1024];
    int64_t half = R / 2;
    memcpy(tmp, x, (size_t)R * 2);
    for (int64_t d = 0; d < half; d++)
        x[d] = bf(fl(bf(fl(tmp[d]) * fl(cos[d]))) + fl(bf(fl(tmp[d + half]) * fl(sin[d]))));
    for (int64_t d = half; d < R; d++)
        x[d] = bf(fl(bf(fl(tmp[d]) * fl(cos[d]))) + fl(bf(fl(tmp[d - half]) * fl(sin[d]))));
}

/* e^x rounded to float from a double approximation within 2^-36 of it (2^k times a degree-9
 * Taylor polynomial of e^r, |r| <= ln 2 / 2): plain arithmetic, so it vectorises where libm's
 * expf (a call per element, 3% of a 9-token pass) does not. Below -104 the float is 0, above
 * 104 infinity (as beyond 88.8); NaN stays NaN. */
INLINE float exp_f(float x) {
    /* |x| beyond 104 (NaN and infinities too) taken as +-104, compared as integers: a float
     * comparison may trap, and gcc does not vectorise a loop with one (-ftrapping-math) */
    uint32_t ux, ax;
    memcpy(&ux, &x, 4);
    ax = ux & 0x7fffffffu;
    uint32_t cu = ax > 0x42d00000u ? (ux & 0x80000000u) | 0x42d00000u : ux;
    float xc;
    memcpy(&xc, &cu, 4);
    double xd = xc;
    double shift = 0x1.8p52, kd = xd * 1.4426950408889634 + shift;
    uint64_t ki;
    memcpy(&ki, &kd, 8);
    kd -= shift;
    double r = xd - kd * 0.6931471805599453;
    double p = 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits = (ki + 1023u) << 52; /* 2^k: k = the low bits of ki, |k| < 151 */
    double scale;
    memcpy(&scale, &bits, 8);
    float y = (float)(p * scale);
    uint32_t uy, nan = 0u - (uint32_t)(ax > 0x7f800000u); /* NaN stays NaN: a mask, not a */
    memcpy(&uy, &y, 4);                                     /* select gcc would branch on */
    uy = (uy & ~nan) | (ux & nan);
    memcpy(&y, &uy, 4);
    return y;
}

/* act [R, I] = bf16(bf16(silu(gate)) * up) of hidden [R, 2I] (gate first). */
INLINE void swiglu(const uint16_t *hidden, int64_t R, int64_t I, uint16_t *act) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < I; i++) {
            float g = fl(hidden[r * 2 * I + i]);
            g = fl(bf(g / (1.0f + exp_f(-g))));
            act[r * I + i] = bf(g * fl(hidden[r * 2 * I + I + i]));
        }
}

/* h = bf16(h + y) over n elements */
INLINE void add_rows(uint16_t *h, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = bf(fl(h[i]) + fl(y[i]));
}

/* Softmax over E logits in fp32, the top k (the largest first, the lower index on a tie),
 * renormalised if asked. */
INLINE void route(const uint16_t *logits, int64_t E, int64_t k, int renormalize, float *p,
                  int64_t *ids, float *weights) {
    float mx = -INFINITY, total = 0.0f;
    for (int64_t e = 0; e < E; e++) mx = fl(logits[e]) > mx ? fl(logits[e]) : mx;
    for (int64_t e = 0; e < E; e++) total += p[e] = expf(fl(logits[e]) - mx);
    for (int64_t e = 0; e < E; e++) p[e] /= total;
    for (int64_t s = 0; s < k; s++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < s; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[s] = best;
        weights[s] = p[best];
    }
    if (renormalize) {
        float sum = 0.0f;
        for (int64_t s = 0; s < k; s++) sum += weights[s];
        for (int64_t s = 0; s < k; s++) weights[s] /= sum;
    }
}

/* The expert operation of MoE layer L on the T rows of x [T, H]: sid, w [T][top_k] each row's
 * experts and routing weights; h [T, H] += each row's combined expert outputs, summed in slot
 * order and rounded once. dedup: each distinct expert takes its rows in one product (else one
 * product per token and slot; the same bits either way). Buffers: hid [S, 2I], act [S, I],
 * xg [S, H] (S = T top_k), meta [5 S], plist [S]. The model pass and `moespec_experts` (the
 * calibration's timing of this operation alone) both run this code. */
INLINE int moe_experts(const Model *m, const Layer *L, const uint16_t *x, int64_t T,
                       const int64_t *sid, const float *w, int dedup, uint16_t *hid,
                       uint16_t *act, uint16_t *xg, int64_t *meta, const Product **plist,
                       uint16_t *h, int threads) {
    const int64_t H = m->hidden;
    const int64_t k = L->top_k, R = T * k, I = ((const Product *)P(L->gate_up))->out / 2;
    const Product *gate_up = (const Product *)P(L->gate_up);
    const Product *down = (const Product *)P(L->down);
    int64_t *xrow = meta, *count = meta + R, *orow = meta + 2 * R, *pos = meta + 3 * R;
    int64_t *order = meta + 4 * R;
    int rc;
    if (R == 0) return 0; /* no tokens (or no slots): nothing to add */
    /* pos[r]: the row of slot r (token-major) in hid/act/xg; the products in `order` */
    int64_t n = 0;
    if (!dedup) {
        for (int64_t r = 0; r < R; r++) {
            plist[r] = &gate_up[sid[r]];
            xrow[r] = r / k, count[r] = 1, orow[r] = r, pos[r] = r;
        }
        n = R;
        if ((rc = products(m, n, plist, x, T, xrow, count, hid, orow, threads, 1))) return rc;
    } else { /* distinct experts in order of first appearance, their slots gathered */
        int64_t filled = 0;
        for (int64_t r = 0; r < R; r++) order[r] = -1;
        for (int64_t r = 0; r < R; r++) {
            if (order[r] >= 0) continue;
            plist[n] = &gate_up[sid[r]];
            xrow[n] = filled, orow[n] = filled, count[n] = 0;
            for (int64_t q = r; q < R; q++)
                if (order[q] < 0 && sid[q] == sid[r]) {
                    order[q] = n;
                    pos[q] = filled++;
                    count[n]++;
                    memcpy(xg + pos[q] * H, x + (q / k) * H, (size_t)H * 2);
                }
            n++;
        }
        if ((rc = products(m, n, plist, xg, R, xrow, count, hid, orow, threads, 1))) return rc;
    }
    swiglu(hid, R, I, act);
    for (int64_t j = 0; j < n; j++)
        plist[j] = &down[plist[j] - gate_up]; /* the same experts' down products */
    if ((rc = products(m, n, plist, act, R, orow, count, xg, orow, threads, 1))) return rc;
    for (int64_t t = 0; t < T; t++) /* each token's slots in slot order, rounded once */
        for (int64_t i0 = 0; i0 < H; i0 += 64) {
            float acc[64] = {0};
            int64_t width = H - i0 < 64 ? H - i0 : 64;
            for (int64_t s = 0; s < k; s++) {
                const uint16_t *out = xg + pos[t * k + s] * H + i0;
                float ws = fl(bf(w[t * k + s]));
                for (int64_t i = 0; i < width; i++) acc[i] += fl(bf(fl(out[i]) * ws));
            }
            uint16_t *row = h + t * H + i0;
            for (int64_t i = 0; i < width; i++) row[i] = bf(fl(row[i]) + fl(bf(acc[i])));
        }
    return 0;
}

/* The buffers of a pass of T tokens, in one allocation: their offsets (64-byte aligned) into
 * at[], the total returned. */
enum { B_H, B_X, B_QKV, B_ATT, B_Y, B_HID, B_ACT, B_XG, B_RL, B_LM, B_P, B_W, B_SID, B_META,
       B_PLIST, B_COUNT };
static int64_t layout(const Model *m, int64_t T, int64_t at[B_COUNT]) {
    const int64_t H = m->hidden, N = m->heads, K = m->kv_heads, D = m->head_dim;
    int64_t top = 1, widest = H, inter = 1, E = 1;
    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *y = &m->layer[l];
        const Product *gu = (const Product *)P(y->gate_up);
        top = y->top_k > top ? y->top_k : top;
        inter = gu->out / 2 > inter ? gu->out / 2 : inter;
        E = y->experts > E ? y->experts : E;
    }
    widest = (N + 2 * K) * D > widest ? (N + 2 * K) * D : widest;
    widest = N * D > widest ? N * D : widest;
    const int64_t S = T * top; /* slots of the pass */
    const int64_t bytes[B_COUNT] = {
        T * H * 2,         /* h: the residual stream */
        T * H * 2,         /* x: normed */
        T * widest * 2,    /* qkv */
        T * N * D * 2,     /* attention out */
        S * H * 2,         /* y: per-slot outputs, then the layer's output */
        S * 2 * inter * 2, /* hidden */
        S * inter * 2,     /* act */
        S * H * 2,         /* xg: rows gathered by expert / expert outputs */
        T * E * 2,         /* router logits */
        T * m->vocab * 2,  /* head out */
        E * 4,             /* routing probabilities */
        S * 4,             /* routing weights */
        S * 8,             /* expert ids */
        S * 40,            /* moe_experts' meta */
        S * (int64_t)sizeof(void *), /* its product list */
    };
    int64_t total = 0;
    for (int i = 0; i < B_COUNT; i++) {
        at[i] = total;
        total += (bytes[i] + 63) / 64 * 64;
    }
    return total;
}

/* One sequence of a pass: its T rows (consecutive in the pass) at positions start ..
 * start + T - 1 of its own cache. cache: per layer the keys' then the values' base
 * ([K, capacity, D] bf16, batch 1); cos, sin: rows start .. of the rotary tables [*, R];
 * attend_threads: its attention's threads (by the positions it reads). */
typedef struct {
    int64_t T, start, capacity;
    uint64_t cache, cos, sin; /* const uint64_t [2 layers], const uint16_t [T, R] each */
    int64_t attend_threads;
} Segment;

/* Layer l's attention of one sequence: its rows of qkv [T, (N + 2K) D] get their q/k norms
 * and their rotation at its positions, its keys and values are written to its cache at start
 * .. start + T - 1, and att [T, N D] is row t over its positions 0 .. start + t alone, as a
 * pass of its own would see them (`attend_rows`). Returns 0, 1 without memory, 2 when the
 * attention refused its shapes. */
INLINE int attend_segment(const Model *m, const Layer *L, int64_t l, const Segment *s,
                          uint16_t *qkv, uint16_t *att) {
    const int64_t N = m->heads, K = m->kv_heads, D = m->head_dim;
    const int64_t QKV = (N + 2 * K) * D, R = m->rotary;
    const uint64_t *cache = (const uint64_t *)P(s->cache);
    uint16_t *keys = (uint16_t *)P(cache[2 * l]), *values = (uint16_t *)P(cache[2 * l + 1]);
    const uint16_t *cos = (const uint16_t *)P(s->cos), *sin = (const uint16_t *)P(s->sin);
    for (int64_t t = 0; t < s->T; t++) {
        uint16_t *row = qkv + t * QKV; /* q heads, k heads, v heads */
        if (L->qk_norm == 1)
            for (int64_t j = 0; j < N + K; j++)
                rms_norm(row + j * D, (const uint16_t *)P(j < N ? L->q_norm : L->k_norm), D,
                         m->eps, row + j * D);
        else if (L->qk_norm == 2) {
            rms_norm(row, (const uint16_t *)P(L->q_norm), N * D, m->eps, row);
            rms_norm(row + N * D, (const uint16_t *)P(L->k_norm), K * D, m->eps, row + N * D);
        }
        for (int64_t j = 0; j < N + K; j++) rotate(row + j * D, cos + t * R, sin + t * R, R);
        const int64_t pos = s->start + t;
        for (int64_t c = 0; c < K; c++) {
            memcpy(keys + (c * s->capacity + pos) * D, row + (N + c) * D, (size_t)D * 2);
            memcpy(values + (c * s->capacity + pos) * D, row + (N + K + c) * D, (size_t)D * 2);
        }
    }
    int rc = ((attend_rows_fn)P(m->attend_rows))(qkv, QKV, s->T, keys, values, att, N * D, N,
                                                 N / K, s->start + 1, D, D, s->capacity * D, D,
                                                 s->capacity * D, D, m->scale,
                                                 (int)s->attend_threads);
    return rc < 0 ? 2 : rc ? 1 : 0;
}

/* A pass over the rows of B sequences (`Segment`s, their rows concatenated: n in all).
 * Everything but attention is row-wise over all n rows at once (norms, projections, router,
 * experts, head), so the products read each weight once for the pass and the deduplicating
 * order reads each distinct expert once for all sequences. Each sequence's rows are rotated
 * at its positions, write its own cache, and attend over its own positions only (one
 * `attend_rows` call a sequence: row t over 0 .. start + t, as a pass of its own would see
 * them). Every row so gets the bits its sequence's pass alone gives it. dedup: each distinct
 * expert of a layer takes its rows in one product (else one product per token and slot; the
 * same bits either way). logits: fp32 [n, V] when all_logits, else [B, V] (each sequence's
 * last row). ids, weights: [layers][n][top], top the largest top_k, of each MoE layer (or
 * NULL). Returns 0, 1 without memory, 2 when a native loop refused its shapes. */
INLINE int step_body(const Model *m, const int64_t *tokens, int64_t B, const Segment *seg,
                     int dedup, int all_logits, float *logits, int64_t *ids, float *weights,
                     int threads, char *base, const int64_t *at) {
    const int64_t H = m->hidden, N = m->heads, K = m->kv_heads, D = m->head_dim;
    const int64_t QKV = (N + 2 * K) * D;
    int64_t top = 1, T = 0; /* T: the pass's rows, all sequences' */
    for (int64_t l = 0; l < m->layers; l++) top = m->layer[l].top_k > top ? m->layer[l].top_k : top;
    for (int64_t b = 0; b < B; b++) T += seg[b].T;
    uint16_t *h = (uint16_t *)(base + at[B_H]), *x = (uint16_t *)(base + at[B_X]);
    uint16_t *qkv = (uint16_t *)(base + at[B_QKV]), *att = (uint16_t *)(base + at[B_ATT]);
    uint16_t *y = (uint16_t *)(base + at[B_Y]), *hid = (uint16_t *)(base + at[B_HID]);
    uint16_t *act = (uint16_t *)(base + at[B_ACT]), *xg = (uint16_t *)(base + at[B_XG]);
    uint16_t *rl = (uint16_t *)(base + at[B_RL]), *lm = (uint16_t *)(base + at[B_LM]);
    float *p = (float *)(base + at[B_P]), *w = (float *)(base + at[B_W]);
    int64_t *sid = (int64_t *)(base + at[B_SID]), *meta = (int64_t *)(base + at[B_META]);
    const Product **plist = (const Product **)(base + at[B_PLIST]);
    const uint16_t *embed = (const uint16_t *)P(m->embed);
    int rc;
    for (int64_t t = 0; t < T; t++) memcpy(h + t * H, embed + tokens[t] * H, (size_t)H * 2);

    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *L = &m->layer[l];
        for (int64_t t = 0; t < T; t++)
            rms_norm(h + t * H, (const uint16_t *)P(L->input_norm), H, m->eps, x + t * H);
        if ((rc = product(m, &L->qkv, x, T, qkv, threads))) return rc;
        for (int64_t b = 0, r0 = 0; b < B; r0 += seg[b++].T) /* r0: its first row */
            if ((rc = attend_segment(m, L, l, &seg[b], qkv + r0 * QKV, att + r0 * N * D)))
                return rc;
        if ((rc = product(m, &L->o, att, T, y, threads))) return rc;
        add_rows(h, y, T * H);
        for (int64_t t = 0; t < T; t++)
            rms_norm(h + t * H, (const uint16_t *)P(L->post_norm), H, m->eps, x + t * H);

        if (!L->experts) { /* a dense MLP */
            const Product *gu = (const Product *)P(L->gate_up), *dn = (const Product *)P(L->down);
            if ((rc = product(m, gu, x, T, hid, threads))) return rc;
            swiglu(hid, T, gu->out / 2, act);
            if ((rc = product(m, dn, act, T, y, threads))) return rc;
            add_rows(h, y, T * H);
            continue;
        }
        const int64_t k = L->top_k;
        if ((rc = product(m, &L->router, x, T, rl, threads))) return rc;
        for (int64_t t = 0; t < T; t++)
            route(rl + t * L->experts, L->experts, k, (int)L->renormalize, p, sid + t * k,
                  w + t * k);
        if (ids) /* [layers][T][top]: this layer's k of each row's top slots */
            for (int64_t t = 0; t < T; t++) {
                memcpy(ids + (l * T + t) * top, sid + t * k, (size_t)k * 8);
                memcpy(weights + (l * T + t) * top, w + t * k, (size_t)k * 4);
            }
        if ((rc = moe_experts(m, L, x, T, sid, w, dedup, hid, act, xg, meta, plist, h,
                              threads)))
            return rc;
    }
    /* the head's rows: every row, or each sequence's last */
    int64_t rows = 0;
    for (int64_t b = 0, r0 = 0; b < B; r0 += seg[b++].T)
        for (int64_t t = all_logits ? r0 : r0 + seg[b].T - 1; t < r0 + seg[b].T; t++)
            rms_norm(h + t * H, (const uint16_t *)P(m->norm), H, m->eps, x + rows++ * H);
    if ((rc = product(m, &m->head, x, rows, lm, threads))) return rc;
    for (int64_t i = 0; i < rows * m->vocab; i++) logits[i] = fl(lm[i]);
    return 0;
}

#define STEP_PARAMS                                                                          \
    const Model *m, const int64_t *tokens, int64_t B, const Segment *seg, int dedup,         \
        int all_logits, float *logits, int64_t *ids, float *weights, int threads, char *base, \
        const int64_t *at
#define STEP_ARGS m, tokens, B, seg, dedup, all_logits, logits, ids, weights, threads, base, at
#define EXPERTS_PARAMS                                                                       \
    const Model *m, const Layer *L, const uint16_t *x, int64_t T, const int64_t *sid,        \
        const float *w, int dedup, uint16_t *hid, uint16_t *act, uint16_t *xg, int64_t *meta, \
        const Product **plist, uint16_t *h, int threads
#define EXPERTS_ARGS m, L, x, T, sid, w, dedup, hid, act, xg, meta, plist, h, threads
#define STEP_VARIANT(SUFFIX, TARGET)                                                         \
    TARGET __attribute__((noinline)) static int step_##SUFFIX(STEP_PARAMS) {                 \
        return step_body(STEP_ARGS);                                                         \
    }                                                                                        \
    TARGET __attribute__((noinline)) static int experts_##SUFFIX(EXPERTS_PARAMS) {           \
        return moe_experts(EXPERTS_ARGS);                                                    \
    }
STEP_VARIANT(sse2, )
STEP_VARIANT(avx2, __attribute__((target("avx2,fma"))))
#ifndef MOESPEC_NO_AVX512
STEP_VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#else
#define step_avx512 step_avx2
#define experts_avx512 experts_avx2
#endif

void moespec_scratch_free(Scratch *s) {
    free(s->p);
    s->p = NULL, s->bytes = 0;
}

/* Whether the model's shapes are out of the bounds the pass's buffers and loops rely on: a
 * rotation of at most 1024 even dims within the head (`rotate`'s buffer), query heads in whole
 * groups per key head, and each MoE layer's top k within its experts (`route` picks k distinct
 * ones). O(layers) integer checks a pass. */
static int model_refused(const Model *m) {
    if (m->layers < 0 || m->hidden < 1 || m->heads < 1 || m->kv_heads < 1 ||
        m->heads % m->kv_heads || m->head_dim < 1 || m->vocab < 1 || m->rotary < 0 ||
        m->rotary % 2 || m->rotary > m->head_dim || m->rotary > 1024)
        return 1;
    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *L = &m->layer[l];
        if (L->experts < 0 || L->qk_norm < 0 || L->qk_norm > 2 ||
            (L->experts && (L->top_k < 1 || L->top_k > L->experts)))
            return 1;
    }
    return 0;
}

/* The pass (`step_body`) on the model's persistent buffers where it can take them, its
 * elementwise loops in the model's instructions; tokens checked first (3: one outside the
 * vocabulary, nothing written). */
static int run_pass(const Model *m, const int64_t *tokens, int64_t B, const Segment *seg,
                    int dedup, int all_logits, float *logits, int64_t *ids, float *weights,
                    int threads) {
    int64_t T = 0;
    for (int64_t b = 0; b < B; b++) T += seg[b].T;
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->vocab) return 3;
    int64_t at[B_COUNT], bytes = layout(m, T, at);
    Scratch *sc = (Scratch *)P(m->scratch);
    char *base = NULL;
    int held = sc && !__atomic_exchange_n(&sc->busy, 1, __ATOMIC_ACQUIRE);
    if (held && sc->bytes < bytes) {
        free(sc->p);
        sc->bytes = 0;
        if ((sc->p = aligned_alloc(64, (size_t)bytes))) sc->bytes = bytes;
    }
    base = held ? (char *)sc->p : (char *)aligned_alloc(64, (size_t)bytes);
    int rc = 1;
    if (base) {
        int (*fn)(STEP_PARAMS) = m->isa == 2 ? step_avx512 : m->isa == 1 ? step_avx2 : step_sse2;
        rc = fn(STEP_ARGS);
    }
    if (held)
        __atomic_store_n(&sc->busy, 0, __ATOMIC_RELEASE);
    else
        free(base);
    return rc;
}

/* A pass of one sequence: T tokens at positions start .. start + T - 1 of its cache (a batch
 * of one `Segment`). Returns 3 for a token id outside the vocabulary, minus an argument's
 * position for one out of bounds (the model's shapes; T >= 1; start >= 0 with start + T
 * within the cache's capacity; threads >= 1): nothing written. */
int moespec_step(const Model *m, const int64_t *tokens, int64_t T, int64_t start,
                 const uint64_t *cache, int64_t capacity, const uint16_t *cos,
                 const uint16_t *sin, int dedup, int all_logits, float *logits, int64_t *ids,
                 float *weights, int threads, int attend_threads) {
    REFUSE(model_refused(m), 1);
    REFUSE(T < 1, 3);
    REFUSE(start < 0, 4);
    REFUSE(capacity < 1 || T > capacity - start, 6); /* the pass's positions in the cache */
    REFUSE(threads < 1, 14);
    REFUSE(attend_threads < 1, 15);
    const Segment one = {T, start, capacity, (uint64_t)(uintptr_t)cache, (uint64_t)(uintptr_t)cos,
                         (uint64_t)(uintptr_t)sin, attend_threads};
    return run_pass(m, tokens, 1, &one, dedup, all_logits, logits, ids, weights, threads);
}

#define MAX_BATCH_ROWS 256 /* a batched pass's rows, all sequences' (native_step.MAX_TOKENS) */

/* Whether a batch's segments are out of bounds: each T >= 1, start >= 0 with start + T
 * within its cache's capacity, its attention's threads >= 1; at most MAX_BATCH_ROWS rows. */
static int segments_refused(const Segment *seg, int64_t B) {
    int64_t rows = 0;
    for (int64_t b = 0; b < B; b++) {
        const Segment *s = &seg[b];
        if (s->T < 1 || s->start < 0 || s->capacity < 1 || s->T > s->capacity - s->start ||
            s->attend_threads < 1 || s->T > MAX_BATCH_ROWS)
            return 1;
        rows += s->T;
    }
    return rows > MAX_BATCH_ROWS;
}

/* A pass of B sequences at once (`step_body`): tokens [n], the sequences' rows concatenated
 * in segment order; logits fp32 [n, V] (all_logits) or [B, V]; ids, weights [layers][n][top]
 * or NULL. Each sequence's rows get the bits of its own pass (`moespec_step`). Returns 3 for
 * a token id outside the vocabulary, minus an argument's position for one out of bounds (the
 * model's shapes; B >= 1; the segments; threads >= 1): nothing written. */
int moespec_step_batch(const Model *m, const int64_t *tokens, int64_t B, const Segment *seg,
                       int dedup, int all_logits, float *logits, int64_t *ids, float *weights,
                       int threads) {
    REFUSE(model_refused(m), 1);
    REFUSE(B < 1, 3);
    REFUSE(segments_refused(seg, B), 4);
    REFUSE(threads < 1, 10);
    return run_pass(m, tokens, B, seg, dedup, all_logits, logits, ids, weights, threads);
}

/* The expert operation of one MoE layer alone, as the model pass runs it (`moe_experts`): the
 * calibration times this, so that its fits describe the engine's own expert operation. x
 * [T, H] bf16 (H = m->hidden); ids, weights [T][k]; out [T, H] bf16 (overwritten with each
 * row's combined expert outputs; T may be 0). k is an argument, not L's: calls of one layer
 * from several threads share L and change nothing in it. Only m's hidden size, product
 * functions, instructions and small-work threshold are read. Returns 0, 1 without memory, 2
 * when a native loop refused its shapes, 4 for an expert id outside 0 .. L->experts - 1,
 * minus an argument's position for one out of bounds (nothing read). */
int moespec_experts(const Model *m, const Layer *L, const uint16_t *x, int64_t T, int64_t k,
                    const int64_t *ids, const float *weights, int dedup, uint16_t *out,
                    int threads) {
    REFUSE(m->hidden < 1, 1);
    REFUSE(L->experts < 1, 2);
    REFUSE(T < 0, 4);
    REFUSE(k < 0, 5);
    REFUSE(threads < 1, 10);
    const int64_t H = m->hidden, S = T * k;
    const int64_t I = ((const Product *)P(L->gate_up))->out / 2;
    for (int64_t r = 0; r < S; r++)
        if (ids[r] < 0 || ids[r] >= L->experts) return 4;
    Layer layer = *L; /* this call's top k, on the stack */
    layer.top_k = k;
    uint16_t *hid = (uint16_t *)malloc((size_t)(S * 2 * I) * 2 + 64);
    uint16_t *act = (uint16_t *)malloc((size_t)(S * I) * 2 + 64);
    uint16_t *xg = (uint16_t *)malloc((size_t)(S * H) * 2 + 64);
    int64_t *meta = (int64_t *)malloc((size_t)S * 40 + 64);
    const Product **plist = (const Product **)malloc((size_t)(S > 1 ? S : 1) * sizeof(void *));
    int rc = 1;
    if (hid && act && xg && meta && plist) {
        if (T) /* bf16 +0: the sum is each row's rounded output */
            memset(out, 0, (size_t)(T * H) * 2);
        int (*fn)(EXPERTS_PARAMS) = m->isa == 2   ? experts_avx512
                                    : m->isa == 1 ? experts_avx2
                                                  : experts_sse2;
        rc = fn(m, &layer, x, T, ids, weights, dedup, hid, act, xg, meta, plist, out, threads);
    }
    free(hid), free(act), free(xg), free(meta), free(plist);
    return rc;
}
