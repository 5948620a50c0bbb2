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
recorder_below(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "below() takes 2 positional arguments");
        return NULL;
    }
    PyObject *keys = args[0];
    PyObject *bound = args[1];
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
    return PyModule_Create(&recorder_module);
}
