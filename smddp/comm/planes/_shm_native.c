/* The shared-memory plane's compiled core: collectives over one host's segment.
 *
 * One translation unit: this file (the Python types Segment and Op) includes _shm_fold.h
 * (reductions), _shm_sync.h (publishing and waiting on the epoch words) and _shm_ops.h (one
 * state machine per collective).
 *
 * smddp/comm/planes/shm.py drives it and keeps the pure-Python path as the fallback.
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

#include "_shm_fold.h"
#include "_shm_sync.h"
#include "_shm_step.h"
#include "_shm_cma.h"
#include "_shm_ops.h"

#include "_shm_op_type.h"

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
    o->one_shot = o->single_copy = 0;
    o->data = o->input = NULL;
    o->n = o->chunk = o->pos = o->len = 0;
    o->step = 0;
    o->phase = o->done = 0;
    o->wait_rank = -1;
    o->wait_epoch = 0;
    o->spun_epoch = -1;
    o->world = 1;
    o->paused = 0;
    o->parts = NULL;
    o->fp_count = -1;
    o->fp_sig = FP_SIG(0, FP_KIND[kind], -1, -1, -1);
    o->signed_ = o->check = 0;
    return o;
}

static int check_dtype_op(int dtype, int op) {
    if (dtype < 0 || dtype >= T_COUNT) {
        PyErr_Format(PyExc_ValueError, "dtype code %d is not supported here", dtype);
        return -1;
    }
    if (op < 0 || op >= R_COUNT) {
        PyErr_Format(PyExc_ValueError, "op code %d is not a reduction", op);
        return -1;
    }
    if (!reducible(dtype, op)) { /* shm.py words it as every plane does (smddp.comm.base.check_reduction) */
        PyErr_Format(PyExc_ValueError, "dtype code %d has no reduction of op code %d", dtype, op);
        return -1;
    }
    return 0;
}

/* The fingerprint of ``o``: collective number ``seq``, ``count`` elements (-1: not compared)
 * of fingerprint dtype code ``dtype`` (-1: none), reduction ``op`` and ``root`` (-1: none). */
static void sign(Op *o, long long seq, long long count, int dtype, int op, int root) {
    o->fp_count = count;
    o->fp_sig = FP_SIG(seq, FP_KIND[o->kind], dtype, op, root);
}

/* A reducing operation of ``kind`` on ``dtype`` with ``op``, its data at ``addr``, ``n``
 * elements, collective number ``seq``. */
static Op *new_reducing_op(Segment *s, int kind, unsigned long long addr, Py_ssize_t n, int dtype, int op,
                           long long seq) {
    Op *o;
    if (check_dtype_op(dtype, op) < 0)
        return NULL;
    if ((o = new_op(s, kind)) == NULL)
        return NULL;
    o->data = (char *)(uintptr_t)addr;
    o->n = n;
    o->dtype = dtype;
    o->op = op;
    o->esize = ELEMENT_SIZE[dtype];
    sign(o, seq, n, dtype, op, -1);
    return o;
}

/* all_reduce(addr, n, dtype, op, chunk_bytes, one_shot_max, seq): called for every all-reduce,
 * so its arguments are read without PyArg_ParseTuple's format parsing. */
static PyObject *Segment_all_reduce(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long addr;
    Py_ssize_t n, chunk_bytes, one_shot_max;
    long long seq;
    int dtype, op;
    Op *o;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "all_reduce() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    addr = PyLong_AsUnsignedLongLong(args[0]);
    n = PyLong_AsSsize_t(args[1]);
    dtype = (int)PyLong_AsLong(args[2]);
    op = (int)PyLong_AsLong(args[3]);
    chunk_bytes = PyLong_AsSsize_t(args[4]);
    one_shot_max = PyLong_AsSsize_t(args[5]);
    seq = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if ((o = new_reducing_op(s, K_ALL_REDUCE, addr, n, dtype, op, seq)) == NULL)
        return NULL;
    o->one_shot = n * o->esize <= one_shot_max && n * o->esize <= s->slot;
    if (o->one_shot) {
        o->chunk = n > 0 ? n : 1;
    } else {
        Py_ssize_t bytes = chunk_bytes < s->slot ? chunk_bytes : s->slot;
        o->chunk = bytes / o->esize;
        if (o->chunk < s->size) o->chunk = s->size;
        /* Every rank picks the same path: the same bytes (the fingerprint's count and dtype), the
         * group's threshold.  A slice's parts from the peers fit in this rank's buffer. */
        o->single_copy = HAVE_CMA && s->single_copy_min > 0 && n * o->esize >= s->single_copy_min;
    }
    return (PyObject *)o;
}

static PyObject *Segment_all_reduce_across(Segment *s, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t n, chunk_bytes;
    long long seq;
    int dtype, op, world;
    Op *o;
    if (!PyArg_ParseTuple(args, "KniiniL", &addr, &n, &dtype, &op, &chunk_bytes, &world, &seq))
        return NULL;
    if (dtype == T_F16 || dtype == T_BF16) {
        PyErr_SetString(PyExc_ValueError, "all_reduce_across: half types are reduced in float32 by the Python path");
        return NULL;
    }
    if (world < 1) {
        PyErr_Format(PyExc_ValueError, "world %d is not a job size", world);
        return NULL;
    }
    if ((o = new_reducing_op(s, K_ALL_REDUCE_ACROSS, addr, n, dtype, op, seq)) == NULL)
        return NULL;
    o->world = world;
    o->chunk = (chunk_bytes < s->slot ? chunk_bytes : s->slot) / o->esize;
    if (o->chunk < s->size) o->chunk = s->size;
    return (PyObject *)o;
}

static PyObject *Segment_reduce_scatter(Segment *s, PyObject *args) {
    unsigned long long out, in;
    Py_ssize_t m, chunk_bytes, per;
    long long seq;
    int dtype, op;
    Op *o;
    if (!PyArg_ParseTuple(args, "KKniinL", &out, &in, &m, &dtype, &op, &chunk_bytes, &seq))
        return NULL;
    if ((o = new_reducing_op(s, K_REDUCE_SCATTER, out, m, dtype, op, seq)) == NULL)
        return NULL;
    o->input = (char *)(uintptr_t)in;
    per = (chunk_bytes < s->slot ? chunk_bytes : s->slot) / (o->esize * s->size);
    o->chunk = per > 0 ? per : 1;
    return (PyObject *)o;
}

static PyObject *Segment_all_gather(Segment *s, PyObject *args) {
    unsigned long long out, in;
    Py_ssize_t nbytes, chunk_bytes, count;
    long long seq;
    int dtype;
    Op *o;
    if (!PyArg_ParseTuple(args, "KKnninL", &out, &in, &nbytes, &chunk_bytes, &dtype, &count, &seq))
        return NULL;
    if ((o = new_op(s, K_ALL_GATHER)) == NULL)
        return NULL;
    sign(o, seq, count, dtype, -1, -1);
    o->data = (char *)(uintptr_t)out;
    o->input = (char *)(uintptr_t)in;
    o->n = nbytes;
    o->chunk = chunk_bytes < s->slot ? chunk_bytes : s->slot;
    if (o->chunk < 1) o->chunk = 1;
    return (PyObject *)o;
}

static PyObject *Segment_broadcast(Segment *s, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t nbytes, chunk_bytes, count;
    long long seq;
    int root, dtype;
    Op *o;
    if (!PyArg_ParseTuple(args, "KnininL", &addr, &nbytes, &root, &chunk_bytes, &dtype, &count, &seq))
        return NULL;
    if (root < 0 || root >= s->size) {
        PyErr_Format(PyExc_ValueError, "root %d is not a rank of this segment (size %d)", root, s->size);
        return NULL;
    }
    if ((o = new_op(s, K_BROADCAST)) == NULL)
        return NULL;
    sign(o, seq, count, dtype, -1, root);
    o->data = (char *)(uintptr_t)addr;
    o->root = root;
    o->n = nbytes;
    o->chunk = chunk_bytes < s->slot ? chunk_bytes : s->slot;
    if (o->chunk < 1) o->chunk = 1;
    return (PyObject *)o;
}

/* Read a sequence of ``size`` byte counts into PART(field, r), with their running offsets. */
static int read_counts(Op *o, PyObject *seq, int len_field, int off_field) {
    Py_ssize_t r, size = o->seg->size, at = 0, v;
    PyObject *fast = PySequence_Fast(seq, "counts must be a sequence");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != size) {
        PyErr_Format(PyExc_ValueError, "counts has %zd entries; the segment has %zd ranks",
                     PySequence_Fast_GET_SIZE(fast), size);
        Py_DECREF(fast);
        return -1;
    }
    for (r = 0; r < size; r++) {
        v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, r));
        if (v < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "counts must not be negative");
            Py_DECREF(fast);
            return -1;
        }
        PART(o, off_field, r) = at;
        PART(o, len_field, r) = v;
        at += v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *Segment_all_to_all(Segment *s, PyObject *args) {
    unsigned long long out, in;
    PyObject *send, *recv;
    Py_ssize_t chunk_bytes;
    long long seq;
    int dtype;
    Op *o;
    if (!PyArg_ParseTuple(args, "KKOOniL", &out, &in, &send, &recv, &chunk_bytes, &dtype, &seq))
        return NULL;
    if ((o = new_op(s, K_ALL_TO_ALL)) == NULL)
        return NULL;
    sign(o, seq, -1, dtype, -1, -1); /* the counts differ from rank to rank: not compared */
    o->data = (char *)(uintptr_t)out;
    o->input = (char *)(uintptr_t)in;
    o->chunk = ((chunk_bytes < s->slot ? chunk_bytes : s->slot) - A2A_HEADER(s->size)) / s->size / 64 * 64;
    if (o->chunk < 64) {
        Py_DECREF(o);
        PyErr_SetString(PyExc_ValueError, "the segment's buffers are too small for an all-to-all");
        return NULL;
    }
    o->parts = PyMem_New(Py_ssize_t, 4 * (size_t)s->size);
    if (o->parts == NULL) {
        Py_DECREF(o);
        return PyErr_NoMemory();
    }
    if (read_counts(o, send, A2A_SEND_LEN, A2A_SEND_OFF) < 0 || read_counts(o, recv, A2A_RECV_LEN, A2A_RECV_OFF) < 0) {
        Py_DECREF(o);
        return NULL;
    }
    if (PART(o, A2A_SEND_LEN, s->rank) != PART(o, A2A_RECV_LEN, s->rank)) {
        Py_DECREF(o);
        PyErr_SetString(PyExc_ValueError, "this rank's part for itself must be as long sent as received");
        return NULL;
    }
    return (PyObject *)o;
}

static PyObject *Segment_barrier(Segment *s, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    Op *o;
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    if ((o = new_op(s, K_BARRIER)) != NULL)
        sign(o, seq, -1, -1, -1, -1);
    return (PyObject *)o;
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
    s->single_copy_min = 0;
    s->single_copy_ops = 0;
    s->open = 1;
    return 0;
}

static void Segment_dealloc(Segment *s) {
    if (s->open)
        PyBuffer_Release(&s->view);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Segment_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Segment_all_reduce, METH_FASTCALL,
     "all_reduce(addr, numel, dtype, op, chunk_bytes, one_shot_max, seq) -> Op: reduce in place; seq (the "
     "collective's number) goes into the fingerprint that every rank checks."},
    {"all_reduce_across", (PyCFunction)Segment_all_reduce_across, METH_VARARGS,
     "all_reduce_across(addr, numel, dtype, op, chunk_bytes, world, seq) -> Op: the hierarchical plane's "
     "all-reduce; it pauses (Op.exchange) for each part's exchange between hosts."},
    {"reduce_scatter", (PyCFunction)Segment_reduce_scatter, METH_VARARGS,
     "reduce_scatter(out_addr, in_addr, m, dtype, op, chunk_bytes, seq) -> Op: rank r gets the reduction of "
     "every rank's slice r (m elements each)."},
    {"all_gather", (PyCFunction)Segment_all_gather, METH_VARARGS,
     "all_gather(out_addr, in_addr, nbytes, chunk_bytes, dtype, count, seq) -> Op: every rank's nbytes in "
     "rank order (dtype and count: the fingerprint's)."},
    {"broadcast", (PyCFunction)Segment_broadcast, METH_VARARGS,
     "broadcast(addr, nbytes, root, chunk_bytes, dtype, count, seq) -> Op: root's bytes into every rank's."},
    {"all_to_all", (PyCFunction)Segment_all_to_all, METH_VARARGS,
     "all_to_all(out_addr, in_addr, send_bytes, recv_bytes, chunk_bytes, dtype, seq) -> Op: send_bytes[r] bytes "
     "(consecutive in the input, rank order) to rank r; recv_bytes[r] from rank r into the output."},
    {"barrier", (PyCFunction)Segment_barrier, METH_O, "barrier(seq) -> Op."},
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
    COUNTER(single_copy_ops, "All-reduces run through the peers' buffers (cross-memory attach)."),
    {"single_copy_min", T_PYSSIZET, offsetof(Segment, single_copy_min), 0,
     "All-reduces of at least this many bytes (above the one-step limit) read and write the peers' "
     "buffers directly; 0: none (every rank of the segment must set the same)."},
    {"rank", T_INT, offsetof(Segment, rank), READONLY, "This rank in the segment."},
    {"size", T_INT, offsetof(Segment, size), READONLY, "Ranks sharing the segment."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "smddp.comm.planes._shm_native.Segment",
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

static PyMethodDef module_methods[] = {
    {"probe_word", probe_word, METH_NOARGS,
     "probe_word() -> (address, token): this process's probe cell, which host-mates read with probe()."},
    {"probe", probe, METH_VARARGS,
     "probe(pid, address, token) -> int: 0 if this process may read and write process pid's memory "
     "(its probe cell at address holds token), else the errno that refused it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shm_native",
    "The shared-memory plane's compiled core (see smddp.comm.planes.shm).", -1, module_methods,
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
    Mismatch = PyErr_NewExceptionWithDoc(
        "smddp.comm.planes._shm_native.Mismatch",
        "The ranks' fingerprints of one operation differ; args[0]: (count, signature) of every rank.", NULL, NULL);
    if (Mismatch == NULL || PyModule_AddObjectRef(m, "Mismatch", Mismatch) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "HAVE_FLOAT16", 1); /* float16 by integer conversions: everywhere */
    PyModule_AddIntConstant(m, "MAX_RANKS", MAX_RANKS);
    PyModule_AddIntConstant(m, "HAVE_CMA", HAVE_CMA);
    init_probe_cell();
    return m;
}
