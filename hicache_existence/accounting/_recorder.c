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
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

PyDoc_STRVAR(below_doc,
"below(keys, bound, /) -> list[int]\n\n"
"Indices of the keys (a list or tuple) that compare below the str bound, in order.");

/* key < bound for an exact compact ASCII key and an ASCII bound, as CPython compares
 * str: byte by byte, then by length.  For a 64-hex page hash against an 8-digit bound
 * the first character almost always decides. */
static inline int
ascii_lt(PyObject *key, const unsigned char *bd, Py_ssize_t blen)
{
    const unsigned char *kd = (const unsigned char *)PyUnicode_DATA(key);
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    if (klen && blen && kd[0] != bd[0]) {
        return kd[0] < bd[0];
    }
    Py_ssize_t n = klen < blen ? klen : blen;
    int c = memcmp(kd, bd, (size_t)n);
    return c < 0 || (c == 0 && klen < blen);
}

static inline int
is_fast_key(PyObject *key)
{
    return PyUnicode_CheckExact(key) && PyUnicode_IS_COMPACT_ASCII(key);
}

/* Indices of keys[start:] below bound (the keys before start are known not to be). */
static PyObject *
below_impl(PyObject *keys, PyObject *bound, Py_ssize_t start)
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
    const unsigned char *bd = bound_fast ? (const unsigned char *)PyUnicode_DATA(bound) : NULL;
    Py_ssize_t blen = PyUnicode_GET_LENGTH(bound);
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = start; i < size; i++) {
        PyObject *key = items[i];
        int lt;
        if (bound_fast && is_fast_key(key)) {
            lt = ascii_lt(key, bd, blen);
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

/* How many keys of an exact list or tuple of exact ASCII strs are below an ASCII bound,
 * without allocating, and the first one's index in *first; CANNOT_TELL (no error set:
 * another sequence, another kind of key anywhere in it) when the caller must test them
 * as Python compares (below_impl).  Every key is looked at: a key the C test cannot take
 * after the first one below must not be skipped. */
#define CANNOT_TELL (-1)
static Py_ssize_t
count_below(PyObject *keys, PyObject *bound, Py_ssize_t *first)
{
    if ((!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) || !PyUnicode_Check(bound)
        || !PyUnicode_IS_COMPACT_ASCII(bound)) {
        return CANNOT_TELL;
    }
    const unsigned char *bd = (const unsigned char *)PyUnicode_DATA(bound);
    Py_ssize_t blen = PyUnicode_GET_LENGTH(bound);
    Py_ssize_t size = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t count = 0;
    *first = size;
    for (Py_ssize_t i = 0; i < size; i++) {
        if (!is_fast_key(items[i])) {
            return CANNOT_TELL;
        }
        if (ascii_lt(items[i], bd, blen) && count++ == 0) {
            *first = i;
        }
    }
    return count;
}

static PyObject *
recorder_below(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "below() takes 2 positional arguments");
        return NULL;
    }
    return below_impl(args[0], args[1], 0);
}

/*
 * Tap: the recorder's BeliefObserver as the cache's Tee calls it, once per
 * operation, without entering Python.  An operation none of whose pages is
 * recorded returns after the page test; otherwise one record is kept, in C, and a
 * request's end (Bracket, Tap.ended) is one more, in the order they happen, until
 * the writer takes them (take()) as the tuples
 *     (time, kind, pool, recorded pages (tuple), their indices (list; None: every
 *      page), extra (lookup: stop; invalidate: keep_pages; prefetch: hit), request)
 *     (time, "request", "", (), None, number, 0)             a request's end
 * At `capacity` records waiting, a record is dropped and counted.  Nothing raises
 * into the cache: a failure (the clock, memory) is counted in `errors`.
 *
 * Why records are C structs, not queued tuples: in the server's cold state the
 * tuples, list, float and ints a record made cost 1.5-3 us of the scheduler's time
 * (allocator pages and a deque block to fetch); a struct and borrowed-then-owned
 * pointers cost a few cache lines.  The writer makes the tuples, on its own thread.
 *
 * Two logs: the scheduler's calls append to `log`; take() drains `out`, and swaps
 * the two when `out` is empty.  Making the tuples may run Python code (a
 * collection's callbacks), which may append records: they go to `log`, whose arrays
 * take() never holds.
 */
typedef struct {
    double t;
    PyObject *kind;       /* borrowed: one of the module's interned kinds */
    PyObject *pool;       /* owned; NULL: an end's (or taken) */
    PyObject *extra;      /* owned; NULL: None, or `hit` when has_hit */
    Py_ssize_t hit;       /* a prefetch's recorded pages among those held */
    Py_ssize_t request;   /* the request whose insert ran (an end: its number) */
    Py_ssize_t first, n;  /* its pages: pages[first:first + n] */
    char has_hit, indexed, end;
} TapRecord;

typedef struct {
    PyObject *page; /* owned; NULL once taken */
    Py_ssize_t index;
} TapPage;

typedef struct {
    TapRecord *records;
    Py_ssize_t head, len, cap; /* records[head:len] wait (take() advances head) */
    TapPage *pages;
    Py_ssize_t npages, pages_cap;
} TapLog;

typedef struct {
    PyObject_HEAD
    PyObject *bound; /* str, or Py_None: every page */
    PyObject *clock; /* NULL once cleared: the tap then records nothing */
    Py_ssize_t capacity;
    Py_ssize_t request;
    Py_ssize_t numbered; /* the last request number given (Recorder.begin_request, Bracket) */
    Py_ssize_t dropped;
    Py_ssize_t errors;
    TapLog log; /* what the scheduler's calls append to */
    TapLog out; /* what take() drains */
    int taking; /* a take() runs: a nested one (a collection's callback) takes nothing */
    int monotonic; /* clock is time.monotonic: read CLOCK_MONOTONIC directly */
} TapObject;

static PyObject *K_LOOKUP, *K_ADD, *K_INVALIDATE, *K_CLEAR, *K_WRITE, *K_PREFETCH, *K_REQUEST;
static PyObject *EMPTY, *EMPTY_STR, *ZERO, *MONOTONIC;

/* Drop a log's references (those not taken) and empty it; its arrays are kept. */
static void
log_empty(TapLog *log)
{
    Py_ssize_t len = log->len, npages = log->npages;
    TapRecord *records = log->records;
    TapPage *pages = log->pages;
    log->head = log->len = log->npages = 0; /* first: a DECREF below may run Python code */
    for (Py_ssize_t i = 0; i < len; i++) {
        Py_XDECREF(records[i].pool);
        Py_XDECREF(records[i].extra);
    }
    for (Py_ssize_t i = 0; i < npages; i++) {
        Py_XDECREF(pages[i].page);
    }
}

static void
log_free(TapLog *log)
{
    TapLog gone = *log;
    memset(log, 0, sizeof(*log));
    log_empty(&gone);
    PyMem_Free(gone.records);
    PyMem_Free(gone.pages);
}

/* Room in `log` for one more record and `pages` more pages: 0, or -1 (no memory;
 * the log unchanged).  Runs no Python code. */
static int
log_reserve(TapLog *log, Py_ssize_t pages)
{
    if (log->len == log->cap) {
        Py_ssize_t cap = log->cap ? log->cap * 2 : 64;
        if (cap > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(TapRecord)) {
            return -1;
        }
        TapRecord *r = PyMem_Realloc(log->records, (size_t)cap * sizeof(TapRecord));
        if (r == NULL) {
            return -1;
        }
        log->records = r;
        log->cap = cap;
    }
    if (pages > log->pages_cap - log->npages) {
        Py_ssize_t cap = log->pages_cap ? log->pages_cap : 256;
        while (cap - log->npages < pages) {
            if (cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(TapPage)) {
                return -1;
            }
            cap *= 2;
        }
        TapPage *p = PyMem_Realloc(log->pages, (size_t)cap * sizeof(TapPage));
        if (p == NULL) {
            return -1;
        }
        log->pages = p;
        log->pages_cap = cap;
    }
    return 0;
}

static void
Tap_dealloc(TapObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->bound);
    Py_CLEAR(self->clock);
    log_free(&self->log);
    log_free(&self->out);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A log's references: page hashes, pools and ints from the cache, but a caller may pass
 * anything (a cycle through a record must be collectable). */
static int
log_traverse(TapLog *log, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < log->len; i++) {
        Py_VISIT(log->records[i].pool);
        Py_VISIT(log->records[i].extra);
    }
    for (Py_ssize_t i = 0; i < log->npages; i++) {
        Py_VISIT(log->pages[i].page);
    }
    return 0;
}

static int
Tap_traverse(TapObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->bound);
    Py_VISIT(self->clock);
    int rc = log_traverse(&self->log, visit, arg);
    return rc ? rc : log_traverse(&self->out, visit, arg);
}

static int
Tap_clear(TapObject *self)
{
    Py_CLEAR(self->bound);
    Py_CLEAR(self->clock);
    log_free(&self->log);
    log_free(&self->out);
    return 0;
}

static int
Tap_init(TapObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *bound, *clock;
    Py_ssize_t capacity;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Tap() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OnO:Tap", &bound, &capacity, &clock)) {
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
    if (self->clock != NULL) {
        PyErr_SetString(PyExc_TypeError, "Tap is already initialized");
        return -1;
    }
    self->monotonic = clock == MONOTONIC; /* (not a time.monotonic patched since) */
    self->bound = Py_NewRef(bound);
    self->clock = Py_NewRef(clock);
    self->capacity = capacity;
    return 0;
}

/* The tap's clock as a double: CLOCK_MONOTONIC read as time.monotonic converts it when the
 * clock is time.monotonic (no call), else the clock called.  -1 on a failure (cleared). */
static int
tap_now(TapObject *self, double *t)
{
    if (self->monotonic) {
        struct timespec ts;
        if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
            *t = (double)((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
            return 0;
        }
    }
    PyObject *o = PyObject_CallNoArgs(self->clock);
    *t = o != NULL ? PyFloat_AsDouble(o) : -1.0;
    Py_XDECREF(o);
    if (*t == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* A new record at time t with room for `pages` pages (the caller appends them), or
 * NULL: dropped at capacity or no memory (counted).  Runs no Python code. */
static TapRecord *
tap_record(TapObject *self, double t, PyObject *kind, PyObject *pool, Py_ssize_t request,
           Py_ssize_t pages)
{
    TapLog *log = &self->log;
    if (log->len + (self->out.len - self->out.head) >= self->capacity) {
        self->dropped++;
        return NULL;
    }
    if (log_reserve(log, pages) < 0) {
        self->errors++;
        return NULL;
    }
    TapRecord *r = &log->records[log->len++];
    memset(r, 0, sizeof(*r));
    r->t = t;
    r->kind = kind;
    r->pool = Py_XNewRef(pool);
    r->request = request;
    r->first = log->npages;
    return r;
}

/* Note request `number`'s end (Bracket, Tap.ended).  Never fails.  The time is read
 * first: a clock that is Python code may note other records. */
static void
tap_end(TapObject *self, Py_ssize_t number)
{
    double t;
    if (self->clock == NULL) {
        return;
    }
    if (tap_now(self, &t) < 0) {
        self->errors++;
        return;
    }
    TapRecord *r = tap_record(self, t, K_REQUEST, NULL, number, 0);
    if (r != NULL) {
        r->end = 1;
    }
}

/* Which pages of an operation's hashes are recorded: the sequence (a list or tuple,
 * owned), how many (`count`), and either the first one's index (`idx` NULL: the C test
 * from there) or their indices (`idx`, an owned list). */
typedef struct {
    PyObject *seq;
    PyObject *idx;
    Py_ssize_t first, count;
} Selection;

/* 1: `count` pages are recorded (maybe 0 with bound None; sel's references owned), 0:
 * none (nothing allocated: most operations), -1: a failure (cleared, counted).
 * The C test runs on an exact list or tuple of exact ASCII strs, and only with the
 * direct clock, so that no Python code runs between the test and the store; anything
 * else is copied to a tuple and tested as Python compares, before the clock is read
 * (what PyTap does): a clock or a comparison that is Python code cannot change it. */
static int
tap_select(TapObject *self, PyObject *hashes, Selection *sel)
{
    sel->seq = sel->idx = NULL;
    sel->first = sel->count = 0;
    if (self->clock == NULL) {
        return 0;
    }
    if (self->monotonic && (PyList_CheckExact(hashes) || PyTuple_CheckExact(hashes))) {
        if (self->bound == Py_None) {
            sel->seq = Py_NewRef(hashes);
            sel->count = PySequence_Fast_GET_SIZE(hashes);
            return 1;
        }
        Py_ssize_t count = count_below(hashes, self->bound, &sel->first);
        if (count == 0) {
            return 0;
        }
        if (count != CANNOT_TELL) {
            sel->seq = Py_NewRef(hashes);
            sel->count = count;
            return 1;
        }
    }
    sel->seq = PySequence_Tuple(hashes);
    if (sel->seq != NULL && self->bound != Py_None) {
        sel->idx = below_impl(sel->seq, self->bound, 0);
        if (sel->idx == NULL) {
            Py_CLEAR(sel->seq);
        }
    }
    if (sel->seq == NULL) {
        PyErr_Clear();
        self->errors++;
        return -1;
    }
    sel->count = sel->idx != NULL ? PyList_GET_SIZE(sel->idx) : PyTuple_GET_SIZE(sel->seq);
    if (sel->count == 0 && self->bound != Py_None) {
        Py_CLEAR(sel->idx);
        Py_CLEAR(sel->seq);
        return 0;
    }
    return 1;
}

/* Append sel's recorded pages to record r (room reserved for sel->count): how many.
 * Fewer than sel->count only if the sequence is not as tested (it cannot be: no Python
 * code ran since; the checks keep a bug from reading past it).  Counts in *below_hit the
 * recorded pages at an index < hit.  Runs no Python code. */
static Py_ssize_t
tap_append(TapObject *self, TapRecord *r, Selection *sel, Py_ssize_t hit, Py_ssize_t *below_hit)
{
    TapLog *log = &self->log;
    TapPage *pages = log->pages + log->npages;
    Py_ssize_t m = 0, below = 0, size = PySequence_Fast_GET_SIZE(sel->seq);
    PyObject **items = PySequence_Fast_ITEMS(sel->seq);
    if (sel->idx != NULL) {
        for (Py_ssize_t j = 0; j < sel->count; j++) {
            Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(sel->idx, j));
            if (i < 0 || i >= size) { /* below_impl's own indices: cannot happen */
                PyErr_Clear();
                break;
            }
            pages[m].page = Py_NewRef(items[i]);
            pages[m].index = i;
            below += i < hit;
            m++;
        }
    }
    else {
        PyObject *bound = self->bound;
        int every = bound == Py_None;
        const unsigned char *bd = every ? NULL : (const unsigned char *)PyUnicode_DATA(bound);
        Py_ssize_t blen = every ? 0 : PyUnicode_GET_LENGTH(bound);
        for (Py_ssize_t i = sel->first; i < size && m < sel->count; i++) {
            PyObject *key = items[i];
            if (!every) {
                if (!is_fast_key(key)) {
                    break;
                }
                if (!ascii_lt(key, bd, blen)) {
                    continue;
                }
            }
            pages[m].page = Py_NewRef(key);
            pages[m].index = i;
            below += i < hit;
            m++;
        }
    }
    log->npages += m;
    r->n = m;
    *below_hit = below;
    return m;
}

enum { KEEP_INDICES = 1, PAGES_ONLY = 2, HIT = 4 };

/* Store sel's record at time t (see tap_offer).  Runs no Python code. */
static void
tap_store(TapObject *self, Selection *sel, double t, PyObject *kind, PyObject *pool,
          PyObject *extra, Py_ssize_t request, int mode, Py_ssize_t hit)
{
    TapRecord *r = tap_record(self, t, kind, pool, request, sel->count);
    if (r == NULL) {
        return;
    }
    Py_ssize_t below_hit;
    Py_ssize_t m = tap_append(self, r, sel, hit, &below_hit);
    if (m != sel->count) { /* unmade (the last record): see tap_append */
        TapLog *log = &self->log;
        log->npages = r->first;
        log->len--;
        for (Py_ssize_t j = 0; j < m; j++) {
            Py_DECREF(log->pages[r->first + j].page); /* the sequence holds them too */
        }
        Py_XDECREF(r->pool); /* the caller holds the pool: nothing is freed */
        self->errors++;
        return;
    }
    r->indexed = (mode & KEEP_INDICES) && self->bound != Py_None;
    if (mode & HIT) {
        r->has_hit = 1;
        r->hit = below_hit;
    }
    else if (extra != NULL && extra != Py_None) {
        r->extra = Py_NewRef(extra);
    }
}

/* One operation's record of the recorded pages of `hashes`: `extra` borrowed (NULL:
 * None), `request` the record's, `mode` what it keeps (KEEP_INDICES: the pages'
 * indices, when pages are sampled; PAGES_ONLY: no record without a recorded page;
 * HIT: the count of recorded pages at an index below `hit`, as its extra).  The time
 * is read once a page is known to be recorded, after the test (which may run Python
 * code only off the C path) and before the store (which runs none). */
static void
tap_offer(TapObject *self, PyObject *kind, PyObject *pool, PyObject *hashes, PyObject *extra,
          Py_ssize_t request, int mode, Py_ssize_t hit)
{
    Selection sel;
    if (tap_select(self, hashes, &sel) <= 0) {
        return;
    }
    double t;
    if ((sel.count == 0 && (mode & PAGES_ONLY)) || self->clock == NULL) {
        /* nothing to record (PyTap reads no clock either), or the test's Python code
         * cleared the tap */
    }
    else if (tap_now(self, &t) < 0) {
        self->errors++;
    }
    else if (self->clock != NULL) { /* (a clock that is Python code may clear the tap) */
        tap_store(self, &sel, t, kind, pool, extra, request, mode, hit);
    }
    Py_XDECREF(sel.idx);
    Py_XDECREF(sel.seq);
}

static PyObject *
Tap_touched(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "touched() takes 3 positional arguments");
        return NULL;
    }
    tap_offer(self, K_LOOKUP, args[0], args[1], args[2], self->request, KEEP_INDICES, 0);
    Py_RETURN_NONE;
}

static PyObject *
Tap_added(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "added() takes 2 positional arguments");
        return NULL;
    }
    tap_offer(self, K_ADD, args[0], args[1], NULL, self->request, KEEP_INDICES, 0);
    Py_RETURN_NONE;
}

static PyObject *
Tap_invalidated(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "invalidated() takes 3 positional arguments");
        return NULL;
    }
    tap_offer(self, K_INVALIDATE, args[0], args[1], args[2], self->request, KEEP_INDICES, 0);
    Py_RETURN_NONE;
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
        Py_RETURN_NONE;
    }
    double t;
    Py_ssize_t request = self->request; /* the request of the call, whatever the clock does */
    if (only || self->clock == NULL) {
        Py_RETURN_NONE;
    }
    if (tap_now(self, &t) < 0) {
        self->errors++;
    }
    else if (self->clock != NULL) {
        tap_record(self, t, K_CLEAR, args[0], request, 0);
    }
    Py_RETURN_NONE;
}

/* The write path's records (Recorder.written, Recorder.prefetch): (time, kind, pool,
 * recorded pages, None, extra, 0), and nothing for a chain without a recorded page.
 * Compiled because the hit-query hook that records a prefetch ran them as four Python
 * frames, cold, once a query. */
static PyObject *
Tap_written(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "written() takes 2 positional arguments");
        return NULL;
    }
    tap_offer(self, K_WRITE, args[0], args[1], NULL, 0, PAGES_ONLY, 0);
    Py_RETURN_NONE;
}

static PyObject *
Tap_prefetch(TapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "prefetch() takes 3 positional arguments");
        return NULL;
    }
    Py_ssize_t hit = PyNumber_AsSsize_t(args[2], NULL); /* clipped, as bisect would place it */
    if (hit == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        self->errors++;
        Py_RETURN_NONE;
    }
    tap_offer(self, K_PREFETCH, args[0], args[1], NULL, 0, PAGES_ONLY | HIT, hit);
    Py_RETURN_NONE;
}

static PyObject *
Tap_ended(TapObject *self, PyObject *number)
{
    Py_ssize_t n = PyNumber_AsSsize_t(number, PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    tap_end(self, n);
    Py_RETURN_NONE;
}

/* Record i of `out` as the writer's tuple, its references moved into it (NULL on no
 * memory: the record stays, for the next take). */
static PyObject *
tap_tuple(TapLog *out, Py_ssize_t i)
{
    TapRecord *r = &out->records[i];
    PyObject *t = PyFloat_FromDouble(r->t);
    if (t == NULL) {
        return NULL;
    }
    if (r->end) {
        PyObject *number = PyLong_FromSsize_t(r->request);
        PyObject *item = number != NULL ? PyTuple_Pack(7, t, K_REQUEST, EMPTY_STR, EMPTY,
                                                       Py_None, number, ZERO)
                                        : NULL;
        Py_XDECREF(number);
        Py_DECREF(t);
        return item;
    }
    /* Containers holding NULLs are untracked until filled: on 3.10/3.11 the allocations
     * after them may run a collection, whose callbacks may list every tracked object. */
    PyObject *pages = r->n ? PyTuple_New(r->n) : Py_NewRef(EMPTY);
    if (pages != NULL && r->n) {
        PyObject_GC_UnTrack(pages);
    }
    PyObject *idx = r->indexed ? PyList_New(r->n) : Py_NewRef(Py_None);
    if (idx != NULL && r->indexed) {
        PyObject_GC_UnTrack(idx);
    }
    PyObject *extra = r->has_hit ? PyLong_FromSsize_t(r->hit)
                                 : Py_NewRef(r->extra != NULL ? r->extra : Py_None);
    PyObject *request = PyLong_FromSsize_t(r->request);
    PyObject *item = NULL;
    for (Py_ssize_t j = 0; idx != NULL && r->indexed && j < r->n; j++) {
        PyObject *index = PyLong_FromSsize_t(out->pages[r->first + j].index);
        if (index == NULL) {
            Py_CLEAR(idx);
            break;
        }
        PyList_SET_ITEM(idx, j, index);
    }
    if (pages != NULL && idx != NULL && extra != NULL && request != NULL) {
        item = PyTuple_New(7);
    }
    if (item != NULL) {
        PyObject_GC_UnTrack(item);
    }
    else {
        Py_DECREF(t);
        Py_XDECREF(pages);
        Py_XDECREF(idx);
        Py_XDECREF(extra);
        Py_XDECREF(request);
        return NULL;
    }
    /* No failure from here: the record's references move into the tuple. */
    for (Py_ssize_t j = 0; j < r->n; j++) {
        TapPage *p = &out->pages[r->first + j];
        PyTuple_SET_ITEM(pages, j, p->page);
        p->page = NULL;
    }
    PyObject *pool = r->pool != NULL ? r->pool : Py_NewRef(EMPTY_STR);
    r->pool = NULL;
    Py_CLEAR(r->extra);
    PyTuple_SET_ITEM(item, 0, t);
    PyTuple_SET_ITEM(item, 1, Py_NewRef(r->kind));
    PyTuple_SET_ITEM(item, 2, pool);
    PyTuple_SET_ITEM(item, 3, pages);
    PyTuple_SET_ITEM(item, 4, idx);
    PyTuple_SET_ITEM(item, 5, extra);
    PyTuple_SET_ITEM(item, 6, request);
    if (r->n) {
        PyObject_GC_Track(pages);
    }
    if (r->indexed) {
        PyObject_GC_Track(idx);
    }
    PyObject_GC_Track(item);
    return item;
}

PyDoc_STRVAR(take_doc,
"take(limit, /) -> list[tuple]\n\n"
"At most limit records, oldest first, as the writer encodes them (the module comment).");

/* Arrays larger than this are freed, not kept, once drained: one burst (a huge chain
 * at a high rate) does not hold its memory for good. */
#define KEEP_RECORDS 16384
#define KEEP_PAGES 262144

/* Empty `out` once drained, freeing arrays past KEEP_*: so that a burst's memory goes
 * with its last take, not with the next record's. */
static void
out_release(TapObject *self)
{
    TapLog *out = &self->out;
    if (out->head == out->len) {
        log_empty(out); /* only NULLs left: runs no code */
        if (out->cap > KEEP_RECORDS || out->pages_cap > KEEP_PAGES) {
            log_free(out);
        }
    }
}

static PyObject *
Tap_take(TapObject *self, PyObject *arg)
{
    Py_ssize_t limit = PyNumber_AsSsize_t(arg, NULL); /* clipped */
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (self->taking) {
        return PyList_New(0);
    }
    Py_ssize_t waiting = self->log.len + self->out.len - self->out.head;
    Py_ssize_t want = limit < 0 ? 0 : (limit < waiting ? limit : waiting);
    self->taking = 1; /* before the list: its allocation may run a collection's callbacks */
    /* Sized now: nothing can fail after a record's references move into its tuple.
     * Records logged during the take (a collection's callbacks) wait for the next.
     * Untracked while it holds NULLs (see tap_tuple). */
    PyObject *got = PyList_New(want);
    if (got == NULL) {
        self->taking = 0;
        return NULL;
    }
    PyObject_GC_UnTrack(got);
    Py_ssize_t k = 0;
    while (k < want) {
        TapLog *out = &self->out;
        if (out->head == out->len) {
            /* `out` is drained: swap (the scheduler's calls append to the emptied
             * arrays; their records are newer than any taken). */
            out_release(self);
            if (self->log.len == 0) {
                break;
            }
            TapLog drained = *out;
            *out = self->log;
            self->log = drained;
            continue;
        }
        PyObject *item = tap_tuple(out, out->head);
        if (item == NULL) { /* no memory: the record waits for the next take */
            PyErr_Clear();
            break;
        }
        out->head++; /* its references are the tuple's now */
        PyList_SET_ITEM(got, k, item);
        k++;
    }
    out_release(self);
    self->taking = 0;
    Py_SET_SIZE(got, k); /* our own list: its items past k are NULL */
    PyObject_GC_Track(got);
    return got;
}

static PyObject *
Tap_get_request(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->request);
}

/* Set a count attribute (request, numbered): an int >= 0, never deleted. */
static int
set_count(Py_ssize_t *field, PyObject *value, const char *name)
{
    if (value == NULL) {
        PyErr_Format(PyExc_TypeError, "%s cannot be deleted", name);
        return -1;
    }
    Py_ssize_t v = PyLong_AsSsize_t(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0", name);
        return -1;
    }
    *field = v;
    return 0;
}

static int
Tap_set_request(TapObject *self, PyObject *value, void *closure)
{
    return set_count(&self->request, value, "request");
}

static PyObject *
Tap_get_numbered(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->numbered);
}

static int
Tap_set_numbered(TapObject *self, PyObject *value, void *closure)
{
    return set_count(&self->numbered, value, "numbered");
}

/*
 * Bracket: a radix tree's insert as one request of the recorder (Recorder.bracket),
 * what the tree's insert attribute becomes in a server with a recorder.  A call
 * numbers the next request, sets it as the tap's request (the lookups inside the
 * insert carry it), calls insert with the arguments as given, then, returned or
 * raised, resets the request and notes its end (a record in the tap's log, as
 * Recorder.end_request does; dropped and counted at `capacity`).  One C call per
 * insert, no Python object made: in the server the Python frames doing the same (one
 * closure) cost a few microseconds an insert, cold, and a queued record tuple about a
 * microsecond more.  Insert's own exception passes through.
 */
typedef struct {
    PyObject_HEAD
    TapObject *tap;
    PyObject *insert;
    vectorcallfunc vectorcall;
} BracketObject;

static PyObject *
Bracket_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    BracketObject *self = (BracketObject *)callable;
    TapObject *tap = self->tap;
    if (tap == NULL || self->insert == NULL) { /* cleared by a collection */
        PyErr_SetString(PyExc_TypeError, "a cleared bracket cannot be called");
        return NULL;
    }
    Py_INCREF(tap); /* held across insert, whatever it does to the bracket */
    Py_ssize_t number = tap->numbered = tap->numbered < PY_SSIZE_T_MAX ? tap->numbered + 1 : 1;
    tap->request = number;
    PyObject *res = PyObject_Vectorcall(self->insert, args, nargsf, kwnames);
    tap->request = 0;
    if (res != NULL) {
        tap_end(tap, number);
    }
    else { /* insert raised: its exception passes through (the clock may be Python code) */
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *raised = PyErr_GetRaisedException();
        tap_end(tap, number);
        PyErr_SetRaisedException(raised);
#else
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        tap_end(tap, number);
        PyErr_Restore(type, value, traceback);
#endif
    }
    Py_DECREF(tap);
    return res;
}

static PyObject *
Bracket_get_insert(BracketObject *self, void *closure)
{
    return Py_NewRef(self->insert != NULL ? self->insert : Py_None);
}

static void
Bracket_dealloc(BracketObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->tap);
    Py_CLEAR(self->insert);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Bracket_traverse(BracketObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->tap);
    Py_VISIT(self->insert);
    return 0;
}

static int
Bracket_clear(BracketObject *self)
{
    Py_CLEAR(self->tap);
    Py_CLEAR(self->insert);
    return 0;
}

static PyGetSetDef Bracket_getset[] = {
    {"hx_brackets", (getter)Bracket_get_insert, NULL, "The insert it brackets.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BracketType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.accounting._recorder.Bracket",
    .tp_basicsize = sizeof(BracketObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A tree's insert as one request of the recorder (Tap.bracket).",
    .tp_vectorcall_offset = offsetof(BracketObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)Bracket_dealloc,
    .tp_traverse = (traverseproc)Bracket_traverse,
    .tp_clear = (inquiry)Bracket_clear,
    .tp_getset = Bracket_getset,
};

static PyObject *
Tap_bracket(TapObject *self, PyObject *insert)
{
    if (!PyCallable_Check(insert)) {
        PyErr_SetString(PyExc_TypeError, "bracket: insert must be callable");
        return NULL;
    }
    BracketObject *b = PyObject_GC_New(BracketObject, &BracketType);
    if (b == NULL) {
        return NULL;
    }
    b->tap = (TapObject *)Py_NewRef(self);
    b->insert = Py_NewRef(insert);
    b->vectorcall = Bracket_vectorcall;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

static PyObject *
Tap_get_dropped(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->dropped);
}

static PyObject *
Tap_get_waiting(TapObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->log.len + self->out.len - self->out.head);
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
    {"written", (PyCFunction)(void (*)(void))Tap_written, METH_FASTCALL,
     "written(pool, pages): the write path launched an L3 write (Recorder.written)."},
    {"prefetch", (PyCFunction)(void (*)(void))Tap_prefetch, METH_FASTCALL,
     "prefetch(pool, chain, hit_pages): a prefetch hit query (Recorder.prefetch)."},
    {"ended", (PyCFunction)Tap_ended, METH_O,
     "ended(number): request number ended (what Bracket notes; Recorder.end_request)."},
    {"take", (PyCFunction)Tap_take, METH_O, take_doc},
    {"bracket", (PyCFunction)Tap_bracket, METH_O,
     "bracket(insert): insert with each call one request (Bracket)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tap_getset[] = {
    {"request", (getter)Tap_get_request, (setter)Tap_set_request,
     "The request whose insert is running (0: none); lookups carry it.", NULL},
    {"numbered", (getter)Tap_get_numbered, (setter)Tap_set_numbered,
     "The last request number given.", NULL},
    {"dropped", (getter)Tap_get_dropped, NULL, "Records dropped: capacity records waited.", NULL},
    {"waiting", (getter)Tap_get_waiting, NULL, "Records waiting for the writer (take).", NULL},
    {"errors", (getter)Tap_get_errors, NULL, "Records lost to a failure (swallowed).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.accounting._recorder.Tap",
    .tp_basicsize = sizeof(TapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Tap(bound, capacity, clock): the recorder's observer (module comment).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tap_init,
    .tp_dealloc = (destructor)Tap_dealloc,
    .tp_traverse = (traverseproc)Tap_traverse,
    .tp_clear = (inquiry)Tap_clear,
    .tp_methods = Tap_methods,
    .tp_getset = Tap_getset,
};

/*
 * encode(record, t0, /) -> str: one record as the JSON line Recorder._encode writes
 * (json.dumps of the same dict with separators (",", ":"), then "\n"), or None where
 * _encode returns None (an invalidation with no recorded page left).
 *
 * Why it exists: the writer thread encodes every record while holding the GIL, and
 * _encode's dict and json.dumps cost about 10 us a record, time the scheduler thread
 * can spend waiting for the GIL; this costs well under 1 us.  It takes the records the
 * taps and Recorder._put make (exact str pool and pages, exact ints, float times):
 * anything else (a non-ASCII pool, a str subclass, an int clock, a non-finite time)
 * raises TypeError, and the caller encodes that record with _encode instead.
 */
typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int
buf_grow(Buf *b, Py_ssize_t more)
{
    if (b->len + more <= b->cap) {
        return 0;
    }
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) {
        cap *= 2;
    }
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int
buf_put(Buf *b, const char *s, Py_ssize_t n)
{
    if (buf_grow(b, n) < 0) {
        return -1;
    }
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define BUF_LIT(b, s) buf_put((b), (s), (Py_ssize_t)(sizeof(s) - 1))

static int
not_encodable(const char *what)
{
    PyErr_Format(PyExc_TypeError, "encode: %s", what);
    return -1;
}

/* An exact ASCII str as a JSON string, escaped as json.dumps escapes it. */
static int
buf_str(Buf *b, PyObject *s)
{
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_COMPACT_ASCII(s)) {
        return not_encodable("not an exact ASCII str");
    }
    const unsigned char *d = (const unsigned char *)PyUnicode_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    if (buf_grow(b, 6 * n + 2) < 0) {
        return -1;
    }
    char *o = b->data + b->len;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = d[i];
        if (c >= 0x20 && c != '"' && c != '\\' && c != 0x7f) {
            *o++ = (char)c;
            continue;
        }
        *o++ = '\\';
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\n': *o++ = 'n'; break;
        case '\r': *o++ = 'r'; break;
        case '\t': *o++ = 't'; break;
        case '\b': *o++ = 'b'; break;
        case '\f': *o++ = 'f'; break;
        default: {
            static const char hex[] = "0123456789abcdef";
            *o++ = 'u';
            *o++ = '0';
            *o++ = '0';
            *o++ = hex[c >> 4];
            *o++ = hex[c & 15];
        }
        }
    }
    *o++ = '"';
    b->len = o - b->data;
    return 0;
}

static int
buf_ssize(Buf *b, Py_ssize_t v)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof(tmp), "%zd", v);
    return buf_put(b, tmp, n);
}

/* An exact int (any size) as json.dumps writes it. */
static int
buf_int(Buf *b, PyObject *v)
{
    if (!PyLong_CheckExact(v)) {
        return not_encodable("not an exact int");
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow) {
        return not_encodable("an int past 64 bits");
    }
    char tmp[32];
    int n = snprintf(tmp, sizeof(tmp), "%lld", x);
    return buf_put(b, tmp, n);
}

/* A tuple of exact ASCII strs (from ``first`` on) as a JSON list. */
static int
buf_pages(Buf *b, PyObject *pages, Py_ssize_t first)
{
    if (BUF_LIT(b, ",\"pages\":[") < 0) {
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(pages);
    for (Py_ssize_t i = first; i < n; i++) {
        if ((i > first && BUF_LIT(b, ",") < 0) || buf_str(b, PyTuple_GET_ITEM(pages, i)) < 0) {
            return -1;
        }
    }
    return BUF_LIT(b, "]");
}

/* An exact int that fits a Py_ssize_t; anything else is handed back (TypeError). */
static int
as_ssize(PyObject *v, const char *what, Py_ssize_t *out)
{
    if (!PyLong_CheckExact(v)) {
        return not_encodable(what);
    }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return not_encodable(what);
    }
    *out = x;
    return 0;
}

/* bisect_left over a list of exact ints (the recorded indices, ascending). */
static int
bisect_idx(PyObject *idx, Py_ssize_t x, Py_ssize_t *out)
{
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(idx);
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        Py_ssize_t v;
        if (as_ssize(PyList_GET_ITEM(idx, mid), "an index that is not a small int", &v) < 0) {
            return -1;
        }
        if (v < x) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    *out = lo;
    return 0;
}

static int
encode_into(Buf *b, PyObject *rec, double t0, int *skip)
{
    if (!PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) != 7) {
        return not_encodable("not a record (a 7-tuple)");
    }
    PyObject *t = PyTuple_GET_ITEM(rec, 0), *kind = PyTuple_GET_ITEM(rec, 1);
    PyObject *pool = PyTuple_GET_ITEM(rec, 2), *pages = PyTuple_GET_ITEM(rec, 3);
    PyObject *idx = PyTuple_GET_ITEM(rec, 4), *extra = PyTuple_GET_ITEM(rec, 5);
    PyObject *request = PyTuple_GET_ITEM(rec, 6);
    if (!PyFloat_CheckExact(t) || !PyUnicode_CheckExact(kind) || !PyTuple_CheckExact(pages)
        || (idx != Py_None && !PyList_CheckExact(idx)) || !PyLong_CheckExact(request)) {
        return not_encodable("a field of an unexpected type");
    }
    double ms = (PyFloat_AS_DOUBLE(t) - t0) * 1000.0;
    if (!isfinite(ms)) {
        return not_encodable("a time that is not finite");
    }
    /* round(ms, 3), then repr: what json.dumps writes for the rounded float */
    char *fixed = PyOS_double_to_string(ms, 'f', 3, 0, NULL);
    if (fixed == NULL) {
        return -1;
    }
    double rounded = PyOS_string_to_double(fixed, NULL, NULL);
    PyMem_Free(fixed);
    if (rounded == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    char *text = PyOS_double_to_string(rounded, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL) {
        return -1;
    }
    int rc = BUF_LIT(b, "{\"timestamp\":") < 0 || buf_put(b, text, (Py_ssize_t)strlen(text)) < 0
             || BUF_LIT(b, ",\"kind\":") < 0 || buf_str(b, kind) < 0;
    PyMem_Free(text);
    if (rc) {
        return -1;
    }
    const char *k = PyUnicode_AsUTF8(kind);
    if (k == NULL) {
        return -1;
    }
    if (strcmp(k, "request") == 0) {
        if (BUF_LIT(b, ",\"request\":") < 0 || buf_int(b, extra) < 0) {
            return -1;
        }
        return BUF_LIT(b, "}\n");
    }
    if (BUF_LIT(b, ",\"pool\":") < 0 || buf_str(b, pool) < 0) {
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(pages);
    if (strcmp(k, "lookup") == 0) {
        Py_ssize_t stop;
        if (as_ssize(extra, "a lookup's stop that is not a small int", &stop) < 0) {
            return -1;
        }
        Py_ssize_t walked;
        int miss = 0;
        if (idx == Py_None) {
            walked = stop < n ? stop : n;
            miss = stop < n;
        }
        else {
            if (bisect_idx(idx, stop, &walked) < 0) {
                return -1;
            }
            if (walked < PyList_GET_SIZE(idx)) {
                Py_ssize_t at;
                if (as_ssize(PyList_GET_ITEM(idx, walked), "an index that is not a small int",
                             &at) < 0) {
                    return -1;
                }
                miss = at == stop;
            }
        }
        if (buf_pages(b, pages, 0) < 0 || BUF_LIT(b, ",\"walked\":") < 0
            || buf_ssize(b, walked) < 0 || (miss && BUF_LIT(b, ",\"miss\":true") < 0)) {
            return -1;
        }
        int has_request = PyObject_IsTrue(request);
        if (has_request < 0
            || (has_request && (BUF_LIT(b, ",\"request\":") < 0 || buf_int(b, request) < 0))) {
            return -1;
        }
    }
    else if (strcmp(k, "invalidate") == 0) {
        Py_ssize_t keep;
        if (as_ssize(extra, "an invalidation's keep_pages that is not a small int", &keep) < 0) {
            return -1;
        }
        Py_ssize_t first = keep;
        if (idx != Py_None && bisect_idx(idx, keep, &first) < 0) {
            return -1;
        }
        if (first < 0) {
            return not_encodable("a negative keep_pages");
        }
        if (first >= n) {
            *skip = 1;
            return 0;
        }
        if (buf_pages(b, pages, first) < 0) {
            return -1;
        }
    }
    else if (strcmp(k, "clear") != 0) {
        if (buf_pages(b, pages, 0) < 0) {
            return -1;
        }
        if (strcmp(k, "prefetch") == 0
            && (BUF_LIT(b, ",\"hit\":") < 0 || buf_int(b, extra) < 0)) {
            return -1;
        }
    }
    return BUF_LIT(b, "}\n");
}

PyDoc_STRVAR(encode_doc,
"encode(record, t0, /) -> str | None\n\n"
"One record as Recorder._encode's JSON line (TypeError: encode it there instead).");

static PyObject *
recorder_encode(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode() takes 2 positional arguments");
        return NULL;
    }
    if (!PyFloat_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "encode: t0 must be a float");
        return NULL;
    }
    Buf b = {NULL, 0, 0};
    int skip = 0;
    PyObject *out = NULL;
    if (encode_into(&b, args[0], PyFloat_AS_DOUBLE(args[1]), &skip) == 0) {
        out = skip ? Py_NewRef(Py_None) : PyUnicode_DecodeASCII(b.data, b.len, NULL);
    }
    PyMem_Free(b.data);
    return out;
}

static PyMethodDef recorder_methods[] = {
    {"below", (PyCFunction)(void (*)(void))recorder_below, METH_FASTCALL, below_doc},
    {"encode", (PyCFunction)(void (*)(void))recorder_encode, METH_FASTCALL, encode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef recorder_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hicache_existence.accounting._recorder",
    .m_doc = "Compiled page test, tap and record encoder of the trace recorder (optional accelerator).",
    .m_size = -1,
    .m_methods = recorder_methods,
};

PyMODINIT_FUNC
PyInit__recorder(void)
{
    if (PyType_Ready(&TapType) < 0 || PyType_Ready(&BracketType) < 0) {
        return NULL;
    }
    K_LOOKUP = PyUnicode_InternFromString("lookup");
    K_ADD = PyUnicode_InternFromString("add");
    K_INVALIDATE = PyUnicode_InternFromString("invalidate");
    K_CLEAR = PyUnicode_InternFromString("clear");
    K_WRITE = PyUnicode_InternFromString("write");
    K_PREFETCH = PyUnicode_InternFromString("prefetch");
    K_REQUEST = PyUnicode_InternFromString("request");
    EMPTY = PyTuple_New(0);
    EMPTY_STR = PyUnicode_InternFromString("");
    ZERO = PyLong_FromLong(0);
    PyObject *time = PyImport_ImportModule("time");
    MONOTONIC = time != NULL ? PyObject_GetAttrString(time, "monotonic") : NULL;
    Py_XDECREF(time);
    if (K_LOOKUP == NULL || K_ADD == NULL || K_INVALIDATE == NULL || K_CLEAR == NULL
        || K_WRITE == NULL || K_PREFETCH == NULL || K_REQUEST == NULL || EMPTY == NULL
        || EMPTY_STR == NULL || ZERO == NULL || MONOTONIC == NULL) {
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
