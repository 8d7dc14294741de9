/*
 * statecore.adapters._hostcopy: batched host memory copies that run without the GIL.
 *
 * The torch adapter's CPU path plans a job as segments: two index lists (GPU block ids, CPU
 * sub-rows) with the base address and stride of each side.  Copying page by page through
 * ctypes re-takes the GIL after every page, so two copy threads spend their time handing it
 * to each other.  Here the indices of a whole piece are read into C arrays while the GIL is
 * held, then the GIL is released once while the addresses are computed, runs that continue
 * each other are merged, and the bytes move.
 *
 * Streaming (stream=True, chosen by the caller for jobs much larger than the caches): the
 * runs are copied with non-temporal stores, and a read-ahead walks PREFETCH_AHEAD bytes in
 * front of the copy along the piece's blocks (across as many as that takes), prefetching the
 * source and, as it enters a block, one line of each page the block's destination touches.
 * Scattered blocks are short runs at random addresses: the hardware prefetcher stops at every
 * 4 KiB page and restarts on each new run, every page is a TLB miss, and ordinary stores first
 * read every destination line (read-for-ownership) into a cache it will not be read from
 * again soon.  A run whose two ranges overlap, and every run on a machine without SSE2, is
 * copied with memmove.
 *
 * ids_valid is the accepting half of that validation at C speed (one pass over each id
 * list, a bitmap for repeated slots); when it says no, the caller's Python check names the
 * fault.
 *
 * The caller owns the addresses: every index must have been validated (every range inside a
 * live buffer that stays alive for the call).  Nothing here checks them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define STACK_COPIES 64
/* How far ahead of the copy the source is prefetched, in bytes of the job's sequence of blocks
 * (the read-ahead walks on across as many blocks as that takes), and the prefetch's locality
 * (1: prefetcht2).  Measured on a 2-core AMD EPYC virtual machine, one thread: from 8 to
 * 32 KiB ahead did about as well at 4, 16 and 64 KiB blocks, 4 KiB less well at 16 and 64 KiB.
 * (An earlier read-ahead stopped at the end of the next run, so "8 KiB ahead" at 4 KiB blocks
 * prefetched nothing.)  Overridable for such experiments. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 16384
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 1
#endif
/* When the read-ahead enters a block, also prefetch the first line the copy will write in each
 * 4 KiB page of its destination, so that the page's TLB entry is there before the stores. */
#ifndef WARM_DST_PAGES
#define WARM_DST_PAGES 1
#endif

#if HAVE_STREAM
/* The read-ahead: a position in the piece's source bytes, block after block, PREFETCH_AHEAD
 * bytes in front of the copy.  Each step prefetches the line it is on and moves 64 bytes on.
 * Every address it forms lies inside a block of the piece (the caller validated them). */
typedef struct {
    const size_t *s, *d;   /* the piece's source and destination indices */
    Py_ssize_t next, count; /* the block it enters next, the piece's blocks */
    uintptr_t src_base, dst_base;
    size_t src_stride, dst_stride, nbytes;
    const char *at;        /* the next line to prefetch (NULL: past the piece's end) */
    size_t left;           /* bytes of its block from at on */
} readahead;

/* Enter the next block (or leave the piece); warm the destination pages it will write. */
static void
readahead_enter(readahead *ra)
{
    if (ra->next >= ra->count) {
        ra->at = NULL;
        ra->left = 0;
        return;
    }
    Py_ssize_t k = ra->next++;
    ra->at = (const char *)(ra->src_base + ra->s[k] * ra->src_stride);
    ra->left = ra->nbytes;
#if WARM_DST_PAGES
    /* A store that misses the TLB waits for the walk; the copy's own prefetch covers only the
     * source.  A block that starts inside a page and ends in another (the KV tensors of
     * torch's allocator start 64 bytes into a page) touches one page more than it holds. */
    uintptr_t d = ra->dst_base + ra->d[k] * ra->dst_stride, end = d + ra->nbytes;
    for (uintptr_t p = d; p < end; p = (p | 4095) + 1) {
        __builtin_prefetch((const void *)p, 0, 0);
    }
#endif
}

static inline void
readahead_step(readahead *ra)
{
    if (ra->at == NULL) return;
    __builtin_prefetch(ra->at, 0, PREFETCH_LOCALITY);
    if (ra->left > 64) {
        ra->at += 64;
        ra->left -= 64;
    } else {
        readahead_enter(ra);
    }
}

/* Copy len bytes from s to d (not overlapping) with non-temporal stores, one read-ahead step
 * per 64 bytes. */
static void
stream_run(char *d, const char *s, size_t len, readahead *ra)
{
    size_t head = (size_t)(-(uintptr_t)d) & 15; /* bytes until d is 16-byte aligned */
    if (head > len) head = len;
    if (head) memcpy(d, s, head);
    size_t o = head;
    for (; o + 64 <= len; o += 64) {
        readahead_step(ra);
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + o));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(s + o + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + o + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(s + o + 48));
        _mm_stream_si128((__m128i *)(d + o), x0);
        _mm_stream_si128((__m128i *)(d + o + 16), x1);
        _mm_stream_si128((__m128i *)(d + o + 32), x2);
        _mm_stream_si128((__m128i *)(d + o + 48), x3);
    }
    if (o < len) memcpy(d + o, s + o, len - o);
}
#endif

/* Do [a, a+n) and [b, b+n) share a byte? */
static int
overlap(uintptr_t a, uintptr_t b, size_t n)
{
    return a < b + n && b < a + n;
}

/* Read items [lo, hi) of a list or tuple of ints into out[0 .. hi-lo). */
static int
read_ints(PyObject *seq, Py_ssize_t lo, Py_ssize_t hi, size_t *out, const char *what)
{
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = lo; i < hi; i++) {
        size_t v = PyLong_AsSize_t(items[i]);
        if (v == (size_t)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError,
                         "copy_blocks: %s[%zd] is not a non-negative int that fits in size_t",
                         what, i);
            return -1;
        }
        out[i - lo] = v;
    }
    return 0;
}

PyDoc_STRVAR(copy_blocks_doc,
"copy_blocks(dst_base, dst_stride, dst_index, src_base, src_stride, src_index, nbytes,\n"
"            start=0, stop=None, stream=False, /) -> tuple[int, int]\n"
"\n"
"For every i in range(start, stop): copy nbytes bytes from host address\n"
"src_base + src_index[i] * src_stride to dst_base + dst_index[i] * dst_stride.\n"
"dst_index and src_index are lists or tuples of non-negative ints of equal length.\n"
"Where both strides equal nbytes, copies whose indices go up by one on both sides are\n"
"merged into one memmove.  The GIL is released while the bytes move.  Returns\n"
"(bytes copied, runs copied).\n"
"\n"
"With a true stream, runs are copied with non-temporal stores while the next bytes of the\n"
"source (across runs) are prefetched: for jobs far larger than the caches, whose\n"
"destination is not read again soon.  Overlapping runs, and every run where the machine\n"
"has no SSE2, are copied with memmove.\n"
"\n"
"The addresses are trusted: the caller must have checked every index.");

static int
arg_size(PyObject *obj, size_t *out, const char *what)
{
    size_t v = PyLong_AsSize_t(obj);
    if (v == (size_t)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError,
                     "copy_blocks: %s must be a non-negative int that fits in size_t", what);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *
copy_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 7 || nargs > 10) {
        PyErr_Format(PyExc_TypeError,
                     "copy_blocks expects 7 to 10 positional arguments, got %zd", nargs);
        return NULL;
    }
    size_t dst_base, dst_stride, src_base, src_stride, nbytes;
    if (arg_size(args[0], &dst_base, "dst_base") < 0
        || arg_size(args[1], &dst_stride, "dst_stride") < 0
        || arg_size(args[3], &src_base, "src_base") < 0
        || arg_size(args[4], &src_stride, "src_stride") < 0
        || arg_size(args[6], &nbytes, "nbytes") < 0) {
        return NULL;
    }
    PyObject *dst = PySequence_Fast(args[2], "copy_blocks: dst_index must be a list or tuple");
    if (dst == NULL) return NULL;
    PyObject *src = PySequence_Fast(args[5], "copy_blocks: src_index must be a list or tuple");
    if (src == NULL) { Py_DECREF(dst); return NULL; }

    PyObject *result = NULL;
    size_t *buf = NULL;
    size_t stack[2 * STACK_COPIES];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dst);
    if (PySequence_Fast_GET_SIZE(src) != n) {
        PyErr_Format(PyExc_ValueError,
                     "copy_blocks: dst_index and src_index differ in length (%zd, %zd)",
                     n, PySequence_Fast_GET_SIZE(src));
        goto done;
    }
    Py_ssize_t lo = 0, hi = n;
    if (nargs > 7) {
        lo = PyLong_AsSsize_t(args[7]);
        if (lo == -1 && PyErr_Occurred()) goto done;
    }
    if (nargs > 8 && args[8] != Py_None) {
        hi = PyLong_AsSsize_t(args[8]);
        if (hi == -1 && PyErr_Occurred()) goto done;
    }
    int stream = 0;
    if (nargs > 9) {
        stream = PyObject_IsTrue(args[9]);
        if (stream < 0) goto done;
    }
    if (lo < 0 || hi > n || lo > hi) {
        PyErr_Format(PyExc_ValueError,
                     "copy_blocks: range [%zd, %zd) is not inside the %zd copies", lo, hi, n);
        goto done;
    }
    Py_ssize_t count = hi - lo;
    if (count <= STACK_COPIES) {
        buf = stack;
    } else {
        buf = (size_t *)PyMem_RawMalloc(2 * (size_t)count * sizeof(size_t));
        if (buf == NULL) { PyErr_NoMemory(); goto done; }
    }
    size_t *d = buf, *s = buf + count;
    if (read_ints(dst, lo, hi, d, "dst_index") < 0 || read_ints(src, lo, hi, s, "src_index") < 0) {
        goto done;
    }
    int mergeable = dst_stride == nbytes && src_stride == nbytes;
    size_t total = 0, calls = 0;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_STREAM
    readahead ra = {s, d, 0, count, src_base, dst_base, src_stride, dst_stride, nbytes, NULL, 0};
    if (stream && nbytes > 0) { /* start the read-ahead where the copy starts, send it ahead */
        readahead_enter(&ra);
        for (size_t step = PREFETCH_AHEAD / 64; step > 0; step--) readahead_step(&ra);
    }
#endif
    for (Py_ssize_t i = 0; i < count;) {
        Py_ssize_t j = i + 1; /* the run [i, j) */
        if (mergeable) {
            while (j < count && d[j] == d[j - 1] + 1 && s[j] == s[j - 1] + 1) j++;
        }
        uintptr_t to = dst_base + d[i] * dst_stride, from = src_base + s[i] * src_stride;
        size_t len = (size_t)(j - i) * nbytes;
#if HAVE_STREAM
        if (stream && !overlap(to, from, len)) {
            stream_run((char *)to, (const char *)from, len, &ra);
        } else {
            memmove((void *)to, (const void *)from, len);
        }
#else
        (void)stream;
        (void)overlap;
        memmove((void *)to, (const void *)from, len);
#endif
        total += len;
        calls++;
        i = j;
    }
#if HAVE_STREAM
    if (stream) _mm_sfence(); /* order the non-temporal stores before the GIL is taken back */
#endif
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nn)", (Py_ssize_t)total, (Py_ssize_t)calls);
done:
    if (buf != NULL && buf != stack) PyMem_RawFree(buf);
    Py_DECREF(dst);
    Py_DECREF(src);
    return result;
}

PyDoc_STRVAR(ids_valid_doc,
"ids_valid(block_ids, num_gpu_blocks, slots, num_slots, /) -> bool\n"
"\n"
"True when every block id is an int in [0, num_gpu_blocks), every slot an int in\n"
"[0, num_slots) and no slot is listed twice; False otherwise, and also whenever it cannot\n"
"tell cheaply (an item that is not an int, more than 2**27 slots): the caller then checks\n"
"in Python, which names what is wrong.  block_ids and slots are lists or tuples.");

/* Largest slot count checked here: a bitmap of 16 MiB (beyond it, Python's set). */
#define IDS_MAX_SLOTS ((Py_ssize_t)1 << 27)

/* 1 when every item of seq is an int in [0, bound), 0 otherwise (error indicator clear). */
static int
all_below(PyObject *seq, Py_ssize_t bound, unsigned char *seen)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i])) return 0;
        Py_ssize_t v = PyLong_AsSsize_t(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (v < 0 || v >= bound) return 0;
        if (seen != NULL) {
            unsigned char bit = (unsigned char)(1u << (v & 7));
            if (seen[v >> 3] & bit) return 0;
            seen[v >> 3] |= bit;
        }
    }
    return 1;
}

static PyObject *
ids_valid(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "ids_valid expects 4 positional arguments, got %zd",
                     nargs);
        return NULL;
    }
    Py_ssize_t num_blocks = PyLong_AsSsize_t(args[1]);
    if (num_blocks == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t num_slots = PyLong_AsSsize_t(args[3]);
    if (num_slots == -1 && PyErr_Occurred()) return NULL;
    PyObject *blocks = PySequence_Fast(args[0], "ids_valid: block_ids must be a list or tuple");
    if (blocks == NULL) return NULL;
    PyObject *slots = PySequence_Fast(args[2], "ids_valid: slots must be a list or tuple");
    if (slots == NULL) {
        Py_DECREF(blocks);
        return NULL;
    }
    int ok = 0;
    if (num_slots >= 0 && num_slots <= IDS_MAX_SLOTS && all_below(blocks, num_blocks, NULL)) {
        if (PySequence_Fast_GET_SIZE(slots) == 0) {
            ok = 1;
        } else {
            unsigned char *seen = (unsigned char *)PyMem_RawCalloc((size_t)num_slots / 8 + 1, 1);
            if (seen == NULL) {
                Py_DECREF(blocks);
                Py_DECREF(slots);
                return PyErr_NoMemory();
            }
            ok = all_below(slots, num_slots, seen);
            PyMem_RawFree(seen);
        }
    }
    Py_DECREF(blocks);
    Py_DECREF(slots);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"copy_blocks", (PyCFunction)(void (*)(void))copy_blocks, METH_FASTCALL, copy_blocks_doc},
    {"ids_valid", (PyCFunction)(void (*)(void))ids_valid, METH_FASTCALL, ids_valid_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef_Slot slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_hostcopy",
    "Batched host memory copies that release the GIL, and the check of a job's ids (statecore's\n"
"torch adapter, CPU path).",
    0,
    methods,
    slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__hostcopy(void)
{
    return PyModuleDef_Init(&module_def);
}
