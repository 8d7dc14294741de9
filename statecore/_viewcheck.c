/*
 * statecore._viewcheck: the accepting half of the step views' checks, at C speed.
 *
 * The views (statecore/views.py: ScheduledRequest, ScheduledColumns, SchedulerOutput) check
 * their fields when they are built, in Python.  Each function here is called first by the
 * view's __post_init__ with the fields as arguments.  It only ever accepts: when every field
 * has the plain form an engine adapter hands over (exact list/tuple/set/frozenset/str/int
 * types, ints >= 0, None for an absent block entry), it stores the normalised fields exactly
 * as the Python path would (tuples of tuples, the group counts) and returns True; for
 * anything else (a subclass, a bool where an int belongs, an object posing as None, a
 * negative id, a missing attribute) it returns False, stores nothing, and the caller's Python
 * path rules on the input and names the fault with the typed error.  So what is accepted
 * never depends on whether this module is built; it only decides how fast a well-formed
 * step is accepted.  block_lists does the same for the block lists the scheduler's
 * update_state_after_alloc is given (statecore/scheduler/planning.py, admitted_lists), with the
 * entries' own normalisation: it returns the groups as a tuple of tuples, or None to decline.
 *
 * Safety: no Python code is called while a value is checked (only exact built-in types are
 * read).  An allocation can run the cyclic collector, and a finalizer could then mutate a
 * list the caller still holds: every list is therefore first copied into a tuple this module
 * owns (the copy is needed for the result anyway), and the copy is what is checked and
 * stored.  Errors (memory) propagate; every reference is released on every path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if PY_VERSION_HEX >= 0x030C0000
#define VC_OBJECT_EX Py_T_OBJECT_EX
#else
#include <structmember.h>
#define VC_OBJECT_EX T_OBJECT_EX
#endif

typedef struct {
    PyObject *req_ids;              /* attribute names, interned */
    PyObject *new_block_ids;
    PyObject *num_scheduled_tokens;
    PyObject *resumed_req_ids;
    PyObject *group_counts;
    PyObject *scheduled;
    PyObject *no_groups;            /* frozenset(), frozenset({1}): the usual group counts */
    PyObject *one_group;
} vc_state;

static inline vc_state *
get_state(PyObject *module)
{
    return (vc_state *)PyModule_GetState(module);
}

/* 1 when v is an int (exactly, not a bool or another subclass) >= 0, of any size. */
static inline int
nonneg_int(PyObject *v)
{
    if (!PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    long x = PyLong_AsLongAndOverflow(v, &overflow);
    if (overflow != 0) return overflow > 0;
    if (x == -1 && PyErr_Occurred()) { /* not reached for an exact int */
        PyErr_Clear();
        return 0;
    }
    return x >= 0;
}

/* 1 when every item of the tuple t is an int >= 0. */
static int
ids_ok(PyObject *t)
{
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!nonneg_int(PyTuple_GET_ITEM(t, i))) return 0;
    }
    return 1;
}

/* Decline: no result and no error.  Fail: no result, error set. */
#define DECLINE ((PyObject *)NULL)

/* One group (a list or tuple of block ids) as a checked tuple: a new reference; NULL without
 * an error when it is not acceptable here, NULL with an error on failure. */
static PyObject *
norm_group(PyObject *g)
{
    PyObject *t;
    if (PyTuple_CheckExact(g)) {
        Py_INCREF(g);
        t = g;
    } else if (PyList_CheckExact(g)) {
        t = PyList_AsTuple(g); /* the copy is checked: the list cannot change under it */
        if (t == NULL) return NULL;
    } else {
        return DECLINE;
    }
    if (!ids_ok(t)) {
        Py_DECREF(t);
        return DECLINE;
    }
    return t;
}

/* One entry (a list or tuple of groups) as a tuple of checked tuples: a new reference (the
 * entry itself when it already is one); NULL as for norm_group.  *ngroups: its length. */
static PyObject *
norm_entry(PyObject *e, Py_ssize_t *ngroups)
{
    if (PyTuple_CheckExact(e)) { /* already a tuple of tuples: no allocation */
        Py_ssize_t n = PyTuple_GET_SIZE(e);
        Py_ssize_t i = 0;
        for (; i < n; i++) {
            PyObject *g = PyTuple_GET_ITEM(e, i);
            if (!PyTuple_CheckExact(g) || !ids_ok(g)) break;
        }
        if (i == n) {
            *ngroups = n;
            Py_INCREF(e);
            return e;
        }
    } else if (!PyList_CheckExact(e)) {
        return DECLINE;
    }
    PyObject *snap = PySequence_Tuple(e); /* a list is copied; a tuple is itself */
    if (snap == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(snap);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        Py_DECREF(snap);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *g = norm_group(PyTuple_GET_ITEM(snap, i));
        if (g == NULL) {
            Py_DECREF(out);
            Py_DECREF(snap);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, g);
    }
    Py_DECREF(snap);
    *ngroups = n;
    return out;
}

/* Group counts: lengths below 64 in a bit mask, longer ones in a set (created on demand). */
typedef struct {
    uint64_t mask;
    PyObject *more;
} counts_acc;

static int
counts_add(counts_acc *acc, Py_ssize_t n)
{
    if (n < 64) {
        acc->mask |= (uint64_t)1 << n;
        return 0;
    }
    if (acc->more == NULL) {
        acc->more = PySet_New(NULL);
        if (acc->more == NULL) return -1;
    }
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL) return -1;
    int rc = PySet_Add(acc->more, v);
    Py_DECREF(v);
    return rc;
}

/* The frozenset of the counts (new reference; NULL with an error); releases acc. */
static PyObject *
counts_frozen(vc_state *st, counts_acc *acc)
{
    if (acc->more == NULL && (acc->mask == 0 || acc->mask == 2)) {
        PyObject *r = acc->mask == 0 ? st->no_groups : st->one_group;
        Py_INCREF(r);
        return r;
    }
    PyObject *fs = PyFrozenSet_New(acc->more); /* NULL: empty */
    Py_CLEAR(acc->more);
    if (fs == NULL) return NULL;
    for (Py_ssize_t k = 0; k < 64; k++) {
        if (!(acc->mask & ((uint64_t)1 << k))) continue;
        PyObject *v = PyLong_FromSsize_t(k);
        if (v == NULL || PySet_Add(fs, v) < 0) { /* a brand-new frozenset may be filled */
            Py_XDECREF(v);
            Py_DECREF(fs);
            return NULL;
        }
        Py_DECREF(v);
    }
    return fs;
}

/* 1 when every item of the set or frozenset s is a str (a subclass too, as str.join
 * accepts), 0 otherwise.  Iterating a set runs no Python code. */
static int
all_str(PyObject *s, int *failed)
{
    if (PySet_GET_SIZE(s) == 0) return 1;
    PyObject *it = PyObject_GetIter(s);
    if (it == NULL) {
        *failed = 1;
        return 0;
    }
    PyObject *v;
    int ok = 1;
    while ((v = PyIter_Next(it)) != NULL) {
        ok = PyUnicode_Check(v);
        Py_DECREF(v);
        if (!ok) break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) *failed = 1;
    return ok && !*failed;
}

static inline int
is_set(PyObject *s)
{
    return PyFrozenSet_CheckExact(s) || PySet_CheckExact(s);
}

static inline int
is_seq(PyObject *s)
{
    return PyList_CheckExact(s) || PyTuple_CheckExact(s);
}

/* ---------------------------------------------------------------------------------------- */

PyDoc_STRVAR(request_doc,
"request(self, req_id, new_block_ids, num_scheduled_tokens, resumed_from_preemption, /)\n"
"-> bool\n"
"\n"
"ScheduledRequest's accepting check: True when req_id is a str, num_scheduled_tokens an\n"
"int >= 0, resumed_from_preemption a bool and new_block_ids a list or tuple of lists or\n"
"tuples of ints >= 0 (the lists then stored on self as tuples); False, storing nothing,\n"
"for anything else (the caller's Python check rules on it).");

static PyObject *
request(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "request expects 5 positional arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *self = args[0], *ids = args[2];
    if (!PyUnicode_CheckExact(args[1]) || !nonneg_int(args[3]) || !PyBool_Check(args[4]))
        Py_RETURN_FALSE;
    Py_ssize_t ngroups;
    PyObject *norm = norm_entry(ids, &ngroups);
    if (norm == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    int rc = 0;
    if (norm != ids) rc = PyObject_GenericSetAttr(self, get_state(module)->new_block_ids, norm);
    Py_DECREF(norm);
    if (rc < 0) return NULL;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(columns_doc,
"columns(self, req_ids, new_block_ids, num_scheduled_tokens, resumed_req_ids, /) -> bool\n"
"\n"
"ScheduledColumns' accepting check: True when the three columns are lists or tuples of\n"
"one length, the ids str, the counts ints >= 0, every block entry None or a list or tuple\n"
"of lists or tuples of ints >= 0, and resumed_req_ids a set or frozenset of str; the\n"
"columns are then stored on self as tuples (the entries as tuples of tuples, the resumed\n"
"ids as a frozenset) with group_counts.  False, storing nothing, for anything else.");

static PyObject *
columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "columns expects 5 positional arguments, got %zd", nargs);
        return NULL;
    }
    vc_state *st = get_state(module);
    PyObject *self = args[0];
    if (!is_seq(args[1]) || !is_seq(args[2]) || !is_seq(args[3]) || !is_set(args[4]))
        Py_RETURN_FALSE;
    PyObject *rids = NULL, *blocks = NULL, *counts = NULL, *resumed = NULL, *out = NULL;
    PyObject *gc = NULL, *result = NULL;
    counts_acc acc = {0, NULL};
    int failed = 0;
    Py_ssize_t n;
    /* copies first (lists only; a tuple is itself), then the checks on the copies */
    rids = PySequence_Tuple(args[1]);
    if (rids == NULL) goto error;
    blocks = PySequence_Tuple(args[2]);
    if (blocks == NULL) goto error;
    counts = PySequence_Tuple(args[3]);
    if (counts == NULL) goto error;
    n = PyTuple_GET_SIZE(rids);
    if (PyTuple_GET_SIZE(blocks) != n || PyTuple_GET_SIZE(counts) != n) goto decline;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(rids, i))) goto decline;
        if (!nonneg_int(PyTuple_GET_ITEM(counts, i))) goto decline;
    }
    if (PyFrozenSet_CheckExact(args[4])) {
        Py_INCREF(args[4]);
        resumed = args[4];
    } else {
        resumed = PyFrozenSet_New(args[4]);
        if (resumed == NULL) goto error;
    }
    if (!all_str(resumed, &failed)) {
        if (failed) goto error;
        goto decline;
    }
    out = PyTuple_New(n);
    if (out == NULL) goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(blocks, i);
        if (e == Py_None) {
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(out, i, Py_None);
            continue;
        }
        Py_ssize_t ngroups;
        PyObject *norm = norm_entry(e, &ngroups);
        if (norm == NULL) {
            if (PyErr_Occurred()) goto error;
            goto decline;
        }
        PyTuple_SET_ITEM(out, i, norm);
        if (counts_add(&acc, ngroups) < 0) goto error;
    }
    gc = counts_frozen(st, &acc);
    if (gc == NULL) goto error;
    if (PyObject_GenericSetAttr(self, st->req_ids, rids) < 0
        || PyObject_GenericSetAttr(self, st->new_block_ids, out) < 0
        || PyObject_GenericSetAttr(self, st->num_scheduled_tokens, counts) < 0
        || PyObject_GenericSetAttr(self, st->resumed_req_ids, resumed) < 0
        || PyObject_GenericSetAttr(self, st->group_counts, gc) < 0)
        goto error;
    result = Py_True;
    goto done;
decline:
    result = Py_False;
    goto done;
error:
    result = NULL;
done:
    Py_XINCREF(result);
    Py_XDECREF(acc.more);
    Py_XDECREF(gc);
    Py_XDECREF(out);
    Py_XDECREF(resumed);
    Py_XDECREF(counts);
    Py_XDECREF(blocks);
    Py_XDECREF(rids);
    return result;
}

PyDoc_STRVAR(output_doc,
"output(self, scheduled, new_req_ids, finished_req_ids, preempted_req_ids,\n"
"       extra_allocated_block_ids, columns, entry_type, columns_type, /) -> bool\n"
"\n"
"SchedulerOutput's accepting check: True when scheduled is a list or tuple of entries of\n"
"exactly entry_type whose block lists are tuples, the three id sets sets or frozensets of\n"
"str, the extra block ids a set or frozenset of ints >= 0 and columns None or exactly a\n"
"columns_type; scheduled is then stored on self as a tuple (when it was a list) with\n"
"group_counts.  False, storing nothing, for anything else.");

static PyObject *
output(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "output expects 9 positional arguments, got %zd", nargs);
        return NULL;
    }
    vc_state *st = get_state(module);
    PyObject *self = args[0], *extra = args[5], *cols = args[6];
    PyObject *entry_type = args[7], *columns_type = args[8];
    if (!PyType_Check(entry_type) || !PyType_Check(columns_type)) {
        PyErr_SetString(PyExc_TypeError, "output: entry_type and columns_type must be types");
        return NULL;
    }
    if (!is_seq(args[1]) || !is_set(args[2]) || !is_set(args[3]) || !is_set(args[4])
        || !is_set(extra) || !(cols == Py_None || Py_IS_TYPE(cols, (PyTypeObject *)columns_type)))
        Py_RETURN_FALSE;
    /* the entries' block lists are read from their slot (entry_type's member descriptor) */
    PyObject *descr = _PyType_Lookup((PyTypeObject *)entry_type, st->new_block_ids);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) Py_RETURN_FALSE;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != VC_OBJECT_EX) Py_RETURN_FALSE;
    Py_ssize_t offset = member->offset;

    PyObject *scheduled = NULL, *colcounts = NULL, *gc = NULL, *result = NULL;
    counts_acc acc = {0, NULL};
    int failed = 0;
    Py_ssize_t n;
    for (int k = 2; k <= 4; k++) {
        if (!all_str(args[k], &failed)) {
            if (failed) goto error;
            goto decline;
        }
    }
    if (PySet_GET_SIZE(extra) != 0) {
        PyObject *it = PyObject_GetIter(extra);
        if (it == NULL) goto error;
        PyObject *v;
        int ok = 1;
        while ((v = PyIter_Next(it)) != NULL) {
            ok = nonneg_int(v);
            Py_DECREF(v);
            if (!ok) break;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) goto error;
        if (!ok) goto decline;
    }
    scheduled = PySequence_Tuple(args[1]);
    if (scheduled == NULL) goto error;
    n = PyTuple_GET_SIZE(scheduled);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyTuple_GET_ITEM(scheduled, i);
        if (!Py_IS_TYPE(s, (PyTypeObject *)entry_type)) goto decline;
        PyObject *ids = *(PyObject **)((char *)s + offset);
        if (ids == NULL || !PyTuple_CheckExact(ids)) goto decline;
        if (counts_add(&acc, PyTuple_GET_SIZE(ids)) < 0) goto error;
    }
    if (cols != Py_None) {
        colcounts = PyObject_GetAttr(cols, st->group_counts);
        if (colcounts == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto error;
            PyErr_Clear();
            goto decline;
        }
        if (!PyFrozenSet_CheckExact(colcounts)) goto decline;
        if (PySet_GET_SIZE(colcounts) != 0) {
            PyObject *it = PyObject_GetIter(colcounts);
            if (it == NULL) goto error;
            PyObject *v;
            int ok = 1;
            while ((v = PyIter_Next(it)) != NULL) {
                Py_ssize_t c = -1;
                if (nonneg_int(v)) c = PyLong_AsSsize_t(v);
                Py_DECREF(v);
                if (c < 0) {
                    PyErr_Clear(); /* beyond Py_ssize_t: the Python path */
                    ok = 0;
                    break;
                }
                if (counts_add(&acc, c) < 0) {
                    Py_DECREF(it);
                    goto error;
                }
            }
            Py_DECREF(it);
            if (PyErr_Occurred()) goto error;
            if (!ok) goto decline;
        }
    }
    gc = counts_frozen(st, &acc);
    if (gc == NULL) goto error;
    if (scheduled != args[1] && PyObject_GenericSetAttr(self, st->scheduled, scheduled) < 0)
        goto error;
    if (PyObject_GenericSetAttr(self, st->group_counts, gc) < 0) goto error;
    result = Py_True;
    goto done;
decline:
    result = Py_False;
    goto done;
error:
    result = NULL;
done:
    Py_XINCREF(result);
    Py_XDECREF(acc.more);
    Py_XDECREF(gc);
    Py_XDECREF(colcounts);
    Py_XDECREF(scheduled);
    return result;
}

PyDoc_STRVAR(block_lists_doc,
"block_lists(block_ids, n_groups, /) -> tuple[tuple[int, ...], ...] | None\n"
"\n"
"The accepting check of OffloadingScheduler.update_state_after_alloc's block lists: when\n"
"block_ids is a list or tuple of n_groups lists or tuples of ints >= 0, the groups as a\n"
"tuple of tuples (a ScheduledRequest entry's normalisation: an already normalised entry is\n"
"itself), as the scheduler's Python check returns them.  None for anything else (the\n"
"Python check rules on it).");

static PyObject *
block_lists(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "block_lists expects 2 positional arguments, got %zd",
                     nargs);
        return NULL;
    }
    int overflow = 0;
    Py_ssize_t want = PyLong_CheckExact(args[1]) ? PyLong_AsLongAndOverflow(args[1], &overflow)
                                                 : -1;
    if (want < 0 || overflow != 0) Py_RETURN_NONE;
    Py_ssize_t ngroups;
    PyObject *norm = norm_entry(args[0], &ngroups);
    if (norm == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (ngroups != want) {
        Py_DECREF(norm);
        Py_RETURN_NONE;
    }
    return norm;
}

static PyMethodDef methods[] = {
    {"request", (PyCFunction)(void (*)(void))request, METH_FASTCALL, request_doc},
    {"columns", (PyCFunction)(void (*)(void))columns, METH_FASTCALL, columns_doc},
    {"output", (PyCFunction)(void (*)(void))output, METH_FASTCALL, output_doc},
    {"block_lists", (PyCFunction)(void (*)(void))block_lists, METH_FASTCALL, block_lists_doc},
    {NULL, NULL, 0, NULL},
};

static int
vc_exec(PyObject *module)
{
    vc_state *st = get_state(module);
#define INTERN(field, text)                                                                    \
    do {                                                                                       \
        st->field = PyUnicode_InternFromString(text);                                          \
        if (st->field == NULL) return -1;                                                      \
    } while (0)
    INTERN(req_ids, "req_ids");
    INTERN(new_block_ids, "new_block_ids");
    INTERN(num_scheduled_tokens, "num_scheduled_tokens");
    INTERN(resumed_req_ids, "resumed_req_ids");
    INTERN(group_counts, "group_counts");
    INTERN(scheduled, "scheduled");
#undef INTERN
    st->no_groups = PyFrozenSet_New(NULL);
    if (st->no_groups == NULL) return -1;
    st->one_group = PyFrozenSet_New(NULL);
    if (st->one_group == NULL) return -1;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) return -1;
    int rc = PySet_Add(st->one_group, one);
    Py_DECREF(one);
    return rc;
}

static int
vc_traverse(PyObject *module, visitproc visit, void *arg)
{
    vc_state *st = get_state(module);
    Py_VISIT(st->no_groups);
    Py_VISIT(st->one_group);
    return 0;
}

static int
vc_clear(PyObject *module)
{
    vc_state *st = get_state(module);
    Py_CLEAR(st->req_ids);
    Py_CLEAR(st->new_block_ids);
    Py_CLEAR(st->num_scheduled_tokens);
    Py_CLEAR(st->resumed_req_ids);
    Py_CLEAR(st->group_counts);
    Py_CLEAR(st->scheduled);
    Py_CLEAR(st->no_groups);
    Py_CLEAR(st->one_group);
    return 0;
}

static void
vc_free(void *module)
{
    vc_clear((PyObject *)module);
}

static struct PyModuleDef_Slot slots[] = {
    {Py_mod_exec, vc_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_viewcheck",
    "The accepting half of the step views' checks at C speed (statecore.views); whatever it\n"
"does not accept, the views' Python checks rule on.",
    sizeof(vc_state),
    methods,
    slots,
    vc_traverse,
    vc_clear,
    vc_free,
};

PyMODINIT_FUNC
PyInit__viewcheck(void)
{
    return PyModuleDef_Init(&module_def);
}
