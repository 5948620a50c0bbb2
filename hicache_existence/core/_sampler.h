/*
 * Sampler: the capacity advisor's SHARDS estimator, fed from inside the LRU index.
 *
 * Included by _lru.c (one extension module), so that an index with a sampler
 * attached feeds it from within touch_prefix/add/discard/clear at the cost of
 * one comparison per page: a page is sampled when its str hash, read as an
 * unsigned 64-bit number, is below `threshold` (the index has that hash in
 * hand already).  Sampled references go through an exact LRU stack; a sampled
 * stack distance d stands for d / rate pages (Waldspurger et al., FAST '15).
 *
 * The stack: each tracked key (its 64-bit hash and tag, in an open-addressing
 * map) carries the timestamp of its last reference.  Live timestamps are bits
 * in a bitmap of `ntimes` bits, cut in 512-bit blocks whose live counts sit in
 * a Fenwick tree, so "how many live timestamps follow t" (the stack distance)
 * is one Fenwick prefix sum plus popcounts inside one 64-byte block.  When the
 * clock reaches `ntimes` the live timestamps are renumbered 0..live-1 in one
 * pass (or the bitmap doubles, up to 4 x max_keys, while more than a quarter of
 * it is live), so a compaction happens at most every 3 x max_keys sampled
 * references.
 *
 * Semantics are those of hicache_existence.core.lru.PySampler, its pure-Python twin
 * and test oracle: every distance of a call is taken before the call's updates;
 * a key repeated within one call is a hit at distance 0 for all but its last
 * occurrence; a lookup does not insert a key the stack does not hold, and the
 * page a lookup missed at is counted (lookup curve) but not moved; beyond
 * max_keys the least recent keys are forgotten.
 *
 * Nothing here calls Python code or allocates Python objects on the recording
 * path (only PyMem memory, which never runs the garbage collector), and
 * nothing raises into the index: a failed allocation drops that call's
 * references and counts them in `lost`.
 */

#define S_FREE 0xFFFFFFFFu
#define S_BLOCK_BITS 9
#define S_BLOCK ((uint32_t)1 << S_BLOCK_BITS)
#define S_WORDS (S_BLOCK / 64)
#define S_MIN_TIMES ((uint32_t)4096)
#define S_MIN_SLOTS ((size_t)1024)
#define S_MAX_KEYS ((Py_ssize_t)1 << 28)
#define S_INLINE 32
#define S_RESCALE_AT 1099511627776.0 /* 2**40 */

typedef struct {
    uint64_t hash; /* the str's hash, as unsigned */
    uint32_t tag;
    uint32_t time; /* S_FREE: an empty slot */
} SEntry;

typedef struct {
    double cold;       /* weighted sampled references the stack did not hold */
    double sampled;    /* weighted sampled references */
    double references; /* weighted references of the whole stream */
} SCurve;

typedef struct {
    PyObject_HEAD
    uint64_t threshold;
    int sample_all; /* rate 1: threshold would be 2**64 */
    Py_ssize_t max_keys;
    double growth; /* per-reference weight growth (half-life decay); 1: none */
    double weight;
    SEntry *map;
    size_t map_mask;
    Py_ssize_t live;
    uint32_t *owner; /* timestamp -> map slot, where the bit is set */
    uint64_t *bits;  /* live timestamps */
    uint32_t *fen;   /* Fenwick tree (1-based) over per-block live counts */
    uint32_t ntimes; /* bitmap size, a power of two >= S_MIN_TIMES */
    uint32_t max_times;
    uint32_t now; /* the next timestamp */
    uint32_t low; /* no live timestamp lies below this */
    SCurve stream;
    SCurve lookups;
    /* Weighted sampled references by sampled stack distance, both curves side by
     * side (one cache line per bucket touched): hist[2*d] stream, hist[2*d+1]
     * lookups. */
    double *hist;
    Py_ssize_t hist_len;
    Py_ssize_t hist_cap;
    unsigned long long raw_references;
    unsigned long long raw_sampled;
    unsigned long long raw_lookups;
    unsigned long long lost; /* page references dropped for lack of memory */
    unsigned long long compactions;
} Sampler;

static PyTypeObject SamplerType;

static inline int
s_sampled(const Sampler *s, Py_hash_t h)
{
    return s->sample_all || (uint64_t)h < s->threshold;
}

/* ---- curves ------------------------------------------------------------ */

/* Add `ws` to the stream curve and `wl` to the lookup curve at distance d. */
static int
s_bucket(Sampler *s, Py_ssize_t d, double ws, double wl)
{
    if (d >= s->hist_len) {
        if (d >= s->hist_cap) {
            Py_ssize_t ncap = s->hist_cap ? s->hist_cap : 256;
            while (ncap <= d) {
                ncap *= 2;
            }
            double *grown = PyMem_Realloc(s->hist, (size_t)ncap * 2 * sizeof(double));
            if (grown == NULL) {
                return -1;
            }
            s->hist = grown;
            s->hist_cap = ncap;
        }
        memset(s->hist + 2 * s->hist_len, 0, (size_t)(d + 1 - s->hist_len) * 2 * sizeof(double));
        s->hist_len = d + 1;
    }
    s->hist[2 * d] += ws;
    s->hist[2 * d + 1] += wl;
    return 0;
}

static void
s_scale(Sampler *s, double f)
{
    for (Py_ssize_t i = 0; i < 2 * s->hist_len; i++) {
        s->hist[i] *= f;
    }
    SCurve *curves[2] = {&s->stream, &s->lookups};
    for (int k = 0; k < 2; k++) {
        curves[k]->cold *= f;
        curves[k]->sampled *= f;
        curves[k]->references *= f;
    }
}

/* ---- the key map --------------------------------------------------------- */

static inline size_t
s_home(uint64_t hash, uint32_t tag, size_t mask)
{
    uint64_t x = hash ^ ((uint64_t)tag * 0x9E3779B97F4A7C15ull);
    x ^= x >> 31;
    return (size_t)x & mask;
}

static inline Py_ssize_t
s_find(const Sampler *s, uint64_t hash, uint32_t tag)
{
    if (s->map == NULL) {
        return -1;
    }
    size_t mask = s->map_mask;
    for (size_t i = s_home(hash, tag, mask);; i = (i + 1) & mask) {
        const SEntry *e = &s->map[i];
        if (e->time == S_FREE) {
            return -1;
        }
        if (e->hash == hash && e->tag == tag) {
            return (Py_ssize_t)i;
        }
    }
}

static int
s_rehash(Sampler *s, size_t nslots)
{
    SEntry *fresh = PyMem_Malloc(nslots * sizeof(SEntry));
    if (fresh == NULL) {
        return -1;
    }
    for (size_t i = 0; i < nslots; i++) {
        fresh[i].time = S_FREE;
    }
    size_t nmask = nslots - 1;
    if (s->map != NULL) {
        for (size_t i = 0; i <= s->map_mask; i++) {
            SEntry e = s->map[i];
            if (e.time == S_FREE) {
                continue;
            }
            size_t j = s_home(e.hash, e.tag, nmask);
            while (fresh[j].time != S_FREE) {
                j = (j + 1) & nmask;
            }
            fresh[j] = e;
            s->owner[e.time] = (uint32_t)j;
        }
        PyMem_Free(s->map);
    }
    s->map = fresh;
    s->map_mask = nmask;
    return 0;
}

/* Backward-shift deletion (no tombstones); moved entries update their owner. */
static void
s_delete_slot(Sampler *s, size_t i)
{
    SEntry *map = s->map;
    size_t mask = s->map_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        SEntry e = map[j];
        if (e.time == S_FREE) {
            break;
        }
        size_t home = s_home(e.hash, e.tag, mask);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            map[i] = e;
            s->owner[e.time] = (uint32_t)i;
            i = j;
        }
    }
    map[i].time = S_FREE;
}

/* ---- live timestamps ------------------------------------------------------ */

static inline void
fen_add(Sampler *s, uint32_t block, int32_t delta)
{
    uint32_t nb = s->ntimes >> S_BLOCK_BITS;
    for (uint32_t i = block + 1; i <= nb; i += i & (0u - i)) {
        s->fen[i] = (uint32_t)((int32_t)s->fen[i] + delta);
    }
}

static inline uint32_t
fen_before(const Sampler *s, uint32_t block)
{
    uint32_t sum = 0;
    for (uint32_t i = block; i > 0; i -= i & (0u - i)) {
        sum += s->fen[i];
    }
    return sum;
}

static void
fen_build(Sampler *s)
{
    uint32_t nb = s->ntimes >> S_BLOCK_BITS;
    s->fen[0] = 0;
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t count = 0;
        for (uint32_t w = 0; w < S_WORDS; w++) {
            count += (uint32_t)__builtin_popcountll(s->bits[b * S_WORDS + w]);
        }
        s->fen[b + 1] = count;
    }
    for (uint32_t i = 1; i <= nb; i++) {
        uint32_t j = i + (i & (0u - i));
        if (j <= nb) {
            s->fen[j] += s->fen[i];
        }
    }
}

/* How many live timestamps are greater than the live timestamp t. */
static inline Py_ssize_t
s_after(const Sampler *s, uint32_t t)
{
    uint32_t block = t >> S_BLOCK_BITS;
    uint32_t upto = fen_before(s, block);
    const uint64_t *w = s->bits + (size_t)block * S_WORDS;
    uint32_t word = (t & (S_BLOCK - 1)) >> 6;
    for (uint32_t k = 0; k < word; k++) {
        upto += (uint32_t)__builtin_popcountll(w[k]);
    }
    uint32_t bit = t & 63;
    uint64_t mask = bit == 63 ? ~(uint64_t)0 : (((uint64_t)1 << (bit + 1)) - 1);
    upto += (uint32_t)__builtin_popcountll(w[word] & mask);
    return s->live - (Py_ssize_t)upto;
}

static inline void
s_set(Sampler *s, uint32_t t)
{
    s->bits[t >> 6] |= (uint64_t)1 << (t & 63);
    fen_add(s, t >> S_BLOCK_BITS, 1);
}

static inline void
s_unset(Sampler *s, uint32_t t)
{
    s->bits[t >> 6] &= ~((uint64_t)1 << (t & 63));
    fen_add(s, t >> S_BLOCK_BITS, -1);
}

/* Renumber the live timestamps 0..live-1 in order (owner moves down in place). */
static void
s_compact(Sampler *s)
{
    uint32_t c = 0;
    for (uint32_t t = s->low; t < s->now; t++) {
        if (s->bits[t >> 6] & ((uint64_t)1 << (t & 63))) {
            uint32_t slot = s->owner[t];
            s->owner[c] = slot;
            s->map[slot].time = c;
            c++;
        }
    }
    memset(s->bits, 0, (size_t)(s->ntimes / 64) * sizeof(uint64_t));
    for (uint32_t t = 0; t < c; t++) {
        s->bits[t >> 6] |= (uint64_t)1 << (t & 63);
    }
    fen_build(s);
    s->now = c;
    s->low = 0;
    s->compactions++;
}

static int
s_grow_times(Sampler *s, uint32_t ntimes)
{
    uint32_t *owner = PyMem_Realloc(s->owner, (size_t)ntimes * sizeof(uint32_t));
    if (owner == NULL) {
        return -1;
    }
    s->owner = owner;
    uint64_t *bits = PyMem_Realloc(s->bits, (size_t)(ntimes / 64) * sizeof(uint64_t));
    if (bits == NULL) {
        return -1;
    }
    memset(bits + s->ntimes / 64, 0, (size_t)((ntimes - s->ntimes) / 64) * sizeof(uint64_t));
    s->bits = bits;
    uint32_t *fen = PyMem_Realloc(s->fen, (size_t)((ntimes >> S_BLOCK_BITS) + 1) * sizeof(uint32_t));
    if (fen == NULL) {
        return -1;
    }
    s->fen = fen;
    s->ntimes = ntimes;
    fen_build(s);
    return 0;
}

/* A free timestamp for the next push: compact, or grow while much is live. */
static int
s_room(Sampler *s)
{
    if (s->ntimes == 0) {
        /* Fresh (or cleared, or a first allocation that failed part-way:
         * ntimes is set only once owner, bits and fen all exist). */
        if (s_grow_times(s, S_MIN_TIMES) < 0) {
            return -1;
        }
    }
    if (s->now < s->ntimes) {
        return 0;
    }
    if ((size_t)s->live * 4 > s->ntimes && s->ntimes < s->max_times) {
        return s_grow_times(s, s->ntimes * 2);
    }
    s_compact(s);
    return s->now < s->ntimes ? 0 : -1;
}

static void
s_forget_slot(Sampler *s, size_t slot)
{
    s_unset(s, s->map[slot].time);
    s_delete_slot(s, slot);
    s->live--;
}

/* Forget the least recent keys beyond max_keys. */
static void
s_trim(Sampler *s)
{
    while (s->live > s->max_keys) {
        uint32_t t = s->low;
        while (!(s->bits[t >> 6] >> (t & 63))) { /* no live bit at or above t in this word */
            t = (t | 63) + 1;
        }
        while (!(s->bits[t >> 6] & ((uint64_t)1 << (t & 63)))) {
            t++;
        }
        s->low = t + 1;
        s_forget_slot(s, s->owner[t]);
    }
}

/* Make (hash, tag) the most recent key. */
static int
s_push(Sampler *s, uint64_t hash, uint32_t tag)
{
    if (s_room(s) < 0) {
        return -1;
    }
    Py_ssize_t slot = s_find(s, hash, tag);
    if (slot >= 0) {
        s_unset(s, s->map[slot].time);
    }
    else {
        size_t nslots = s->map ? s->map_mask + 1 : 0;
        if ((size_t)(s->live + 1) * 4 > nslots * 3) {
            if (s_rehash(s, nslots ? nslots * 2 : S_MIN_SLOTS) < 0) {
                return -1;
            }
        }
        size_t i = s_home(hash, tag, s->map_mask);
        while (s->map[i].time != S_FREE) {
            i = (i + 1) & s->map_mask;
        }
        s->map[i].hash = hash;
        s->map[i].tag = tag;
        slot = (Py_ssize_t)i;
        s->live++;
    }
    uint32_t t = s->now++;
    s->map[slot].time = t;
    s->owner[t] = (uint32_t)slot;
    s_set(s, t);
    s_trim(s);
    return 0;
}

static void
s_clear(Sampler *s)
{
    PyMem_Free(s->map);
    PyMem_Free(s->owner);
    PyMem_Free(s->bits);
    PyMem_Free(s->fen);
    s->map = NULL;
    s->owner = NULL;
    s->bits = NULL;
    s->fen = NULL;
    s->map_mask = 0;
    s->live = 0;
    s->ntimes = 0;
    s->now = s->low = 0;
}

/* ---- recording ------------------------------------------------------------ */

/* Count `total` stream references (`lookups` of them lookup references); returns their weight. */
static double
s_advance(Sampler *s, Py_ssize_t total, Py_ssize_t lookups)
{
    if (s->growth != 1.0) {
        s->weight *= pow(s->growth, (double)total);
        if (s->weight > S_RESCALE_AT) {
            s_scale(s, 1.0 / s->weight);
            s->weight = 1.0;
        }
    }
    double w = s->weight;
    s->stream.references += w * (double)total;
    s->raw_references += (unsigned long long)total;
    if (lookups) {
        s->lookups.references += w * (double)lookups;
        s->raw_lookups += (unsigned long long)lookups;
    }
    return w;
}

/* One call: `k` sampled hashes among `total` references (a lookup when
 * `lookup`, counting `lookups` pages, `missed` the sampled page it missed at
 * when `has_missed`).  `hashes` is the caller's scratch array, reordered. */
static void
s_reference(Sampler *s, uint32_t tag, uint64_t *hashes, Py_ssize_t k, Py_ssize_t total,
            int lookup, Py_ssize_t lookups, int has_missed, uint64_t missed)
{
    double w = s_advance(s, total, lookups);
    SCurve *lk = lookup ? &s->lookups : NULL;
    int failed = 0;
    if (lk != NULL) {
        lk->sampled += w * (double)(k + has_missed);
    }
    if (has_missed) {
        Py_ssize_t slot = s_find(s, missed, tag);
        if (slot < 0) {
            lk->cold += w;
        }
        else {
            failed |= s_bucket(s, s_after(s, s->map[slot].time), 0.0, w);
        }
    }
    if (k == 0) {
        goto done;
    }
    s->raw_sampled += (unsigned long long)k;
    s->stream.sampled += w * (double)k;
    if (k > 1) {
        /* Keep each key's last occurrence only (scanning backwards with a small
         * seen-set); earlier ones are hits at distance 0. */
        size_t nseen = 4;
        while (nseen < (size_t)k * 2) {
            nseen <<= 1;
        }
        uint64_t seen_inline[64];
        unsigned char used_inline[64];
        uint64_t *seen = nseen <= 64 ? seen_inline : PyMem_Malloc(nseen * sizeof(uint64_t));
        unsigned char *used = nseen <= 64 ? used_inline : PyMem_Calloc(nseen, 1);
        if (seen == NULL || used == NULL) {
            if (seen != seen_inline) {
                PyMem_Free(seen);
                PyMem_Free(used);
            }
            s->lost += (unsigned long long)(k + has_missed);
            return;
        }
        if (used == used_inline) {
            memset(used_inline, 0, sizeof(used_inline));
        }
        Py_ssize_t kept = k;
        for (Py_ssize_t i = k - 1; i >= 0; i--) {
            uint64_t h = hashes[i];
            size_t j = (size_t)(h ^ (h >> 29)) & (nseen - 1);
            int dup = 0;
            while (used[j]) {
                if (seen[j] == h) {
                    dup = 1;
                    break;
                }
                j = (j + 1) & (nseen - 1);
            }
            if (dup) {
                failed |= s_bucket(s, 0, w, lk != NULL ? w : 0.0);
                continue;
            }
            used[j] = 1;
            seen[j] = h;
            hashes[--kept] = h; /* survivors packed at the end, in order */
        }
        if (seen != seen_inline) {
            PyMem_Free(seen);
            PyMem_Free(used);
        }
        hashes += kept;
        k -= kept;
    }
    /* Every distance before any update; a lookup drops keys the stack lacks. */
    Py_ssize_t push = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t slot = s_find(s, hashes[i], tag);
        if (slot < 0) {
            s->stream.cold += w;
            if (lk != NULL) {
                lk->cold += w;
                continue;
            }
        }
        else {
            failed |= s_bucket(s, s_after(s, s->map[slot].time), w, lk != NULL ? w : 0.0);
        }
        hashes[push++] = hashes[i];
    }
    for (Py_ssize_t i = 0; i < push; i++) {
        if (s_push(s, hashes[i], tag) < 0) {
            failed = 1;
            break;
        }
    }
done:
    if (failed) {
        s->lost += (unsigned long long)(k + has_missed);
    }
}

/* The hashes of the sampled pages among items[start:stop], into *out (scratch
 * of S_INLINE, or PyMem memory the caller frees when != scratch).  -1: no memory. */
static Py_ssize_t
s_collect(const Sampler *s, PyObject *const *items, Py_ssize_t start, Py_ssize_t stop,
          uint64_t *scratch, uint64_t **out)
{
    uint64_t *buf = scratch;
    Py_ssize_t cap = S_INLINE;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        Py_hash_t h = PyUnicode_Type.tp_hash(items[i]);
        if (!s_sampled(s, h)) {
            continue;
        }
        if (k == cap) {
            Py_ssize_t ncap = cap * 4 > stop - start ? stop - start : cap * 4;
            uint64_t *grown = PyMem_Malloc((size_t)ncap * sizeof(uint64_t));
            if (grown == NULL) {
                if (buf != scratch) {
                    PyMem_Free(buf);
                }
                *out = scratch;
                return -1;
            }
            memcpy(grown, buf, (size_t)k * sizeof(uint64_t));
            if (buf != scratch) {
                PyMem_Free(buf);
            }
            buf = grown;
            cap = ncap;
        }
        buf[k++] = (uint64_t)h;
    }
    *out = buf;
    return k;
}

/* Sampled hashes gathered inside an index loop, where each page's hash is in
 * hand: no second pass over the batch.  More than S_INLINE sampled pages in
 * one call (a chain of ~1600 pages at rate 0.02) fall back to a second pass. */
typedef struct {
    uint64_t buf[S_INLINE];
    Py_ssize_t k;
    int overflow;
} SCollect;

static inline void
sc_offer(SCollect *c, const Sampler *s, Py_hash_t h, uint32_t tag)
{
    if (!s_sampled(s, h)) {
        return;
    }
    if (c->k == S_INLINE) {
        c->overflow = 1;
        return;
    }
    c->buf[c->k++] = (uint64_t)h;
    if (s->map != NULL) {
        /* The stack update after the loop starts with this slot: fetch it now. */
        __builtin_prefetch(&s->map[s_home((uint64_t)h, tag, s->map_mask)]);
    }
}

/* Recording entry points (items: ready str objects, already checked). */

static void
s_record_add(Sampler *s, uint32_t tag, PyObject *const *items, Py_ssize_t n)
{
    uint64_t scratch[S_INLINE];
    uint64_t *keys;
    Py_ssize_t k = s_collect(s, items, 0, n, scratch, &keys);
    if (k < 0) {
        s_advance(s, n, 0);
        s->lost += 1;
        return;
    }
    s_reference(s, tag, keys, k, n, 0, 0, 0, 0);
    if (keys != scratch) {
        PyMem_Free(keys);
    }
}

/* A lookup walked items[:stop] and, if stop < n, missed at items[stop]. */
static void
s_record_walk(Sampler *s, uint32_t tag, PyObject *const *items, Py_ssize_t n, Py_ssize_t stop)
{
    if (n == 0) {
        return;
    }
    if (stop > n) {
        stop = n;
    }
    uint64_t scratch[S_INLINE];
    uint64_t *keys;
    Py_ssize_t k = s_collect(s, items, 0, stop, scratch, &keys);
    Py_ssize_t lookups = stop + (stop < n);
    if (k < 0) {
        s_advance(s, stop, lookups);
        s->lost += 1;
        return;
    }
    int has_missed = 0;
    uint64_t missed = 0;
    if (stop < n) {
        Py_hash_t h = PyUnicode_Type.tp_hash(items[stop]);
        if (s_sampled(s, h)) {
            has_missed = 1;
            missed = (uint64_t)h;
        }
    }
    s_reference(s, tag, keys, k, stop, 1, lookups, has_missed, missed);
    if (keys != scratch) {
        PyMem_Free(keys);
    }
}

/* invalidate_beyond: the sampled keys among items leave the stack. */
static void
s_record_remove(Sampler *s, uint32_t tag, PyObject *const *items, Py_ssize_t n)
{
    if (s->live == 0) {
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_hash_t h = PyUnicode_Type.tp_hash(items[i]);
        if (!s_sampled(s, h)) {
            continue;
        }
        Py_ssize_t slot = s_find(s, (uint64_t)h, tag);
        if (slot >= 0) {
            s_forget_slot(s, (size_t)slot);
        }
    }
}

/* ---- the Python type -------------------------------------------------------- */

/* (The argument helpers are _lru.c's: this file is included after them.) */

/* The batch of hashes and optional tag of a recording call, checked. */
static int
s_parse_batch(PyObject *seq, PyObject *tag_obj, PyObject *const **items, Py_ssize_t *n,
              uint32_t *tag)
{
    if (parse_batch(seq, tag_obj, tag) < 0) {
        return -1;
    }
    *items = PySequence_Fast_ITEMS(seq);
    *n = PySequence_Fast_GET_SIZE(seq);
    return check_items(*items, *n, NULL);
}

/* added() and removed(): (hashes, tag=0) into `record`. */
static PyObject *
s_batch_call(Sampler *self, const char *name, PyObject *const *args, Py_ssize_t nargs,
             void (*record)(Sampler *, uint32_t, PyObject *const *, Py_ssize_t))
{
    PyObject *const *items;
    Py_ssize_t n;
    uint32_t tag;
    if (check_nargs(name, nargs, 1, 2) < 0
        || s_parse_batch(args[0], nargs == 2 ? args[1] : NULL, &items, &n, &tag) < 0) {
        return NULL;
    }
    record(self, tag, items, n);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(s_added_doc,
"added(hashes, tag=0, /) -> None\n\n"
"Record an add of `hashes` (list or tuple of str): every page is a reference.");

static PyObject *
Sampler_added(Sampler *self, PyObject *const *args, Py_ssize_t nargs)
{
    return s_batch_call(self, "added", args, nargs, s_record_add);
}

PyDoc_STRVAR(s_walked_doc,
"walked(hashes, stop, tag=0, /) -> None\n\n"
"Record a lookup that walked hashes[:stop] and, if stop < len(hashes), missed\n"
"at hashes[stop].");

static PyObject *
Sampler_walked(Sampler *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("walked", nargs, 2, 3) < 0) {
        return NULL;
    }
    if (!PyLong_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "stop must be an int, got %.100s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    Py_ssize_t stop = PyNumber_AsSsize_t(args[1], NULL);
    if (stop == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (stop < 0) {
        PyErr_SetString(PyExc_ValueError, "stop must be >= 0");
        return NULL;
    }
    PyObject *const *items;
    Py_ssize_t n;
    uint32_t tag;
    if (s_parse_batch(args[0], nargs == 3 ? args[2] : NULL, &items, &n, &tag) < 0) {
        return NULL;
    }
    s_record_walk(self, tag, items, n, stop);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(s_removed_doc,
"removed(hashes, tag=0, /) -> None\n\n"
"The sampled pages of `hashes` leave the stack (invalidate_beyond).");

static PyObject *
Sampler_removed(Sampler *self, PyObject *const *args, Py_ssize_t nargs)
{
    return s_batch_call(self, "removed", args, nargs, s_record_remove);
}

PyDoc_STRVAR(s_clear_doc, "clear(/) -> None\n\nForget every tracked key (the curves stay).");

static PyObject *
Sampler_clear(Sampler *self, PyObject *Py_UNUSED(ignored))
{
    s_clear(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(s_cumulative_doc,
"cumulative(limits, lookups=False, /) -> list\n\n"
"For each limit, the weighted sampled references at a sampled stack distance\n"
"below it (of the lookup curve when `lookups`).");

static PyObject *
Sampler_cumulative(Sampler *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("cumulative", nargs, 1, 2) < 0) {
        return NULL;
    }
    int lookups = 0;
    if (nargs == 2 && (lookups = PyObject_IsTrue(args[1])) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "limits must be a sequence of int");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t *limits = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(Py_ssize_t));
    if (limits == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyLong_Check(it)) {
            PyErr_Format(PyExc_TypeError, "limits[%zd] must be an int, got %.100s", i,
                         Py_TYPE(it)->tp_name);
            PyMem_Free(limits);
            Py_DECREF(seq);
            return NULL;
        }
        limits[i] = PyNumber_AsSsize_t(it, NULL);
        if (limits[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(limits);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    PyObject *out = PyList_New(m);
    for (Py_ssize_t i = 0; out != NULL && i < m; i++) {
        Py_ssize_t len = self->hist_len;
        Py_ssize_t upto = limits[i] < 0 ? 0 : (limits[i] > len ? len : limits[i]);
        double sum = 0.0;
        for (Py_ssize_t d = 0; d < upto; d++) {
            sum += self->hist[2 * d + lookups];
        }
        PyObject *v = PyFloat_FromDouble(sum);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(limits);
    return out;
}

PyDoc_STRVAR(s_counts_doc,
"counts(/) -> dict\n\n"
"The curves' totals and the raw counters (see hicache_existence.core.lru.PySampler).");

static PyObject *
Sampler_counts(Sampler *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue(
        "{s:d,s:d,s:d,s:d,s:d,s:d,s:K,s:K,s:K,s:n,s:K,s:K}",
        "stream_sampled", self->stream.sampled,
        "stream_cold", self->stream.cold,
        "stream_references", self->stream.references,
        "lookup_sampled", self->lookups.sampled,
        "lookup_cold", self->lookups.cold,
        "lookup_references", self->lookups.references,
        "raw_references", self->raw_references,
        "raw_sampled", self->raw_sampled,
        "raw_lookups", self->raw_lookups,
        "tracked", self->live,
        "lost", self->lost,
        "compactions", self->compactions);
}

static PyObject *
Sampler_sizeof(Sampler *self, PyObject *Py_UNUSED(ignored))
{
    size_t total = sizeof(Sampler);
    if (self->map != NULL) {
        total += (self->map_mask + 1) * sizeof(SEntry);
    }
    if (self->bits != NULL) {
        total += (size_t)self->ntimes * sizeof(uint32_t) + (size_t)(self->ntimes / 8)
                 + (size_t)((self->ntimes >> S_BLOCK_BITS) + 1) * sizeof(uint32_t);
    }
    total += (size_t)self->hist_cap * 2 * sizeof(double);
    return PyLong_FromSize_t(total);
}

static PyObject *
Sampler_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"threshold", "max_keys", "half_life", NULL};
    PyObject *threshold_obj;
    Py_ssize_t max_keys;
    Py_ssize_t half_life = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On|n:Sampler", kwlist, &threshold_obj,
                                     &max_keys, &half_life)) {
        return NULL;
    }
    if (!PyLong_Check(threshold_obj)) {
        PyErr_Format(PyExc_TypeError, "threshold must be an int, got %.100s",
                     Py_TYPE(threshold_obj)->tp_name);
        return NULL;
    }
    int overflow = 0;
    long long signed_threshold = PyLong_AsLongLongAndOverflow(threshold_obj, &overflow);
    if (signed_threshold == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int sample_all = 0;
    uint64_t threshold = 0;
    if (overflow < 0 || (!overflow && signed_threshold < 0)) {
        PyErr_SetString(PyExc_ValueError, "threshold must be in [0, 2**64]");
        return NULL;
    }
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(threshold_obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            /* Beyond 2**64 - 1: only 2**64 itself (sample everything) is valid. */
            PyErr_Clear();
            PyObject *limit = PyLong_FromUnsignedLongLong(0xFFFFFFFFFFFFFFFFull);
            if (limit == NULL) {
                return NULL;
            }
            PyObject *one = PyLong_FromLong(1);
            PyObject *top = one ? PyNumber_Add(limit, one) : NULL;
            Py_DECREF(limit);
            Py_XDECREF(one);
            if (top == NULL) {
                return NULL;
            }
            int eq = PyObject_RichCompareBool(threshold_obj, top, Py_EQ);
            Py_DECREF(top);
            if (eq < 0) {
                return NULL;
            }
            if (!eq) {
                PyErr_SetString(PyExc_ValueError, "threshold must be in [0, 2**64]");
                return NULL;
            }
            sample_all = 1;
        }
        else {
            threshold = (uint64_t)u;
        }
    }
    else {
        threshold = (uint64_t)signed_threshold;
    }
    if (max_keys < 1 || max_keys > S_MAX_KEYS) {
        PyErr_Format(PyExc_ValueError, "max_keys must be in [1, %zd], got %zd", S_MAX_KEYS,
                     max_keys);
        return NULL;
    }
    if (half_life < 0) {
        PyErr_Format(PyExc_ValueError, "half_life must be >= 0, got %zd", half_life);
        return NULL;
    }
    Sampler *self = (Sampler *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->threshold = threshold;
    self->sample_all = sample_all;
    self->max_keys = max_keys;
    self->growth = half_life ? pow(2.0, 1.0 / (double)half_life) : 1.0;
    self->weight = 1.0;
    uint32_t max_times = S_MIN_TIMES;
    while ((size_t)max_times < (size_t)max_keys * 4) {
        max_times <<= 1;
    }
    self->max_times = max_times;
    return (PyObject *)self;
}

static void
Sampler_dealloc(Sampler *self)
{
    s_clear(self);
    PyMem_Free(self->hist);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Sampler_repr(Sampler *self)
{
    return PyUnicode_FromFormat("<Sampler tracked=%zd max_keys=%zd>", self->live,
                                self->max_keys);
}

static PyMethodDef Sampler_methods[] = {
    {"added", (PyCFunction)(void (*)(void))Sampler_added, METH_FASTCALL, s_added_doc},
    {"walked", (PyCFunction)(void (*)(void))Sampler_walked, METH_FASTCALL, s_walked_doc},
    {"removed", (PyCFunction)(void (*)(void))Sampler_removed, METH_FASTCALL, s_removed_doc},
    {"clear", (PyCFunction)Sampler_clear, METH_NOARGS, s_clear_doc},
    {"cumulative", (PyCFunction)(void (*)(void))Sampler_cumulative, METH_FASTCALL,
     s_cumulative_doc},
    {"counts", (PyCFunction)Sampler_counts, METH_NOARGS, s_counts_doc},
    {"__sizeof__", (PyCFunction)Sampler_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Sampler_doc,
"Sampler(threshold, max_keys, half_life=0)\n\n"
"SHARDS reuse-distance sampling of one LRU's reference stream: pages whose str\n"
"hash (as unsigned 64-bit) is below `threshold` (2**64: all) are tracked, up to\n"
"`max_keys` of them.  Attach it to an LruIndex (attach) to feed it from inside\n"
"touch_prefix/add/discard/clear, or feed it by hand.");

static PyTypeObject SamplerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache_existence.core._lru.Sampler",
    .tp_basicsize = sizeof(Sampler),
    .tp_dealloc = (destructor)Sampler_dealloc,
    .tp_repr = (reprfunc)Sampler_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Sampler_doc,
    .tp_methods = Sampler_methods,
    .tp_new = Sampler_new,
};
