/* The shared-memory core's segment as a rank sees it: epoch words, publishing, waiting (spin,
 * then futex), and copies and reductions that release the GIL. Included by _shm_native.c. */
#ifndef SMDDP_SHM_SYNC_H
#define SMDDP_SHM_SYNC_H

#define WORD_BYTES 64           /* bytes between two ranks' epoch words: a rank's header line */
#define SLEEPERS_OFFSET 16      /* in a rank's header line (after its epoch and pid): an int32 count
                                   of the threads asleep on its epoch word */
#define GIL_FREE_BYTES 65536    /* copies and reductions at least this large release the GIL */
#ifndef HOT_CHECKS
#define HOT_CHECKS 32           /* checks of the peers' words before a wait gives up the GIL */
#endif

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
    Py_ssize_t single_copy_min; /* all-reduces of at least this many bytes read and write the peers'
                                   buffers directly (_shm_cma.h); 0: never (the group's agreed value) */
    long long single_copy_ops;  /* all-reduces run that way */
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
    /* A peer in step publishes within a microsecond: check that long holding the GIL, which
     * costs less than giving it up and taking it back. */
    for (n = 0; n < HOT_CHECKS; n++) {
        CPU_RELAX();
        if (reached(s, who, epoch))
            return 1;
    }
    n = 0;
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

#endif
