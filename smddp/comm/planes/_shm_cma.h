/* The shared-memory core's single-copy all-reduce: ranks read and write each other's buffers
 * directly (cross-memory attach: process_vm_readv / process_vm_writev), never the segment's.
 * Included by _shm_native.c, after _shm_step.h (and before _shm_ops.h, which runs it).
 *
 * A large all-reduce through the segment copies every byte in, reduces there and copies the
 * result out.  Here rank r owns part r of every slice of the message (the same parts as the
 * segment path's, bound()), and no one else ever touches it:
 *
 *   1. one step, as every operation's first: the fingerprint and the address of this rank's
 *      buffer go into its header line; publish; wait for every rank; compare the fingerprints;
 *   2. for each slice of ``chunk`` elements: read part r of every peer's slice into this rank's
 *      segment buffer (scratch, free since the step began), fold the parts in rank order into
 *      this rank's own part r (the segment path's fold: the same bits), then write the result
 *      into part r of every peer's buffer;
 *   3. publish; wait for every rank: no peer reads or writes this rank's buffer any more.
 *
 * Part r of peer q's buffer is read and written by rank r alone, and only after q published
 * its address, so step 2 needs no synchronisation at all: two waits per all-reduce, where the
 * segment path has two per slice.  The kernel moves the bytes: one read of the peer's part and
 * one write of the result, against the segment path's copy in, second write and copy out.
 *
 * The group agrees once, at set-up, whether a host's ranks may do this (smddp.comm.planes.layout: each
 * rank probes every host-mate with probe() on its probe_word()) and from which size
 * (Segment.single_copy_min).  A transfer that fails afterwards raises on this rank.
 */
#ifndef SMDDP_SHM_CMA_H
#define SMDDP_SHM_CMA_H

#if defined(__linux__)
#include <errno.h>
#include <sys/uio.h>
#define HAVE_CMA 1
#else
#define HAVE_CMA 0
#endif

#define PID_WORD 1  /* int64 index, in a rank's header line, of its pid (written by shm.py) */
#define ADDR_WORD 3 /* ... of its buffer's address during a single-copy all-reduce */

/* What a peer reads at set-up to learn whether it may read this process's memory. */
static volatile int64_t probe_cell;

#if HAVE_CMA
/* Copy ``nbytes`` between ``local`` and ``remote`` in process ``pid`` (``to_remote``: write);
 * 0, or -1 with errno set (EFAULT when the kernel moves nothing more). */
static int remote_copy(pid_t pid, char *local, char *remote, Py_ssize_t nbytes, int to_remote) {
    while (nbytes > 0) {
        struct iovec here = {local, (size_t)nbytes}, there = {remote, (size_t)nbytes};
        ssize_t moved = to_remote ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                                  : process_vm_readv(pid, &here, 1, &there, 1, 0);
        if (moved < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (moved == 0) {
            errno = EFAULT;
            return -1;
        }
        local += moved;
        remote += moved;
        nbytes -= moved;
    }
    return 0;
}
#endif

/* Step 2 for every slice, without the GIL: 0, or -1 with an exception set. */
static int exchange_in_place(Op *o) {
#if HAVE_CMA
    Segment *s = o->seg;
    int me = s->rank, size = s->size, r, k, failed = -1, err = 0, writing = 0;
    Py_ssize_t es = o->esize, pos, len, lo, hi, off, nbytes;
    char *scratch = buffer(s, me, o->step), *parts[MAX_RANKS], *addrs[MAX_RANKS];
    pid_t pids[MAX_RANKS];
    for (r = 0; r < size; r++) {
        pids[r] = (pid_t)word(s, r)[PID_WORD];
        addrs[r] = (char *)(uintptr_t)word(s, r)[ADDR_WORD];
    }
    Py_BEGIN_ALLOW_THREADS
    for (pos = 0; pos < o->n && failed < 0; pos += o->chunk) {
        len = o->n - pos < o->chunk ? o->n - pos : o->chunk;
        lo = bound(len, size, me);
        hi = bound(len, size, me + 1);
        if (hi == lo)
            continue;
        off = (pos + lo) * es;
        nbytes = (hi - lo) * es;
        for (r = 0, k = 0; r < size && failed < 0; r++) {
            if (r == me) {
                parts[r] = o->data + off;
                continue;
            }
            parts[r] = scratch + (k++) * nbytes;
            if (remote_copy(pids[r], parts[r], addrs[r] + off, nbytes, 0) < 0)
                failed = r, err = errno;
        }
        if (failed >= 0)
            break;
        fold(o->dtype, o->data + off, NULL, parts, size, hi - lo, o->op, size);
        for (r = 0; r < size && failed < 0; r++)
            if (r != me && remote_copy(pids[r], o->data + off, addrs[r] + off, nbytes, 1) < 0)
                failed = r, err = errno, writing = 1;
    }
    Py_END_ALLOW_THREADS
    if (failed >= 0 && err == ESRCH) {
        PyErr_Format(PyExc_RuntimeError,
                     "local rank %d of this host's shared-memory group (pid %d) exited in the middle of a "
                     "collective; the job cannot continue: look for their error output", failed, (int)pids[failed]);
        return -1;
    }
    if (failed >= 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "the shared-memory plane's single-copy all-reduce could not %s local rank %d's memory "
                     "(pid %d): %s; the result is lost (SMDDP_SHM_CMA=0 turns this path off)",
                     writing ? "write" : "read", failed, (int)pids[failed], strerror(err));
        return -1;
    }
    return 0;
#else
    (void)o;
    PyErr_SetString(PyExc_RuntimeError, "this platform has no cross-memory attach");
    return -1;
#endif
}

static int run_all_reduce_single_copy(Op *o) {
    Segment *s = o->seg;
    switch (o->phase) {
    case 0: /* the step's buffer (scratch) and its half of the header line must be free */
        begin_step(o);
        o->phase = 1;
        return 0;
    case 1:
        word(s, s->rank)[ADDR_WORD] = (int64_t)(uintptr_t)o->data;
        written_wait_all(o); /* with the fingerprint, which Op.advance compares after the wait */
        o->phase = 2;
        return 0;
    case 2:
        if (exchange_in_place(o) < 0)
            return -1;
        s->single_copy_ops += 1;
        publish(s);
        wait_for(o, -1, s->epoch);
        o->phase = 3;
        return 0;
    }
    return 1;
}

/* probe_word() -> (address, token): where this process's probe cell is, and what it holds. */
static PyObject *probe_word(PyObject *module, PyObject *noargs) {
    (void)module;
    (void)noargs;
    return Py_BuildValue("(KL)", (unsigned long long)(uintptr_t)&probe_cell, (long long)probe_cell);
}

/* probe(pid, address, token) -> 0, or the errno that refuses a read or write of that process's
 * probe cell (EINVAL: it holds another token: not the process that published it). */
static PyObject *probe(PyObject *module, PyObject *args) {
    unsigned long long addr;
    long long token;
    int pid, err = 0;
    (void)module;
    if (!PyArg_ParseTuple(args, "iKL", &pid, &addr, &token))
        return NULL;
#if HAVE_CMA
    {
        int64_t seen = 0;
        char *remote = (char *)(uintptr_t)addr;
        Py_BEGIN_ALLOW_THREADS
        if (remote_copy(pid, (char *)&seen, remote, sizeof seen, 0) < 0)
            err = errno;
        else if (seen != token)
            err = EINVAL;
        else if (remote_copy(pid, (char *)&seen, remote, sizeof seen, 1) < 0) /* the same value back */
            err = errno;
        Py_END_ALLOW_THREADS
    }
#else
    (void)addr;
    (void)token;
    err = ENOSYS;
#endif
    return PyLong_FromLong(err);
}

/* A token no other process is likely to hold at the same address. */
static void init_probe_cell(void) {
    uint64_t mix = (uint64_t)now_ns() ^ (uint64_t)(uintptr_t)&probe_cell;
#if HAVE_CMA
    mix ^= (uint64_t)getpid() << 40;
#endif
    probe_cell = (int64_t)(mix & 0x3FFFFFFFFFFFFFFFULL);
}

#endif
