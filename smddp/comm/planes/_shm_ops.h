/* The shared-memory core's operations: one resumable state machine per collective.
 * Included by _shm_native.c. */
#ifndef SMDDP_SHM_OPS_H
#define SMDDP_SHM_OPS_H

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
        case 3:
            gather_parts(o);
            o->pos += o->len;
            o->phase = 0;
            break;
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
            if (o->check) { /* the first step: every rank reads every fingerprint, the root's too */
                wait_for(o, -1, s->epoch);
                o->phase = 2;
                return 0;
            }
            if (me == o->root) {
                o->pos += o->len;
                o->phase = 0;
                break;
            }
            wait_for(o, o->root, s->epoch);
            o->phase = 2;
            return 0;
        case 2:
            if (me != o->root)
                copy(o->data + o->pos, buffer(s, o->root, o->step), o->len);
            o->pos += o->len;
            o->phase = 0;
            break;
        }
    }
}

static int run_barrier(Op *o) {
    switch (o->phase) {
    case 0: /* its fingerprint's half of the header line must be free, as a buffer must */
        begin_step(o);
        o->phase = 1;
        return 0;
    case 1:
        written_wait_all(o);
        o->phase = 2;
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
            gather_parts(o);
            o->pos += o->len;
            o->phase = 0;
            break;
        }
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

static void raise_unpaired(Op *o);

/* 1 if every rank sends every other what that one expects; else raise Mismatch (0). */
static int splits_pair_up(Op *o) {
    int r, q, size = o->seg->size;
    for (r = 0; r < size; r++)
        for (q = 0; q < size; q++)
            if (a2a_sent(o, r, q) != a2a_expected(o, q, r)) {
                o->done = 1;
                raise_unpaired(o);
                return 0;
            }
    return 1;
}

/* Every rank sends PART(SEND_LEN, r) bytes to rank r, ``chunk`` bytes per step and peer; the
 * number of steps (Op.n) is known to all once they have read the first step's headers. */
static int run_all_to_all(Op *o) {
    Segment *s = o->seg;
    int r, me = s->rank, size = s->size;
    Py_ssize_t left;
    for (;;) {
        switch (o->phase) {
        case 0:
            if (o->n > 0 && o->pos >= o->n * o->chunk)
                return 1;
            begin_step(o);
            o->phase = 1;
            return 0;
        case 1: {
            char *mine = buffer(s, me, o->step);
            if (o->n == 0) {
                int64_t most = 0, v;
                for (r = 0; r < size; r++) {
                    if (r != me && PART(o, A2A_SEND_LEN, r) > most)
                        most = PART(o, A2A_SEND_LEN, r);
                    v = PART(o, A2A_SEND_LEN, r);
                    memcpy(mine + 8 + 8 * r, &v, sizeof v);
                    v = PART(o, A2A_RECV_LEN, r);
                    memcpy(mine + 8 + 8 * ((Py_ssize_t)size + r), &v, sizeof v);
                }
                memcpy(mine, &most, sizeof most);
            }
            for (r = 0; r < size; r++) {
                left = PART(o, A2A_SEND_LEN, r) - o->pos;
                if (r != me && left > 0)
                    copy(mine + A2A_HEADER(size) + r * o->chunk, o->input + PART(o, A2A_SEND_OFF, r) + o->pos,
                         left < o->chunk ? left : o->chunk);
            }
            written_wait_all(o);
            o->phase = 2;
            return 0;
        }
        case 2:
            if (o->n == 0) {
                int64_t most = 0, theirs;
                if (!splits_pair_up(o))
                    return -1; /* every rank sees the same headers: every one raises here */
                for (r = 0; r < size; r++) {
                    memcpy(&theirs, buffer(s, r, o->step), sizeof theirs);
                    if (theirs > most)
                        most = theirs;
                }
                o->n = most > 0 ? (most + o->chunk - 1) / o->chunk : 1;
                copy(o->data + PART(o, A2A_RECV_OFF, me), o->input + PART(o, A2A_SEND_OFF, me),
                     PART(o, A2A_SEND_LEN, me));
            }
            for (r = 0; r < size; r++) {
                left = PART(o, A2A_RECV_LEN, r) - o->pos;
                if (r != me && left > 0)
                    copy(o->data + PART(o, A2A_RECV_OFF, r) + o->pos, buffer(s, r, o->step) + A2A_HEADER(size) + me * o->chunk,
                         left < o->chunk ? left : o->chunk);
            }
            o->pos += o->chunk;
            o->phase = 0;
            break;
        }
    }
}

static int run_all_reduce_single_copy(Op *o); /* _shm_cma.h */

/* 1 once complete, 0 to wait, -1 with an exception set. */
static int run(Op *o) {
    switch (o->kind) {
    case K_ALL_REDUCE: return o->single_copy ? run_all_reduce_single_copy(o) : run_all_reduce(o);
    case K_REDUCE_SCATTER: return run_reduce_scatter(o);
    case K_ALL_GATHER: return run_all_gather(o);
    case K_BROADCAST: return run_broadcast(o);
    case K_ALL_REDUCE_ACROSS: return run_all_reduce_across(o);
    case K_ALL_TO_ALL: return run_all_to_all(o);
    default: return run_barrier(o);
    }
}

#endif
