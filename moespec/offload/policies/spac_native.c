/* SpAc's per-layer decisions in C (spac.py, `spac_kernel`): the same decisions as the
 * Python classes (estimator.py, balancer.py, queues.py), step for step and in the same
 * floating-point order, with no Python per expert.
 *
 * One `State` per run. The arrays the Python side reads (the cache's present, pinned and
 * ready_at; the estimator's u and boundaries; the balancer's shares; tau; the unit times) are
 * numpy arrays it owns and this object holds; the eviction pool and the prefetch queue live
 * here only: per utility level, a doubly linked list in LRU order (the pool) and a FIFO with
 * lazy cancellation (the queue). Built with -ffp-contract=off: no fused multiply-adds, so
 * every sum and product rounds as numpy's and Python's do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { REF_COUNT = 0, REF_LEVEL = 1, REF_PREVIOUS = 2 };
/* UnitTimes.totals, in UnitTimes.KEYS order */
enum { CPU_SECONDS, CPU_SLOTS, CPU_EXPERTS, ACC_SECONDS, ACC_EXPERTS, COPY_SECONDS, COPIES,
       DRAFT_SECONDS, DRAFTED, N_SUMS };
/* LayerTiming fields */
enum { T_LAYER, T_SECONDS, T_CPU_SECONDS, T_CPU_SLOTS, T_CPU_EXPERTS, T_ACC_SECONDS,
       T_ACC_EXPERTS, T_COPY_SECONDS, T_COPIES, N_TIMING };
static const char *TIMING_NAMES[N_TIMING] = {
    "layer", "seconds", "cpu_seconds", "cpu_slots", "cpu_experts", "accelerator_seconds",
    "accelerator_experts", "copy_seconds", "copies"};
static PyObject *timing_keys[N_TIMING];

typedef struct {
    int32_t *items; /* l * N + e */
    Py_ssize_t cap, head, len;
} Fifo;

#define N_ARRAYS 13
typedef struct {
    PyObject_HEAD
    Py_ssize_t L, N, K;
    int reference, adaptive, balancer, prefetch, evict;
    double fixed_up, fixed_down, forgetting, level_scale;
    long long static_tau, warmup_steps, draft_length, top_k, budget;
    double tier_overlap;
    long long step, n_tokens;
    PyObject *arrays[N_ARRAYS];
    npy_bool *present, *pinned;
    double *ready_at;
    int64_t *expert_bytes, *utility, *tau;
    double *previous, *theta_up, *theta_down, *slot_share, *expert_share, *distinct, *passes;
    /* the unit times (UnitTimes: three buffers of doubles, two arrays) */
    Py_buffer sums_view, rest_view, rest_passes_view;
    int views; /* buffers held */
    double *sums, *rest, *rest_passes;
    PyObject *layer_seconds_obj, *layer_passes_obj;
    double *layer_seconds, *layer_passes;
    long long choices, tau_sum, infeasible, none_hot, cancelled;
    /* the eviction pool */
    int32_t *pool_level, *prev, *next, *head, *tail;
    int64_t *bytes_at;
    /* the prefetch queue */
    int32_t *queued;
    int64_t *queued_in_layer, queued_total;
    Fifo *fifos;
    /* scratch [N] */
    double *f;
    int64_t *old;
    unsigned char *mark;
} State;

/* ---- the eviction pool: per level, LRU first ---- */
static void pool_append(State *s, int32_t i, int32_t level) {
    s->prev[i] = s->tail[level];
    s->next[i] = -1;
    if (s->tail[level] >= 0) s->next[s->tail[level]] = i;
    else s->head[level] = i;
    s->tail[level] = i;
}

static void pool_unlink(State *s, int32_t i, int32_t level) {
    if (s->prev[i] >= 0) s->next[s->prev[i]] = s->next[i];
    else s->head[level] = s->next[i];
    if (s->next[i] >= 0) s->prev[s->next[i]] = s->prev[i];
    else s->tail[level] = s->prev[i];
}

static int pool_add(State *s, Py_ssize_t l, Py_ssize_t e, int32_t level) {
    int32_t i = (int32_t)(l * s->N + e);
    if (s->pool_level[i] >= 0) {
        PyErr_Format(PyExc_KeyError, "expert %zd of layer %zd is already in the pool", e, l);
        return -1;
    }
    s->pool_level[i] = level;
    pool_append(s, i, level);
    s->bytes_at[level] += s->expert_bytes[l];
    return 0;
}

/* Re-key at `level`, to the back of it (the most recently used). */
static int pool_move(State *s, Py_ssize_t l, Py_ssize_t e, int32_t level) {
    int32_t i = (int32_t)(l * s->N + e), old = s->pool_level[i];
    if (old < 0) {
        PyErr_Format(PyExc_KeyError, "expert %zd of layer %zd is not in the pool", e, l);
        return -1;
    }
    pool_unlink(s, i, old);
    pool_append(s, i, level);
    if (old != level) {
        s->pool_level[i] = level;
        s->bytes_at[old] -= s->expert_bytes[l];
        s->bytes_at[level] += s->expert_bytes[l];
    }
    return 0;
}

static void pool_remove(State *s, int32_t i) {
    int32_t level = s->pool_level[i];
    pool_unlink(s, i, level);
    s->pool_level[i] = -1;
    s->bytes_at[level] -= s->expert_bytes[i / s->N];
}

/* ---- the prefetch queue: per level a FIFO, stale entries dropped when popped ---- */
static int fifo_push(Fifo *q, int32_t item) {
    if (q->len == q->cap) {
        Py_ssize_t cap = q->cap ? 2 * q->cap : 64;
        int32_t *items = PyMem_Malloc(cap * sizeof(int32_t));
        if (!items) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t k = 0; k < q->len; k++) items[k] = q->items[(q->head + k) % q->cap];
        PyMem_Free(q->items);
        q->head = 0;
        q->items = items;
        q->cap = cap;
    }
    q->items[(q->head + q->len) % q->cap] = item;
    q->len++;
    return 0;
}

static int queue_push(State *s, Py_ssize_t l, Py_ssize_t e, int32_t level) {
    int32_t i = (int32_t)(l * s->N + e);
    if (s->queued[i] == level) return 0;
    if (s->queued[i] < 0) {
        s->queued_in_layer[l]++;
        s->queued_total++;
    }
    s->queued[i] = level; /* an older entry at another level becomes stale */
    return fifo_push(&s->fifos[level], i);
}

static int32_t queue_pop(State *s) {
    for (Py_ssize_t level = s->K; level >= 0; level--) {
        Fifo *q = &s->fifos[level];
        while (q->len) {
            int32_t i = q->items[q->head];
            q->head = (q->head + 1) % q->cap;
            q->len--;
            if (s->queued[i] == level) {
                s->queued[i] = -1;
                s->queued_in_layer[i / s->N]--;
                s->queued_total--;
                return i;
            }
        }
    }
    return -1;
}

static void queue_cancel_layer(State *s, Py_ssize_t l) {
    int64_t n = s->queued_in_layer[l];
    if (!n) return;
    int32_t *row = s->queued + l * s->N;
    for (Py_ssize_t e = 0; e < s->N; e++) row[e] = -1;
    s->queued_in_layer[l] = 0;
    s->queued_total -= n;
    s->cancelled += n;
}

/* ---- layer l's rows, read ahead ----
 * Between two layers of a real pass the layer's weights stream through the caches, so every
 * row a plan or finish touches (~80 lines of 64 bytes on Qwen3-30B-A3B shapes, spread over a
 * dozen arrays) has left them; read on demand, each waits for its lines in turn. One prefetch
 * per line at the call's start puts those reads in flight together. */
static inline void read_ahead(const void *row, Py_ssize_t bytes) {
    for (Py_ssize_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 0, 3);
}

static inline void write_ahead(const void *row, Py_ssize_t bytes) {
    for (Py_ssize_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 1, 3);
}

static void prefetch_layer(State *s, Py_ssize_t l) {
    Py_ssize_t N = s->N, K = s->K, at = l * N;
    write_ahead(s->utility + at, N * (Py_ssize_t)sizeof(int64_t));
    read_ahead(s->present + at, N * (Py_ssize_t)sizeof(npy_bool));
    write_ahead(s->pinned + at, N * (Py_ssize_t)sizeof(npy_bool));
    read_ahead(s->ready_at + at, N * (Py_ssize_t)sizeof(double));
    write_ahead(s->previous + at, N * (Py_ssize_t)sizeof(double));
    if (s->adaptive) {
        write_ahead(s->theta_up + at, N * (Py_ssize_t)sizeof(double));
        write_ahead(s->theta_down + at, N * (Py_ssize_t)sizeof(double));
    }
    write_ahead(s->pool_level + at, N * (Py_ssize_t)sizeof(int32_t));
    write_ahead(s->prev + at, N * (Py_ssize_t)sizeof(int32_t));
    write_ahead(s->next + at, N * (Py_ssize_t)sizeof(int32_t));
    write_ahead(s->queued + at, N * (Py_ssize_t)sizeof(int32_t));
    write_ahead(s->slot_share + l * (K + 1), (K + 1) * (Py_ssize_t)sizeof(double));
    write_ahead(s->expert_share + l * (K + 1), (K + 1) * (Py_ssize_t)sizeof(double));
}

/* ---- the unit times (base.UnitTimes) ---- */
static double sum_of(State *s, int key) { return s->sums[key]; }

/* numerator / denominator, or NAN where the denominator is not above 0 (Python's None) */
static double ratio(State *s, int numerator, int denominator) {
    double d = sum_of(s, denominator);
    return d > 0 ? sum_of(s, numerator) / d : NAN;
}


static int observe_layer(State *s, PyObject *timing) {
    double t[N_TIMING];
    for (int k = 0; k < N_TIMING; k++) {
        PyObject *v = PyObject_GetAttr(timing, timing_keys[k]);
        if (!v) return -1;
        t[k] = PyFloat_AsDouble(v);
        Py_DECREF(v);
        if (t[k] == -1.0 && PyErr_Occurred()) return -1;
    }
    int split = t[T_CPU_EXPERTS] > 0 && t[T_ACC_EXPERTS] > 0;
    s->rest[split] += t[T_SECONDS] - t[T_CPU_SECONDS] - t[T_ACC_SECONDS];
    s->rest_passes[split] += 1;
    static const int pairs[7][2] = {{CPU_SECONDS, T_CPU_SECONDS}, {CPU_SLOTS, T_CPU_SLOTS},
                                    {CPU_EXPERTS, T_CPU_EXPERTS}, {ACC_SECONDS, T_ACC_SECONDS},
                                    {ACC_EXPERTS, T_ACC_EXPERTS}, {COPY_SECONDS, T_COPY_SECONDS},
                                    {COPIES, T_COPIES}};
    for (int k = 0; k < 7; k++) s->sums[pairs[k][0]] += t[pairs[k][1]];
    Py_ssize_t layer = (Py_ssize_t)t[T_LAYER];
    if (layer < 0 || layer >= s->L) {
        PyErr_Format(PyExc_IndexError, "timing of layer %zd outside 0..%zd", layer, s->L - 1);
        return -1;
    }
    s->layer_seconds[layer] += t[T_SECONDS];
    s->layer_passes[layer] += 1;
    return 0;
}

/* ---- the balancer (balancer.WorkloadBalancer.choose, solve_threshold) ---- */
static long long choose_tau(State *s, Py_ssize_t l, long long used_bytes) {
    Py_ssize_t K = s->K;
    long long lo = s->static_tau < 1 ? 1 : s->static_tau;
    long long fixed = lo < K ? lo : K;
    if (!s->balancer) return fixed;
    double cpu_per_slot = ratio(s, CPU_SECONDS, CPU_SLOTS);
    double gpu_per_expert = ratio(s, ACC_SECONDS, ACC_EXPERTS);
    double n_layer = s->layer_passes[l];
    double layer_seconds = n_layer != 0 ? s->layer_seconds[l] / n_layer : NAN;
    double serial = 1.0 - s->tier_overlap;
    long long warmup = serial <= 0 ? s->warmup_steps : 0;
    if (s->step < warmup || isnan(cpu_per_slot) || isnan(gpu_per_expert) || isnan(layer_seconds))
        return fixed;
    double per_copy = ratio(s, COPY_SECONDS, COPIES);
    if (isnan(per_copy) && serial > 0) per_copy = ratio(s, CPU_SECONDS, CPU_EXPERTS);
    int has_copy = !isnan(per_copy) && per_copy != 0;
    /* n(tau): absent experts at utility >= tau */
    int64_t absent[64] = {0}, prefetch_counts[64];
    const int64_t *u = s->utility + l * s->N;
    const npy_bool *present = s->present + l * s->N;
    for (Py_ssize_t e = 0; e < s->N; e++)
        if (!present[e]) absent[u[e]]++;
    int64_t above = 0;
    for (Py_ssize_t v = K; v >= 1; v--) prefetch_counts[v - 1] = (above += absent[v]);
    long long free_bytes = s->budget - used_bytes, w = s->expert_bytes[l];
    double memory[64];
    int64_t below = 0;
    for (Py_ssize_t v = 0; v < K; v++) {
        below += s->bytes_at[v];
        memory[v] = s->evict ? (double)(free_bytes + below) / (double)w
                             : (double)free_bytes / (double)w;
    }
    double draft = ratio(s, DRAFT_SECONDS, DRAFTED);
    if (isnan(draft)) draft = 0.0;
    double window = layer_seconds + draft * (double)s->draft_length / (double)s->L;
    double io_capacity = has_copy ? window / per_copy : INFINITY;
    double split_seconds = 0.0;
    if (serial > 0) {
        double one = s->rest[0], both = s->rest[1];
        double n_one = s->rest_passes[0], n_both = s->rest_passes[1];
        if (n_one != 0 && n_both != 0) {
            split_seconds = both / n_both - one / n_one;
            if (0.0 > split_seconds) split_seconds = 0.0;
        }
    }
    /* shares: r_c(tau), r_g(tau) averaged over the passes recorded */
    long long slots = s->n_tokens * s->top_k;
    double passes = s->passes[l];
    if (1.0 > passes) passes = 1.0;
    double cpu_unit = (double)slots * cpu_per_slot;
    double gpu_unit = s->distinct[l] / passes * gpu_per_expert;
    double copy_seconds = has_copy ? per_copy : 0.0;
    const double *slot_share = s->slot_share + l * (K + 1);
    const double *expert_share = s->expert_share + l * (K + 1);
    double slot_sum = 0.0, expert_sum = 0.0;
    double best_violation = 0, best_objective = 0;
    long long best = -1;
    Py_ssize_t candidates = K + (serial > 0);
    for (Py_ssize_t i = 0; i < candidates; i++) {
        double count, mem, cpu, gpu;
        if (i < K) {
            slot_sum += slot_share[i];
            expert_sum += expert_share[i];
            count = (double)prefetch_counts[i];
            mem = memory[i];
            cpu = slot_sum / passes * cpu_unit;
            gpu = (1.0 - expert_sum / passes) * gpu_unit;
        } else { /* tau = K + 1: nothing prefetched, the layer whole on the CPU */
            count = 0.0;
            mem = INFINITY;
            cpu = (double)slots * cpu_per_slot;
            gpu = 0.0;
        }
        double room = mem < io_capacity ? mem : io_capacity;
        double violation = count - room;
        if (!(violation > 0.0)) violation = 0.0;
        double objective;
        if (serial > 0) {
            double split = cpu > 0 && gpu > 0 ? split_seconds : 0.0;
            double hi = gpu > cpu ? gpu : cpu, lo_ = gpu < cpu ? gpu : cpu;
            objective = hi + serial * (lo_ + count * copy_seconds + split);
        } else {
            objective = fabs(cpu - gpu);
        }
        if (best < 0 || violation < best_violation ||
            (violation == best_violation && objective < best_objective)) {
            best = i + 1;
            best_violation = violation;
            best_objective = objective;
        }
    }
    s->choices++;
    s->tau_sum += best;
    s->infeasible += best_violation != 0;
    s->none_hot += best > K;
    return best;
}

/* ---- helpers for the methods ---- */
static PyArrayObject *int64_vector(PyObject *obj, const char *what) {
    if (PyArray_CheckExact(obj)) { /* the usual argument: taken as it is */
        PyArrayObject *v = (PyArrayObject *)obj;
        if (PyArray_NDIM(v) == 1 && PyArray_TYPE(v) == NPY_INT64 &&
            PyArray_ISNBO(PyArray_DESCR(v)->byteorder) && PyArray_IS_C_CONTIGUOUS(v) &&
            PyArray_ISALIGNED(v)) {
            Py_INCREF(obj);
            return v;
        }
    }
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT64, 1, 1, NPY_ARRAY_CARRAY_RO);
    if (!a) PyErr_Format(PyExc_ValueError, "%s must be a vector of integers", what);
    return a;
}

static int check_layer(State *s, Py_ssize_t l) {
    if (l < 0 || l >= s->L) {
        PyErr_Format(PyExc_IndexError, "layer %zd outside 0..%zd", l, s->L - 1);
        return -1;
    }
    return 0;
}

/* The ids in 0..N-1 and distinct (the driver's plan check, for a plan built from them). */
static int check_experts(State *s, Py_ssize_t l, const int64_t *ids, Py_ssize_t n) {
    int ok = 1;
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= s->N || s->mark[ids[k]]) {
            ok = 0;
            break;
        }
        s->mark[ids[k]] = 1;
    }
    for (Py_ssize_t j = 0; j < k; j++) s->mark[ids[j]] = 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "layer %zd: the routing must name distinct experts within 0..%zd", l,
                     s->N - 1);
    return ok ? 0 : -1;
}

static PyObject *new_ids(Py_ssize_t n) {
    npy_intp dims[1] = {n};
    return PyArray_SimpleNew(1, dims, NPY_INT64);
}

/* ---- methods ---- */
static PyObject *State_plan(State *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "plan(layer, experts, counts, now, pin)");
        return NULL;
    }
    Py_ssize_t l = PyLong_AsSsize_t(args[0]);
    double now = PyFloat_AsDouble(args[3]);
    int pin = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || check_layer(s, l)) return NULL;
    prefetch_layer(s, l);
    PyArrayObject *E = int64_vector(args[1], "experts"), *C = NULL;
    PyObject *acc = NULL, *cpu = NULL, *out = NULL;
    if (!E || !(C = int64_vector(args[2], "counts"))) goto done;
    Py_ssize_t n = PyArray_SIZE(E);
    if (PyArray_SIZE(C) != n) {
        PyErr_SetString(PyExc_ValueError, "experts and counts differ in length");
        goto done;
    }
    const int64_t *ids = PyArray_DATA(E), *counts = PyArray_DATA(C);
    if (check_experts(s, l, ids, n)) goto done;
    Py_ssize_t K = s->K, N = s->N;
    int64_t *u = s->utility + l * N;
    const double *ready = s->ready_at + l * N;
    const npy_bool *present = s->present + l * N;
    long long hits = 0, total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        hits += ready[ids[k]] <= now;
        total += counts[k];
    }
    /* balancer.record: the pass's slots and experts per utility level (before the update) */
    double slot_bins[64], expert_bins[64];
    for (Py_ssize_t v = 0; v <= K; v++) slot_bins[v] = expert_bins[v] = 0.0;
    for (Py_ssize_t k = 0; k < n; k++) {
        slot_bins[u[ids[k]]] += (double)counts[k] / (double)total;
        expert_bins[u[ids[k]]] += 1.0;
    }
    for (Py_ssize_t v = 0; v <= K; v++) {
        s->slot_share[l * (K + 1) + v] += slot_bins[v];
        s->expert_share[l * (K + 1) + v] += expert_bins[v] / (double)n;
    }
    s->distinct[l] += (double)n;
    s->passes[l] += 1;
    queue_cancel_layer(s, l); /* this layer's prefetches not started would come too late */
    if (s->tau[l] > K) {      /* tau = K + 1: nothing hot, the layer whole on the CPU */
        acc = new_ids(0);
        cpu = new_ids(n);
        if (acc && cpu) memcpy(PyArray_DATA((PyArrayObject *)cpu), ids, n * sizeof(int64_t));
    } else {
        Py_ssize_t resident = 0;
        for (Py_ssize_t k = 0; k < n; k++) resident += present[ids[k]] != 0;
        acc = new_ids(resident);
        cpu = new_ids(n - resident);
        if (acc && cpu) {
            int64_t *a = PyArray_DATA((PyArrayObject *)acc), *c = PyArray_DATA((PyArrayObject *)cpu);
            for (Py_ssize_t k = 0; k < n; k++) {
                int64_t e = ids[k];
                if (present[e]) {
                    *a++ = e;
                    if (pool_move(s, l, e, (int32_t)u[e])) goto done; /* used now: last */
                    if (pin) s->pinned[l * N + e] = 1;
                } else {
                    *c++ = e;
                }
            }
        }
    }
    if (acc && cpu) out = Py_BuildValue("(OOL)", acc, cpu, hits);
done:
    Py_XDECREF(E);
    Py_XDECREF(C);
    Py_XDECREF(acc);
    Py_XDECREF(cpu);
    return out;
}

/* estimator.update over layer l's row, for the frequencies f; `reference` and `adaptive`
 * constant in each call site, so each reading gets a loop without their branches */
static inline __attribute__((always_inline)) void estimate(State *s, Py_ssize_t l,
                                                           const double *f, const int reference,
                                                           const int adaptive) {
    Py_ssize_t N = s->N, K = s->K;
    int64_t *u = s->utility + l * N;
    double *previous = s->previous + l * N, *up_bound = s->theta_up + l * N;
    double *down_bound = s->theta_down + l * N;
    for (Py_ssize_t e = 0; e < N; e++) {
        double delta;
        if (reference == REF_PREVIOUS) delta = f[e] - previous[e];
        else if (reference == REF_COUNT) delta = f[e] - (double)u[e];
        else delta = f[e] - (double)u[e] * s->level_scale;
        int up, down;
        if (!adaptive) {
            up = delta >= s->fixed_up;
            down = delta <= s->fixed_down;
        } else {
            up = delta >= up_bound[e];
            down = delta <= -down_bound[e];
        }
        int64_t v = u[e] + up - down;
        u[e] = v > K ? K : (v < 0 ? 0 : v);
        if (adaptive) {
            if (delta > 0) up_bound[e] = up_bound[e] + s->forgetting * (delta - up_bound[e]);
            if (delta < 0) down_bound[e] = down_bound[e] + s->forgetting * (-delta - down_bound[e]);
        }
        previous[e] = f[e];
    }
}

static int end_layer(State *s, Py_ssize_t l, PyObject *experts, PyObject *counts_obj,
                     long long used_bytes) {
    PyArrayObject *E = int64_vector(experts, "experts"), *C = NULL;
    int rc = -1;
    if (!E || !(C = int64_vector(counts_obj, "counts"))) goto done;
    Py_ssize_t n = PyArray_SIZE(E), N = s->N;
    if (PyArray_SIZE(C) != n) {
        PyErr_SetString(PyExc_ValueError, "experts and counts differ in length");
        goto done;
    }
    const int64_t *ids = PyArray_DATA(E), *counts = PyArray_DATA(C);
    if (check_experts(s, l, ids, n)) goto done;
    /* the window's frequencies: the pass */
    double *f = s->f;
    for (Py_ssize_t e = 0; e < N; e++) f[e] = 0.0;
    for (Py_ssize_t k = 0; k < n; k++) f[ids[k]] = (double)counts[k];
    /* estimator.update */
    int64_t *u = s->utility + l * N;
    memcpy(s->old, u, N * sizeof(int64_t));
    /* each reading in a loop of its own (the branches out of the loop; the same arithmetic) */
    switch (s->reference * 2 + s->adaptive) {
    case REF_COUNT * 2: estimate(s, l, f, REF_COUNT, 0); break;
    case REF_COUNT * 2 + 1: estimate(s, l, f, REF_COUNT, 1); break;
    case REF_LEVEL * 2: estimate(s, l, f, REF_LEVEL, 0); break;
    case REF_LEVEL * 2 + 1: estimate(s, l, f, REF_LEVEL, 1); break;
    case REF_PREVIOUS * 2: estimate(s, l, f, REF_PREVIOUS, 0); break;
    default: estimate(s, l, f, REF_PREVIOUS, 1); break;
    }
    const npy_bool *present = s->present + l * N;
    for (Py_ssize_t e = 0; e < N; e++)
        if (present[e] && u[e] != s->old[e] && pool_move(s, l, e, (int32_t)u[e])) goto done;
    if (s->prefetch) {
        long long tau = s->tau[l] = choose_tau(s, l, used_bytes);
        if (PyErr_Occurred()) goto done;
        /* hottest first, then by id: each level is a FIFO of its own, so one pass in id order
         * queues what a pass per level from the hottest down would */
        for (Py_ssize_t e = 0; e < N; e++)
            if (u[e] >= tau && !present[e] && queue_push(s, l, e, (int32_t)u[e])) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(E);
    Py_XDECREF(C);
    return rc;
}

static PyObject *State_end_layer(State *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "end_layer(layer, experts, counts, used_bytes)");
        return NULL;
    }
    Py_ssize_t l = PyLong_AsSsize_t(args[0]);
    long long used = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred() || check_layer(s, l)) return NULL;
    if (end_layer(s, l, args[1], args[2], used)) return NULL;
    Py_RETURN_NONE;
}

/* finish(layer, experts, counts, accelerator, timing, used_bytes): unpin the accelerator
 * experts, end_layer, observe_layer(timing): the driver's finish in one call. */
static PyObject *State_finish(State *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "finish(layer, experts, counts, accelerator, timing, used_bytes)");
        return NULL;
    }
    Py_ssize_t l = PyLong_AsSsize_t(args[0]);
    long long used = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred() || check_layer(s, l)) return NULL;
    prefetch_layer(s, l);
    PyArrayObject *A = int64_vector(args[3], "accelerator");
    if (!A) return NULL;
    const int64_t *acc = PyArray_DATA(A);
    for (Py_ssize_t k = 0; k < PyArray_SIZE(A); k++) {
        if (acc[k] < 0 || acc[k] >= s->N) {
            Py_DECREF(A);
            PyErr_SetString(PyExc_IndexError, "accelerator expert out of range");
            return NULL;
        }
        s->pinned[l * s->N + acc[k]] = 0;
    }
    Py_DECREF(A);
    if (end_layer(s, l, args[1], args[2], used) || observe_layer(s, args[4])) return NULL;
    Py_RETURN_NONE;
}

static PyObject *State_admitted(State *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "admitted(layer, expert)");
        return NULL;
    }
    Py_ssize_t l = PyLong_AsSsize_t(args[0]), e = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred() || check_layer(s, l)) return NULL;
    if (e < 0 || e >= s->N) return PyErr_Format(PyExc_IndexError, "expert %zd out of range", e);
    if (pool_add(s, l, e, (int32_t)s->utility[l * s->N + e])) return NULL;
    Py_RETURN_NONE;
}

static PyObject *State_next_prefetch(State *s, PyObject *unused) {
    int32_t i;
    while ((i = queue_pop(s)) >= 0)
        if (!s->present[i]) return Py_BuildValue("(nn)", (Py_ssize_t)(i / s->N), (Py_ssize_t)(i % s->N));
    Py_RETURN_NONE;
}

/* victim(layer, expert, now): the least recently used expert of the lowest level below the
 * incoming expert's utility that can leave now (present, not pinned, arrived), removed from
 * the pool; None when there is none (or eviction is off). */
static PyObject *State_victim(State *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "victim(layer, expert, now)");
        return NULL;
    }
    Py_ssize_t l = PyLong_AsSsize_t(args[0]), e = PyLong_AsSsize_t(args[1]);
    double now = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred() || check_layer(s, l)) return NULL;
    if (e < 0 || e >= s->N) return PyErr_Format(PyExc_IndexError, "expert %zd out of range", e);
    if (!s->evict) Py_RETURN_NONE;
    int64_t below = s->utility[l * s->N + e];
    if (below > s->K + 1) below = s->K + 1;
    for (int64_t level = 0; level < below; level++)
        for (int32_t i = s->head[level]; i >= 0; i = s->next[i])
            if (s->present[i] && !s->pinned[i] && s->ready_at[i] <= now) {
                pool_remove(s, i);
                return Py_BuildValue("(nn)", (Py_ssize_t)(i / s->N), (Py_ssize_t)(i % s->N));
            }
    Py_RETURN_NONE;
}

static PyObject *State_set_step(State *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_step(step, n_tokens)");
        return NULL;
    }
    long long step = PyLong_AsLongLong(args[0]), n_tokens = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    s->step = step;
    s->n_tokens = n_tokens;
    Py_RETURN_NONE;
}

/* counters(): (queued, cancelled, choices, tau_sum, infeasible, none_hot) */
static PyObject *State_counters(State *s, PyObject *unused) {
    return Py_BuildValue("(LLLLLL)", (long long)s->queued_total, s->cancelled, s->choices,
                         s->tau_sum, s->infeasible, s->none_hot);
}

/* pool_levels(): [L, N] each cached expert's level in the pool, -1 where none (for tests). */
static PyObject *State_pool_levels(State *s, PyObject *unused) {
    npy_intp dims[2] = {s->L, s->N};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_INT32);
    if (out) memcpy(PyArray_DATA((PyArrayObject *)out), s->pool_level, s->L * s->N * 4);
    return out;
}

static PyMethodDef State_methods[] = {
    {"plan", (PyCFunction)(void (*)(void))State_plan, METH_FASTCALL, NULL},
    {"end_layer", (PyCFunction)(void (*)(void))State_end_layer, METH_FASTCALL, NULL},
    {"finish", (PyCFunction)(void (*)(void))State_finish, METH_FASTCALL, NULL},
    {"admitted", (PyCFunction)(void (*)(void))State_admitted, METH_FASTCALL, NULL},
    {"victim", (PyCFunction)(void (*)(void))State_victim, METH_FASTCALL, NULL},
    {"set_step", (PyCFunction)(void (*)(void))State_set_step, METH_FASTCALL, NULL},
    {"next_prefetch", (PyCFunction)State_next_prefetch, METH_NOARGS, NULL},
    {"counters", (PyCFunction)State_counters, METH_NOARGS, NULL},
    {"pool_levels", (PyCFunction)State_pool_levels, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}};

static void State_dealloc(State *s) {
    for (int k = 0; k < N_ARRAYS; k++) Py_XDECREF(s->arrays[k]);
    if (s->views > 0) PyBuffer_Release(&s->sums_view);
    if (s->views > 1) PyBuffer_Release(&s->rest_view);
    if (s->views > 2) PyBuffer_Release(&s->rest_passes_view);
    Py_XDECREF(s->layer_seconds_obj);
    Py_XDECREF(s->layer_passes_obj);
    PyMem_Free(s->pool_level);
    PyMem_Free(s->prev);
    PyMem_Free(s->next);
    PyMem_Free(s->head);
    PyMem_Free(s->tail);
    PyMem_Free(s->bytes_at);
    PyMem_Free(s->queued);
    PyMem_Free(s->queued_in_layer);
    if (s->fifos)
        for (Py_ssize_t k = 0; k <= s->K; k++) PyMem_Free(s->fifos[k].items);
    PyMem_Free(s->fifos);
    PyMem_Free(s->f);
    PyMem_Free(s->old);
    PyMem_Free(s->mark);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* An array argument: C-contiguous, of `type`, of `size` elements; held by the state. */
static void *held(State *s, int slot, PyObject *obj, int type, Py_ssize_t size, const char *name) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != type ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)obj) ||
        !PyArray_ISWRITEABLE((PyArrayObject *)obj) || PyArray_SIZE((PyArrayObject *)obj) != size) {
        PyErr_Format(PyExc_ValueError, "%s: a writeable C-contiguous array of %zd items of the "
                     "expected type is needed", name, size);
        return NULL;
    }
    Py_INCREF(obj);
    s->arrays[slot] = obj;
    return PyArray_DATA((PyArrayObject *)obj);
}

/* A buffer of `size` writeable C-contiguous doubles (UnitTimes' array('d')s), held. */
static double *held_doubles(State *s, Py_buffer *view, PyObject *obj, Py_ssize_t size,
                            const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    s->views++;
    if (view->itemsize != sizeof(double) || strcmp(view->format, "d") != 0 ||
        view->len != size * (Py_ssize_t)sizeof(double)) {
        PyErr_Format(PyExc_ValueError, "%s: a writeable buffer of %zd doubles is needed", name,
                     size);
        return NULL;
    }
    return view->buf;
}

/* State(shape, config, arrays, times): see spac_kernel.make_state. */
static PyObject *State_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t L, N, K;
    int reference, adaptive, balancer, prefetch, evict;
    double fixed_up, fixed_down, forgetting, level_scale, tier_overlap;
    long long static_tau, warmup, draft_length, top_k, budget;
    PyObject *present, *pinned, *ready_at, *expert_bytes, *utility, *previous, *theta_up,
        *theta_down, *slot_share, *expert_share, *distinct, *passes, *tau;
    PyObject *sums, *rest, *rest_passes, *layer_seconds, *layer_passes;
    if (!PyArg_ParseTuple(args, "(nnn)(iiiiiddddLLLLLd)(OOOOOOOOOOOOO)(OOOOO)", &L, &N, &K,
                          &reference, &adaptive, &balancer, &prefetch, &evict, &fixed_up,
                          &fixed_down, &forgetting, &level_scale, &static_tau, &warmup,
                          &draft_length, &top_k, &budget, &tier_overlap, &present, &pinned,
                          &ready_at, &expert_bytes, &utility, &previous, &theta_up, &theta_down,
                          &slot_share, &expert_share, &distinct, &passes, &tau, &sums, &rest,
                          &rest_passes, &layer_seconds, &layer_passes))
        return NULL;
    if (L < 1 || N < 1 || K < 1 || K > 62 || L * N >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "shape outside 1 <= K <= 62, L * N < 2^31");
        return NULL;
    }
    State *s = (State *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    s->L = L, s->N = N, s->K = K;
    s->reference = reference, s->adaptive = adaptive, s->balancer = balancer;
    s->prefetch = prefetch, s->evict = evict;
    s->fixed_up = fixed_up, s->fixed_down = fixed_down, s->forgetting = forgetting;
    s->level_scale = level_scale, s->static_tau = static_tau, s->warmup_steps = warmup;
    s->draft_length = draft_length, s->top_k = top_k, s->budget = budget;
    s->tier_overlap = tier_overlap, s->n_tokens = 1;
    Py_ssize_t LN = L * N;
    if (!(s->present = held(s, 0, present, NPY_BOOL, LN, "present")) ||
        !(s->pinned = held(s, 1, pinned, NPY_BOOL, LN, "pinned")) ||
        !(s->ready_at = held(s, 2, ready_at, NPY_DOUBLE, LN, "ready_at")) ||
        !(s->expert_bytes = held(s, 3, expert_bytes, NPY_INT64, L, "expert_bytes")) ||
        !(s->utility = held(s, 4, utility, NPY_INT64, LN, "utility")) ||
        !(s->previous = held(s, 5, previous, NPY_DOUBLE, LN, "previous")) ||
        !(s->theta_up = held(s, 6, theta_up, NPY_DOUBLE, LN, "theta_up")) ||
        !(s->theta_down = held(s, 7, theta_down, NPY_DOUBLE, LN, "theta_down")) ||
        !(s->slot_share = held(s, 8, slot_share, NPY_DOUBLE, L * (K + 1), "slot_share")) ||
        !(s->expert_share = held(s, 9, expert_share, NPY_DOUBLE, L * (K + 1), "expert_share")) ||
        !(s->distinct = held(s, 10, distinct, NPY_DOUBLE, L, "distinct")) ||
        !(s->passes = held(s, 11, passes, NPY_DOUBLE, L, "passes")) ||
        !(s->tau = held(s, 12, tau, NPY_INT64, L, "tau")))
        goto fail;
    if (!(s->sums = held_doubles(s, &s->sums_view, sums, N_SUMS, "totals")) ||
        !(s->rest = held_doubles(s, &s->rest_view, rest, 2, "rest")) ||
        !(s->rest_passes = held_doubles(s, &s->rest_passes_view, rest_passes, 2, "rest_passes")))
        goto fail;
    Py_INCREF(layer_seconds), Py_INCREF(layer_passes);
    s->layer_seconds_obj = layer_seconds, s->layer_passes_obj = layer_passes;
    if (!PyArray_Check(layer_seconds) || !PyArray_Check(layer_passes) ||
        PyArray_TYPE((PyArrayObject *)layer_seconds) != NPY_DOUBLE ||
        PyArray_TYPE((PyArrayObject *)layer_passes) != NPY_DOUBLE ||
        PyArray_SIZE((PyArrayObject *)layer_seconds) != L ||
        PyArray_SIZE((PyArrayObject *)layer_passes) != L) {
        PyErr_SetString(PyExc_ValueError, "layer_seconds and layer_passes: float64 [L]");
        goto fail;
    }
    s->layer_seconds = PyArray_DATA((PyArrayObject *)layer_seconds);
    s->layer_passes = PyArray_DATA((PyArrayObject *)layer_passes);
    s->pool_level = PyMem_Malloc(LN * sizeof(int32_t));
    s->prev = PyMem_Malloc(LN * sizeof(int32_t));
    s->next = PyMem_Malloc(LN * sizeof(int32_t));
    s->head = PyMem_Malloc((K + 1) * sizeof(int32_t));
    s->tail = PyMem_Malloc((K + 1) * sizeof(int32_t));
    s->bytes_at = PyMem_Calloc(K + 1, sizeof(int64_t));
    s->queued = PyMem_Malloc(LN * sizeof(int32_t));
    s->queued_in_layer = PyMem_Calloc(L, sizeof(int64_t));
    s->fifos = PyMem_Calloc(K + 1, sizeof(Fifo));
    s->f = PyMem_Malloc(N * sizeof(double));
    s->old = PyMem_Malloc(N * sizeof(int64_t));
    s->mark = PyMem_Calloc(N, 1);
    if (!s->pool_level || !s->prev || !s->next || !s->head || !s->tail || !s->bytes_at ||
        !s->queued || !s->queued_in_layer || !s->fifos || !s->f || !s->old || !s->mark) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < LN; i++) s->pool_level[i] = s->queued[i] = -1;
    for (Py_ssize_t v = 0; v <= K; v++) s->head[v] = s->tail[v] = -1;
    return (PyObject *)s;
fail:
    Py_DECREF(s);
    return NULL;
}

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "spac_native.State",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = State_new,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_methods = State_methods,
};

static int VERSION = 2;

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "spac_native", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_spac_native(void) {
    import_array();
    for (int k = 0; k < N_TIMING; k++)
        if (!(timing_keys[k] = PyUnicode_InternFromString(TIMING_NAMES[k]))) return NULL;
    if (PyType_Ready(&StateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&StateType);
    if (PyModule_AddObject(m, "State", (PyObject *)&StateType) < 0 ||
        PyModule_AddIntConstant(m, "VERSION", VERSION) < 0)
        return NULL;
    return m;
}
