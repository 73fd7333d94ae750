/* kernels._nontemporal: batched outer products written with non-temporal (streaming) stores.

   out[b, o, i] = g[b, o] * a[b, i] for float32 buffers, the per-sample weight gradient of a
   Linear layer (kernels/per_sample.py). An ordinary store to a cache line that is not cached
   first reads the line from memory (a read for ownership), so writing N bytes moves 2N; a
   non-temporal store writes the line whole and moves N. It pays where the output is larger
   than the last-level cache and its pages are already mapped (a reused buffer): a page the
   kernel maps on the first write is zeroed in the cache, where an ordinary store then finds it.

   outer(g, a, out, (B, O, I), threads)  g (B, O), a (B, I), out (B, O, I): C-contiguous float32
                                         buffers; the B*O rows split over `threads` OpenMP threads
   outer_all(parts, threads) -> reads    parts: a sequence of (g, a, out, (B, O, I)) as outer's, all
                                         written in one parallel region, their rows split over the
                                         threads by elements (a small part does not get a thread
                                         alone); the outs must not overlap the other parts' memory.
                                         reads: per part, (the largest |g|, the largest |a|) of the
                                         values its products read (all of g and a where B*O*I > 0,
                                         else none: 0.0), NaN where one read is NaN
   resident(buffer) -> bool              every page of it is resident (mincore); a store can still
                                         fault on a copy-on-write or zero page
   NONTEMPORAL                           True where this build has streaming stores (SSE2)
   MAX_THREADS                           the most threads outer takes

   The rows are split over an OpenMP team, not threads of its own: built with -fopenmp, the module
   needs libgomp.so.1, which the loader resolves to the copy torch already loaded, so the team is
   torch's intra-op pool. Threads of its own would contend with that pool's workers, which spin
   on their cores for a while after each torch op: on a 2-vCPU host a started thread then waited
   for a scheduler slice, and a call took 2x as long. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define NONTEMPORAL 1
#else
#define NONTEMPORAL 0
#endif

#define MAX_THREADS 256

typedef struct {
    const float *g, *a;
    float *out;
    Py_ssize_t O, I, rows, start; /* rows = B*O of length I; start: its first element among all parts' */
} Part;

/* One row: out[0:I] = s * a[0:I]. Scalar head to a cache-line boundary, then whole lines of
   four streaming stores each (a line written whole in one go leaves the write-combining buffer
   at once), scalar tail: each element is the one float32 product torch.mul computes. Not its
   bits for a NaN times a NaN: x86 keeps the payload of the instruction's first operand, which the
   compiler may swap (a multiply commutes), and the streaming loop's is a's where torch's is s's. */
static void row(float *restrict dst, const float *restrict a, float s, Py_ssize_t I) {
    Py_ssize_t i = 0;
#if NONTEMPORAL
    const __m128 vs = _mm_set1_ps(s);
    for (; i < I && ((uintptr_t)(dst + i) & 63); i++) dst[i] = _mm_cvtss_f32(_mm_mul_ss(vs, _mm_load_ss(a + i)));
    for (; i + 16 <= I; i += 16) {
        _mm_stream_ps(dst + i, _mm_mul_ps(vs, _mm_loadu_ps(a + i)));
        _mm_stream_ps(dst + i + 4, _mm_mul_ps(vs, _mm_loadu_ps(a + i + 4)));
        _mm_stream_ps(dst + i + 8, _mm_mul_ps(vs, _mm_loadu_ps(a + i + 8)));
        _mm_stream_ps(dst + i + 12, _mm_mul_ps(vs, _mm_loadu_ps(a + i + 12)));
    }
    for (; i < I; i++) dst[i] = _mm_cvtss_f32(_mm_mul_ss(vs, _mm_load_ss(a + i)));
#else
    for (; i < I; i++) dst[i] = s * a[i];
#endif
}

/* The largest |x[i]| of n floats, NaN where one is NaN (maxps keeps its second operand where
   either is NaN, so NaNs are flagged apart). */
static float absmax(const float *x, Py_ssize_t n) {
    float top = 0.0f;
    int nan = 0;
    Py_ssize_t i = 0;
#if NONTEMPORAL
    const __m128 sign = _mm_set1_ps(-0.0f);
    __m128 m = _mm_setzero_ps(), unordered = _mm_setzero_ps();
    for (; i + 4 <= n; i += 4) {
        __m128 v = _mm_loadu_ps(x + i);
        unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
        m = _mm_max_ps(m, _mm_andnot_ps(sign, v));
    }
    float lanes[4];
    _mm_storeu_ps(lanes, m);
    nan = _mm_movemask_ps(unordered) != 0;
    for (int k = 0; k < 4; k++) top = lanes[k] > top ? lanes[k] : top;
#endif
    for (; i < n; i++) {
        nan |= isnan(x[i]);
        top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    }
    return nan ? NAN : top;
}

/* The larger of two reads, NaN where either is. */
static float wider(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : (a > b ? a : b); }

/* The rows of `parts` whose first element (counted over all parts in order) lies in [e0, e1):
   a thread's share, so every row is written by exactly one thread. reads[2k], reads[2k+1]: the
   largest |g| and |a| of part k this share read (each a row of a read once a share). */
static void run(const Part *parts, Py_ssize_t n, Py_ssize_t e0, Py_ssize_t e1, float *reads) {
    for (Py_ssize_t k = 0; k < n; k++) {
        const Part *p = parts + k;
        Py_ssize_t end = p->start + p->rows * p->I;
        if (p->I == 0 || end <= e0 || p->start >= e1) continue;
        Py_ssize_t r0 = e0 <= p->start ? 0 : (e0 - p->start + p->I - 1) / p->I;
        Py_ssize_t r1 = e1 >= end ? p->rows : (e1 - p->start + p->I - 1) / p->I;
        float big_g = 0.0f, big_a = 0.0f;
        for (Py_ssize_t r = r0, last = -1; r < r1; r++) {
            Py_ssize_t b = r / p->O;
            const float s = p->g[r];
            row(p->out + r * p->I, p->a + b * p->I, s, p->I);
            big_g = wider(big_g, fabsf(s));
            if (b != last) {  /* a sample's input row, read once for its first row here */
                big_a = wider(big_a, absmax(p->a + b * p->I, p->I));
                last = b;
            }
        }
        reads[2 * k] = big_g;
        reads[2 * k + 1] = big_a;
    }
#if NONTEMPORAL
    _mm_sfence(); /* streaming stores are weakly ordered: drain them before the caller reads */
#endif
}

/* a * b where it stays under a float32 buffer's largest element count (its bytes fit a
   Py_ssize_t), else -1 */
static Py_ssize_t count(Py_ssize_t a, Py_ssize_t b) {
    return (b != 0 && a > PY_SSIZE_T_MAX / 4 / b) ? -1 : a * b;
}

/* A C-contiguous float32 buffer of exactly `want` elements, or a Python error naming `name`. */
static int get(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t want, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != 4 || view->format == NULL || view->format[0] != 'f' || view->format[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s must hold float32 ('f'), got format '%s'", name,
                     view->format ? view->format : "B");
    } else if (view->len != want * 4) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd float32 elements, got %zd", name, want, view->len / 4);
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

/* One part's buffers, checked against its shape (B, O, I), into `part` (its start set by the
   caller); 0, or -1 with a Python error and nothing held. */
static int take(PyObject *go, PyObject *ao, PyObject *oo, Py_ssize_t B, Py_ssize_t O, Py_ssize_t I,
                Py_buffer views[3], Part *part) {
    if (B < 0 || O < 0 || I < 0) {
        PyErr_Format(PyExc_ValueError, "shape must be (B, O, I) >= 0, got (%zd, %zd, %zd)", B, O, I);
        return -1;
    }
    Py_ssize_t rows = count(B, O), inputs = count(B, I), total = rows < 0 ? -1 : count(rows, I);
    if (rows < 0 || inputs < 0 || total < 0) {
        PyErr_Format(PyExc_ValueError, "shape (%zd, %zd, %zd) is too large for a float32 buffer", B, O, I);
        return -1;
    }
    if (get(go, &views[0], 0, rows, "g") < 0) return -1;
    if (get(ao, &views[1], 0, inputs, "a") < 0) { PyBuffer_Release(&views[0]); return -1; }
    if (get(oo, &views[2], 1, total, "out") < 0) {
        PyBuffer_Release(&views[0]);
        PyBuffer_Release(&views[1]);
        return -1;
    }
    *part = (Part){views[0].buf, views[1].buf, views[2].buf, O, I, rows, 0};
    return 0;
}

/* Write the n parts (starts set here) on `threads` threads, each a contiguous share of their
   elements, the GIL released; `reads` (2n floats): each part's largest |g| and |a| read (run's),
   over the threads. -1 with a Python error where their elements together pass a float32 buffer's
   largest count, or memory for the threads' reads is short. */
static int write_parts(Part *parts, Py_ssize_t n, Py_ssize_t threads, float *reads) {
    Py_ssize_t elements = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t size = parts[k].rows * parts[k].I; /* checked by take() */
        if (size > PY_SSIZE_T_MAX / 4 - elements) {
            PyErr_SetString(PyExc_ValueError, "the parts together are too large for float32 buffers");
            return -1;
        }
        parts[k].start = elements;
        elements += size;
    }
    Py_ssize_t rows = 0;
    for (Py_ssize_t k = 0; k < n; k++) rows += parts[k].rows;
    if (threads > rows) threads = rows > 0 ? rows : 1;
    float *shares = PyMem_Calloc(threads * (n ? 2 * n : 1), sizeof(float)); /* a thread's reads each */
    if (shares == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (Py_ssize_t t = 0; t < threads; t++)
        run(parts, n, elements / threads * t + elements % threads * t / threads,
            elements / threads * (t + 1) + elements % threads * (t + 1) / threads, shares + 2 * n * t);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < 2 * n; k++) {
        reads[k] = 0.0f;
        for (Py_ssize_t t = 0; t < threads; t++) reads[k] = wider(reads[k], shares[2 * n * t + k]);
    }
    PyMem_Free(shares);
    return 0;
}

static int check_threads(Py_ssize_t threads) {
    if (threads >= 1 && threads <= MAX_THREADS) return 0;
    PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %zd", MAX_THREADS, threads);
    return -1;
}

static PyObject *outer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *go, *ao, *oo;
    Py_ssize_t B, O, I, threads;
    if (!PyArg_ParseTuple(args, "OOO(nnn)n:outer", &go, &ao, &oo, &B, &O, &I, &threads)) return NULL;
    if (check_threads(threads) < 0) return NULL;
    Py_buffer views[3];
    Part part;
    if (take(go, ao, oo, B, O, I, views, &part) < 0) return NULL;
    float reads[2];
    int ok = write_parts(&part, 1, threads, reads);
    for (int v = 0; v < 3; v++) PyBuffer_Release(&views[v]);
    if (ok < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *outer_all(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    Py_ssize_t threads;
    if (!PyArg_ParseTuple(args, "On:outer_all", &seq, &threads)) return NULL;
    if (check_threads(threads) < 0) return NULL;
    /* a tuple of its own: Python code run while a part is parsed (an __index__) cannot drop a part */
    PyObject *items = PySequence_Check(seq) ? PySequence_Tuple(seq) : NULL;
    if (items == NULL) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "parts must be a sequence of (g, a, out, (B, O, I))");
        }
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(items), held = 0;
    float *reads = NULL;
    PyObject *result = NULL;
    Part *parts = PyMem_Calloc(n ? n : 1, sizeof(Part));
    Py_buffer *views = PyMem_Calloc(n ? 3 * n : 1, sizeof(Py_buffer));
    if (parts == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        PyObject *go, *ao, *oo, *item = PyTuple_GET_ITEM(items, held);
        Py_ssize_t B, O, I;
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError, "parts[%zd] must be a tuple (g, a, out, (B, O, I)), got %s", held,
                         Py_TYPE(item)->tp_name);
            goto done;
        }
        if (!PyArg_ParseTuple(item, "OOO(nnn):outer_all part", &go, &ao, &oo, &B, &O, &I)
            || take(go, ao, oo, B, O, I, views + 3 * held, parts + held) < 0)
            goto done;
    }
    reads = PyMem_Calloc(n ? 2 * n : 1, sizeof(float));
    if (reads == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (write_parts(parts, n, threads, reads) == 0 && (result = PyList_New(n)) != NULL) {
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *pair = Py_BuildValue("(dd)", (double)reads[2 * k], (double)reads[2 * k + 1]);
            if (pair == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, k, pair);
        }
    }
done:
    for (Py_ssize_t k = 0; k < 3 * held; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(parts);
    PyMem_Free(views);
    PyMem_Free(reads);
    Py_DECREF(items);
    if (PyErr_Occurred()) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *resident(PyObject *self, PyObject *obj) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)view.buf / page * page, hi = (uintptr_t)view.buf + view.len;
    size_t pages = (hi - lo + page - 1) / page;
    int all = 1;
    if (pages) {
        unsigned char *vec = malloc(pages);
        if (vec == NULL) { PyBuffer_Release(&view); return PyErr_NoMemory(); }
        if (mincore((void *)lo, hi - lo, vec) != 0) all = 0; /* cannot tell: treat as not mapped */
        for (size_t p = 0; all && p < pages; p++) all = vec[p] & 1;
        free(vec);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(all);
}

static PyMethodDef methods[] = {
    {"outer", outer, METH_VARARGS, "outer(g, a, out, (B, O, I), threads): out[b,o,i] = g[b,o] * a[b,i], streamed"},
    {"outer_all", outer_all, METH_VARARGS,
     "outer_all(parts, threads) -> reads: outer of each (g, a, out, (B, O, I)) of parts in one parallel region; "
     "per part, the largest |g| and |a| read (NaN where one is NaN)"},
    {"resident", resident, METH_O, "resident(buffer) -> bool: every page of the buffer is resident"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nontemporal", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nontemporal(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddObject(m, "NONTEMPORAL", PyBool_FromLong(NONTEMPORAL)) < 0
                      || PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
