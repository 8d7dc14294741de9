/*
 * statecore._keyorder: KeyOrder, an insertion-ordered set of offload keys (exact bytes) with
 * its memory sized once, for the CPU tier's LRU list, and KeyTable, the same with an int
 * value per key, for the CPU tier's key table (statecore/managers/keyorder.py).
 *
 * Why not an OrderedDict: a dict grows by rebuilding its whole table in one call, and an
 * OrderedDict then rebuilds its node index by looking every key up again.  For a tier that
 * fills, those are one-step stalls proportional to the keys held (1.5 ms at 11,000 keys, 200
 * ms at 1.4 million on the development machine), and a full tier pays them again whenever
 * churn compacts the table.  The OrderedDict is also a container the cyclic collector
 * traverses key by key.
 *
 * Layout: a node array and a bucket array, both allocated at construction for `capacity`
 * keys (zeroed memory, so pages the tier never uses are never touched).  A node (40 bytes)
 * holds one key (a strong reference), a KeyTable's value for it (NULL in a KeyOrder), its
 * hash, its neighbours in the order and the next node of its bucket's chain.  Node 0 is the
 * sentinel of the circular order: its `next` is the oldest key, its `prev` the newest.  Index 0 means "none" in buckets and chains.  Freed nodes go
 * on a free list (reused last-freed first).  Holding more than `capacity` keys works (the
 * arrays double), at the cost of one rebuild per doubling: the presizing is a promise about
 * time only, never about what is accepted.
 *
 * Only exact bytes are accepted as keys (TypeError otherwise, before anything changes), so
 * no Python code runs inside an operation: hashing and comparing exact bytes call nothing,
 * and dropping a reference to one frees plain memory.  For the same reason the type holds no
 * reference that can take part in a cycle and is not tracked by the collector.  Iterators
 * check a version number and raise RuntimeError when the set changed under them, as dict
 * iterators do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef uint32_t ko_index;
#define KO_MAX_NODES ((Py_ssize_t)0x7ffffffe)

typedef struct {
    PyObject *key;      /* NULL when the node is free */
    PyObject *value;    /* KeyTable: the key's value (an exact int); KeyOrder: NULL */
    Py_hash_t hash;
    ko_index prev;      /* neighbours in the order (0: the sentinel) */
    ko_index next;
    ko_index chain;     /* next node of the bucket; the free list's link for a free node */
} ko_node;

typedef struct {
    PyObject_HEAD
    ko_node *nodes;       /* nodes[0] is the sentinel; nodes[1..n_nodes] hold keys */
    ko_index *buckets;    /* head node of each bucket's chain, 0 for none */
    size_t mask;          /* number of buckets - 1 (a power of two) */
    Py_ssize_t n_nodes;   /* nodes allocated besides the sentinel */
    Py_ssize_t fresh;     /* nodes handed out so far (1..fresh were used at some time) */
    ko_index free_head;   /* free list (freed nodes), 0 when empty */
    Py_ssize_t len;
    Py_ssize_t capacity;  /* as constructed */
    uint64_t version;     /* bumped by every change, checked by iterators */
} KeyOrder;

/* What an iterator yields: keys, values (KeyTable) or (key, value) pairs (KeyTable). */
enum { KO_KEYS, KO_VALUES, KO_ITEMS };

typedef struct {
    PyObject_HEAD
    KeyOrder *set;
    ko_index at;          /* next node to yield (0: exhausted) */
    uint64_t version;
    int kind;             /* KO_KEYS, KO_VALUES or KO_ITEMS */
} KeyOrderIter;

static PyTypeObject KeyOrder_Type;
static PyTypeObject KeyOrderIter_Type;

static size_t
buckets_for(Py_ssize_t n)
{
    size_t b = 8;
    while ((Py_ssize_t)b < n) b <<= 1;
    return b;
}

/* Allocate the arrays for n nodes; 0 on success, -1 with MemoryError set. */
static int
ko_alloc(KeyOrder *self, Py_ssize_t n)
{
    size_t nb = buckets_for(n);
    self->nodes = (ko_node *)PyMem_RawCalloc((size_t)n + 1, sizeof(ko_node));
    self->buckets = (ko_index *)PyMem_RawCalloc(nb, sizeof(ko_index));
    if (self->nodes == NULL || self->buckets == NULL) {
        PyMem_RawFree(self->nodes);
        PyMem_RawFree(self->buckets);
        self->nodes = NULL;
        self->buckets = NULL;
        PyErr_NoMemory();
        return -1;
    }
    self->mask = nb - 1;
    self->n_nodes = n;
    self->fresh = 0;
    self->free_head = 0;
    self->len = 0;
    return 0;
}

static inline int
key_equal(PyObject *a, PyObject *b)
{
    if (a == b) return 1;
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
}

/* The node holding key (with its hash), or 0. */
static inline ko_index
ko_find(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    ko_index i = self->buckets[(size_t)hash & self->mask];
    while (i != 0) {
        ko_node *nd = &self->nodes[i];
        if (nd->hash == hash && key_equal(nd->key, key)) return i;
        i = nd->chain;
    }
    return 0;
}

static inline void
link_newest(KeyOrder *self, ko_index i)
{
    ko_node *nodes = self->nodes;
    ko_index last = nodes[0].prev;
    nodes[i].prev = last;
    nodes[i].next = 0;
    nodes[last].next = i;
    nodes[0].prev = i;
}

static inline void
unlink_order(KeyOrder *self, ko_index i)
{
    ko_node *nodes = self->nodes;
    nodes[nodes[i].prev].next = nodes[i].next;
    nodes[nodes[i].next].prev = nodes[i].prev;
}

/* Double the arrays (more keys than the capacity): every node keeps its index, the buckets
 * are rebuilt.  0 on success, -1 with MemoryError set (nothing changed). */
static int
ko_grow(KeyOrder *self)
{
    Py_ssize_t n = self->n_nodes;
    if (n >= KO_MAX_NODES) {
        PyErr_SetString(PyExc_OverflowError, "KeyOrder cannot hold more keys");
        return -1;
    }
    Py_ssize_t want = n > KO_MAX_NODES / 2 ? KO_MAX_NODES : (n < 8 ? 8 : 2 * n);
    ko_node *nodes = (ko_node *)PyMem_RawRealloc(self->nodes, ((size_t)want + 1) * sizeof(ko_node));
    if (nodes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(nodes + n + 1, 0, (size_t)(want - n) * sizeof(ko_node));
    self->nodes = nodes;
    size_t nb = buckets_for(want);
    if (nb - 1 != self->mask) {
        ko_index *buckets = (ko_index *)PyMem_RawCalloc(nb, sizeof(ko_index));
        if (buckets == NULL) {
            self->n_nodes = want;  /* the larger node array is kept; the buckets stay valid */
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 1; i <= self->fresh; i++) {
            if (nodes[i].key == NULL) continue;
            size_t b = (size_t)nodes[i].hash & (nb - 1);
            nodes[i].chain = buckets[b];
            buckets[b] = (ko_index)i;
        }
        PyMem_RawFree(self->buckets);
        self->buckets = buckets;
        self->mask = nb - 1;
    }
    self->n_nodes = want;
    return 0;
}

/* Append key (known absent, exact bytes, with its hash) as the newest: its node, or 0
 * (error set). */
static ko_index
ko_insert_node(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    ko_index i = self->free_head;
    if (i != 0) {
        self->free_head = self->nodes[i].chain;
    } else {
        if (self->fresh == self->n_nodes && ko_grow(self) < 0) return 0;
        i = (ko_index)(++self->fresh);
    }
    ko_node *nd = &self->nodes[i];
    Py_INCREF(key);
    nd->key = key;
    nd->hash = hash;
    size_t b = (size_t)hash & self->mask;
    nd->chain = self->buckets[b];
    self->buckets[b] = i;
    link_newest(self, i);
    self->len++;
    return i;
}

/* ko_insert_node for the batch operations: 0 or -1 (error set). */
static int
ko_insert(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    return ko_insert_node(self, key, hash) == 0 ? -1 : 0;
}

/* Take node i, whose bucket-chain link is *link, out of the set and onto the free list,
 * releasing its key and value. */
static void
ko_release_node(KeyOrder *self, ko_index *link, ko_index i)
{
    ko_node *nd = &self->nodes[i];
    *link = nd->chain;
    unlink_order(self, i);
    PyObject *held = nd->key;
    PyObject *value = nd->value;
    nd->key = NULL;
    nd->value = NULL;
    nd->chain = self->free_head;
    self->free_head = i;
    self->len--;
    Py_DECREF(held);  /* exact bytes and ints: frees memory, runs no code */
    Py_XDECREF(value);
}

/* Remove key (exact bytes, with its hash) if present: 1 removed, 0 absent. */
static int
ko_remove(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    ko_index *link = &self->buckets[(size_t)hash & self->mask];
    while (*link != 0) {
        ko_node *nd = &self->nodes[*link];
        if (nd->hash == hash && key_equal(nd->key, key)) {
            ko_release_node(self, link, *link);
            return 1;
        }
        link = &nd->chain;
    }
    return 0;
}

static int
check_key(PyObject *key)
{
    if (PyBytes_CheckExact(key)) return 0;
    PyErr_Format(PyExc_TypeError, "KeyOrder keys are bytes, got %.100s", Py_TYPE(key)->tp_name);
    return -1;
}

/* keys as a fast sequence whose items are all exact bytes (a new reference), or NULL. */
static PyObject *
checked_keys(PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "KeyOrder: keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (check_key(items[k]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

static inline void
move_newest(KeyOrder *self, ko_index i)
{
    if (self->nodes[0].prev != i) {
        unlink_order(self, i);
        link_newest(self, i);
    }
}

/* The per-key operations of the batch methods: 1 or 0 (what they count), -1 on error. */
typedef int (*ko_op)(KeyOrder *self, PyObject *key, Py_hash_t hash);

/* Make key the newest: appended when absent, moved when present. */
static int
op_append(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    ko_index i = ko_find(self, key, hash);
    if (i == 0) return ko_insert(self, key, hash);
    move_newest(self, i);
    return 0;
}

/* Move key to the newest end when present. */
static int
op_touch(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    ko_index i = ko_find(self, key, hash);
    if (i != 0) move_newest(self, i);
    return 0;
}

/* Apply op to each of keys (all checked first: exact bytes), last to first when reverse;
 * the sum of what op answered, or -1 with the error set. */
static Py_ssize_t
ko_batch(KeyOrder *self, PyObject *keys, ko_op op, int reverse)
{
    PyObject *seq = checked_keys(keys);
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t total = 0;
    self->version++;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *key = items[reverse ? n - 1 - k : k];
        Py_hash_t hash = PyObject_Hash(key);  /* exact bytes: cached after the first call */
        int r = hash == -1 ? -1 : op(self, key, hash);
        if (r < 0) {
            Py_DECREF(seq);
            return -1;
        }
        total += r;
    }
    Py_DECREF(seq);
    return total;
}

/* --- methods --------------------------------------------------------------------------- */

static PyObject *
KeyOrder_append(KeyOrder *self, PyObject *key)
{
    if (check_key(key) < 0) return NULL;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return NULL;
    self->version++;
    if (op_append(self, key, hash) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *
KeyOrder_append_many(KeyOrder *self, PyObject *keys)
{
    if (ko_batch(self, keys, op_append, 0) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *
KeyOrder_touch(KeyOrder *self, PyObject *keys)
{
    if (ko_batch(self, keys, op_touch, 1) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *
KeyOrder_discard(KeyOrder *self, PyObject *key)
{
    if (check_key(key) < 0) return NULL;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return NULL;
    self->version++;
    return PyBool_FromLong(ko_remove(self, key, hash));
}

static PyObject *
KeyOrder_discard_many(KeyOrder *self, PyObject *keys)
{
    Py_ssize_t removed = ko_batch(self, keys, ko_remove, 0);
    return removed < 0 ? NULL : PyLong_FromSsize_t(removed);
}

static void
ko_release_all(KeyOrder *self)
{
    if (self->nodes == NULL) return;
    for (Py_ssize_t i = 1; i <= self->fresh; i++) {
        Py_CLEAR(self->nodes[i].key);
        Py_CLEAR(self->nodes[i].value);
    }
}

static PyObject *
KeyOrder_clear(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    /* O(nodes ever used): the buckets of the held keys are emptied one by one, so pages of a
     * large table that were never touched stay untouched */
    self->version++;
    ko_node *nodes = self->nodes;
    for (Py_ssize_t i = 1; i <= self->fresh; i++) {
        if (nodes[i].key == NULL) continue;
        self->buckets[(size_t)nodes[i].hash & self->mask] = 0;
        Py_CLEAR(nodes[i].key);
        Py_CLEAR(nodes[i].value);
    }
    memset(nodes, 0, ((size_t)self->fresh + 1) * sizeof(ko_node));
    self->fresh = 0;
    self->free_head = 0;
    self->len = 0;
    Py_RETURN_NONE;
}

static PyObject *
KeyOrder_oldest(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    ko_index i = self->nodes[0].next;
    if (i == 0) Py_RETURN_NONE;
    return Py_NewRef(self->nodes[i].key);
}

static PyObject *
KeyOrder_sizeof(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    size_t total = sizeof(KeyOrder) + ((size_t)self->n_nodes + 1) * sizeof(ko_node)
                   + (self->mask + 1) * sizeof(ko_index);
    return PyLong_FromSize_t(total);
}

static PyObject *KeyOrder_iter(KeyOrder *self);

/* What iterators and pickling yield of a node: its key, its value or a (key, value) pair;
 * a new reference, or NULL (error set). */
static PyObject *
ko_item(ko_node *nd, int kind)
{
    if (kind == KO_KEYS) return Py_NewRef(nd->key);
    if (kind == KO_VALUES) return Py_NewRef(nd->value);
    return PyTuple_Pack(2, nd->key, nd->value);
}

/* Pickle support for both types: (type, (capacity, [item, ...] oldest first)). */
static PyObject *
ko_reduce(KeyOrder *self, int kind)
{
    PyObject *items = PyList_New(self->len);
    if (items == NULL) return NULL;
    ko_index i = self->nodes[0].next;
    for (Py_ssize_t k = 0; k < self->len; k++) {
        PyObject *item = ko_item(&self->nodes[i], kind);
        if (item == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        PyList_SET_ITEM(items, k, item);
        i = self->nodes[i].next;
    }
    return Py_BuildValue("O(nN)", (PyObject *)Py_TYPE(self), self->capacity, items);
}

static PyObject *
KeyOrder_reduce(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    return ko_reduce(self, KO_KEYS);
}

/* --- construction and protocols -------------------------------------------------------- */

/* A new, empty KeyOrder or KeyTable (type) with room for capacity keys, or NULL. */
static KeyOrder *
ko_new_sized(PyTypeObject *type, Py_ssize_t capacity, const char *name)
{
    if (capacity < 0) {
        PyErr_Format(PyExc_ValueError, "%s capacity must be >= 0", name);
        return NULL;
    }
    if (capacity > KO_MAX_NODES) {
        PyErr_Format(PyExc_OverflowError, "%s capacity must be at most %zd", name, KO_MAX_NODES);
        return NULL;
    }
    KeyOrder *self = (KeyOrder *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->capacity = capacity;
    if (ko_alloc(self, capacity < 8 ? 8 : capacity) < 0) {
        /* no room for the whole capacity up front (a strict overcommit policy): start small
         * and grow as keys arrive; the presizing only ever promises time */
        if (capacity <= 8 || !PyErr_ExceptionMatches(PyExc_MemoryError)) {
            Py_DECREF(self);
            return NULL;
        }
        PyErr_Clear();
        if (ko_alloc(self, 8) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    }
    return self;
}

static PyObject *
KeyOrder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "keys", NULL};
    Py_ssize_t capacity;
    PyObject *keys = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|O:KeyOrder", kwlist, &capacity, &keys))
        return NULL;
    KeyOrder *self = ko_new_sized(type, capacity, "KeyOrder");
    if (self == NULL) return NULL;
    if (keys != NULL && keys != Py_None) {
        PyObject *r = KeyOrder_append_many(self, keys);
        if (r == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        Py_DECREF(r);
    }
    return (PyObject *)self;
}

static void
KeyOrder_dealloc(KeyOrder *self)
{
    ko_release_all(self);
    PyMem_RawFree(self->nodes);
    PyMem_RawFree(self->buckets);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
KeyOrder_len(KeyOrder *self)
{
    return self->len;
}

static int
KeyOrder_contains(KeyOrder *self, PyObject *key)
{
    if (!PyBytes_CheckExact(key)) return 0;  /* only bytes are ever held */
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return -1;
    return ko_find(self, key, hash) != 0;
}

static PyObject *
KeyOrder_repr(KeyOrder *self)
{
    return PyUnicode_FromFormat("KeyOrder(capacity=%zd, len=%zd)", self->capacity, self->len);
}

static PyObject *
KeyOrder_get_capacity(KeyOrder *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->capacity);
}

static PyObject *
ko_iter_of(KeyOrder *self, int kind)
{
    KeyOrderIter *it = PyObject_New(KeyOrderIter, &KeyOrderIter_Type);
    if (it == NULL) return NULL;
    it->set = (KeyOrder *)Py_NewRef((PyObject *)self);
    it->at = self->nodes[0].next;
    it->version = self->version;
    it->kind = kind;
    return (PyObject *)it;
}

static PyObject *
KeyOrder_iter(KeyOrder *self)
{
    return ko_iter_of(self, KO_KEYS);
}

static void
KeyOrderIter_dealloc(KeyOrderIter *it)
{
    Py_XDECREF(it->set);
    PyObject_Free(it);
}

static PyObject *
KeyOrderIter_next(KeyOrderIter *it)
{
    KeyOrder *set = it->set;
    if (set == NULL) return NULL;
    if (set->version != it->version) {
        const char *name = strrchr(Py_TYPE(set)->tp_name, '.');
        PyErr_Format(PyExc_RuntimeError, "%s changed during iteration", name ? name + 1 : "?");
        return NULL;
    }
    ko_index i = it->at;
    if (i == 0) {
        it->set = NULL;
        Py_DECREF(set);
        return NULL;
    }
    it->at = set->nodes[i].next;
    return ko_item(&set->nodes[i], it->kind);
}

static PyMethodDef KeyOrder_methods[] = {
    {"append", (PyCFunction)KeyOrder_append, METH_O,
     "append(key): make key the newest (appended when absent, moved when present)."},
    {"append_many", (PyCFunction)KeyOrder_append_many, METH_O,
     "append_many(keys): append(key) for each key in order (the last one newest)."},
    {"touch", (PyCFunction)KeyOrder_touch, METH_O,
     "touch(keys): move the present keys to the newest end, last to first (the first key "
     "ends newest); absent keys are ignored."},
    {"discard", (PyCFunction)KeyOrder_discard, METH_O,
     "discard(key) -> bool: remove key if present; whether it was."},
    {"discard_many", (PyCFunction)KeyOrder_discard_many, METH_O,
     "discard_many(keys) -> int: discard each key; how many were present."},
    {"clear", (PyCFunction)KeyOrder_clear, METH_NOARGS, "clear(): remove every key."},
    {"oldest", (PyCFunction)KeyOrder_oldest, METH_NOARGS,
     "oldest() -> bytes | None: the oldest key, or None when empty."},
    {"__sizeof__", (PyCFunction)KeyOrder_sizeof, METH_NOARGS,
     "Bytes of the object and its arrays (allocated, whether touched or not)."},
    {"__reduce__", (PyCFunction)KeyOrder_reduce, METH_NOARGS, "Pickle support."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyOrder_getset[] = {
    {"capacity", (getter)KeyOrder_get_capacity, NULL, "The capacity it was built for.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeyOrder_as_sequence = {
    .sq_length = (lenfunc)KeyOrder_len,
    .sq_contains = (objobjproc)KeyOrder_contains,
};

static PyTypeObject KeyOrder_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "statecore._keyorder.KeyOrder",
    .tp_basicsize = sizeof(KeyOrder),
    .tp_dealloc = (destructor)KeyOrder_dealloc,
    .tp_repr = (reprfunc)KeyOrder_repr,
    .tp_as_sequence = &KeyOrder_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyOrder(capacity, keys=None): an insertion-ordered set of bytes keys, oldest "
              "first, with memory for capacity keys allocated once.",
    .tp_iter = (getiterfunc)KeyOrder_iter,
    .tp_methods = KeyOrder_methods,
    .tp_getset = KeyOrder_getset,
    .tp_new = KeyOrder_new,
};

static PyTypeObject KeyOrderIter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "statecore._keyorder.KeyOrderIterator",
    .tp_basicsize = sizeof(KeyOrderIter),
    .tp_dealloc = (destructor)KeyOrderIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)KeyOrderIter_next,
};

/* --- KeyTable: an insertion-ordered map of bytes keys to ints ------------------------------
 *
 * The same nodes and buckets as KeyOrder, each node also holding its key's value, with a
 * dict's semantics for the operations the CPU tier's key table uses: setting a present key
 * replaces its value and keeps its place in the order; a new key is the newest; iteration
 * runs oldest first.  Keys are exact bytes and values exact ints (TypeError otherwise,
 * before any change), so releasing either runs no code; a lookup of anything else answers
 * "absent" after hashing it (an unhashable key is a TypeError, as with a dict).  Replacing
 * a value does not invalidate iterators (a dict's rule); inserting or removing a key does.
 */

static PyTypeObject KeyTable_Type;

/* The node holding key, 0 when absent, -1 with an error set (an unhashable key). */
static Py_ssize_t
kt_node_of(KeyOrder *self, PyObject *key)
{
    Py_hash_t hash = PyObject_Hash(key);  /* exact bytes: cached after the first call */
    if (hash == -1) return -1;
    if (!PyBytes_CheckExact(key)) return 0;  /* only exact bytes are ever held */
    return (Py_ssize_t)ko_find(self, key, hash);
}

static int
kt_check_item(PyObject *key, PyObject *value)
{
    if (!PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "KeyTable keys are bytes, got %.100s",
                     Py_TYPE(key)->tp_name);
        return -1;
    }
    if (!PyLong_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "KeyTable values are ints, got %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    return 0;
}

/* Set key to value (both checked); 0 or -1 (error set, nothing changed). */
static int
kt_set(KeyOrder *self, PyObject *key, PyObject *value)
{
    if (kt_check_item(key, value) < 0) return -1;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return -1;
    ko_index i = ko_find(self, key, hash);
    if (i != 0) {
        PyObject *old = self->nodes[i].value;
        self->nodes[i].value = Py_NewRef(value);
        Py_XDECREF(old);  /* an exact int: runs no code */
        return 0;
    }
    i = ko_insert_node(self, key, hash);
    if (i == 0) return -1;
    self->nodes[i].value = Py_NewRef(value);
    self->version++;
    return 0;
}

/* Remove node i (found by kt_node_of) and hand its value to the caller: a new reference. */
static PyObject *
kt_take(KeyOrder *self, Py_ssize_t i)
{
    ko_index node = (ko_index)i;
    PyObject *value = Py_NewRef(self->nodes[node].value);
    ko_index *link = &self->buckets[(size_t)self->nodes[node].hash & self->mask];
    while (*link != node) link = &self->nodes[*link].chain;  /* (its chain holds it) */
    ko_release_node(self, link, node);
    self->version++;
    return value;
}

static void
kt_key_error(PyObject *key)
{
    PyObject *arg = PyTuple_Pack(1, key);  /* (a tuple key must not be unpacked) */
    if (arg != NULL) {
        PyErr_SetObject(PyExc_KeyError, arg);
        Py_DECREF(arg);
    }
}

static PyObject *
KeyTable_subscript(KeyOrder *self, PyObject *key)
{
    Py_ssize_t i = kt_node_of(self, key);
    if (i < 0) return NULL;
    if (i == 0) {
        kt_key_error(key);
        return NULL;
    }
    return Py_NewRef(self->nodes[i].value);
}

static int
KeyTable_ass_subscript(KeyOrder *self, PyObject *key, PyObject *value)
{
    if (value != NULL) return kt_set(self, key, value);
    Py_ssize_t i = kt_node_of(self, key);
    if (i < 0) return -1;
    if (i == 0) {
        kt_key_error(key);
        return -1;
    }
    Py_DECREF(kt_take(self, i));
    return 0;
}

static int
KeyTable_contains(KeyOrder *self, PyObject *key)
{
    Py_ssize_t i = kt_node_of(self, key);
    return i < 0 ? -1 : i != 0;
}

static PyObject *
KeyTable_get(KeyOrder *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t i = kt_node_of(self, args[0]);
    if (i < 0) return NULL;
    if (i != 0) return Py_NewRef(self->nodes[i].value);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *
KeyTable_pop(KeyOrder *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t i = kt_node_of(self, args[0]);
    if (i < 0) return NULL;
    if (i != 0) return kt_take(self, i);
    if (nargs == 2) return Py_NewRef(args[1]);
    kt_key_error(args[0]);
    return NULL;
}

/* One (key, value) pair of update's iterable, set; 0 or -1 (error set). */
static int
kt_set_pair(KeyOrder *self, PyObject *pair, Py_ssize_t n)
{
    if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2) {
        return kt_set(self, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
    }
    PyObject *seq = PySequence_Fast(pair, "");
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "KeyTable.update: element #%zd is not a (key, value) pair", n);
        return -1;
    }
    int r;
    if (PySequence_Fast_GET_SIZE(seq) != 2) {
        PyErr_Format(PyExc_ValueError,
                     "KeyTable.update: element #%zd is not a (key, value) pair", n);
        r = -1;
    } else {
        r = kt_set(self, PySequence_Fast_GET_ITEM(seq, 0), PySequence_Fast_GET_ITEM(seq, 1));
    }
    Py_DECREF(seq);
    return r;
}

static PyObject *
KeyTable_update(KeyOrder *self, PyObject *items)
{
    /* a mapping (a dict, a KeyTable, anything with items()) gives its pairs */
    PyObject *source = PyObject_HasAttrString(items, "items")
                           ? PyObject_CallMethod(items, "items", NULL)
                           : Py_NewRef(items);
    if (source == NULL) return NULL;
    PyObject *it = PyObject_GetIter(source);
    Py_DECREF(source);
    if (it == NULL) return NULL;
    /* one pair at a time, nothing held across the iterator's next step (which may run code
     * that changes this table): zip can reuse its pair tuple, and a change is seen */
    PyObject *pair;
    Py_ssize_t n = 0;
    while ((pair = PyIter_Next(it)) != NULL) {
        int r = kt_set_pair(self, pair, n++);
        Py_DECREF(pair);
        if (r < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *
KeyTable_keys(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    return ko_iter_of(self, KO_KEYS);
}

static PyObject *
KeyTable_values(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    return ko_iter_of(self, KO_VALUES);
}

static PyObject *
KeyTable_items(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    return ko_iter_of(self, KO_ITEMS);
}

static PyObject *
KeyTable_reduce(KeyOrder *self, PyObject *Py_UNUSED(ignored))
{
    return ko_reduce(self, KO_ITEMS);
}

static PyObject *
KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "items", NULL};
    Py_ssize_t capacity;
    PyObject *items = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|O:KeyTable", kwlist, &capacity, &items))
        return NULL;
    KeyOrder *self = ko_new_sized(type, capacity, "KeyTable");
    if (self == NULL) return NULL;
    if (items != NULL && items != Py_None) {
        PyObject *r = KeyTable_update(self, items);
        if (r == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        Py_DECREF(r);
    }
    return (PyObject *)self;
}

static PyObject *
KeyTable_repr(KeyOrder *self)
{
    return PyUnicode_FromFormat("KeyTable(capacity=%zd, len=%zd)", self->capacity, self->len);
}

static PyObject *
KeyTable_contains_method(KeyOrder *self, PyObject *key)
{
    int r = KeyTable_contains(self, key);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyMethodDef KeyTable_methods[] = {
    /* (as a dict does: bound `table.__contains__` and `table.__getitem__`, which the tier
     * maps over keys, then call these directly instead of through a slot wrapper) */
    {"__contains__", (PyCFunction)KeyTable_contains_method, METH_O | METH_COEXIST,
     "key in table"},
    {"__getitem__", (PyCFunction)KeyTable_subscript, METH_O | METH_COEXIST, "table[key]"},
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL,
     "get(key, default=None): key's value, or default when absent."},
    {"pop", (PyCFunction)(void (*)(void))KeyTable_pop, METH_FASTCALL,
     "pop(key[, default]): remove key and return its value; default (or KeyError) when "
     "absent."},
    {"update", (PyCFunction)KeyTable_update, METH_O,
     "update(items): set each (key, value) pair of an iterable or mapping, in order."},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys(): an iterator, oldest first."},
    {"values", (PyCFunction)KeyTable_values, METH_NOARGS,
     "values(): an iterator over the values, oldest key first."},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS,
     "items(): an iterator over (key, value) pairs, oldest first."},
    {"clear", (PyCFunction)KeyOrder_clear, METH_NOARGS, "clear(): remove every key."},
    {"__sizeof__", (PyCFunction)KeyOrder_sizeof, METH_NOARGS,
     "Bytes of the object and its arrays (allocated, whether touched or not)."},
    {"__reduce__", (PyCFunction)KeyTable_reduce, METH_NOARGS, "Pickle support."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    .mp_length = (lenfunc)KeyOrder_len,
    .mp_subscript = (binaryfunc)KeyTable_subscript,
    .mp_ass_subscript = (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTable_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "statecore._keyorder.KeyTable",
    .tp_basicsize = sizeof(KeyOrder),
    .tp_dealloc = (destructor)KeyOrder_dealloc,
    .tp_repr = (reprfunc)KeyTable_repr,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyTable(capacity, items=None): an insertion-ordered map of bytes keys to ints, "
              "oldest first, with memory for capacity keys allocated once.",
    .tp_iter = (getiterfunc)KeyOrder_iter,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyOrder_getset,
    .tp_new = KeyTable_new,
};

static int
ko_exec(PyObject *module)
{
    if (PyType_Ready(&KeyOrder_Type) < 0) return -1;
    if (PyType_Ready(&KeyOrderIter_Type) < 0) return -1;
    if (PyType_Ready(&KeyTable_Type) < 0) return -1;
    if (PyModule_AddObjectRef(module, "KeyOrder", (PyObject *)&KeyOrder_Type) < 0) return -1;
    if (PyModule_AddObjectRef(module, "KeyTable", (PyObject *)&KeyTable_Type) < 0) return -1;
    return 0;
}

static struct PyModuleDef_Slot slots[] = {
    {Py_mod_exec, ko_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "statecore._keyorder",
    .m_doc = "KeyOrder and KeyTable: an insertion-ordered set of bytes keys and map of bytes "
             "keys to ints, each sized once (the CPU tier's LRU list and key table).",
    .m_size = 0,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__keyorder(void)
{
    return PyModuleDef_Init(&module_def);
}
