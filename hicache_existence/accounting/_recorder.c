/*
 * hicache_existence.accounting._recorder: the trace recorder's page test, compiled.
 *
 * Why it exists: the recorder (hicache_existence.accounting.recorder) decides on
 * the scheduler thread, for every page of every cache operation, whether the
 * page is recorded: page < bound as Python compares str (the bound is the
 * sampling rate as 8 hex digits, so for SGLang's 64-hex page hashes this is a
 * test of the hash's first 32 bits).  A Python loop costs 30-100 ns a page,
 * more than the cache operation itself; this loop costs a few ns.
 *
 * Tap (below) is the recorder's observer in the cache's Tee: an operation with
 * no recorded page costs one C call and never enters Python.
 *
 * below(keys, bound) is exactly [i for i, k in enumerate(keys) if k < bound]:
 * exact ASCII strings against an ASCII bound are compared byte by byte then by
 * length, as CPython's own str comparison does; anything else (other kinds, str
 * subclasses) goes through PyObject_RichCompareBool (a non-str key raises
 * TypeError, as the comprehension would).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

PyDoc_STRVAR(below_doc,
"below(keys, bound, /) -> list[int]\n\n"
"Indices of the keys (a list or tuple) that compare below the str bound, in order.");

static PyObject *
below_impl(PyObject *keys, PyObject *bound)
{
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list or a tuple");
        return NULL;
    }
    if (!PyUnicode_Check(bound)) {
        PyErr_SetString(PyExc_TypeError, "bound must be a str");
        return NULL;
    }
    int bound_fast = PyUnicode_IS_COMPACT_ASCII(bound);
    const char *bdata = bound_fast ? (const char *)PyUnicode_DATA(bound) : NULL;
    Py_ssize_t blen = PyUnicode_GET_LENGTH(bound);
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    const unsigned char *bd = (const unsigned char *)bdata;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *key = items[i];
        int lt;
        if (bound_fast && PyUnicode_CheckExact(key) && PyUnicode_IS_COMPACT_ASCII(key)) {
            /* The common case, a 64-hex page hash against an 8-digit bound: the
             * first character almost always decides. */
            const unsigned char *kd = (const unsigned char *)PyUnicode_DATA(key);
            Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
            if (klen && blen && kd[0] != bd[0]) {
                lt = kd[0] < bd[0];
            }
            else {
                Py_ssize_t n = klen < blen ? klen : blen;
                int c = memcmp(kd, bd, (size_t)n);
                lt = c < 0 || (c == 0 && klen < blen);
            }
        }
        else {
            /* Anything else compares as Python does; a str subclass's __lt__ may
             * run Python code that changes the list: re-read it afterwards. */
            Py_INCREF(key);
            lt = PyObject_RichCompareBool(key, bound, Py_LT);
            Py_DECREF(key);
            if (lt < 0) {
                Py_DECREF(out);
                return NULL;
            }
            size = PySequence_Fast_GET_SIZE(keys);
            items = PySequence_Fast_ITEMS(keys);
        }
        if (lt) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(out, index) < 0) {
                Py_XDECREF(index);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(index);
            /* PyList_Append may run the garbage collector, and with it Python code. */
            size = PySequence_Fast_GET_SIZE(keys);
            items = PySequence_Fast_ITEMS(keys);
        }
    }
    return out;
}

static PyObject *
recorder_below(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "below() takes 2 positional arguments");
        return NULL;
    }
    return below_impl(args[0], args[1]);
}

/*
 * Tap: the recorder's BeliefObserver as the cache's Tee calls it, once per
 * operation, without entering Python.  An operation none of whose pages is
 * recorded returns after the page test; otherwise one record
 *     (clock(), kind, pool, recorded pages (tuple), their indices (list; None:
 *      every page), extra (lookup: stop; invalidate: keep_pages), request)
 * is appended to the queue (a collections.deque), unless it already holds
 * `capacity` records: then the record is dropped and counted.  Nothing raises
 * into the cache: a failure (the clock, the append) is counted in `errors`.
 */
typedef struct {
    PyObject_HEAD
    PyObject *bound; /* str, or Py_None: every page */
    PyObject *queue;
    PyObject *append;
    PyObject *clock;
    Py_ssize_t capacity;
    Py_ssize_t request;
    Py_ssize_t dropped;
    Py_ssize_t errors;
} TapObject;

static PyObject *K_LOOKUP, *K_ADD, *K_INVALIDATE, *K_CLEAR, *EMPTY;

static void
Tap_dealloc(TapObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->bound);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->append);
    Py_CLEAR(self->clock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Tap_traverse(TapObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->bound);
    Py_VISIT(self->queue);
    Py_VISIT(self->append);
    Py_VISIT(self->clock);
    return 0;
}

static int
Tap_clear(TapObject *self)
{
    Py_CLEAR(self->bound);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->append);
    Py_CLEAR(self->clock);
    return 0;
}

static int
Tap_init(TapObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *bound, *queue, *clock;
    Py_ssize_t capacity;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Tap() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOnO:Tap", &bound, &queue, &capacity, &clock)) {
        return -1;
    }
    if (bound != Py_None && !PyUnicode_Check(bound)) {
        PyErr_SetString(PyExc_TypeError, "bound must be a str or None");
        return -1;
    }
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be >= 1");
        return -1;
    }
    if (!PyCallable_Check(clock)) {
        PyErr_SetString(PyExc_TypeError, "clock must be callable");
        return -1;
    }
    PyObject *append = PyObject_GetAttrString(queue, "append");
    if (append == NULL) {
        PyErr_SetString(PyExc_TypeError, "queue must have an append method");
        return -1;
    }
    Py_INCREF(bound);
    Py_XSETREF(self->bound, bound);
    Py_INCREF(queue);
    Py_XSETREF(self->queue, queue);
    Py_XSETREF(self->append, append);
    Py_INCREF(clock);
    Py_XSETREF(self->clock, clock);
    self->capacity = capacity;
    return 0;
}

/* Queue one record; every reference passed is borrowed.  Never fails. */
static void
tap_put(TapObject *self, PyObject *kind, PyObject *pool, PyObject *pages, PyObject *idx,
        PyObject *extra)
{
    Py_ssize_t n = PyObject_Size(self->queue);
    if (n < 0) {
        PyErr_Clear();
        self->errors++;
        return;
    }
    if (n >= self->capacity) {
        self->dropped++;
        return;
    }
    PyObject *t = PyObject_CallNoArgs(self->clock);
    PyObject *req = t != NULL ? PyLong_FromSsize_t(self->request) : NULL;
    PyObject *rec = req != NULL ? PyTuple_Pack(7, t, kind, pool, pages, idx, extra, req) : NULL;
    PyObject *res = rec != NULL ? PyObject_CallOneArg(self->append, rec) : NULL;
    if (res == NULL) {
        PyErr_Clear();
        self->errors++;
    }
    Py_XDECREF(res);
    Py_XDECREF(rec);
    Py_XDECREF(req);
    Py_XDECREF(t);
}

static PyObject *
tap_offer(TapObject *self, PyObject *kind, PyObject *pool, PyObject *hashes, PyObject *extra)
{
    if (self->queue == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *pages = NULL;
    PyObject *idx = NULL;
    PyObject *seq = NULL;
    if (self->bound == Py_None) {
        pages = PySequence_Tuple(hashes);
        idx = Py_NewRef(Py_None);
    }
    else {
        idx = below_impl(hashes, self->bound);
        if (idx == NULL) { /* not a list or tuple: test its tuple */
            PyErr_Clear();
            seq = PySequence_Tuple(hashes);
            idx = seq != NULL ? below_impl(seq, self->bound) : NULL;
            hashes = seq;
        }
        if (idx != NULL) {
            Py_ssize_t m = PyList_GET_SIZE(idx);
            if (m == 0) {
                Py_DECREF(idx);
                Py_XDECREF(seq);
                Py_RETURN_NONE;
            }
            pages = PyTuple_New(m);
            if (pages != NULL) {
                for (Py_ssize_t j = 0; j < m; j++) {
                    Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(idx, j));
                    PyObject *item = PySequence_Fast_GET_ITEM(hashes, i);
                    PyTuple_SET_ITEM(pages, j, Py_NewRef(item));
                }
            }
        }
    }
    if (pages == NULL || idx == NULL) {
        PyErr_Clear();
        self->errors++;
    }
    else {
        tap_put(self, kind, pool, pages, idx, extra);
    }
    Py_XDECREF(pages);
    Py_XDECREF(idx);
    Py_XDECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Tap_touched(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "touched() takes 3 positional arguments");
        return NULL;
    }
    return tap_offer(self, K_LOOKUP, args[0], args[1], args[2]);
}

static PyObject *
Tap_added(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "added() takes 2 positional arguments");
        return NULL;
    }
    return tap_offer(self, K_ADD, args[0], args[1], Py_None);
}

static PyObject *
Tap_invalidated(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "invalidated() takes 3 positional arguments");
        return NULL;
    }
    return tap_offer(self, K_INVALIDATE, args[0], args[1], args[2]);
}

static PyObject *
Tap_inflight(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_RETURN_NONE; /* in-flight refs are not part of the recorded stream */
}

static PyObject *
Tap_cleared(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "cleared() takes 2 positional arguments");
        return NULL;
    }
    int only = PyObject_IsTrue(args[1]);
    if (only < 0) {
        PyErr_Clear();
        self->errors++;
    }
    else if (only == 0 && self->queue != NULL) {
        tap_put(self, K_CLEAR, args[0], EMPTY, Py_None, Py_None);
    }
    Py_RETURN_NONE;
}

static PyObject *
Tap_get_request(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->request);
}

static int
Tap_set_request(TapObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "request cannot be deleted");
        return -1;
    }
    Py_ssize_t v = PyLong_AsSsize_t(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "request must be >= 0");
        return -1;
    }
    self->request = v;
    return 0;
}

static PyObject *
Tap_get_dropped(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->dropped);
}

static PyObject *
Tap_get_errors(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->errors);
}

static PyMethodDef Tap_methods[] = {
    {"touched", (PyCFunction)(void (*)(void))Tap_touched, METH_FASTCALL, "A lookup (BeliefObserver)."},
    {"added", (PyCFunction)(void (*)(void))Tap_added, METH_FASTCALL, "An add (BeliefObserver)."},
    {"invalidated", (PyCFunction)(void (*)(void))Tap_invalidated, METH_FASTCALL,
     "An invalidate_beyond (BeliefObserver)."},
    {"inflight", (PyCFunction)(void (*)(void))Tap_inflight, METH_FASTCALL,
     "In-flight refs: not recorded (BeliefObserver)."},
    {"cleared", (PyCFunction)(void (*)(void))Tap_cleared, METH_FASTCALL, "A clear (BeliefObserver)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tap_getset[] = {
    {"request", (getter)Tap_get_request, (setter)Tap_set_request,
     "The request whose insert is running (0: none); lookups carry it.", NULL},
    {"dropped", (getter)Tap_get_dropped, NULL, "Records dropped: the queue was full.", NULL},
    {"errors", (getter)Tap_get_errors, NULL, "Records lost to a failure (swallowed).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.accounting._recorder.Tap",
    .tp_basicsize = sizeof(TapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Tap(bound, queue, capacity, clock): the recorder's observer (module comment).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tap_init,
    .tp_dealloc = (destructor)Tap_dealloc,
    .tp_traverse = (traverseproc)Tap_traverse,
    .tp_clear = (inquiry)Tap_clear,
    .tp_methods = Tap_methods,
    .tp_getset = Tap_getset,
};

static PyMethodDef recorder_methods[] = {
    {"below", (PyCFunction)(void (*)(void))recorder_below, METH_FASTCALL, below_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef recorder_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hicache_existence.accounting._recorder",
    .m_doc = "Compiled page test of the trace recorder (optional accelerator).",
    .m_size = -1,
    .m_methods = recorder_methods,
};

PyMODINIT_FUNC
PyInit__recorder(void)
{
    if (PyType_Ready(&TapType) < 0) {
        return NULL;
    }
    K_LOOKUP = PyUnicode_InternFromString("lookup");
    K_ADD = PyUnicode_InternFromString("add");
    K_INVALIDATE = PyUnicode_InternFromString("invalidate");
    K_CLEAR = PyUnicode_InternFromString("clear");
    EMPTY = PyTuple_New(0);
    if (K_LOOKUP == NULL || K_ADD == NULL || K_INVALIDATE == NULL || K_CLEAR == NULL
        || EMPTY == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&recorder_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&TapType);
    if (PyModule_AddObject(m, "Tap", (PyObject *)&TapType) < 0) {
        Py_DECREF(&TapType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
