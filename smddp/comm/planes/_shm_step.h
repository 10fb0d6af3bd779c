/* The shared-memory core's operations as state: an Op, and the steps every collective is made of
 * (begin, publish with the fingerprint, wait, compare; the mismatch a step finds).
 * Included by _shm_native.c, after _shm_sync.h: _shm_cma.h and _shm_ops.h build on it. */
#ifndef SMDDP_SHM_STEP_H
#define SMDDP_SHM_STEP_H

/* ------------------------------------------------------------------ operations */
enum { K_ALL_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST, K_BARRIER, K_ALL_REDUCE_ACROSS, K_ALL_TO_ALL };

typedef struct {
    PyObject_HEAD
    Segment *seg;
    int kind, dtype, op, esize, root, one_shot;
    int single_copy;  /* all_reduce: through the peers' buffers, not the segment's (_shm_cma.h) */
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
    Py_ssize_t *parts;     /* all_to_all: bytes sent to and received from each rank (see A2A_*) */
    long long fp_count;    /* the fingerprint (see FP_*): element count, or -1 where none is compared */
    long long fp_sig;      /* ... sequence, kind, dtype, reduction op and root, packed */
    int signed_;           /* the fingerprint is in this rank's header line */
    int check;             /* compare the peers' fingerprints once the wait ends */
} Op;

static PyTypeObject OpType;

#define MAX_RANKS 64

/* The fingerprint: every operation's first step writes it into this rank's header line (the
 * cache line of its epoch word, which the peers read anyway), in the half of the step's
 * parity, before it publishes; once every rank has published that step, each compares every
 * rank's with its own (Op.advance raises Mismatch) before it uses their data.  Two int64
 * words: the element count, then FP_SIG's packing.  Field codes are
 * smddp.comm.mismatch.fingerprint's (KINDS, DTYPES, OPS); shm_torch.py packs the same. */
#define FP_WORD 4  /* int64 index, in a rank's header line, of parity 0's fingerprint */
#define FP_SIG(seq, kind, dtype, op, root) \
    ((((long long)(seq) & 0x7FFFFFFFLL) << 32) | ((long long)(kind) << 24) | ((long long)((dtype) + 1) << 16) \
     | ((long long)((op) + 1) << 8) | (long long)((root) + 1))
/* smddp.comm.mismatch.fingerprint.KINDS's code of each operation (the hierarchical all-reduce is an all_reduce). */
static const int FP_KIND[] = {0, 5, 2, 1, 4, 0, 3};

/* all_to_all's table (Op.parts), size entries each: send offset, send length, receive offset,
 * receive length, in bytes. In a step, a rank's buffer holds a header of A2A_HEADER(size) bytes,
 * then one sub-buffer of ``chunk`` bytes per destination rank.  The first step's header has the
 * rank's largest send length (from which every rank learns how many steps the exchange takes),
 * then what it sends to each rank, then what it expects from each (int64 each): every rank checks
 * that they pair up before it moves any data (Op.advance raises Mismatch with the pairs that
 * do not).  The split sizes thus ride with the data: no exchange of their own. */
enum { A2A_SEND_OFF, A2A_SEND_LEN, A2A_RECV_OFF, A2A_RECV_LEN };
#define A2A_HEADER(size) ((8 + 16 * (Py_ssize_t)(size) + 63) / 64 * 64)
#define PART(o, field, r) ((o)->parts[(field) * (o)->seg->size + (r)])

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

static inline volatile int64_t *fingerprint(Segment *s, int rank, long long step) {
    return word(s, rank) + FP_WORD + 2 * (step & 1);
}

/* Publish this step's copy-in; the operation's first also publishes its fingerprint. */
static void written(Op *o) {
    Segment *s = o->seg;
    if (!o->signed_) {
        volatile int64_t *fp = fingerprint(s, s->rank, o->step);
        fp[0] = o->fp_count;
        fp[1] = o->fp_sig;
        o->signed_ = o->check = 1;
    }
    publish(s);
    s->last_written = s->epoch;
}

/* 1 if every rank's fingerprint of the current step is this rank's (read after the step's wait on all). */
static int fingerprints_match(Op *o) {
    Segment *s = o->seg;
    int r;
    for (r = 0; r < s->size; r++) {
        volatile int64_t *fp = fingerprint(s, r, o->step);
        if (fp[0] != o->fp_count || fp[1] != o->fp_sig)
            return 0;
    }
    return 1;
}

/* Start the next chunk (its step waits for its buffer to be free): 1 once there is none. An
 * empty operation takes one step too: its fingerprint is checked like the others'. */
static int next_chunk(Op *o) {
    if (o->pos >= o->n && o->step)
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

/* Copy every other rank's part of the current chunk (the part it reduced) from its buffer. */
static void gather_parts(Op *o) {
    Segment *s = o->seg;
    Py_ssize_t es = o->esize, lo, hi;
    int r;
    for (r = 0; r < s->size; r++) {
        if (r == s->rank)
            continue;
        lo = bound(o->len, s->size, r);
        hi = bound(o->len, s->size, r + 1);
        copy(o->data + (o->pos + lo) * es, buffer(s, r, o->step) + lo * es, (hi - lo) * es);
    }
}

/* What rank r sends to rank q, and what q expects from r, from the first step's headers. */
static int64_t a2a_sent(Op *o, int r, int q) {
    int64_t v;
    memcpy(&v, buffer(o->seg, r, o->step) + 8 + 8 * (Py_ssize_t)q, sizeof v);
    return v;
}

static int64_t a2a_expected(Op *o, int q, int r) {
    int64_t v;
    memcpy(&v, buffer(o->seg, q, o->step) + 8 + 8 * ((Py_ssize_t)o->seg->size + r), sizeof v);
    return v;
}

static PyObject *Mismatch; /* raised by Op.advance: args[0] holds every rank's fingerprint; an
                            * all_to_all's split sizes that do not pair up add args[1] */

/* Raise Mismatch with ((count, signature) of each rank of the segment), and ``pairs`` if not NULL
 * (the reference is stolen). */
static void raise_mismatch_with(Op *o, PyObject *pairs) {
    Segment *s = o->seg;
    PyObject *rows = PyTuple_New(s->size), *exc;
    int r;
    if (rows == NULL) {
        Py_XDECREF(pairs);
        return;
    }
    for (r = 0; r < s->size; r++) {
        volatile int64_t *fp = fingerprint(s, r, o->step);
        PyObject *row = Py_BuildValue("(LL)", (long long)fp[0], (long long)fp[1]);
        if (row == NULL) {
            Py_DECREF(rows);
            Py_XDECREF(pairs);
            return;
        }
        PyTuple_SET_ITEM(rows, r, row);
    }
    exc = pairs == NULL ? PyObject_CallOneArg(Mismatch, rows)
                        : PyObject_CallFunctionObjArgs(Mismatch, rows, pairs, NULL);
    Py_DECREF(rows);
    Py_XDECREF(pairs);
    if (exc != NULL) {
        PyErr_SetObject(Mismatch, exc);
        Py_DECREF(exc);
    }
}

static void raise_mismatch(Op *o) {
    raise_mismatch_with(o, NULL);
}

/* Raise Mismatch with args[1]: (sender, receiver, bytes sent, bytes expected) of every pair of
 * ranks whose all_to_all split sizes disagree (read from the first step's headers). */
static void raise_unpaired(Op *o) {
    int r, q, size = o->seg->size;
    PyObject *pairs = PyList_New(0), *pair;
    if (pairs == NULL)
        return;
    for (r = 0; r < size; r++)
        for (q = 0; q < size; q++) {
            int64_t sent = a2a_sent(o, r, q), expected = a2a_expected(o, q, r);
            if (sent == expected)
                continue;
            pair = Py_BuildValue("(iiLL)", r, q, (long long)sent, (long long)expected);
            if (pair == NULL || PyList_Append(pairs, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(pairs);
                return;
            }
            Py_DECREF(pair);
        }
    raise_mismatch_with(o, pairs);
}

#endif
