/*
 * hicache_existence.core._lru: a compact LRU index of str page hashes.
 *
 * Why it exists: the existence cache's hot path touches every page of a
 * 1024-page chain in LRU order.  OrderedDict.move_to_end costs a dict probe, a
 * probe of its node side table and a node relink per page, touching about five
 * cache lines, and the seed generation also builds and hashes a (pool, hash)
 * tuple per page.  This index keeps, per entry, one 8-byte table slot (32 hash
 * bits and a node id, so probes and rehashes never dereference a key) and one
 * 24-byte node (key, LRU links, pool tag, hash bits) in chunked arrays, so a
 * touch is one slot probe and one relink, and an entry costs ~40 bytes instead
 * of OrderedDict's ~77.
 *
 * Semantics are OrderedDict's, restricted to what the caches need: keys are
 * compared as str *values* (subclasses are stored as exact str copies), a
 * ``tag`` (small unsigned int, the pool) is part of the key, and every method
 * validates all of its input before it changes anything.  Methods never call
 * back into Python code (exact str only, no __eq__/__hash__ overrides are
 * consulted), so each call is atomic under the GIL and holds no reference
 * cycles, which is why the type is not GC-tracked.
 *
 * The pure-Python twin with the same interface is hicache_existence.core.lru.
 *
 * The module also holds StepGate (at the end), the runtime's per-step test, and
 * StepHook, the per-step hook that calls it: unlike the index they call back into
 * Python (the due work, a test clock; the write path's reap), so they are
 * GC-tracked.  Their twins are hicache_existence.core.gate.PyStepGate and PyStepHook.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK_BITS 10
#define CHUNK_NODES ((uint32_t)1 << CHUNK_BITS)
#define CHUNK_MASK (CHUNK_NODES - 1)
#define NIL ((uint32_t)0xFFFFFFFFu)
/* Node ids are stored +1 in the low half of a slot; keep them far from NIL. */
#define MAX_ENTRIES ((Py_ssize_t)0x7FFFFFFF)
#define MIN_SLOTS 8

typedef struct {
    PyObject *key; /* exact str, owned; NULL while the node is free */
    uint32_t prev; /* towards the least recently used end */
    uint32_t next; /* towards the most recently used end; free-list link */
    uint32_t tag;
    uint32_t hash; /* mixed 32-bit hash, also kept in the slot */
} Node;

typedef struct {
    PyObject_HEAD
    uint64_t *slots;   /* (hash << 32) | (node id + 1); 0 is empty */
    size_t mask;       /* number of slots - 1 (a power of two) */
    Node **chunks;     /* CHUNK_NODES nodes each */
    uint32_t nchunks;
    uint32_t chunks_cap;
    uint32_t fresh;     /* ids below this were handed out at least once */
    uint32_t free_head; /* released ids, linked through Node.next */
    uint32_t nfree;
    uint32_t head;      /* least recently used, NIL when empty */
    uint32_t tail;      /* most recently used, NIL when empty */
    Py_ssize_t size;
    /* Samplers fed from inside touch_prefix/add/discard/clear (attach): one per
     * tag at most, a handful in all (the pools of a cache). */
    PyObject **samplers;
    uint32_t *sampler_tags;
    uint32_t nsamplers;
} Lru;

static inline Node *
node_at(const Lru *self, uint32_t id)
{
    return &self->chunks[id >> CHUNK_BITS][id & CHUNK_MASK];
}

static inline uint32_t
mix_hash(Py_hash_t h, uint32_t tag)
{
    uint64_t x = (uint64_t)h ^ ((uint64_t)tag * 0x9E3779B97F4A7C15ull);
    return (uint32_t)(x ^ (x >> 32));
}

/* The str's own hash, ignoring any subclass override (value semantics). */
static inline Py_hash_t
str_hash(PyObject *s)
{
    return PyUnicode_Type.tp_hash(s);
}

static inline int
str_eq(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    if (n != PyUnicode_GET_LENGTH(b)) {
        return 0;
    }
    unsigned int kind = PyUnicode_KIND(a);
    if (kind != PyUnicode_KIND(b)) {
        return 0; /* str storage is canonical: different kinds differ */
    }
    return memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * kind) == 0;
}

/* Slot index of (key, tag), or -1 with *hole set to the empty slot that ended
 * the probe (where the key would be inserted). */
static inline Py_ssize_t
find(const Lru *self, PyObject *key, uint32_t tag, uint32_t h, size_t *hole)
{
    const uint64_t *slots = self->slots;
    size_t mask = self->mask;
    size_t i = h & mask;
    for (;;) {
        uint64_t s = slots[i];
        if (s == 0) {
            *hole = i;
            return -1;
        }
        if ((uint32_t)(s >> 32) == h) {
            const Node *nd = node_at(self, (uint32_t)s - 1);
            if (nd->tag == tag && str_eq(nd->key, key)) {
                return (Py_ssize_t)i;
            }
        }
        i = (i + 1) & mask;
    }
}

static inline void
unlink_node(Lru *self, Node *nd)
{
    if (nd->prev != NIL) {
        node_at(self, nd->prev)->next = nd->next;
    }
    else {
        self->head = nd->next;
    }
    if (nd->next != NIL) {
        node_at(self, nd->next)->prev = nd->prev;
    }
    else {
        self->tail = nd->prev;
    }
}

static inline void
append_node(Lru *self, uint32_t id, Node *nd)
{
    nd->prev = self->tail;
    nd->next = NIL;
    if (self->tail != NIL) {
        node_at(self, self->tail)->next = id;
    }
    else {
        self->head = id;
    }
    self->tail = id;
}

static inline void
move_to_end(Lru *self, uint32_t id, Node *nd)
{
    if (self->tail != id) {
        unlink_node(self, nd);
        append_node(self, id, nd);
    }
}

/* Rebuild the table with ncap slots; only slot words move (no key is read). */
static int
rehash(Lru *self, size_t ncap)
{
    uint64_t *fresh = PyMem_Calloc(ncap, sizeof(uint64_t));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t nmask = ncap - 1;
    if (self->slots != NULL) {
        for (size_t i = 0; i <= self->mask; i++) {
            uint64_t s = self->slots[i];
            if (s != 0) {
                size_t j = (uint32_t)(s >> 32) & nmask;
                while (fresh[j] != 0) {
                    j = (j + 1) & nmask;
                }
                fresh[j] = s;
            }
        }
        PyMem_Free(self->slots);
    }
    self->slots = fresh;
    self->mask = nmask;
    return 0;
}

/* Make room for `extra` more entries (table load <= 3/4, nodes allocated), so
 * that the mutation that follows cannot fail half-way. */
static int
reserve(Lru *self, Py_ssize_t extra)
{
    if (extra > MAX_ENTRIES - self->size) {
        PyErr_SetString(PyExc_OverflowError, "LRU index cannot hold more than 2**31-1 entries");
        return -1;
    }
    size_t need = (size_t)(self->size + extra);
    size_t cap = self->mask + 1;
    if (self->slots == NULL || need * 4 > cap * 3) {
        size_t ncap = self->slots == NULL ? MIN_SLOTS : cap;
        while (need * 4 > ncap * 3) {
            ncap <<= 1;
        }
        if (self->slots == NULL || ncap != cap) {
            if (rehash(self, ncap) < 0) {
                return -1;
            }
        }
    }
    uint64_t avail = (uint64_t)self->nfree + (uint64_t)self->nchunks * CHUNK_NODES - self->fresh;
    while (avail < (uint64_t)extra) {
        if (self->nchunks == self->chunks_cap) {
            uint32_t ncc = self->chunks_cap ? self->chunks_cap * 2 : 4;
            Node **grown = PyMem_Realloc(self->chunks, ncc * sizeof(Node *));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            self->chunks = grown;
            self->chunks_cap = ncc;
        }
        Node *chunk = PyMem_Malloc(CHUNK_NODES * sizeof(Node));
        if (chunk == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->chunks[self->nchunks++] = chunk;
        avail += CHUNK_NODES;
    }
    return 0;
}

static inline uint32_t
alloc_node(Lru *self)
{
    uint32_t id = self->free_head;
    if (id != NIL) {
        self->free_head = node_at(self, id)->next;
        self->nfree--;
        return id;
    }
    return self->fresh++;
}

/* Linear-probing deletion with backward shift: no tombstones, so probe
 * lengths do not grow under the constant insert/evict churn of a full cache. */
static void
delete_slot(Lru *self, size_t i)
{
    uint64_t *slots = self->slots;
    size_t mask = self->mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t s = slots[j];
        if (s == 0) {
            break;
        }
        size_t home = (uint32_t)(s >> 32) & mask;
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            slots[i] = s;
            i = j;
        }
    }
    slots[i] = 0;
}

/* Remove node `id` from the table and the LRU list; returns its (owned) key. */
static PyObject *
remove_node(Lru *self, uint32_t id, Node *nd)
{
    size_t mask = self->mask;
    size_t i = nd->hash & mask;
    uint32_t want = id + 1;
    while ((uint32_t)self->slots[i] != want) {
        i = (i + 1) & mask;
    }
    delete_slot(self, i);
    unlink_node(self, nd);
    PyObject *key = nd->key;
    nd->key = NULL;
    nd->next = self->free_head;
    self->free_head = id;
    self->nfree++;
    self->size--;
    return key;
}

/* ---- argument helpers ------------------------------------------------- */

static int
parse_tag(PyObject *obj, uint32_t *tag)
{
    if (obj == NULL) {
        *tag = 0;
        return 0;
    }
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "tag must be an int, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "tag must be in [0, 2**32)");
        return -1;
    }
    if (v > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "tag must be in [0, 2**32)");
        return -1;
    }
    *tag = (uint32_t)v;
    return 0;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi)
{
    if (nargs >= lo && nargs <= hi) {
        return 0;
    }
    if (lo == hi) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", name, lo,
                     nargs);
    }
    else {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd positional arguments (%zd given)",
                     name, lo, hi, nargs);
    }
    return -1;
}

/* A batch argument (list or tuple; its items are checked by check_items) and
 * its optional tag. */
static int
parse_batch(PyObject *seq, PyObject *tag_obj, uint32_t *tag)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "hashes must be a list or tuple of str, got %.100s",
                     Py_TYPE(seq)->tp_name);
        return -1;
    }
    return parse_tag(tag_obj, tag);
}

static int
parse_seq_tag(const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject **seq,
              uint32_t *tag)
{
    if (check_nargs(name, nargs, 1, 2) < 0) {
        return -1;
    }
    *seq = args[0];
    return parse_batch(*seq, nargs == 2 ? args[1] : NULL, tag);
}

/* Every item must be a str: checked before anything changes.  Sets *exact to
 * 0 when some item is a str subclass (stored as an exact copy). */
static int
check_items(PyObject *const *items, Py_ssize_t n, int *exact)
{
    int all_exact = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = items[i];
        if (PyUnicode_CheckExact(it)) {
            continue;
        }
        if (!PyUnicode_Check(it)) {
            /* The type's short name, as type(it).__name__ reads for ordinary
             * classes, without running any Python code. */
            const char *name = Py_TYPE(it)->tp_name;
            const char *dot = strrchr(name, '.');
            PyErr_Format(PyExc_TypeError, "hashes[%zd] must be a str page hash, got %.100s", i,
                         dot ? dot + 1 : name);
            return -1;
        }
        all_exact = 0;
    }
#if PY_VERSION_HEX < 0x030C0000
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyUnicode_READY(items[i]) < 0) {
            return -1;
        }
    }
#endif
    if (exact != NULL) {
        *exact = all_exact;
    }
    return 0;
}

static int
check_key(PyObject *key)
{
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "page hash must be a str, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(key) < 0) {
        return -1;
    }
#endif
    return 0;
}

#include "_sampler.h"

static inline Sampler *
sampler_for(const Lru *self, uint32_t tag)
{
    for (uint32_t i = 0; i < self->nsamplers; i++) {
        if (self->sampler_tags[i] == tag) {
            return (Sampler *)self->samplers[i];
        }
    }
    return NULL;
}

/* ---- methods ---------------------------------------------------------- */

PyDoc_STRVAR(touch_prefix_doc,
"touch_prefix(hashes, tag=0, /) -> int\n\n"
"Move each page of `hashes` (list or tuple of str) that is present to the most\n"
"recently used end, in order, stopping at the first absent page; return how\n"
"many were touched (== len(hashes) when all are present).");

/* The walk of touch_prefix; -1 on error.  Inlined twice, with and without a
 * sampler, so the path without one has no per-page test for it. */
static inline __attribute__((always_inline)) Py_ssize_t
walk_prefix(Lru *self, PyObject *const *items, Py_ssize_t n, uint32_t tag, Sampler *smp,
            SCollect *col)
{
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *key = items[i];
        Py_hash_t ph = str_hash(key);
        if (ph == -1) {
            return -1;
        }
        size_t hole = 0;
        Py_ssize_t pos = find(self, key, tag, mix_hash(ph, tag), &hole);
        if (pos < 0) {
            break;
        }
        uint32_t id = (uint32_t)self->slots[pos] - 1;
        move_to_end(self, id, node_at(self, id));
        if (smp != NULL) {
            sc_offer(col, smp, ph, tag);
        }
    }
    return i;
}

static PyObject *
Lru_touch_prefix(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq;
    uint32_t tag;
    if (parse_seq_tag("touch_prefix", args, nargs, &seq, &tag) < 0) {
        return NULL;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (check_items(items, n, NULL) < 0) {
        return NULL;
    }
    Py_ssize_t i = 0;
    Sampler *smp = self->nsamplers != 0 ? sampler_for(self, tag) : NULL;
    SCollect col;
    col.k = 0;
    col.overflow = 0;
    if (self->size != 0) {
        i = smp == NULL ? walk_prefix(self, items, n, tag, NULL, &col)
                        : walk_prefix(self, items, n, tag, smp, &col);
        if (i < 0) {
            return NULL;
        }
    }
    if (smp != NULL && i == n && n != 0) {
        /* A complete walk is recorded here; one that stops short is finished
         * (and recorded, via Sampler.walked) by the caller. */
        if (col.overflow) {
            s_record_walk(smp, tag, items, n, n);
        }
        else {
            s_reference(smp, tag, col.buf, col.k, n, 1, n, 0, 0);
        }
    }
    return PyLong_FromSsize_t(i);
}

/* One page argument and its optional tag. */
static int
parse_key_tag(const char *name, PyObject *const *args, Py_ssize_t nargs, uint32_t *tag)
{
    if (check_nargs(name, nargs, 1, 2) < 0 || check_key(args[0]) < 0) {
        return -1;
    }
    return parse_tag(nargs == 2 ? args[1] : NULL, tag);
}

/* The slot of a checked key: >= 0 present, -1 absent, -2 error. */
static Py_ssize_t
find_key(const Lru *self, PyObject *key, uint32_t tag)
{
    if (self->size == 0) {
        return -1;
    }
    Py_hash_t ph = str_hash(key);
    if (ph == -1) {
        return -2;
    }
    size_t hole = 0;
    return find(self, key, tag, mix_hash(ph, tag), &hole);
}

PyDoc_STRVAR(touch_doc,
"touch(page_hash, tag=0, /) -> bool\n\n"
"Move one page to the most recently used end if present; return whether it was.");

static PyObject *
Lru_touch(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t tag;
    if (parse_key_tag("touch", args, nargs, &tag) < 0) {
        return NULL;
    }
    Py_ssize_t pos = find_key(self, args[0], tag);
    if (pos < 0) {
        return pos == -2 ? NULL : Py_NewRef(Py_False);
    }
    uint32_t id = (uint32_t)self->slots[pos] - 1;
    move_to_end(self, id, node_at(self, id));
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(cover_rest_doc,
"cover_rest(hashes, start, tag, cover, /) -> (stop, rescues)\n\n"
"Continue a walk from hashes[start]: touch each present page; a page that is\n"
"not present but in cover (any container; None: none) is a rescue; stop at the\n"
"first page that is neither.  stop == len(hashes) when the walk completed.\n"
"The sampler is not fed (the caller records the walk).");

static PyObject *
Lru_cover_rest(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t tag;
    if (check_nargs("cover_rest", nargs, 4, 4) < 0 || parse_batch(args[0], args[2], &tag) < 0) {
        return NULL;
    }
    PyObject *seq = args[0];
    PyObject *cover = args[3];
    if (check_items(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), NULL) < 0) {
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (start < 0 || start > PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_ValueError, "cover_rest: start out of range");
        return NULL;
    }
    Py_ssize_t i = start, rescues = 0;
    /* The size is read every page: cover's __contains__ may be Python code. */
    for (; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (check_key(key) < 0) {
            return NULL;
        }
        Py_ssize_t pos = find_key(self, key, tag);
        if (pos == -2) {
            return NULL;
        }
        if (pos >= 0) {
            uint32_t id = (uint32_t)self->slots[pos] - 1;
            move_to_end(self, id, node_at(self, id));
            continue;
        }
        if (cover == Py_None) {
            break;
        }
        Py_INCREF(key);
        int c = PySequence_Contains(cover, key);
        Py_DECREF(key);
        if (c < 0) {
            return NULL;
        }
        if (c == 0) {
            break;
        }
        rescues++;
    }
    return Py_BuildValue("(nn)", i, rescues);
}

PyDoc_STRVAR(contains_doc,
"contains(page_hash, tag=0, /) -> bool\n\n"
"Whether a page is present, without touching it.");

static PyObject *
Lru_contains(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t tag;
    if (parse_key_tag("contains", args, nargs, &tag) < 0) {
        return NULL;
    }
    Py_ssize_t pos = find_key(self, args[0], tag);
    return pos == -2 ? NULL : PyBool_FromLong(pos >= 0);
}

static int
Lru_sq_contains(Lru *self, PyObject *key)
{
    if (!PyUnicode_Check(key)) {
        return 0; /* like a dict of str keys: other objects are simply absent */
    }
    if (check_key(key) < 0) {
        return -1;
    }
    Py_ssize_t pos = find_key(self, key, 0);
    return pos == -2 ? -1 : pos >= 0;
}

/* The insert loop of add (room reserved); the count inserted, -1 on error.
 * Inlined with and without a sampler, like walk_prefix. */
static inline __attribute__((always_inline)) Py_ssize_t
add_items(Lru *self, PyObject *const *items, Py_ssize_t n, uint32_t tag, Sampler *smp,
          SCollect *col)
{
    Py_ssize_t inserted = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        Py_hash_t ph = str_hash(key);
        if (ph == -1) {
            return -1;
        }
        if (smp != NULL) {
            sc_offer(col, smp, ph, tag);
        }
        uint32_t h = mix_hash(ph, tag);
        size_t hole = 0;
        Py_ssize_t pos = find(self, key, tag, h, &hole);
        if (pos >= 0) {
            uint32_t id = (uint32_t)self->slots[pos] - 1;
            move_to_end(self, id, node_at(self, id));
            continue;
        }
        uint32_t id = alloc_node(self);
        Node *nd = node_at(self, id);
        nd->key = Py_NewRef(key);
        nd->tag = tag;
        nd->hash = h;
        self->slots[hole] = ((uint64_t)h << 32) | (uint64_t)(id + 1);
        append_node(self, id, nd);
        self->size++;
        inserted++;
    }
    return inserted;
}

PyDoc_STRVAR(add_doc,
"add(hashes, tag=0, /) -> int\n\n"
"Insert each page of `hashes` at the most recently used end, or move it there\n"
"if present, in order; return how many were new.  Nothing is evicted.");

static PyObject *
Lru_add(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq;
    uint32_t tag;
    if (parse_seq_tag("add", args, nargs, &seq, &tag) < 0) {
        return NULL;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int exact;
    if (check_items(items, n, &exact) < 0) {
        return NULL;
    }
    PyObject *copies = NULL;
    if (!exact) {
        /* Store subclasses as exact str copies: no overridden method can run
         * inside the index, and stored keys cannot hold references back.  The
         * list is allocated empty first (that allocation may run finalizers
         * that change `seq`), then `seq` is read and checked again; str copies
         * and appends allocate nothing the collector tracks. */
        copies = PyList_New(0);
        if (copies == NULL) {
            return NULL;
        }
        items = PySequence_Fast_ITEMS(seq);
        n = PySequence_Fast_GET_SIZE(seq);
        if (check_items(items, n, NULL) < 0) {
            Py_DECREF(copies);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *c = PyUnicode_CheckExact(items[i]) ? Py_NewRef(items[i])
                                                         : PyUnicode_FromObject(items[i]);
            if (c == NULL || PyList_Append(copies, c) < 0) {
                Py_XDECREF(c);
                Py_DECREF(copies);
                return NULL;
            }
            Py_DECREF(c);
        }
        items = PySequence_Fast_ITEMS(copies);
    }
    if (reserve(self, n) < 0) {
        Py_XDECREF(copies);
        return NULL;
    }
    Sampler *smp = self->nsamplers != 0 ? sampler_for(self, tag) : NULL;
    SCollect col;
    col.k = 0;
    col.overflow = 0;
    Py_ssize_t inserted = smp == NULL ? add_items(self, items, n, tag, NULL, &col)
                                      : add_items(self, items, n, tag, smp, &col);
    if (inserted < 0) { /* cannot happen for ready str; keep what was done */
        Py_XDECREF(copies);
        return NULL;
    }
    if (smp != NULL) {
        if (col.overflow) {
            s_record_add(smp, tag, items, n);
        }
        else {
            s_reference(smp, tag, col.buf, col.k, n, 0, 0, 0, 0);
        }
    }
    Py_XDECREF(copies);
    return PyLong_FromSsize_t(inserted);
}

/* Add one run of `count` evicted entries of `tag` to `out`: their number, or
 * (when `keys` is a list) the slice of it from `start`. */
static int
add_run(PyObject *out, uint32_t tag, PyObject *keys, Py_ssize_t start, Py_ssize_t count)
{
    PyObject *k = PyLong_FromUnsignedLong(tag);
    if (k == NULL) {
        return -1;
    }
    PyObject *old = PyDict_GetItemWithError(out, k);
    if (old == NULL && PyErr_Occurred()) {
        Py_DECREF(k);
        return -1;
    }
    int rc;
    if (keys == NULL) {
        PyObject *v = PyLong_FromSsize_t(count + (old ? PyLong_AsSsize_t(old) : 0));
        rc = v == NULL ? -1 : PyDict_SetItem(out, k, v);
        Py_XDECREF(v);
    }
    else if (old != NULL) {
        PyObject *part = PyList_GetSlice(keys, start, start + count);
        rc = part == NULL ? -1 : PyList_SetSlice(old, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, part);
        Py_XDECREF(part);
    }
    else if (start == 0 && count == PyList_GET_SIZE(keys)) {
        rc = PyDict_SetItem(out, k, keys); /* one run: the list itself */
    }
    else {
        PyObject *part = PyList_GetSlice(keys, start, start + count);
        rc = part == NULL ? -1 : PyDict_SetItem(out, k, part);
        Py_XDECREF(part);
    }
    Py_DECREF(k);
    return rc;
}

/* Remove the `count_obj` least recently used entries; {tag: number} or,
 * with `want_keys`, {tag: [keys, oldest first]}. */
static PyObject *
evict_oldest(Lru *self, PyObject *count_obj, int want_keys)
{
    Py_ssize_t count = PyNumber_AsSsize_t(count_obj, NULL); /* clamps, as min() in Python */
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0");
        return NULL;
    }
    /* Everything that can allocate a Python object (and so run the garbage
     * collector, finalizers, other threads) happens before the walk or after
     * the removal, never while the index is half-changed. */
    PyObject *out = PyDict_New();
    if (out == NULL) {
        return NULL;
    }
    if (count > self->size) {
        count = self->size;
    }
    PyObject *keys = want_keys ? PyList_New(count) : NULL;
    uint32_t *tags = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(uint32_t));
    if ((want_keys && keys == NULL) || tags == NULL) {
        Py_XDECREF(keys);
        PyMem_Free(tags);
        Py_DECREF(out);
        return tags == NULL ? PyErr_NoMemory() : NULL;
    }
    if (count > self->size) { /* the collector ran above and shrank us */
        count = self->size;
        if (keys != NULL && PyList_SetSlice(keys, count, PY_SSIZE_T_MAX, NULL) < 0) {
            Py_DECREF(keys);
            PyMem_Free(tags);
            Py_DECREF(out);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t victim = self->head;
        Node *nd = node_at(self, victim);
        tags[i] = nd->tag;
        PyObject *key = remove_node(self, victim, nd);
        if (keys != NULL) {
            PyList_SET_ITEM(keys, i, key); /* the node's reference moves to the list */
        }
        else {
            Py_DECREF(key);
        }
    }
    /* Building the answer can fail only for lack of memory, after the entries
     * are gone: the caller then gets MemoryError and loses the keys, which at
     * that point is the least of its problems. */
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 1; i <= count; i++) {
        if (i == count || tags[i] != tags[start]) {
            if (add_run(out, tags[start], keys, start, i - start) < 0) {
                Py_CLEAR(out);
                break;
            }
            start = i;
        }
    }
    Py_XDECREF(keys);
    PyMem_Free(tags);
    return out;
}

PyDoc_STRVAR(evict_doc,
"evict(count, /) -> dict\n\n"
"Remove the `count` least recently used entries (all, if fewer); return\n"
"{tag: number removed}.");

static PyObject *
Lru_evict(Lru *self, PyObject *count)
{
    return evict_oldest(self, count, 0);
}

PyDoc_STRVAR(evict_keys_doc,
"evict_keys(count, /) -> dict\n\n"
"As evict(), returning {tag: [keys removed, oldest first]}.");

static PyObject *
Lru_evict_keys(Lru *self, PyObject *count)
{
    return evict_oldest(self, count, 1);
}

PyDoc_STRVAR(discard_doc,
"discard(hashes, tag=0, /) -> list\n\n"
"Remove each page of `hashes` that is present; return the removed pages in order.");

static PyObject *
Lru_discard(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq;
    uint32_t tag;
    if (parse_seq_tag("discard", args, nargs, &seq, &tag) < 0) {
        return NULL;
    }
    /* Allocated before the caller's sequence is read: the allocation may run
     * finalizers that change it.  Appends only grow the item array (no
     * collector), so nothing after this point can. */
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (check_items(items, n, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    if (self->nsamplers != 0) {
        /* Evicted pages stay in a sampler's stack (that is how it sees beyond
         * the cap), so this runs whether or not the index holds them. */
        Sampler *s = sampler_for(self, tag);
        if (s != NULL) {
            s_record_remove(s, tag, items, n);
        }
    }
    if (self->size == 0) {
        return out;
    }
    /* Pass 1 collects the present keys without changing anything (so a failed
     * allocation leaves the index as it was); pass 2 removes them.  A page that
     * repeats is collected twice and dropped from the answer at its second
     * removal, so it counts once, at its first occurrence. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        Py_hash_t ph = str_hash(key);
        if (ph == -1) {
            Py_DECREF(out);
            return NULL;
        }
        size_t hole = 0;
        Py_ssize_t pos = find(self, key, tag, mix_hash(ph, tag), &hole);
        if (pos < 0) {
            continue;
        }
        if (PyList_Append(out, key) < 0) { /* the caller's object, as the Python twin */
            Py_DECREF(out);
            return NULL;
        }
    }
    /* Removal: look each collected key up again and unlink it. */
    Py_ssize_t m = PyList_GET_SIZE(out);
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *key = PyList_GET_ITEM(out, i);
        size_t hole = 0;
        Py_ssize_t pos = find(self, key, tag, mix_hash(str_hash(key), tag), &hole);
        if (pos < 0) {
            /* A repeat of a page removed a moment ago: drop it from the answer. */
            Py_DECREF(key);
            continue;
        }
        uint32_t id = (uint32_t)self->slots[pos] - 1;
        PyObject *owned = remove_node(self, id, node_at(self, id));
        Py_DECREF(owned);
        PyList_SET_ITEM(out, kept, key);
        kept++;
    }
    Py_SET_SIZE(out, kept);
    return out;
}

PyDoc_STRVAR(clear_doc, "clear(/) -> None\n\nRemove every entry and release the memory.");

static void
release_all(Lru *self)
{
    /* Detach first so that the index is consistent (empty) while keys die. */
    Node **chunks = self->chunks;
    uint32_t nchunks = self->nchunks;
    uint32_t fresh = self->fresh;
    PyMem_Free(self->slots);
    self->slots = NULL;
    self->mask = 0;
    self->chunks = NULL;
    self->nchunks = self->chunks_cap = 0;
    self->fresh = self->nfree = 0;
    self->free_head = self->head = self->tail = NIL;
    self->size = 0;
    for (uint32_t c = 0; c < nchunks; c++) {
        Node *chunk = chunks[c];
        /* Nodes at or past `fresh` were never handed out (a reservation may
         * allocate chunks that stay unused): their memory is uninitialised. */
        uint64_t first = (uint64_t)c * CHUNK_NODES;
        uint32_t upto = fresh <= first ? 0 : (uint32_t)(fresh - first);
        if (upto > CHUNK_NODES) {
            upto = CHUNK_NODES;
        }
        for (uint32_t k = 0; k < upto; k++) {
            Py_XDECREF(chunk[k].key);
        }
        PyMem_Free(chunk);
    }
    PyMem_Free(chunks);
}

static PyObject *
Lru_clear(Lru *self, PyObject *Py_UNUSED(ignored))
{
    for (uint32_t i = 0; i < self->nsamplers; i++) {
        s_clear((Sampler *)self->samplers[i]);
    }
    release_all(self);
    if (reserve(self, 0) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(keys_doc, "keys(/) -> list\n\nEvery key, least recently used first.");

static PyObject *
Lru_keys(Lru *self, PyObject *Py_UNUSED(ignored))
{
    /* Allocating the list may run the collector (and finalizers that change
     * this index): size it again until the size it was made for still holds,
     * then walk with no allocation. */
    Py_ssize_t n;
    PyObject *out;
    for (;;) {
        n = self->size;
        out = PyList_New(n);
        if (out == NULL || self->size == n) {
            break;
        }
        Py_DECREF(out);
    }
    if (out == NULL) {
        return NULL;
    }
    uint32_t id = self->head;
    for (Py_ssize_t i = 0; i < n; i++) {
        Node *nd = node_at(self, id);
        PyList_SET_ITEM(out, i, Py_NewRef(nd->key));
        id = nd->next;
    }
    return out;
}

PyDoc_STRVAR(items_doc, "items(/) -> list\n\nEvery (tag, key), least recently used first.");

static PyObject *
Lru_items(Lru *self, PyObject *Py_UNUSED(ignored))
{
    /* Keys and tags are read in one walk with no Python allocation (see evict);
     * the pairs are built afterwards. */
    PyObject *keys = Lru_keys(self, NULL);
    if (keys == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint32_t *tags = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (tags == NULL) {
        Py_DECREF(keys);
        return PyErr_NoMemory();
    }
    uint32_t id = self->head;
    for (Py_ssize_t i = 0; i < n && id != NIL; i++) {
        Node *nd = node_at(self, id);
        tags[i] = nd->tag;
        id = nd->next;
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *pair = Py_BuildValue("(kO)", (unsigned long)tags[i], PyList_GET_ITEM(keys, i));
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    PyMem_Free(tags);
    Py_DECREF(keys);
    return out;
}

PyDoc_STRVAR(sizeof_doc, "__sizeof__() -> int\n\nBytes held by the index (keys excluded).");

static PyObject *
Lru_sizeof(Lru *self, PyObject *Py_UNUSED(ignored))
{
    size_t total = sizeof(Lru);
    if (self->slots != NULL) {
        total += (self->mask + 1) * sizeof(uint64_t);
    }
    total += (size_t)self->chunks_cap * sizeof(Node *);
    total += (size_t)self->nchunks * CHUNK_NODES * sizeof(Node);
    return PyLong_FromSize_t(total);
}

static PyObject *
Lru_iter(Lru *self)
{
    PyObject *keys = Lru_keys(self, NULL);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static Py_ssize_t
Lru_len(Lru *self)
{
    return self->size;
}

static PyObject *
Lru_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "LruIndex() takes no arguments");
        return NULL;
    }
    Lru *self = (Lru *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->free_head = self->head = self->tail = NIL;
    if (reserve(self, 0) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void
release_samplers(Lru *self)
{
    PyObject **samplers = self->samplers;
    uint32_t n = self->nsamplers;
    PyMem_Free(self->sampler_tags);
    self->samplers = NULL;
    self->sampler_tags = NULL;
    self->nsamplers = 0;
    for (uint32_t i = 0; i < n; i++) {
        Py_DECREF(samplers[i]);
    }
    PyMem_Free(samplers);
}

PyDoc_STRVAR(attach_doc,
"attach(tag, sampler, /) -> None\n\n"
"Feed `sampler` (a Sampler, or None to detach) with tag `tag`'s references\n"
"from now on: complete touch_prefix walks, adds, discards and clears.");

static PyObject *
Lru_attach(Lru *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t tag;
    if (check_nargs("attach", nargs, 2, 2) < 0 || parse_tag(args[0], &tag) < 0) {
        return NULL;
    }
    PyObject *sampler = args[1];
    if (sampler != Py_None && !PyObject_TypeCheck(sampler, &SamplerType)) {
        PyErr_Format(PyExc_TypeError, "sampler must be a Sampler or None, got %.100s",
                     Py_TYPE(sampler)->tp_name);
        return NULL;
    }
    for (uint32_t i = 0; i < self->nsamplers; i++) {
        if (self->sampler_tags[i] != tag) {
            continue;
        }
        PyObject *old = self->samplers[i];
        if (sampler == Py_None) {
            self->nsamplers--;
            self->samplers[i] = self->samplers[self->nsamplers];
            self->sampler_tags[i] = self->sampler_tags[self->nsamplers];
        }
        else {
            self->samplers[i] = Py_NewRef(sampler);
        }
        Py_DECREF(old);
        Py_RETURN_NONE;
    }
    if (sampler == Py_None) {
        Py_RETURN_NONE;
    }
    uint32_t n = self->nsamplers + 1;
    PyObject **samplers = PyMem_Realloc(self->samplers, n * sizeof(PyObject *));
    if (samplers == NULL) {
        return PyErr_NoMemory();
    }
    self->samplers = samplers;
    uint32_t *tags = PyMem_Realloc(self->sampler_tags, n * sizeof(uint32_t));
    if (tags == NULL) {
        return PyErr_NoMemory();
    }
    self->sampler_tags = tags;
    samplers[n - 1] = Py_NewRef(sampler);
    tags[n - 1] = tag;
    self->nsamplers = n;
    Py_RETURN_NONE;
}

static void
Lru_dealloc(Lru *self)
{
    release_samplers(self);
    release_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Lru_repr(Lru *self)
{
    return PyUnicode_FromFormat("<LruIndex entries=%zd>", self->size);
}

static PyMethodDef Lru_methods[] = {
    {"touch_prefix", (PyCFunction)(void (*)(void))Lru_touch_prefix, METH_FASTCALL,
     touch_prefix_doc},
    {"touch", (PyCFunction)(void (*)(void))Lru_touch, METH_FASTCALL, touch_doc},
    {"cover_rest", (PyCFunction)(void (*)(void))Lru_cover_rest, METH_FASTCALL, cover_rest_doc},
    {"contains", (PyCFunction)(void (*)(void))Lru_contains, METH_FASTCALL, contains_doc},
    {"add", (PyCFunction)(void (*)(void))Lru_add, METH_FASTCALL, add_doc},
    {"evict", (PyCFunction)Lru_evict, METH_O, evict_doc},
    {"evict_keys", (PyCFunction)Lru_evict_keys, METH_O, evict_keys_doc},
    {"discard", (PyCFunction)(void (*)(void))Lru_discard, METH_FASTCALL, discard_doc},
    {"clear", (PyCFunction)Lru_clear, METH_NOARGS, clear_doc},
    {"attach", (PyCFunction)(void (*)(void))Lru_attach, METH_FASTCALL, attach_doc},
    {"keys", (PyCFunction)Lru_keys, METH_NOARGS, keys_doc},
    {"items", (PyCFunction)Lru_items, METH_NOARGS, items_doc},
    {"__sizeof__", (PyCFunction)Lru_sizeof, METH_NOARGS, sizeof_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Lru_as_sequence = {
    .sq_length = (lenfunc)Lru_len,
    .sq_contains = (objobjproc)Lru_sq_contains,
};

PyDoc_STRVAR(Lru_doc,
"LruIndex()\n\n"
"An LRU-ordered set of (tag, str) keys: the storage behind the existence\n"
"caches' per-page beliefs.  See hicache_existence.core.lru for the interface.");

static PyTypeObject LruType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.core._lru.LruIndex",
    .tp_basicsize = sizeof(Lru),
    .tp_dealloc = (destructor)Lru_dealloc,
    .tp_repr = (reprfunc)Lru_repr,
    .tp_as_sequence = &Lru_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Lru_doc,
    .tp_iter = (getiterfunc)Lru_iter,
    .tp_methods = Lru_methods,
    .tp_new = Lru_new,
};

/* ------------------------------------------------------------------------------------
 * StepGate: the per-step test of ExistenceRuntime (hicache_existence/core/gate.py has
 * the interface and the pure-Python twin, PyStepGate, which behaves identically).
 * Called once per scheduler iteration; a step with nothing due is a count, a clock
 * read and two compares, here without a Python frame.
 * ------------------------------------------------------------------------------------ */

#include <time.h>
#include "structmember.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *due;   /* due(steps, now, flush), called when the gate opens */
    PyObject *clock; /* NULL: CLOCK_MONOTONIC read here (time.monotonic's clock) */
    long long steps;
    long long wake;
    double flush_at;
    double last;
    double busy_s;
    double defer_s;
} Gate;

static PyObject *
Gate_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Gate *g = (Gate *)op;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "StepGate() takes no arguments");
        return NULL;
    }
    long long n = ++g->steps;
    double now;
    if (g->clock == NULL) {
        struct timespec ts;
        if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return NULL;
        }
        /* time.monotonic()'s value: nanoseconds as an integer, then / 1e9 */
        long long ns = (long long)ts.tv_sec * 1000000000LL + (long long)ts.tv_nsec;
        now = (double)ns / 1e9;
    }
    else {
        PyObject *t = PyObject_CallNoArgs(g->clock);
        if (t == NULL) {
            return NULL;
        }
        now = PyFloat_AsDouble(t);
        Py_DECREF(t);
        if (now == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
    }
    double gap = now - g->last;
    g->last = now;
    /* The flush waits before flush_at, and after a batch (busy_s < gap < defer_s)
     * while it may still wait. */
    int flush = !(now < g->flush_at
                  || (g->busy_s < gap && gap < g->defer_s && now < g->flush_at + g->defer_s));
    if (n < g->wake && !flush) {
        Py_RETURN_NONE;
    }
    PyObject *argv[3];
    argv[0] = PyLong_FromLongLong(n);
    argv[1] = PyFloat_FromDouble(now);
    argv[2] = PyBool_FromLong(flush);
    PyObject *result = NULL;
    if (argv[0] != NULL && argv[1] != NULL && argv[2] != NULL) {
        result = PyObject_Vectorcall(g->due, argv, 3, NULL);
    }
    Py_XDECREF(argv[0]);
    Py_XDECREF(argv[1]);
    Py_XDECREF(argv[2]);
    return result;
}

static PyObject *
Gate_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"due", "clock", "busy_s", "defer_s", NULL};
    PyObject *due, *clock;
    double busy_s, defer_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOdd:StepGate", kwlist, &due, &clock,
                                     &busy_s, &defer_s)) {
        return NULL;
    }
    if (!PyCallable_Check(due) || (clock != Py_None && !PyCallable_Check(clock))) {
        PyErr_SetString(PyExc_TypeError, "StepGate: due and clock must be callable");
        return NULL;
    }
    Gate *g = (Gate *)type->tp_alloc(type, 0);
    if (g == NULL) {
        return NULL;
    }
    g->vectorcall = Gate_vectorcall;
    Py_INCREF(due);
    g->due = due;
    if (clock != Py_None) {
        Py_INCREF(clock);
        g->clock = clock;
    }
    g->steps = 0;
    g->wake = 1;
    g->flush_at = -INFINITY;
    g->last = -INFINITY;
    g->busy_s = busy_s;
    g->defer_s = defer_s;
    return (PyObject *)g;
}

static int
Gate_traverse(Gate *g, visitproc visit, void *arg)
{
    Py_VISIT(g->due);
    Py_VISIT(g->clock);
    return 0;
}

static int
Gate_clear(Gate *g)
{
    Py_CLEAR(g->due);
    Py_CLEAR(g->clock);
    return 0;
}

static void
Gate_dealloc(Gate *g)
{
    PyObject_GC_UnTrack(g);
    Gate_clear(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyMemberDef Gate_members[] = {
    {"steps", T_LONGLONG, offsetof(Gate, steps), 0, "Steps counted (calls)."},
    {"wake", T_LONGLONG, offsetof(Gate, wake), 0, "The first step with counted work."},
    {"flush_at", T_DOUBLE, offsetof(Gate, flush_at), 0, "The clock value of the next flush."},
    {"last", T_DOUBLE, offsetof(Gate, last), 0, "The clock at the previous step."},
    {"busy_s", T_DOUBLE, offsetof(Gate, busy_s), READONLY, "A longer iteration ran a batch."},
    {"defer_s", T_DOUBLE, offsetof(Gate, defer_s), READONLY, "How long a due flush may wait."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Gate_doc,
"StepGate(due, clock, busy_s, defer_s)\n\n"
"The per-step test of the runtime; see hicache_existence.core.gate.");

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.core._lru.StepGate",
    .tp_basicsize = sizeof(Gate),
    .tp_dealloc = (destructor)Gate_dealloc,
    .tp_vectorcall_offset = offsetof(Gate, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = Gate_doc,
    .tp_traverse = (traverseproc)Gate_traverse,
    .tp_clear = (inquiry)Gate_clear,
    .tp_members = Gate_members,
    .tp_new = Gate_new,
};

/* ------------------------------------------------------------------------------------
 * StepHook: the per-step hook SGLang calls after every check_hicache_events, idle
 * polling included (hicache_existence/core/gate.py has the pure-Python twin,
 * PyStepHook, which behaves identically).  Bound to its tree, a call is one identity
 * test, one size test of the write path's pending operations and the gate's test,
 * here without a Python frame; anything else (the first step, a foreign tree, an
 * unbound hook) goes to ``fallback`` with the arguments as given.
 * ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback; /* fallback(*args, **kwargs): every call not for ``tree`` */
    PyObject *tree;     /* the bound tree (args[1]); NULL or None: unbound */
    PyObject *step;     /* step(), a StepGate called directly; NULL or None: none */
    PyObject *pending;  /* sized; when non-empty, reap(tree) first */
    PyObject *reap;
    PyObject *dict;     /* __name__, __qualname__, __doc__ of the hook it stands for */
    long long reap_errors;
} Hook;

#define HOOK_SET(o) ((o) != NULL && (o) != Py_None)

/* len(pending) without a call for the exact types the package hands over. */
static Py_ssize_t
hook_size(PyObject *pending)
{
    if (PyDict_CheckExact(pending)) {
        return PyDict_GET_SIZE(pending);
    }
    if (PyAnySet_CheckExact(pending)) {
        return PySet_GET_SIZE(pending);
    }
    return PyObject_Length(pending);
}

/* reap(tree) when pending is non-empty.  An Exception raised here (by reap, or by
 * the size test) is dropped and counted: the hook is the boundary with the
 * scheduler, which must never see observability fail.  Anything else (a
 * KeyboardInterrupt, SystemExit) is not a failure of ours: -1, passed on. */
static int
hook_reap(Hook *h, PyObject *tree)
{
    PyObject *pending = h->pending, *reap = h->reap;
    if (!HOOK_SET(pending) || !HOOK_SET(reap)) {
        return 0;
    }
    Py_INCREF(pending);
    Py_INCREF(reap);
    Py_ssize_t n = hook_size(pending);
    PyObject *r = NULL;
    if (n > 0) {
        r = PyObject_CallOneArg(reap, tree);
    }
    Py_DECREF(pending);
    Py_DECREF(reap);
    if (n == 0 || r != NULL) {
        Py_XDECREF(r);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyErr_Clear();
    h->reap_errors++;
    return 0;
}

static PyObject *
Hook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hook *h = (Hook *)op;
    PyObject *tree = h->tree;
    if (!HOOK_SET(tree) || PyVectorcall_NARGS(nargsf) < 2 || args[1] != tree) {
        return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
    }
    Py_INCREF(tree); /* reap may unbind the hook */
    int failed = hook_reap(h, tree);
    Py_DECREF(tree);
    if (failed) {
        return NULL;
    }
    PyObject *step = h->step; /* read after reap, which may have rebound it */
    if (!HOOK_SET(step)) {
        Py_RETURN_NONE;
    }
    Py_INCREF(step);
    PyObject *r = Py_IS_TYPE(step, &GateType) ? Gate_vectorcall(step, NULL, 0, NULL)
                                              : PyObject_CallNoArgs(step);
    Py_DECREF(step);
    if (r == NULL) {
        return NULL; /* the step's errors are the runtime's to raise (DivergenceError) */
    }
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
Hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fallback", NULL};
    PyObject *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:StepHook", kwlist, &fallback)) {
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "StepHook: fallback must be callable");
        return NULL;
    }
    Hook *h = (Hook *)type->tp_alloc(type, 0);
    if (h == NULL) {
        return NULL;
    }
    h->vectorcall = Hook_vectorcall;
    Py_INCREF(fallback);
    h->fallback = fallback;
    h->reap_errors = 0;
    return (PyObject *)h;
}

static int
Hook_traverse(Hook *h, visitproc visit, void *arg)
{
    Py_VISIT(h->fallback);
    Py_VISIT(h->tree);
    Py_VISIT(h->step);
    Py_VISIT(h->pending);
    Py_VISIT(h->reap);
    Py_VISIT(h->dict);
    return 0;
}

static int
Hook_clear(Hook *h)
{
    Py_CLEAR(h->fallback);
    Py_CLEAR(h->tree);
    Py_CLEAR(h->step);
    Py_CLEAR(h->pending);
    Py_CLEAR(h->reap);
    Py_CLEAR(h->dict);
    return 0;
}

static void
Hook_dealloc(Hook *h)
{
    PyObject_GC_UnTrack(h);
    Hook_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *
Hook_get_fallback(Hook *h, void *closure)
{
    if (h->fallback == NULL) { /* only after tp_clear */
        Py_RETURN_NONE;
    }
    Py_INCREF(h->fallback);
    return h->fallback;
}

static PyGetSetDef Hook_getset[] = {
    {"fallback", (getter)Hook_get_fallback, NULL, "Called for every call not for tree.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Hook_members[] = {
    {"tree", T_OBJECT, offsetof(Hook, tree), 0, "The bound tree (None: unbound)."},
    {"step", T_OBJECT, offsetof(Hook, step), 0, "Called once per step of tree."},
    {"pending", T_OBJECT, offsetof(Hook, pending), 0, "When non-empty, reap(tree) first."},
    {"reap", T_OBJECT, offsetof(Hook, reap), 0, "reap(tree): never reaches the caller."},
    {"reap_errors", T_LONGLONG, offsetof(Hook, reap_errors), 0, "Exceptions reap raised."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Hook_doc,
"StepHook(fallback)\n\n"
"The per-step hook, bound to its tree; see hicache_existence.core.gate.");

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.core._lru.StepHook",
    .tp_basicsize = sizeof(Hook),
    .tp_dealloc = (destructor)Hook_dealloc,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = Hook_doc,
    .tp_traverse = (traverseproc)Hook_traverse,
    .tp_clear = (inquiry)Hook_clear,
    .tp_members = Hook_members,
    .tp_getset = Hook_getset,
    .tp_dictoffset = offsetof(Hook, dict),
    .tp_new = Hook_new,
};

/* ---- module functions: the caches' per-batch checks and in-flight refcounts ----
 *
 * Run on every mutation of a cache, in the scheduler thread, where a Python loop
 * over a chain's pages (or a "".join of it, as a type check) costs several
 * microseconds in a cold cache.  Twins: hicache_existence.core.lru (page_hashes,
 * inflight_add, inflight_release). */

static PyObject *page_hashes_fallback = NULL;

PyDoc_STRVAR(page_hashes_doc,
             "page_hashes(hashes, arg='hashes') -> hashes\n\n"
             "A list or tuple of str, returned as is; TypeError naming arg[index] for an item\n"
             "that is not a str.  Any other iterable: _validate.page_hashes's answer.");

static PyObject *
mod_page_hashes(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "page_hashes expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        if (page_hashes_fallback == NULL) {
            PyObject *v = PyImport_ImportModule("hicache_existence.core._validate");
            if (v == NULL) {
                return NULL;
            }
            page_hashes_fallback = PyObject_GetAttrString(v, "page_hashes");
            Py_DECREF(v);
            if (page_hashes_fallback == NULL) {
                return NULL;
            }
        }
        return PyObject_Vectorcall(page_hashes_fallback, args, (size_t)nargs, NULL);
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = items[i];
        if (PyUnicode_Check(it)) {
            continue;
        }
        const char *name = Py_TYPE(it)->tp_name;
        const char *dot = strrchr(name, '.');
        if (nargs == 2 && PyUnicode_Check(args[1])) {
            PyErr_Format(PyExc_TypeError, "%U[%zd] must be a str page hash, got %.100s", args[1],
                         i, dot ? dot + 1 : name);
        }
        else {
            PyErr_Format(PyExc_TypeError, "hashes[%zd] must be a str page hash, got %.100s", i,
                         dot ? dot + 1 : name);
        }
        return NULL;
    }
    return Py_NewRef(seq);
}

static int
parse_refs(const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject **refs,
           PyObject **seq)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s expected 2 arguments, got %zd", name, nargs);
        return -1;
    }
    if (!PyDict_CheckExact(args[0])) {
        PyErr_Format(PyExc_TypeError, "%s: refs must be a dict", name);
        return -1;
    }
    if (!PyList_CheckExact(args[1]) && !PyTuple_CheckExact(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s: hashes must be a list or tuple", name);
        return -1;
    }
    *refs = args[0];
    *seq = args[1];
    return 0;
}

/* refs[key] as a count: 1 and *n when present, 0 when absent, -1 on an error. */
static int
ref_count(PyObject *refs, PyObject *key, long long *n)
{
    PyObject *old = PyDict_GetItemWithError(refs, key);
    if (old == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    *n = PyLong_AsLongLong(old);
    return (*n == -1 && PyErr_Occurred()) ? -1 : 1;
}

/* refs[key] = n, or del refs[key] when n <= 0. */
static int
set_count(PyObject *refs, PyObject *key, long long n)
{
    if (n <= 0) {
        return PyDict_DelItem(refs, key);
    }
    PyObject *v = PyLong_FromLongLong(n);
    int rc = v == NULL ? -1 : PyDict_SetItem(refs, key, v);
    Py_XDECREF(v);
    return rc;
}

/* One ref more (delta 1) or less (-1) per page of seq, in order; counts the pages
 * that had a ref and those that had none.  Nothing here runs Python code for exact
 * str keys; a subclass's __hash__/__eq__ could, so seq is held and its size re-read. */
static int
shift_refs(PyObject *refs, PyObject *seq, int delta, Py_ssize_t *had, Py_ssize_t *lacked)
{
    int rc = 0;
    Py_INCREF(seq);
    for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        long long n = 0;
        int found = ref_count(refs, key, &n);
        if (found < 0) {
            rc = -1;
        }
        else if (found == 0 && delta < 0) {
            (*lacked)++;
        }
        else {
            *(found ? had : lacked) += 1;
            rc = set_count(refs, key, n + delta);
        }
        Py_DECREF(key);
    }
    Py_DECREF(seq);
    return rc;
}

PyDoc_STRVAR(inflight_add_doc,
             "inflight_add(refs, hashes) -> None\n\n"
             "One ref more per page: refs[h] = refs.get(h, 0) + 1 for each h, in order.");

static PyObject *
mod_inflight_add(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *refs, *seq;
    Py_ssize_t had = 0, lacked = 0;
    if (parse_refs("inflight_add", args, nargs, &refs, &seq) < 0
        || shift_refs(refs, seq, 1, &had, &lacked) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(inflight_release_doc,
             "inflight_release(refs, hashes) -> (released, unmatched)\n\n"
             "One ref less per page, in order; a page at its last ref leaves refs.  Counts the\n"
             "pages that had a ref and those that had none.");

static PyObject *
mod_inflight_release(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *refs, *seq;
    Py_ssize_t released = 0, unmatched = 0;
    if (parse_refs("inflight_release", args, nargs, &refs, &seq) < 0
        || shift_refs(refs, seq, -1, &released, &unmatched) < 0) {
        return NULL;
    }
    return Py_BuildValue("(nn)", released, unmatched);
}

static PyMethodDef lru_module_methods[] = {
    {"page_hashes", (PyCFunction)(void (*)(void))mod_page_hashes, METH_FASTCALL,
     page_hashes_doc},
    {"inflight_add", (PyCFunction)(void (*)(void))mod_inflight_add, METH_FASTCALL,
     inflight_add_doc},
    {"inflight_release", (PyCFunction)(void (*)(void))mod_inflight_release, METH_FASTCALL,
     inflight_release_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lru_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hicache_existence.core._lru",
    .m_doc = "Compiled LRU index behind the existence caches (optional accelerator).",
    .m_size = -1,
    .m_methods = lru_module_methods,
};

PyMODINIT_FUNC
PyInit__lru(void)
{
    if (PyType_Ready(&LruType) < 0 || PyType_Ready(&SamplerType) < 0
        || PyType_Ready(&GateType) < 0 || PyType_Ready(&HookType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&lru_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&LruType);
    if (PyModule_AddObject(m, "LruIndex", (PyObject *)&LruType) < 0) {
        Py_DECREF(&LruType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SamplerType);
    if (PyModule_AddObject(m, "Sampler", (PyObject *)&SamplerType) < 0) {
        Py_DECREF(&SamplerType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "StepGate", (PyObject *)&GateType) < 0) {
        Py_DECREF(&GateType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HookType);
    if (PyModule_AddObject(m, "StepHook", (PyObject *)&HookType) < 0) {
        Py_DECREF(&HookType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
