/*
 * hicache_existence.accounting._ghosts: the byte-table scatter and gather behind
 * hicache_existence.accounting.ghosts.FingerprintGhosts (miss reasons).
 *
 * Why it exists: every page the LRU evicts leaves a one-byte trace, so the
 * trace write runs on the eviction path of every steady-state add.  The pure
 * Python batch path (bytes.fromhex, extended slices, map(setitem)) costs ~45 ns
 * a page, a third of a compiled-index add; this loop costs a few ns.
 *
 * The layout is FingerprintGhosts's, bit for bit: a key's 32-bit word is its
 * first 8 hex digits; with p = word * len(table), slot index = p >> 32 (always
 * below len) and the slot byte is (word & 0xFC) | reason.  Only
 * batches whose every key is 64 characters starting with 8 hex digits are
 * handled (as the Python batch path); otherwise nothing is written (remember
 * returns False, classify None) and the caller takes its per-key path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define KEY_LEN 64
#define FP_MASK 0xFCu
#define PREFETCH_AHEAD 16
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_W(p) __builtin_prefetch((p), 1, 1)
#define PREFETCH_R(p) __builtin_prefetch((p), 0, 1)
#else
#define PREFETCH_W(p) ((void)(p))
#define PREFETCH_R(p) ((void)(p))
#endif

static int
hex_value(Py_UCS4 c)
{
    if (c >= '0' && c <= '9') {
        return (int)(c - '0');
    }
    if (c >= 'a' && c <= 'f') {
        return (int)(c - 'a' + 10);
    }
    if (c >= 'A' && c <= 'F') {
        return (int)(c - 'A' + 10);
    }
    return -1;
}

/* The key's 32-bit word, or -1 when the key is not batchable. */
static int64_t
key_word(PyObject *key)
{
    if (!PyUnicode_Check(key)) {
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(key) < 0) {
        PyErr_Clear();
        return -1;
    }
#endif
    if (PyUnicode_GET_LENGTH(key) != KEY_LEN) {
        return -1;
    }
    int kind = PyUnicode_KIND(key);
    const void *data = PyUnicode_DATA(key);
    uint32_t word = 0;
    for (Py_ssize_t i = 0; i < 8; i++) {
        int v = hex_value(PyUnicode_READ(kind, data, i));
        if (v < 0) {
            return -1;
        }
        word = (word << 4) | (uint32_t)v;
    }
    return (int64_t)word;
}

/* At most 2**24 slots: each slot then spans at least 256 words, so the
 * fingerprint (the word's low byte) stays independent of the index. */
#define MAX_TABLE ((Py_ssize_t)1 << 24)

typedef struct {
    Py_buffer table;
} Layout;

static int
parse_layout(PyObject *table, int writable, Layout *out)
{
    if (PyObject_GetBuffer(table, &out->table, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (out->table.len < 1 || out->table.len > MAX_TABLE) {
        PyBuffer_Release(&out->table);
        PyErr_SetString(PyExc_ValueError, "the table must hold 1 to 2**24 slots");
        return -1;
    }
    return 0;
}

static void
release_layout(Layout *l)
{
    PyBuffer_Release(&l->table);
}

/* The word scaled to the table (multiply-shift over all 32 bits): the index is the
 * product's high 32 bits, so every slot gets floor or ceil of 2**32 / len words and
 * departures spread evenly (a trace survives n of them with probability about
 * exp(-n / len)); the fingerprint is the word's low byte (its top 6 bits).  (A top byte scaled to `top` values, or 24 bits scaled
 * to a table near 2**24 slots, gave some slots twice the traffic of others.) */
static inline Py_ssize_t
slot_index(const Layout *l, uint32_t word)
{
    return (Py_ssize_t)(((uint64_t)word * (uint64_t)l->table.len) >> 32);
}

static inline uint32_t
slot_fp(uint32_t word)
{
    return word & FP_MASK;
}

/* Words of every key into `words`; 0 if some key is not batchable. */
static int
batch_words(PyObject *seq, uint32_t **words, Py_ssize_t *n)
{
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    *n = PySequence_Fast_GET_SIZE(seq);
    *words = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(uint32_t));
    if (*words == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        int64_t w = key_word(items[i]);
        if (w < 0) {
            PyMem_Free(*words);
            *words = NULL;
            return 0;
        }
        (*words)[i] = (uint32_t)w;
    }
    return 1;
}

/* Shared argument handling: the layout, and the words of a batchable `keys`.
 * Returns -1 on error, 0 when the batch is not batchable (nothing held), 1 with
 * `l` and `*words` held (release with finish()). */
static int
prepare(PyObject *table, PyObject *keys, int writable, Layout *l, uint32_t **words,
        Py_ssize_t *n)
{
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        return 0;
    }
    if (parse_layout(table, writable, l) < 0) {
        return -1;
    }
    int ok = batch_words(keys, words, n);
    if (ok <= 0) {
        release_layout(l);
    }
    return ok;
}

static void
finish(Layout *l, uint32_t *words)
{
    PyMem_Free(words);
    release_layout(l);
}

PyDoc_STRVAR(remember_doc,
"remember(table, keys, reason, /) -> bool\n\n"
"Write fingerprint | reason into every key's slot, in order (later wins).\n"
"Returns False, writing nothing, when some key is not 64 characters starting\n"
"with 8 hex digits.");

static PyObject *
ghosts_remember(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "remember() takes 3 positional arguments");
        return NULL;
    }
    long reason = PyLong_AsLong(args[2]);
    if (reason == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (reason < 1 || reason > 3) {
        PyErr_SetString(PyExc_ValueError, "reason must be 1, 2 or 3");
        return NULL;
    }
    Layout l;
    uint32_t *words;
    Py_ssize_t n;
    int ok = prepare(args[0], args[1], 1, &l, &words, &n);
    if (ok <= 0) {
        return ok < 0 ? NULL : Py_NewRef(Py_False);
    }
    unsigned char *table = l.table.buf;
    /* The slots are random lines of a table larger than the CPU caches:
     * prefetch for writing a few iterations ahead so the misses overlap. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            PREFETCH_W(table + slot_index(&l, words[i + PREFETCH_AHEAD]));
        }
        table[slot_index(&l, words[i])] = (unsigned char)(slot_fp(words[i]) | (uint32_t)reason);
    }
    finish(&l, words);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(classify_doc,
"classify(table, keys, /) -> bytes | None\n\n"
"One byte per key: the reason (1..3) its slot holds when the fingerprint\n"
"matches, else 0 (cold).  None when some key is not batchable.");

static PyObject *
ghosts_classify(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "classify() takes 2 positional arguments");
        return NULL;
    }
    Layout l;
    uint32_t *words;
    Py_ssize_t n;
    int ok = prepare(args[0], args[1], 0, &l, &words, &n);
    if (ok <= 0) {
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        const unsigned char *table = l.table.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + PREFETCH_AHEAD < n) {
                PREFETCH_R(table + slot_index(&l, words[i + PREFETCH_AHEAD]));
            }
            unsigned char s = table[slot_index(&l, words[i])];
            dst[i] = (s && ((s ^ slot_fp(words[i])) & FP_MASK) == 0) ? (unsigned char)(s & 3) : 0;
        }
    }
    finish(&l, words);
    return out;
}

static PyMethodDef ghosts_methods[] = {
    {"remember", (PyCFunction)(void (*)(void))ghosts_remember, METH_FASTCALL, remember_doc},
    {"classify", (PyCFunction)(void (*)(void))ghosts_classify, METH_FASTCALL, classify_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ghosts_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hicache_existence.accounting._ghosts",
    .m_doc = "Compiled trace scatter/gather for the miss-reason memory (optional accelerator).",
    .m_size = -1,
    .m_methods = ghosts_methods,
};

PyMODINIT_FUNC
PyInit__ghosts(void)
{
    return PyModule_Create(&ghosts_module);
}
