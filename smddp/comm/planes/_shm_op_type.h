/* The shared-memory core's Op type as Python sees it: advance, resume, the mismatch it raises.
 * Included by _shm_native.c, after _shm_ops.h. */
#ifndef SMDDP_SHM_OP_TYPE_H
#define SMDDP_SHM_OP_TYPE_H

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
        if (o->check) {
            o->check = 0;
            if (!fingerprints_match(o)) {
                /* Every rank sees the same fingerprints and stops here, after the same steps and
                 * publishes: the segment stays in step for the operations after this one. */
                o->done = 1;
                raise_mismatch(o);
                return NULL;
            }
        }
        switch (run(o)) {
        case -1:
            return NULL;
        case 0:
            break;
        default:
            o->done = 1;
        }
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
    PyMem_Free(o->parts);
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
    .tp_name = "smddp.comm.planes._shm_native.Op",
    .tp_basicsize = sizeof(Op),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One shared-memory collective in flight.",
    .tp_dealloc = (destructor)Op_dealloc,
    .tp_methods = Op_methods,
    .tp_getset = Op_getset,
};

#endif
