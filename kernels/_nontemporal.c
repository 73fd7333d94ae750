/* kernels._nontemporal: batched outer products written with non-temporal (streaming) stores.

   out[b, o, i] = g[b, o] * a[b, i] for float32 buffers, the per-sample weight gradient of a
   Linear layer (kernels/per_sample.py). An ordinary store to a cache line that is not cached
   first reads the line from memory (a read for ownership), so writing N bytes moves 2N; a
   non-temporal store writes the line whole and moves N. It pays where the output is larger
   than the last-level cache and its pages are already mapped (a reused buffer): a page the
   kernel maps on the first write is zeroed in the cache, where an ordinary store then finds it.

   outer(g, a, out, (B, O, I), threads)  g (B, O), a (B, I), out (B, O, I): C-contiguous float32
                                         buffers; the B*O rows split over `threads` OpenMP threads
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
    Py_ssize_t O, I, row0, row1; /* rows [row0, row1) of the B*O rows of length I */
} Job;

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

static void run(const Job *j) {
    for (Py_ssize_t r = j->row0; r < j->row1; r++) {
        Py_ssize_t b = r / j->O;
        row(j->out + r * j->I, j->a + b * j->I, j->g[r], j->I);
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

static PyObject *outer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *go, *ao, *oo;
    Py_ssize_t B, O, I, threads;
    if (!PyArg_ParseTuple(args, "OOO(nnn)n:outer", &go, &ao, &oo, &B, &O, &I, &threads)) return NULL;
    if (B < 0 || O < 0 || I < 0) return PyErr_Format(PyExc_ValueError, "shape must be (B, O, I) >= 0, got (%zd, %zd, %zd)", B, O, I);
    if (threads < 1 || threads > MAX_THREADS)
        return PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %zd", MAX_THREADS, threads);
    Py_ssize_t rows = count(B, O), inputs = count(B, I), total = rows < 0 ? -1 : count(rows, I);
    if (rows < 0 || inputs < 0 || total < 0)
        return PyErr_Format(PyExc_ValueError, "shape (%zd, %zd, %zd) is too large for a float32 buffer", B, O, I);
    Py_buffer g, a, out;
    if (get(go, &g, 0, rows, "g") < 0) return NULL;
    if (get(ao, &a, 0, inputs, "a") < 0) { PyBuffer_Release(&g); return NULL; }
    if (get(oo, &out, 1, total, "out") < 0) { PyBuffer_Release(&g); PyBuffer_Release(&a); return NULL; }

    if (threads > rows) threads = rows > 0 ? rows : 1;
    const float *gb = g.buf, *ab = a.buf;
    float *ob = out.buf;
    Py_BEGIN_ALLOW_THREADS
    /* one contiguous share of the rows a thread */
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (Py_ssize_t t = 0; t < threads; t++) {
        Job job = {gb, ab, ob, O, I, rows * t / threads, rows * (t + 1) / threads};
        run(&job);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&g);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
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
