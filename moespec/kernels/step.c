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
 * Batch 1, bf16 activations (the eager pass's rounding points: the residual stream, each
 * product's output, each norm, the rotation and the SwiGLU are rounded to bf16; norms,
 * softmax and the expert combine compute in fp32). Every row of a pass of T tokens is computed
 * as a pass of its own would compute it: the products give each row its one-row bits, each
 * row attends over exactly the positions it sees, and everything else is row-wise. So a
 * verification pass reproduces the bits of one-token steps, and the slot and deduplicating
 * expert orders (which only change which rows share a weight's read) give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int moespec_step_version(void) { return 1; }

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

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, rotary, vocab;
    float eps, scale;
    uint64_t embed, norm; /* bf16 [V, H], [H] */
    Product head;
    const Layer *layer;
    uint64_t bf16_batch, int8_batch, attend; /* native.c's functions for this CPU */
    int64_t small_bytes; /* below this many bytes a product runs on one thread */
} Model;

#define P(u) ((const void *)(uintptr_t)(u))

static inline uint16_t bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fl(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n products of one shape: product k takes rows xrow[k] .. of X (count[k] of them) into rows
 * orow[k] .. of out. Weights given as Product pointers (all bf16 or all int8). */
static int products(const Model *m, int64_t n, const Product *const *w, const uint16_t *X,
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
    return rc;
}

/* One product of all T rows of X [T, in] into out [T, out]. */
static int product(const Model *m, const Product *w, const uint16_t *X, int64_t T, uint16_t *out,
                   int threads) {
    int64_t zero = 0;
    return products(m, 1, &w, X, T, &zero, &T, out, &zero, threads, T);
}

/* out = w * bf16(x / rms(x)), the eager RMSNorm's rounding points; x and out may alias. */
static void rms_norm(const uint16_t *x, const uint16_t *w, int64_t n, float eps, uint16_t *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += fl(x[i]) * fl(x[i]);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = bf(fl(w[i]) * fl(bf(fl(x[i]) * r)));
}

/* x * cos + roll(x, R / 2) * sin over the first R of D dimensions, with the signed tables of
 * moespec.models.layers.Rotary (bf16, rounded as the eager rotation rounds). */
static void rotate(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t R) {
    uint16_t tmp[1024];
    int64_t half = R / 2;
    memcpy(tmp, x, (size_t)R * 2);
    for (int64_t d = 0; d < R; d++) {
        uint16_t a = bf(fl(tmp[d]) * fl(cos[d]));
        uint16_t b = bf(fl(tmp[(d + half) % R]) * fl(sin[d]));
        x[d] = bf(fl(a) + fl(b));
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* act [R, I] = bf16(bf16(silu(gate)) * up) of hidden [R, 2I] (gate first). */
static void swiglu(const uint16_t *hidden, int64_t R, int64_t I, uint16_t *act) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < I; i++) {
            float g = fl(bf(silu(fl(hidden[r * 2 * I + i]))));
            act[r * I + i] = bf(g * fl(hidden[r * 2 * I + I + i]));
        }
}

/* Softmax over E logits in fp32, the top k (the largest first, the lower index on a tie),
 * renormalised if asked. */
static void route(const uint16_t *logits, int64_t E, int64_t k, int renormalize, float *p,
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
static int moe_experts(const Model *m, const Layer *L, const uint16_t *x, int64_t T,
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
        for (int64_t i = 0; i < H; i++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < k; s++)
                acc += fl(bf(fl(xg[pos[t * k + s] * H + i]) * fl(bf(w[t * k + s]))));
            h[t * H + i] = bf(fl(h[t * H + i]) + fl(bf(acc)));
        }
    return 0;
}

/* A pass of T tokens at positions start .. start + T - 1 of the cache. cache: per layer the
 * keys' then the values' base ([K, capacity, D] bf16, batch 1); cos, sin: rows start .. of the
 * rotary tables [*, R]. dedup: each distinct expert of a layer takes its rows in one product
 * (else one product per token and slot; the same bits either way). logits: fp32 [T, V] when
 * all_logits, else [1, V] of the last row. ids, weights: [layers][T][top], top the largest
 * top_k, of each MoE layer
 * (or NULL). Returns 0, 1 without memory, 2 when a native loop refused its shapes, 3 for a
 * token id outside the vocabulary (nothing written). */
int moespec_step(const Model *m, const int64_t *tokens, int64_t T, int64_t start,
                 const uint64_t *cache, int64_t capacity, const uint16_t *cos,
                 const uint16_t *sin, int dedup, int all_logits, float *logits, int64_t *ids,
                 float *weights, int threads, int attend_threads) {
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->vocab) return 3;
    const int64_t H = m->hidden, N = m->heads, K = m->kv_heads, D = m->head_dim;
    const int64_t QKV = (N + 2 * K) * D;
    int64_t top = 1, widest = H, inter = 1, E = 1;
    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *y = &m->layer[l];
        const Product *gu = (const Product *)P(y->gate_up);
        top = y->top_k > top ? y->top_k : top;
        inter = gu->out / 2 > inter ? gu->out / 2 : inter;
        E = y->experts > E ? y->experts : E;
    }
    widest = QKV > widest ? QKV : widest;
    widest = N * D > widest ? N * D : widest;
    const int64_t S = T * top; /* slots of the pass */
    size_t sizes[] = {
        (size_t)(T * H),         /* h: the residual stream */
        (size_t)(T * H),         /* x: normed */
        (size_t)(T * widest),    /* qkv */
        (size_t)(T * N * D),     /* attention out */
        (size_t)(S * H),         /* y: per-slot outputs, then the layer's output */
        (size_t)(S * 2 * inter), /* hidden */
        (size_t)(S * inter),     /* act */
        (size_t)(S * H),         /* xg: rows gathered by expert / expert outputs */
        (size_t)(T * E),         /* router logits */
        (size_t)(T * m->vocab),  /* head out */
    };
    const int nb = (int)(sizeof sizes / sizeof sizes[0]);
    uint16_t *buf[10];
    int rc = 0;
    for (int i = 0; i < nb; i++) buf[i] = (uint16_t *)malloc(sizes[i] * 2 + 64);
    float *p = (float *)malloc((size_t)E * 4), *w = (float *)malloc((size_t)S * 4);
    int64_t *sid = (int64_t *)malloc((size_t)S * 8), *meta = (int64_t *)malloc((size_t)S * 40);
    const Product **plist = (const Product **)malloc((size_t)(S > 1 ? S : 1) * sizeof(void *));
    for (int i = 0; i < nb; i++) rc |= !buf[i];
    if (rc || !p || !w || !sid || !meta || !plist) {
        rc = 1;
        goto done;
    }
    uint16_t *h = buf[0], *x = buf[1], *qkv = buf[2], *att = buf[3], *y = buf[4];
    uint16_t *hid = buf[5], *act = buf[6], *xg = buf[7], *rl = buf[8], *lm = buf[9];
    const uint16_t *embed = (const uint16_t *)P(m->embed);
    for (int64_t t = 0; t < T; t++) memcpy(h + t * H, embed + tokens[t] * H, (size_t)H * 2);

    for (int64_t l = 0; l < m->layers; l++) {
        const Layer *L = &m->layer[l];
        uint16_t *keys = (uint16_t *)P(cache[2 * l]), *values = (uint16_t *)P(cache[2 * l + 1]);
        for (int64_t t = 0; t < T; t++)
            rms_norm(h + t * H, (const uint16_t *)P(L->input_norm), H, m->eps, x + t * H);
        if ((rc = product(m, &L->qkv, x, T, qkv, threads))) goto done;
        for (int64_t t = 0; t < T; t++) {
            uint16_t *row = qkv + t * QKV; /* q heads, k heads, v heads */
            if (L->qk_norm == 1)
                for (int64_t j = 0; j < N + K; j++)
                    rms_norm(row + j * D, (const uint16_t *)P(j < N ? L->q_norm : L->k_norm), D,
                             m->eps, row + j * D);
            else if (L->qk_norm == 2) {
                rms_norm(row, (const uint16_t *)P(L->q_norm), N * D, m->eps, row);
                rms_norm(row + N * D, (const uint16_t *)P(L->k_norm), K * D, m->eps, row + N * D);
            }
            for (int64_t j = 0; j < N + K; j++)
                rotate(row + j * D, cos + t * m->rotary, sin + t * m->rotary, m->rotary);
            int64_t at = start + t;
            for (int64_t c = 0; c < K; c++) {
                memcpy(keys + (c * capacity + at) * D, row + (N + c) * D, (size_t)D * 2);
                memcpy(values + (c * capacity + at) * D, row + (N + K + c) * D, (size_t)D * 2);
            }
            /* row t sees positions 0 .. start + t, as a pass of its own would */
            if (((attend_fn)P(m->attend))(row, keys, values, att + t * N * D, N, N / K, at + 1, D,
                                          D, capacity * D, D, capacity * D, D, m->scale,
                                          attend_threads)) {
                rc = 1;
                goto done;
            }
        }
        if ((rc = product(m, &L->o, att, T, y, threads))) goto done;
        for (int64_t i = 0; i < T * H; i++) h[i] = bf(fl(h[i]) + fl(y[i]));
        for (int64_t t = 0; t < T; t++)
            rms_norm(h + t * H, (const uint16_t *)P(L->post_norm), H, m->eps, x + t * H);

        if (!L->experts) { /* a dense MLP */
            const Product *gu = (const Product *)P(L->gate_up), *dn = (const Product *)P(L->down);
            if ((rc = product(m, gu, x, T, hid, threads))) goto done;
            swiglu(hid, T, gu->out / 2, act);
            if ((rc = product(m, dn, act, T, y, threads))) goto done;
            for (int64_t i = 0; i < T * H; i++) h[i] = bf(fl(h[i]) + fl(y[i]));
            continue;
        }
        const int64_t k = L->top_k;
        if ((rc = product(m, &L->router, x, T, rl, threads))) goto done;
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
            goto done;
    }
    int64_t first = all_logits ? 0 : T - 1, rows = T - first;
    for (int64_t t = first; t < T; t++)
        rms_norm(h + t * H, (const uint16_t *)P(m->norm), H, m->eps, x + (t - first) * H);
    if ((rc = product(m, &m->head, x, rows, lm, threads))) goto done;
    for (int64_t i = 0; i < rows * m->vocab; i++) logits[i] = fl(lm[i]);
done:
    for (int i = 0; i < nb; i++) free(buf[i]);
    free(p), free(w), free(sid), free(meta), free(plist);
    return rc;
}

/* The expert operation of one MoE layer alone, as the model pass runs it (`moe_experts`): the
 * calibration times this, so that its fits describe the engine's own expert operation. x
 * [T, H] bf16 (H = m->hidden); ids, weights [T][L->top_k]; out [T, H] bf16 (overwritten with
 * each row's combined expert outputs). Only m's hidden size, product functions and small-work
 * threshold are read. Returns 0, 1 without memory, 2 when a native loop refused its shapes,
 * 4 for an expert id outside 0 .. L->experts - 1 (nothing read). */
int moespec_experts(const Model *m, const Layer *L, const uint16_t *x, int64_t T,
                    const int64_t *ids, const float *weights, int dedup, uint16_t *out,
                    int threads) {
    const int64_t H = m->hidden, S = T * L->top_k;
    const int64_t I = ((const Product *)P(L->gate_up))->out / 2;
    for (int64_t r = 0; r < S; r++)
        if (ids[r] < 0 || ids[r] >= L->experts) return 4;
    uint16_t *hid = (uint16_t *)malloc((size_t)(S * 2 * I) * 2 + 64);
    uint16_t *act = (uint16_t *)malloc((size_t)(S * I) * 2 + 64);
    uint16_t *xg = (uint16_t *)malloc((size_t)(S * H) * 2 + 64);
    int64_t *meta = (int64_t *)malloc((size_t)S * 40);
    const Product **plist = (const Product **)malloc((size_t)(S > 1 ? S : 1) * sizeof(void *));
    int rc = 1;
    if (hid && act && xg && meta && plist) {
        memset(out, 0, (size_t)(T * H) * 2); /* bf16 +0: the sum is each row's rounded output */
        rc = moe_experts(m, L, x, T, ids, weights, dedup, hid, act, xg, meta, plist, out,
                         threads);
    }
    free(hid), free(act), free(xg), free(meta), free(plist);
    return rc;
}
