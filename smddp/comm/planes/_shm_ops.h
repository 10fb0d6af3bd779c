/* The shared-memory core's operations: one resumable state machine per collective.
 * Included by _shm_native.c. */
#ifndef SMDDP_SHM_OPS_H
#define SMDDP_SHM_OPS_H

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
