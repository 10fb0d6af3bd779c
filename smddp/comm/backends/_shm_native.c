/* The shared-memory plane's compiled core: collectives over one host's segment.
 *
 * smddp/comm/backends/shm.py drives it and keeps the pure-Python path as the fallback.
 * The segment's layout and protocol are the Python plane's (see shm.py): each rank owns an
 * epoch word (one cache line each, from the segment's start) and two buffers of ``slot``
 * bytes after ``header`` bytes.  A step waits until every rank has published the epoch of
 * the step before last (the buffer it is about to write is free), copies in, publishes,
 * waits for the others, and reads their buffers.
 *
 * Each operation is a small state machine: ``Op.advance(wait_ns)`` runs it as far as it can
 * and waits at most ``wait_ns`` nanoseconds on a peer's epoch word before handing control
 * back to Python, which owns deadlines, liveness checks and issue order.  A wait spins for
 * ``spin_ns`` (the Segment's), then sleeps on a futex on the awaited epoch word: a rank that
 * waits long (its peer is still computing) gives its core to the peer instead of taking it.
 * A rank that publishes wakes the sleepers it finds counted in its header line.  Waits and
 * large copies release the GIL.  Reductions fold the ranks' parts in rank order, so every
 * rank computes the same bits; float16 and bfloat16 accumulate in float32 and round once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_FUTEX 1
#else
#define HAVE_FUTEX 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() do { } while (0)
#endif

#define WORD_BYTES 64           /* bytes between two ranks' epoch words: a rank's header line */
#define SLEEPERS_OFFSET 16      /* in a rank's header line (after its epoch and pid): an int32 count
                                   of the threads asleep on its epoch word */
#define GIL_FREE_BYTES 65536    /* copies and reductions at least this large release the GIL */

enum { T_F32, T_F64, T_F16, T_BF16, T_I8, T_U8, T_I16, T_I32, T_I64, T_COUNT };
enum { R_SUM, R_AVG, R_MIN, R_MAX, R_PROD, R_COUNT };
static const int ELEMENT_SIZE[T_COUNT] = {4, 8, 2, 2, 1, 1, 2, 4, 8};

/* ------------------------------------------------------------------ half precision */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__FLT16_MAX__)
#define HAVE_F16 1
static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
static inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
#else
#define HAVE_F16 0
#endif

/* ------------------------------------------------------------------ reductions
 * fold: out[i] = parts[0][i] op parts[1][i] op ... (rank order); AVERAGE divides by
 * ``divisor`` at the end (integers round toward zero).  A block at a time through a local
 * accumulator, so ``out`` may be any of the parts; ``out2`` (may be NULL) receives a second
 * copy of the result.
 */
#define FOLD_BLOCK 1024

/* torch.minimum / torch.maximum: a NaN on either side wins. */
#define MIN_OF(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define MAX_OF(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define IMIN_OF(a, b) ((a) < (b) ? (a) : (b))
#define IMAX_OF(a, b) ((a) > (b) ? (a) : (b))

#define FDIV(T, a, d) ((T)((a) / (T)(d)))
#define IDIV(T, a, d) ((T)((long long)(a) / (long long)(d)))

#define FOLD_DIRECT(T, U, MINF, MAXF, DIV)                                                    \
    static void fold_##T(T *out, T *out2, T *const *parts, int nparts, Py_ssize_t n,      \
                         int op, int divisor) {                                            \
        T acc[FOLD_BLOCK];                                                                 \
        Py_ssize_t base, i, len;                                                           \
        int k;                                                                             \
        for (base = 0; base < n; base += FOLD_BLOCK) {                                     \
            const T *p0 = parts[0] + base;                                                 \
            len = n - base < FOLD_BLOCK ? n - base : FOLD_BLOCK;                           \
            if (nparts == 1) {                                                             \
                memcpy(acc, p0, len * sizeof(T));                                          \
            } else {                                                                       \
                const T *p1 = parts[1] + base;                                             \
                if (op == R_SUM || op == R_AVG)                                            \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)p0[i] + (U)p1[i]);           \
                else if (op == R_MIN)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MINF(p0[i], p1[i]);                 \
                else if (op == R_MAX)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MAXF(p0[i], p1[i]);                 \
                else                                                                       \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)p0[i] * (U)p1[i]);           \
            }                                                                              \
            for (k = 2; k < nparts; k++) {                                                 \
                const T *p = parts[k] + base;                                              \
                if (op == R_SUM || op == R_AVG)                                            \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)acc[i] + (U)p[i]);           \
                else if (op == R_MIN)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MINF(acc[i], p[i]);                 \
                else if (op == R_MAX)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MAXF(acc[i], p[i]);                 \
                else                                                                       \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)acc[i] * (U)p[i]);           \
            }                                                                              \
            if (op == R_AVG && divisor > 1)                                                \
                for (i = 0; i < len; i++) acc[i] = DIV(T, acc[i], divisor);                \
            memcpy(out + base, acc, len * sizeof(T));                                      \
            if (out2 != NULL) memcpy(out2 + base, acc, len * sizeof(T));                   \
        }                                                                                  \
    }

/* Integer sums and products wrap, as torch's do: computed in the unsigned type. */
FOLD_DIRECT(float, float, MIN_OF, MAX_OF, FDIV)
FOLD_DIRECT(double, double, MIN_OF, MAX_OF, FDIV)
FOLD_DIRECT(int8_t, uint8_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(uint8_t, uint8_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(int16_t, uint16_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(int32_t, uint32_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(int64_t, uint64_t, IMIN_OF, IMAX_OF, IDIV)

/* Half types: a block at a time in float32, rounded once. */
#define HALF_BLOCK 256
static void fold_half(uint16_t *out, uint16_t *out2, uint16_t *const *parts, int nparts, Py_ssize_t n,
                      int op, int divisor, int is_bf16) {
    float acc[HALF_BLOCK], v[HALF_BLOCK];
    Py_ssize_t base, i, len;
    int k;
    for (base = 0; base < n; base += HALF_BLOCK) {
        len = n - base < HALF_BLOCK ? n - base : HALF_BLOCK;
        for (i = 0; i < len; i++)
#if HAVE_F16
            acc[i] = is_bf16 ? bf16_to_f32(parts[0][base + i]) : f16_to_f32(parts[0][base + i]);
#else
            acc[i] = bf16_to_f32(parts[0][base + i]);
#endif
        for (k = 1; k < nparts; k++) {
            for (i = 0; i < len; i++)
#if HAVE_F16
                v[i] = is_bf16 ? bf16_to_f32(parts[k][base + i]) : f16_to_f32(parts[k][base + i]);
#else
                v[i] = bf16_to_f32(parts[k][base + i]);
#endif
            if (op == R_SUM || op == R_AVG) {
                for (i = 0; i < len; i++) acc[i] += v[i];
            } else if (op == R_MIN) {
                for (i = 0; i < len; i++) acc[i] = MIN_OF(acc[i], v[i]);
            } else if (op == R_MAX) {
                for (i = 0; i < len; i++) acc[i] = MAX_OF(acc[i], v[i]);
            } else {
                for (i = 0; i < len; i++) acc[i] *= v[i];
            }
        }
        if (op == R_AVG && divisor > 1)
            for (i = 0; i < len; i++) acc[i] /= (float)divisor;
        for (i = 0; i < len; i++) {
#if HAVE_F16
            uint16_t h = is_bf16 ? f32_to_bf16(acc[i]) : f32_to_f16(acc[i]);
#else
            uint16_t h = f32_to_bf16(acc[i]);
#endif
            out[base + i] = h;
            if (out2 != NULL) out2[base + i] = h;
        }
    }
}

static void fold(int dtype, char *out, char *out2, char *const *parts, int nparts, Py_ssize_t n, int op,
                 int divisor) {
    switch (dtype) {
    case T_F32: fold_float((float *)out, (float *)out2, (float *const *)parts, nparts, n, op, divisor); break;
    case T_F64: fold_double((double *)out, (double *)out2, (double *const *)parts, nparts, n, op, divisor); break;
    case T_F16: fold_half((uint16_t *)out, (uint16_t *)out2, (uint16_t *const *)parts, nparts, n, op, divisor, 0); break;
    case T_BF16: fold_half((uint16_t *)out, (uint16_t *)out2, (uint16_t *const *)parts, nparts, n, op, divisor, 1); break;
    case T_I8: fold_int8_t((int8_t *)out, (int8_t *)out2, (int8_t *const *)parts, nparts, n, op, divisor); break;
    case T_U8: fold_uint8_t((uint8_t *)out, (uint8_t *)out2, (uint8_t *const *)parts, nparts, n, op, divisor); break;
    case T_I16: fold_int16_t((int16_t *)out, (int16_t *)out2, (int16_t *const *)parts, nparts, n, op, divisor); break;
    case T_I32: fold_int32_t((int32_t *)out, (int32_t *)out2, (int32_t *const *)parts, nparts, n, op, divisor); break;
    default: fold_int64_t((int64_t *)out, (int64_t *)out2, (int64_t *const *)parts, nparts, n, op, divisor); break;
    }
}

/* ------------------------------------------------------------------ the segment */
typedef struct {
    PyObject_HEAD
    Py_buffer view;     /* the mapping, held until close() */
    char *base;
    int rank, size;
    Py_ssize_t slot, header;
    long long epoch;        /* the last epoch this rank published */
    long long last_written; /* epoch of the latest copy-in: buffers older than it are free */
    long long steps;        /* steps started (a step's parity picks its buffer) */
    long long spin_ns;      /* how long a wait spins before it sleeps */
    int open;
} Segment;

static inline volatile int64_t *word(Segment *s, int rank) {
    return (volatile int64_t *)(s->base + (Py_ssize_t)rank * WORD_BYTES);
}

static inline char *buffer(Segment *s, int rank, long long step) {
    return s->base + s->header + ((Py_ssize_t)rank * 2 + (Py_ssize_t)(step & 1)) * s->slot;
}

static inline int32_t *sleepers(Segment *s, int rank) {
    return (int32_t *)(s->base + (Py_ssize_t)rank * WORD_BYTES + SLEEPERS_OFFSET);
}

/* The futex word of a rank: the low half of its epoch word (changes with every publish). */
static inline int32_t *futex_word(Segment *s, int rank) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (int32_t *)(s->base + (Py_ssize_t)rank * WORD_BYTES) + 1;
#else
    return (int32_t *)(s->base + (Py_ssize_t)rank * WORD_BYTES);
#endif
}

static inline void publish(Segment *s) {
    s->epoch += 1;
    /* Sequentially consistent store, then load: either a sleeper counted itself before this
     * store (and is woken), or it reads the new epoch after counting itself (and never sleeps). */
    __atomic_store_n((int64_t *)word(s, s->rank), (int64_t)s->epoch, __ATOMIC_SEQ_CST);
#if HAVE_FUTEX
    if (__atomic_load_n(sleepers(s, s->rank), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, futex_word(s, s->rank), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
}

/* True once rank ``who`` (-1: every rank) has published ``epoch``. */
static inline int reached(Segment *s, int who, long long epoch) {
    int r;
    if (who >= 0)
        return __atomic_load_n((int64_t *)word(s, who), __ATOMIC_ACQUIRE) >= epoch;
    for (r = 0; r < s->size; r++)
        if (__atomic_load_n((int64_t *)word(s, r), __ATOMIC_ACQUIRE) < epoch)
            return 0;
    return 1;
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The first rank (``who``, or any with -1) that has not published ``epoch``; -1 if none. */
static inline int behind(Segment *s, int who, long long epoch) {
    int r;
    if (who >= 0)
        return __atomic_load_n((int64_t *)word(s, who), __ATOMIC_SEQ_CST) >= epoch ? -1 : who;
    for (r = 0; r < s->size; r++)
        if (__atomic_load_n((int64_t *)word(s, r), __ATOMIC_SEQ_CST) < epoch)
            return r;
    return -1;
}

/* Sleep on rank r's epoch word until it publishes or ``ns`` pass. */
static void sleep_on(Segment *s, int r, long long epoch, long long ns) {
#if HAVE_FUTEX
    struct timespec ts;
    int64_t seen;
    __atomic_fetch_add(sleepers(s, r), 1, __ATOMIC_SEQ_CST);
    seen = __atomic_load_n((int64_t *)word(s, r), __ATOMIC_SEQ_CST);
    if (seen < epoch) {
        ts.tv_sec = ns / 1000000000LL;
        ts.tv_nsec = ns % 1000000000LL;
        /* Returns at once if the word no longer holds ``seen``'s low half. */
        syscall(SYS_futex, futex_word(s, r), FUTEX_WAIT, (int32_t)(uint64_t)seen, &ts, NULL, 0);
    }
    __atomic_fetch_sub(sleepers(s, r), 1, __ATOMIC_SEQ_CST);
#else
    (void)s; (void)r; (void)epoch;
    struct timespec ts = {0, ns < 50000 ? ns : 50000};
    nanosleep(&ts, NULL);
#endif
}

/* Wait until ``reached`` or ``budget_ns`` pass, with the GIL released: spin for ``spin_ns``
 * (a peer a few microseconds behind costs no system call), then sleep on the futex of the
 * first rank still behind. */
static int spin(Segment *s, int who, long long epoch, long long budget_ns, long long spin_ns) {
    long long start, t;
    unsigned n = 0;
    int ok = 0, r;
    if (reached(s, who, epoch))
        return 1;
    if (budget_ns <= 0)
        return 0;
    Py_BEGIN_ALLOW_THREADS
    start = now_ns();
    for (;;) {
        if (reached(s, who, epoch)) { ok = 1; break; }
        if ((++n & 31) == 0) {
            t = now_ns() - start;
            if (t >= budget_ns) break;
            if (t >= spin_ns) {
                r = behind(s, who, epoch);
                if (r < 0) { ok = 1; break; }
                sleep_on(s, r, epoch, budget_ns - t);
            }
        } else {
            CPU_RELAX();
        }
    }
    Py_END_ALLOW_THREADS
    return ok;
}

static void copy(char *dst, const char *src, Py_ssize_t nbytes) {
    if (nbytes <= 0 || dst == src)
        return;
    if (nbytes >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, nbytes);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, src, nbytes);
    }
}

static void fold_gil(int dtype, char *out, char *out2, char *const *parts, int nparts, Py_ssize_t n, int op,
                     int divisor) {
    if (n * ELEMENT_SIZE[dtype] >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        fold(dtype, out, out2, parts, nparts, n, op, divisor);
        Py_END_ALLOW_THREADS
    } else {
        fold(dtype, out, out2, parts, nparts, n, op, divisor);
    }
}

/* Split points of n elements into parts near-equal runs (as torch.tensor_split). */
static inline Py_ssize_t bound(Py_ssize_t n, int parts, int i) {
    Py_ssize_t q = n / parts, r = n % parts;
    return q * i + (i < r ? i : r);
}

/* ------------------------------------------------------------------ operations */
enum { K_ALL_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST, K_BARRIER, K_ALL_REDUCE_ACROSS };

typedef struct {
    PyObject_HEAD
    Segment *seg;
    int kind, dtype, op, esize, root, one_shot;
    char *data;       /* all_reduce, broadcast: in and out; reduce_scatter, all_gather: output */
    char *input;      /* reduce_scatter, all_gather: input */
    Py_ssize_t n;     /* elements: all_reduce's and broadcast's total, the per-rank count otherwise */
    Py_ssize_t chunk; /* elements per step */
    Py_ssize_t pos, len;
    long long step;
    int phase, done;
    int wait_rank;         /* -1: every rank */
    long long wait_epoch;  /* 0: not waiting */
    long long spun_epoch;  /* the wait already spun for: later advances sleep at once */
    int world;             /* all_reduce_across: the job's size (divides an AVERAGE) */
    int paused;            /* all_reduce_across: this rank's part waits for the exchange between hosts */
} Op;

static PyTypeObject OpType;

#define MAX_RANKS 64

/* Start a step: this rank's next buffer must be free (phase then goes on). */
static int begin_step(Op *o) {
    Segment *s = o->seg;
    s->steps += 1;
    o->step = s->steps;
    o->wait_rank = -1;
    o->wait_epoch = s->last_written;
    return 0;
}

static void wait_for(Op *o, int who, long long epoch) {
    o->wait_rank = who;
    o->wait_epoch = epoch;
}

static void written(Op *o) {
    Segment *s = o->seg;
    publish(s);
    s->last_written = s->epoch;
}

/* Start the next chunk (its step waits for its buffer to be free): 1 once there is none. */
static int next_chunk(Op *o) {
    if (o->pos >= o->n)
        return 1;
    o->len = o->n - o->pos < o->chunk ? o->n - o->pos : o->chunk;
    begin_step(o);
    o->phase = 1;
    return 0;
}

/* Publish this step's copy-in and wait until every rank has published its own. */
static void written_wait_all(Op *o) {
    written(o);
    wait_for(o, -1, o->seg->epoch);
}

/* One piece of work; returns 1 when the operation is complete. Sets a wait to pause. */
static int run_all_reduce(Op *o) {
    Segment *s = o->seg;
    int r, me = s->rank, size = s->size;
    char *parts[MAX_RANKS];
    Py_ssize_t es = o->esize;
    for (;;) {
        switch (o->phase) {
        case 0:
            return next_chunk(o);
        case 1: { /* copy in: everything (one shot) or what the others reduce */
            char *mine = buffer(s, me, o->step), *src = o->data + o->pos * es;
            if (o->one_shot) {
                copy(mine, src, o->len * es);
            } else {
                Py_ssize_t lo = bound(o->len, size, me), hi = bound(o->len, size, me + 1);
                copy(mine, src, lo * es);
                copy(mine + hi * es, src + hi * es, (o->len - hi) * es);
            }
            written_wait_all(o);
            o->phase = 2;
            return 0;
        }
        case 2: {
            char *dst = o->data + o->pos * es;
            if (o->one_shot) {
                for (r = 0; r < size; r++)
                    parts[r] = r == me ? dst : buffer(s, r, o->step);
                fold_gil(o->dtype, dst, NULL, parts, size, o->len, o->op, size);
                o->pos += o->len;
                o->phase = 0;
                break;
            }
            {
                Py_ssize_t lo = bound(o->len, size, me), hi = bound(o->len, size, me + 1);
                for (r = 0; r < size; r++)
                    parts[r] = r == me ? dst + lo * es : buffer(s, r, o->step) + lo * es;
                fold_gil(o->dtype, dst + lo * es, buffer(s, me, o->step) + lo * es, parts, size, hi - lo,
                         o->op, size);
            }
            publish(s);
            wait_for(o, -1, s->epoch);
            o->phase = 3;
            return 0;
        }
        case 3: { /* copy out the parts the others reduced */
            char *dst = o->data + o->pos * es;
            for (r = 0; r < size; r++) {
                Py_ssize_t lo, hi;
                if (r == me) continue;
                lo = bound(o->len, size, r);
                hi = bound(o->len, size, r + 1);
                copy(dst + lo * es, buffer(s, r, o->step) + lo * es, (hi - lo) * es);
            }
            o->pos += o->len;
            o->phase = 0;
            break;
        }
        }
    }
}

static int run_reduce_scatter(Op *o) {
    Segment *s = o->seg;
    int r, me = s->rank, size = s->size;
    char *parts[MAX_RANKS];
    Py_ssize_t es = o->esize;
    for (;;) {
        switch (o->phase) {
        case 0:
            return next_chunk(o);
        case 1: { /* cell r of this rank's buffer: its row r's current slice, for rank r */
            char *mine = buffer(s, me, o->step);
            for (r = 0; r < size; r++)
                if (r != me)
                    copy(mine + r * o->len * es, o->input + (r * o->n + o->pos) * es, o->len * es);
            written_wait_all(o);
            o->phase = 2;
            return 0;
        }
        case 2:
            for (r = 0; r < size; r++)
                parts[r] = r == me ? o->input + (me * o->n + o->pos) * es : buffer(s, r, o->step) + me * o->len * es;
            fold_gil(o->dtype, o->data + o->pos * es, NULL, parts, size, o->len, o->op, size);
            o->pos += o->len;
            o->phase = 0;
            break;
        }
    }
}

static int run_all_gather(Op *o) {
    Segment *s = o->seg;
    int r, me = s->rank, size = s->size;
    Py_ssize_t es = o->esize;
    for (;;) {
        switch (o->phase) {
        case 0:
            return next_chunk(o);
        case 1:
            copy(buffer(s, me, o->step), o->input + o->pos * es, o->len * es);
            written_wait_all(o);
            o->phase = 2;
            return 0;
        case 2:
            for (r = 0; r < size; r++)
                copy(o->data + (r * o->n + o->pos) * es,
                     r == me ? o->input + o->pos * es : buffer(s, r, o->step), o->len * es);
            o->pos += o->len;
            o->phase = 0;
            break;
        }
    }
}

static int run_broadcast(Op *o) {
    Segment *s = o->seg;
    int me = s->rank;
    for (;;) {
        switch (o->phase) {
        case 0:
            return next_chunk(o);
        case 1:
            if (me == o->root)
                copy(buffer(s, me, o->step), o->data + o->pos, o->len);
            written(o);
            if (me == o->root) {
                o->pos += o->len;
                o->phase = 0;
                break;
            }
            wait_for(o, o->root, s->epoch);
            o->phase = 2;
            return 0;
        case 2:
            copy(o->data + o->pos, buffer(s, o->root, o->step), o->len);
            o->pos += o->len;
            o->phase = 0;
            break;
        }
    }
}

static int run_barrier(Op *o) {
    if (o->phase == 0) {
        o->seg->steps += 1;
        written_wait_all(o);
        o->phase = 1;
        return 0;
    }
    return 1;
}

/* The hierarchical plane's all-reduce: per chunk, every rank copies the chunk in, reduces its
 * part over the host, pauses while Python all-reduces that part with the same local rank of
 * the other hosts (MPI), then publishes it (AVERAGE divided by the world) and gathers the
 * others' parts. */
static int run_all_reduce_across(Op *o) {
    Segment *s = o->seg;
    int r, me = s->rank, size = s->size;
    char *parts[MAX_RANKS];
    Py_ssize_t es = o->esize, lo, hi;
    for (;;) {
        lo = bound(o->len, size, me);
        hi = bound(o->len, size, me + 1);
        switch (o->phase) {
        case 0:
            return next_chunk(o);
        case 1:
            copy(buffer(s, me, o->step), o->data + o->pos * es, o->len * es);
            written_wait_all(o);
            o->phase = 2;
            return 0;
        case 2: /* this rank's part over the host, not yet divided */
            for (r = 0; r < size; r++)
                parts[r] = buffer(s, r, o->step) + lo * es;
            fold_gil(o->dtype, o->data + (o->pos + lo) * es, NULL, parts, size, hi - lo,
                     o->op == R_AVG ? R_SUM : o->op, 1);
            o->paused = 1;
            o->phase = 3;
            return 0;
        case 3: { /* after the exchange: publish the part, divided for an AVERAGE */
            char *part = o->data + (o->pos + lo) * es;
            parts[0] = part;
            fold_gil(o->dtype, part, buffer(s, me, o->step) + lo * es, parts, 1, hi - lo, o->op, o->world);
            publish(s);
            wait_for(o, -1, s->epoch);
            o->phase = 4;
            return 0;
        }
        case 4:
            for (r = 0; r < size; r++) {
                Py_ssize_t rlo = bound(o->len, size, r), rhi = bound(o->len, size, r + 1);
                if (r != me)
                    copy(o->data + (o->pos + rlo) * es, buffer(s, r, o->step) + rlo * es, (rhi - rlo) * es);
            }
            o->pos += o->len;
            o->phase = 0;
            break;
        }
    }
}

static int run(Op *o) {
    switch (o->kind) {
    case K_ALL_REDUCE: return run_all_reduce(o);
    case K_REDUCE_SCATTER: return run_reduce_scatter(o);
    case K_ALL_GATHER: return run_all_gather(o);
    case K_BROADCAST: return run_broadcast(o);
    case K_ALL_REDUCE_ACROSS: return run_all_reduce_across(o);
    default: return run_barrier(o);
    }
}

static PyObject *Op_advance(Op *o, PyObject *arg) {
    long long budget = PyLong_AsLongLong(arg);
    if (budget == -1 && PyErr_Occurred())
        return NULL;
    if (!o->seg->open) {
        PyErr_SetString(PyExc_RuntimeError, "the shared-memory segment is closed");
        return NULL;
    }
    while (!o->done) {
        if (o->paused)
            Py_RETURN_FALSE;
        if (o->wait_epoch) {
            /* A wait spins once; when it outlasts an advance, the next ones sleep at once. */
            long long spin_ns = o->spun_epoch == o->wait_epoch ? 0 : o->seg->spin_ns;
            if (!spin(o->seg, o->wait_rank, o->wait_epoch, budget, spin_ns)) {
                o->spun_epoch = o->wait_epoch;
                Py_RETURN_FALSE;
            }
            o->wait_epoch = 0;
        }
        if (run(o))
            o->done = 1;
    }
    Py_RETURN_TRUE;
}

static PyObject *Op_get_waiting(Op *o, void *closure) {
    (void)closure;
    if (o->done || !o->wait_epoch)
        Py_RETURN_NONE;
    if (o->wait_rank < 0)
        return Py_BuildValue("(OL)", Py_None, o->wait_epoch);
    return Py_BuildValue("(iL)", o->wait_rank, o->wait_epoch);
}

static PyObject *Op_get_exchange(Op *o, void *closure) {
    Py_ssize_t lo, hi;
    (void)closure;
    if (!o->paused)
        Py_RETURN_NONE;
    lo = bound(o->len, o->seg->size, o->seg->rank);
    hi = bound(o->len, o->seg->size, o->seg->rank + 1);
    return Py_BuildValue("(nn)", o->pos + lo, hi - lo);
}

static PyObject *Op_resume(Op *o, PyObject *noargs) {
    (void)noargs;
    o->paused = 0;
    Py_RETURN_NONE;
}

static PyObject *Op_get_done(Op *o, void *closure) {
    (void)closure;
    return PyBool_FromLong(o->done);
}

static void Op_dealloc(Op *o) {
    Py_XDECREF(o->seg);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyMethodDef Op_methods[] = {
    {"resume", (PyCFunction)Op_resume, METH_NOARGS,
     "resume(): the exchange between hosts is done (its result is in place); go on."},
    {"advance", (PyCFunction)Op_advance, METH_O,
     "advance(spin_ns) -> bool: run as far as the peers allow, spinning at most spin_ns on each "
     "wait; True once complete."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Op_getset[] = {
    {"waiting", (getter)Op_get_waiting, NULL, "(rank or None for every rank, epoch) awaited, or None.", NULL},
    {"done", (getter)Op_get_done, NULL, "True once the operation completed.", NULL},
    {"exchange", (getter)Op_get_exchange, NULL,
     "(first element, count) of this rank's part, to all-reduce between hosts before resume(); or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject OpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smddp.comm.backends._shm_native.Op",
    .tp_basicsize = sizeof(Op),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One shared-memory collective in flight.",
    .tp_dealloc = (destructor)Op_dealloc,
    .tp_methods = Op_methods,
    .tp_getset = Op_getset,
};

static Op *new_op(Segment *s, int kind) {
    Op *o;
    if (!s->open) {
        PyErr_SetString(PyExc_RuntimeError, "the shared-memory segment is closed");
        return NULL;
    }
    o = PyObject_New(Op, &OpType);
    if (o == NULL)
        return NULL;
    Py_INCREF(s);
    o->seg = s;
    o->kind = kind;
    o->dtype = T_U8;
    o->op = R_SUM;
    o->esize = 1;
    o->root = 0;
    o->one_shot = 0;
    o->data = o->input = NULL;
    o->n = o->chunk = o->pos = o->len = 0;
    o->step = 0;
    o->phase = o->done = 0;
    o->wait_rank = -1;
    o->wait_epoch = 0;
    o->spun_epoch = -1;
    o->world = 1;
    o->paused = 0;
    return o;
}

static int check_dtype_op(int dtype, int op) {
    if (dtype < 0 || dtype >= T_COUNT || (dtype == T_F16 && !HAVE_F16)) {
        PyErr_Format(PyExc_ValueError, "dtype code %d is not supported here", dtype);
        return -1;
    }
    if (op < 0 || op >= R_COUNT) {
        PyErr_Format(PyExc_ValueError, "op code %d is not a reduction", op);
        return -1;
    }
    return 0;
}

static PyObject *Segment_all_reduce(Segment *s, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t n, chunk_bytes, one_shot_max;
    int dtype, op;
    Op *o;
    if (!PyArg_ParseTuple(args, "Kniinn", &addr, &n, &dtype, &op, &chunk_bytes, &one_shot_max))
        return NULL;
    if (check_dtype_op(dtype, op) < 0)
        return NULL;
    if ((o = new_op(s, K_ALL_REDUCE)) == NULL)
        return NULL;
    o->data = (char *)(uintptr_t)addr;
    o->dtype = dtype;
    o->op = op;
    o->esize = ELEMENT_SIZE[dtype];
    o->n = n;
    o->one_shot = n * o->esize <= one_shot_max && n * o->esize <= s->slot;
    if (o->one_shot) {
        o->chunk = n > 0 ? n : 1;
    } else {
        Py_ssize_t bytes = chunk_bytes < s->slot ? chunk_bytes : s->slot;
        o->chunk = bytes / o->esize;
        if (o->chunk < s->size) o->chunk = s->size;
    }
    return (PyObject *)o;
}

static PyObject *Segment_all_reduce_across(Segment *s, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t n, chunk_bytes;
    int dtype, op, world;
    Op *o;
    if (!PyArg_ParseTuple(args, "Kniini", &addr, &n, &dtype, &op, &chunk_bytes, &world))
        return NULL;
    if (check_dtype_op(dtype, op) < 0)
        return NULL;
    if (dtype == T_F16 || dtype == T_BF16) {
        PyErr_SetString(PyExc_ValueError, "all_reduce_across: half types are reduced in float32 by the Python path");
        return NULL;
    }
    if (world < 1) {
        PyErr_Format(PyExc_ValueError, "world %d is not a job size", world);
        return NULL;
    }
    if ((o = new_op(s, K_ALL_REDUCE_ACROSS)) == NULL)
        return NULL;
    o->data = (char *)(uintptr_t)addr;
    o->dtype = dtype;
    o->op = op;
    o->esize = ELEMENT_SIZE[dtype];
    o->n = n;
    o->world = world;
    o->chunk = (chunk_bytes < s->slot ? chunk_bytes : s->slot) / o->esize;
    if (o->chunk < s->size) o->chunk = s->size;
    return (PyObject *)o;
}

static PyObject *Segment_reduce_scatter(Segment *s, PyObject *args) {
    unsigned long long out, in;
    Py_ssize_t m, chunk_bytes, per;
    int dtype, op;
    Op *o;
    if (!PyArg_ParseTuple(args, "KKniin", &out, &in, &m, &dtype, &op, &chunk_bytes))
        return NULL;
    if (check_dtype_op(dtype, op) < 0)
        return NULL;
    if ((o = new_op(s, K_REDUCE_SCATTER)) == NULL)
        return NULL;
    o->data = (char *)(uintptr_t)out;
    o->input = (char *)(uintptr_t)in;
    o->dtype = dtype;
    o->op = op;
    o->esize = ELEMENT_SIZE[dtype];
    o->n = m;
    per = (chunk_bytes < s->slot ? chunk_bytes : s->slot) / (o->esize * s->size);
    o->chunk = per > 0 ? per : 1;
    return (PyObject *)o;
}

static PyObject *Segment_all_gather(Segment *s, PyObject *args) {
    unsigned long long out, in;
    Py_ssize_t nbytes, chunk_bytes;
    Op *o;
    if (!PyArg_ParseTuple(args, "KKnn", &out, &in, &nbytes, &chunk_bytes))
        return NULL;
    if ((o = new_op(s, K_ALL_GATHER)) == NULL)
        return NULL;
    o->data = (char *)(uintptr_t)out;
    o->input = (char *)(uintptr_t)in;
    o->n = nbytes;
    o->chunk = chunk_bytes < s->slot ? chunk_bytes : s->slot;
    if (o->chunk < 1) o->chunk = 1;
    return (PyObject *)o;
}

static PyObject *Segment_broadcast(Segment *s, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t nbytes, chunk_bytes;
    int root;
    Op *o;
    if (!PyArg_ParseTuple(args, "Knin", &addr, &nbytes, &root, &chunk_bytes))
        return NULL;
    if (root < 0 || root >= s->size) {
        PyErr_Format(PyExc_ValueError, "root %d is not a rank of this segment (size %d)", root, s->size);
        return NULL;
    }
    if ((o = new_op(s, K_BROADCAST)) == NULL)
        return NULL;
    o->data = (char *)(uintptr_t)addr;
    o->root = root;
    o->n = nbytes;
    o->chunk = chunk_bytes < s->slot ? chunk_bytes : s->slot;
    if (o->chunk < 1) o->chunk = 1;
    return (PyObject *)o;
}

static PyObject *Segment_barrier(Segment *s, PyObject *noargs) {
    (void)noargs;
    return (PyObject *)new_op(s, K_BARRIER);
}

static PyObject *Segment_publish(Segment *s, PyObject *noargs) {
    (void)noargs;
    if (!s->open) {
        PyErr_SetString(PyExc_RuntimeError, "the shared-memory segment is closed");
        return NULL;
    }
    publish(s);
    return PyLong_FromLongLong(s->epoch);
}

static PyObject *Segment_close(Segment *s, PyObject *noargs) {
    (void)noargs;
    if (s->open) {
        s->open = 0;
        s->base = NULL;
        PyBuffer_Release(&s->view);
    }
    Py_RETURN_NONE;
}

static int Segment_init(Segment *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", "rank", "size", "slot", "header", "spin_ns", NULL};
    PyObject *obj;
    int rank, size;
    Py_ssize_t slot, header;
    long long spin_ns = 20000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oiinn|L", kwlist, &obj, &rank, &size, &slot, &header,
                                     &spin_ns))
        return -1;
    if (size < 1 || size > MAX_RANKS || rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "rank %d of %d: the segment serves 1 to %d ranks", rank, size, MAX_RANKS);
        return -1;
    }
    if (header < (Py_ssize_t)size * WORD_BYTES || slot < 64) {
        PyErr_SetString(PyExc_ValueError, "header too small for the ranks' words, or slot below 64 bytes");
        return -1;
    }
    if (s->open) {
        PyErr_SetString(PyExc_RuntimeError, "Segment already initialized");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &s->view, PyBUF_WRITABLE) < 0)
        return -1;
    if (s->view.len < header + (Py_ssize_t)size * 2 * slot) {
        PyBuffer_Release(&s->view);
        PyErr_SetString(PyExc_ValueError, "the buffer is smaller than header + size * 2 * slot");
        return -1;
    }
    s->base = (char *)s->view.buf;
    s->rank = rank;
    s->size = size;
    s->slot = slot;
    s->header = header;
    s->epoch = s->last_written = s->steps = 0;
    s->spin_ns = spin_ns;
    s->open = 1;
    return 0;
}

static void Segment_dealloc(Segment *s) {
    if (s->open)
        PyBuffer_Release(&s->view);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Segment_behind(Segment *s, PyObject *args) {
    PyObject *who_obj, *out;
    long long epoch;
    int r;
    if (!PyArg_ParseTuple(args, "OL", &who_obj, &epoch))
        return NULL;
    if (!s->open)
        return PyList_New(0);
    out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (r = 0; r < s->size; r++) {
        if (who_obj != Py_None && PyLong_AsLong(who_obj) != r)
            continue;
        if (!reached(s, r, epoch)) {
            PyObject *v = PyLong_FromLong(r);
            if (v == NULL || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return out;
}

static PyMethodDef Segment_methods[] = {
    {"all_reduce", (PyCFunction)Segment_all_reduce, METH_VARARGS,
     "all_reduce(addr, numel, dtype, op, chunk_bytes, one_shot_max) -> Op: reduce in place."},
    {"all_reduce_across", (PyCFunction)Segment_all_reduce_across, METH_VARARGS,
     "all_reduce_across(addr, numel, dtype, op, chunk_bytes, world) -> Op: the hierarchical plane's "
     "all-reduce; it pauses (Op.exchange) for each part's exchange between hosts."},
    {"reduce_scatter", (PyCFunction)Segment_reduce_scatter, METH_VARARGS,
     "reduce_scatter(out_addr, in_addr, m, dtype, op, chunk_bytes) -> Op: rank r gets the reduction of "
     "every rank's slice r (m elements each)."},
    {"all_gather", (PyCFunction)Segment_all_gather, METH_VARARGS,
     "all_gather(out_addr, in_addr, nbytes, chunk_bytes) -> Op: every rank's nbytes in rank order."},
    {"broadcast", (PyCFunction)Segment_broadcast, METH_VARARGS,
     "broadcast(addr, nbytes, root, chunk_bytes) -> Op: root's bytes into every rank's."},
    {"barrier", (PyCFunction)Segment_barrier, METH_NOARGS, "barrier() -> Op."},
    {"behind", (PyCFunction)Segment_behind, METH_VARARGS,
     "behind(rank_or_None, epoch) -> list of the ranks that have not published epoch."},
    {"publish", (PyCFunction)Segment_publish, METH_NOARGS,
     "publish() -> int: publish this rank's next epoch (waking its sleepers); returns it."},
    {"close", (PyCFunction)Segment_close, METH_NOARGS, "Release the mapping; later calls fail."},
    {NULL, NULL, 0, NULL},
};

#define COUNTER(name, doc) \
    {#name, T_LONGLONG, offsetof(Segment, name), 0, doc}

static PyMemberDef Segment_members[] = {
    COUNTER(epoch, "The last epoch this rank published."),
    COUNTER(last_written, "Epoch of the latest copy-in: buffers older than it are free."),
    COUNTER(steps, "Steps started."),
    {"rank", T_INT, offsetof(Segment, rank), READONLY, "This rank in the segment."},
    {"size", T_INT, offsetof(Segment, size), READONLY, "Ranks sharing the segment."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smddp.comm.backends._shm_native.Segment",
    .tp_basicsize = sizeof(Segment),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Segment(buffer, rank, size, slot, header, spin_ns=20000): one host's shared segment, as this "
              "rank sees it; waits spin spin_ns, then sleep.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Segment_init,
    .tp_dealloc = (destructor)Segment_dealloc,
    .tp_methods = Segment_methods,
    .tp_members = Segment_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shm_native",
    "The shared-memory plane's compiled core (see smddp.comm.backends.shm).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shm_native(void) {
    PyObject *m;
    if (PyType_Ready(&SegmentType) < 0 || PyType_Ready(&OpType) < 0)
        return NULL;
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SegmentType);
    if (PyModule_AddObject(m, "Segment", (PyObject *)&SegmentType) < 0) {
        Py_DECREF(&SegmentType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "HAVE_FLOAT16", HAVE_F16);
    PyModule_AddIntConstant(m, "MAX_RANKS", MAX_RANKS);
    return m;
}
