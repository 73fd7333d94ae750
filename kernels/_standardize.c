/* kernels._standardize: kernels.Standardizer's column statistics and transform of an (N, D)
   float32 or float64 buffer, each in one pass over X.

   moments(x, shift, mean, var, chunk, threads)
       x          (N, D) buffer, float32 or float64, rows at any stride, columns at unit stride
       shift      (D,) C-contiguous buffer of x's format
       mean, var  (D,) writable C-contiguous buffers of x's format: the column mean and variance
                  (ddof 0) of d = x - shift
       chunk      rows of a chunk, 1 to 2^24
   Each thread takes a contiguous share of the rows and works through it a chunk at a time, while
   the chunk is in cache: the chunk's mean m of d, then the sums of e = d - m and of e^2 (the
   corrected two-pass formula: m2 = sum e^2 - (sum e)^2 / n, which also takes back the rounding of
   m), in x's precision, four rows at a time (the sums loaded and stored once for the four). The
   chunks, then the threads in order, are merged in double by Chan et al.'s pairwise update. NaN
   and inf reach the mean or the variance, as do squares that overflow.

   transform(x, out, shift, dmean, scale, threads) -> bool
       out[r, c] = ((x[r, c] - shift[c]) - dmean[c]) / scale[c], each operation rounded in x's
       precision, as torch's sub, sub and div round them: the same bits as those three ops. out is a
       C-contiguous (N, D) buffer of x's format that overlaps neither x nor the statistics (the
       caller's to guarantee); dmean and scale (D,) like shift. Returns whether every result is finite.

   Built with -ffp-contract=off (pyproject.toml): no clone fuses a multiply and an add, so the
   statistics have the same bits on an AVX-512, an AVX2 and a baseline x86-64 CPU.

   The rows split over an OpenMP team: with -fopenmp the module resolves libgomp.so.1 to the copy
   torch loaded, so the team is torch's intra-op pool (as kernels/_nontemporal.c). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>

#define MAX_THREADS 256
#define MAX_CHUNK (1 << 24) /* the most rows a chunk has: counted exactly in float32 */
#define LINE 64             /* bytes of a cache line: each thread's scratch starts on one of its own */

#include "_clones.h" /* CLONES: loops compiled for AVX-512, AVX2 and the baseline, the widest picked at load */

/* A thread's running statistics: the rows merged so far and, per column, their mean and sum of
   squared deviations. */
typedef struct {
    double n, *mean, *m2;
} Running;

/* Merge a part of nb rows (per column its mean mb and sum of squared deviations m2b) into r. */
static void merge(Running *r, Py_ssize_t D, double nb, const double *mb, const double *m2b) {
    const double n = r->n + nb, wb = nb / n, cross = r->n * nb / n;
    for (Py_ssize_t c = 0; c < D; c++) {
        const double delta = mb[c] - r->mean[c];
        r->mean[c] += delta * wb;
        r->m2[c] += m2b[c] + delta * delta * cross;
    }
    r->n = n;
}

/* Rows r to r + 3 of x as x0 to x3. */
#define ROWS4(T)                                                                                       \
    const T *restrict x0 = (const T *)(x + r * rs), *restrict x1 = (const T *)(x + (r + 1) * rs);     \
    const T *restrict x2 = (const T *)(x + (r + 2) * rs), *restrict x3 = (const T *)(x + (r + 3) * rs);

/* The kernels of one element type T (float, double), named NAME_f32 or NAME_f64 by SUFFIX; MAXV
   and FABS: the type's largest finite value and absolute value. */
#define KERNELS(T, SUFFIX, MAXV, FABS)                                                                     \
    /* Rows [r0, r1) into *run, a chunk of `chunk` rows at a time; s, u, q: D scratch elements each,   \
       mb, m2b: D doubles each. */                                                                     \
    CLONES static void moments_##SUFFIX(const char *x, Py_ssize_t rs, Py_ssize_t r0, Py_ssize_t r1,     \
                                        Py_ssize_t D, const T *restrict shift, Py_ssize_t chunk,      \
                                        T *restrict s, T *restrict u, T *restrict q,                  \
                                        double *restrict mb, double *restrict m2b, Running *run) {    \
        for (Py_ssize_t a = r0; a < r1; a += chunk) {                                                  \
            const Py_ssize_t b = r1 - a > chunk ? a + chunk : r1;                                      \
            const T rows = (T)(b - a);                                                                 \
            for (Py_ssize_t c = 0; c < D; c++) s[c] = 0, u[c] = 0, q[c] = 0;                           \
            /* the chunk's mean of d = x - shift, four rows at a time (s loaded and stored once for four) */ \
            Py_ssize_t r = a;                                                                          \
            for (; r + 4 <= b; r += 4) {                                                               \
                ROWS4(T)                                                                               \
                for (Py_ssize_t c = 0; c < D; c++) {                                                   \
                    const T d0 = x0[c] - shift[c], d1 = x1[c] - shift[c];                              \
                    const T d2 = x2[c] - shift[c], d3 = x3[c] - shift[c];                              \
                    s[c] += (d0 + d1) + (d2 + d3);                                                     \
                }                                                                                      \
            }                                                                                          \
            for (; r < b; r++) {                                                                       \
                const T *restrict xr = (const T *)(x + r * rs);                                        \
                for (Py_ssize_t c = 0; c < D; c++) s[c] += xr[c] - shift[c];                           \
            }                                                                                          \
            for (Py_ssize_t c = 0; c < D; c++) s[c] /= rows;                                           \
            /* the sums of e = d - mean and of e^2, the chunk read again from cache */                \
            for (r = a; r + 4 <= b; r += 4) {                                                          \
                ROWS4(T)                                                                               \
                for (Py_ssize_t c = 0; c < D; c++) {                                                   \
                    const T e0 = (x0[c] - shift[c]) - s[c], e1 = (x1[c] - shift[c]) - s[c];            \
                    const T e2 = (x2[c] - shift[c]) - s[c], e3 = (x3[c] - shift[c]) - s[c];            \
                    u[c] += (e0 + e1) + (e2 + e3);                                                     \
                    q[c] += (e0 * e0 + e1 * e1) + (e2 * e2 + e3 * e3);                                 \
                }                                                                                      \
            }                                                                                          \
            for (; r < b; r++) {                                                                       \
                const T *restrict xr = (const T *)(x + r * rs);                                        \
                for (Py_ssize_t c = 0; c < D; c++) {                                                   \
                    const T e = (xr[c] - shift[c]) - s[c];                                             \
                    u[c] += e;                                                                         \
                    q[c] += e * e;                                                                     \
                }                                                                                      \
            }                                                                                          \
            /* the chunk's exact-as-can-be mean and m2, in double; m2 >= 0 (a NaN stays NaN) */       \
            for (Py_ssize_t c = 0; c < D; c++) {                                                       \
                const double ue = (double)u[c], m2 = (double)q[c] - ue * ue / (double)rows;            \
                mb[c] = (double)s[c] + ue / (double)rows;                                              \
                m2b[c] = m2 < 0 ? 0 : m2;                                                              \
            }                                                                                          \
            merge(run, D, (double)rows, mb, m2b);                                                      \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    /* Rows [r0, r1) standardized into out; returns 1 where a result is not finite. */                 \
    CLONES static int transform_##SUFFIX(const char *x, Py_ssize_t rs, T *out, Py_ssize_t r0,          \
                                         Py_ssize_t r1, Py_ssize_t D, const T *restrict shift,        \
                                         const T *restrict dmean, const T *restrict scale) {          \
        int bad = 0;                                                                                   \
        for (Py_ssize_t r = r0; r < r1; r++) {                                                         \
            const T *restrict xr = (const T *)(x + r * rs);                                            \
            T *restrict o = out + r * D;                                                               \
            _Pragma("GCC unroll 4") /* four vectors an iteration (evidence/standardize-passes-zen4.txt) */ \
            for (Py_ssize_t c = 0; c < D; c++) {                                                       \
                const T v = ((xr[c] - shift[c]) - dmean[c]) / scale[c];                                \
                o[c] = v;                                                                              \
                bad |= !(FABS(v) <= MAXV); /* NaN and inf fail */                                      \
            }                                                                                          \
        }                                                                                              \
        return bad;                                                                                    \
    }

KERNELS(float, f32, FLT_MAX, fabsf)
KERNELS(double, f64, DBL_MAX, fabs)

/* A buffer of `ndim` dims holding float32 or float64, or a Python error naming `name`. */
static int get(PyObject *obj, Py_buffer *view, int flags, int ndim, const char *name) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format;
    if (f != NULL && (f[0] == 'f' || f[0] == 'd') && f[1] == '\0' && view->ndim == ndim) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a float32 ('f') or float64 ('d') buffer of %d dim(s), got format "
                 "'%s' with %d", name, ndim, f ? f : "B", view->ndim);
    PyBuffer_Release(view);
    return -1;
}

/* x (N, D) and the (D,) vectors after it in `views`: all of x's format, x's columns at unit stride,
   each vector D long. Sets a Python error and returns -1 where not. */
static int check(Py_buffer *views, int count) {
    const Py_buffer *x = &views[0];
    for (int i = 1; i < count; i++)
        if (views[i].itemsize != x->itemsize || views[i].format[0] != x->format[0]) {
            PyErr_Format(PyExc_TypeError, "every buffer must hold x's format '%s'", x->format);
            return -1;
        }
    if (x->shape[1] > 1 && x->strides[1] != x->itemsize) {
        PyErr_SetString(PyExc_ValueError, "x's columns must be at unit stride");
        return -1;
    }
    for (int i = 1; i < count; i++)
        if (views[i].ndim == 1 && views[i].shape[0] != x->shape[1]) {
            PyErr_Format(PyExc_ValueError, "the statistics must have x's %zd columns, got %zd", x->shape[1],
                         views[i].shape[0]);
            return -1;
        }
    return 0;
}

static void release(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

/* The threads argument checked and cut to one per row at most. */
static int team(Py_ssize_t *threads, Py_ssize_t rows) {
    if (*threads < 1 || *threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %zd", MAX_THREADS, *threads);
        return -1;
    }
    if (*threads > rows) *threads = rows > 0 ? rows : 1;
    return 0;
}

static PyObject *moments(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[4];
    Py_ssize_t chunk, threads;
    if (!PyArg_ParseTuple(args, "OOOOnn:moments", &o[0], &o[1], &o[2], &o[3], &chunk, &threads)) return NULL;
    static const char *const names[] = {"x", "shift", "mean", "var"};
    Py_buffer v[4];
    int got = 0;
    for (; got < 4; got++)
        if (get(o[got], &v[got], got == 0 ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS | (got > 1 ? PyBUF_WRITABLE : 0),
                got == 0 ? 2 : 1, names[got]) < 0)
            break;
    if (got < 4 || check(v, 4) < 0 || team(&threads, v[0].shape[0]) < 0) {
        release(v, got);
        return NULL;
    }
    if (chunk < 1 || chunk > MAX_CHUNK) {
        release(v, 4);
        return PyErr_Format(PyExc_ValueError, "chunk must be 1..%d rows, got %zd", MAX_CHUNK, chunk);
    }
    const Py_ssize_t N = v[0].shape[0], D = v[0].shape[1], size = v[0].itemsize;
    const int f64 = v[0].format[0] == 'd';
    /* per thread, from a cache line of its own: its Running (one line), the running mean and m2 and
       the chunk's mean and m2 (4 D doubles), then s, u, q (3 D elements) */
    const size_t stride = (LINE + (size_t)D * (4 * sizeof(double) + 3 * size) + LINE - 1) / LINE * LINE;
    char *scratch = aligned_alloc(LINE, (size_t)threads * stride);
    if (scratch == NULL) {
        release(v, 4);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (Py_ssize_t t = 0; t < threads; t++) {
        Running *run = (Running *)(scratch + t * stride);
        double *d = (double *)(scratch + t * stride + LINE);
        char *e = (char *)(d + 4 * D);
        *run = (Running){0.0, d, d + D};
        const Py_ssize_t r0 = N * t / threads, r1 = N * (t + 1) / threads;
        for (Py_ssize_t c = 0; c < D; c++) d[c] = 0, d[D + c] = 0;
        if (f64)
            moments_f64(v[0].buf, v[0].strides[0], r0, r1, D, v[1].buf, chunk, (double *)e, (double *)e + D,
                        (double *)e + 2 * D, d + 2 * D, d + 3 * D, run);
        else
            moments_f32(v[0].buf, v[0].strides[0], r0, r1, D, v[1].buf, chunk, (float *)e, (float *)e + D,
                        (float *)e + 2 * D, d + 2 * D, d + 3 * D, run);
    }
    /* the threads' statistics merged in order into the first's */
    Running *all = (Running *)scratch;
    for (Py_ssize_t t = 1; t < threads; t++) {
        const Running *run = (const Running *)(scratch + t * stride);
        if (run->n > 0) merge(all, D, run->n, run->mean, run->m2);
    }
    for (Py_ssize_t c = 0; c < D; c++) {
        const double mean = all->mean[c], var = all->m2[c] / (N > 0 ? (double)N : 1.0);
        if (f64)
            ((double *)v[2].buf)[c] = mean, ((double *)v[3].buf)[c] = var;
        else
            ((float *)v[2].buf)[c] = (float)mean, ((float *)v[3].buf)[c] = (float)var;
    }
    Py_END_ALLOW_THREADS
    free(scratch), release(v, 4);
    Py_RETURN_NONE;
}

static PyObject *transform(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[5];
    Py_ssize_t threads;
    if (!PyArg_ParseTuple(args, "OOOOOn:transform", &o[0], &o[1], &o[2], &o[3], &o[4], &threads)) return NULL;
    static const char *const names[] = {"x", "out", "shift", "dmean", "scale"};
    Py_buffer v[5];
    int got = 0;
    for (; got < 5; got++)
        if (get(o[got], &v[got], got == 0 ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS | (got == 1 ? PyBUF_WRITABLE : 0),
                got < 2 ? 2 : 1, names[got]) < 0)
            break;
    if (got < 5 || check(v, 5) < 0 || team(&threads, v[0].shape[0]) < 0) {
        release(v, got);
        return NULL;
    }
    if (v[1].shape[0] != v[0].shape[0] || v[1].shape[1] != v[0].shape[1]) {
        release(v, 5);
        return PyErr_Format(PyExc_ValueError, "out must have x's shape");
    }
    const Py_ssize_t N = v[0].shape[0], D = v[0].shape[1];
    const int f64 = v[0].format[0] == 'd';
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(|: bad)
    for (Py_ssize_t t = 0; t < threads; t++) {
        const Py_ssize_t r0 = N * t / threads, r1 = N * (t + 1) / threads;
        bad |= f64 ? transform_f64(v[0].buf, v[0].strides[0], v[1].buf, r0, r1, D, v[2].buf, v[3].buf, v[4].buf)
                   : transform_f32(v[0].buf, v[0].strides[0], v[1].buf, r0, r1, D, v[2].buf, v[3].buf, v[4].buf);
    }
    Py_END_ALLOW_THREADS
    release(v, 5);
    return PyBool_FromLong(!bad);
}

static PyMethodDef methods[] = {
    {"moments", moments, METH_VARARGS,
     "moments(x, shift, mean, var, chunk, threads): column mean and variance of x - shift into mean, var"},
    {"transform", transform, METH_VARARGS,
     "transform(x, out, shift, dmean, scale, threads) -> bool: ((x - shift) - dmean) / scale into out; "
     "whether all are finite"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_standardize", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__standardize(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
