/* kernels._softmax: softmax over the last dim of a float32 buffer, in place, with AVX-512F.

   Each row in three passes over the row, which stays in the L1 cache between them: its max m,
   then y = exp(x - m) written back and summed, then y / sum. exp(t) for t <= 0: t clamped to
   -104 (below it exp rounds to 0 in float32), t = k ln2 + r with k = round(t / ln2) (ln2 in two
   parts, Cody-Waite), exp(r) by Cephes' degree-7 polynomial for expf (within about 1 ulp on
   |r| <= ln2 / 2), then scaled by 2^k exactly (vscalefps, which also rounds a result below the
   normal floats to a subnormal or 0). So a masked score (-inf) gets exactly 0, and a row with a
   NaN, with +inf, or with nothing but -inf gets NaN throughout, as torch.softmax gives.

   softmax_(x, threads)   x: writable C-contiguous float32 buffer of at least one dim; its rows
                          (the last dim) split over `threads` OpenMP threads
   AVX512F                1 where this CPU runs softmax_ (AVX-512F); elsewhere softmax_ raises
   MAX_THREADS            the most threads softmax_ takes

   torch.softmax takes the same three passes with an exp of its own (evidence/softmax.py times
   the two). The team is torch's intra-op pool, as kernels/_nontemporal.c. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_THREADS 256

/* x86-64 GCC 7 or later (the _mm512_reduce_* intrinsics) or clang; elsewhere the module is built
   without a kernel and AVX512F is 0 */
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 7))
#include <immintrin.h>
#define HAVE_AVX512F 1

/* Lanes [0, n) of 16 as a mask. */
#define LANES(n) ((__mmask16)((n) >= 16 ? 0xFFFF : (1u << (n)) - 1))

/* exp(t) lane by lane for t <= 0 or NaN (module note). */
__attribute__((target("avx512f"))) static inline __m512 exp_nonpositive(__m512 t) {
    t = _mm512_max_ps(_mm512_set1_ps(-104.0f), t); /* the second operand when either is NaN: NaN stays */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), t); /* t - k ln2, ln2 = 0.693359375 - 2.12194440e-4 */
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f))); /* exp(r) */
    return _mm512_scalef_ps(p, k);
}

/* Softmax of one row of n floats in place. */
__attribute__((target("avx512f"))) static void row(float *x, Py_ssize_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (Py_ssize_t i = 0; i < n; i += 16) {
        const __mmask16 k = LANES(n - i);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + i));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (Py_ssize_t i = 0; i < n; i += 16) {
        const __mmask16 k = LANES(n - i);
        /* lanes past the row read top, so that they compute exp(0): a 0 there would overflow
           exp(-top) where every score is below -88, raising the overflow flag (a trap where
           enabled) for a lane that is never stored */
        const __m512 y = exp_nonpositive(_mm512_sub_ps(_mm512_mask_loadu_ps(top, k, x + i), top));
        _mm512_mask_storeu_ps(x + i, k, y);
        sum = _mm512_mask_add_ps(sum, k, sum, y);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (Py_ssize_t i = 0; i < n; i += 16) {
        const __mmask16 k = LANES(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    }
}
#else
#define HAVE_AVX512F 0
#endif

static int avx512f(void) {
#if HAVE_AVX512F
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

static PyObject *softmax_(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    Py_ssize_t threads;
    if (!PyArg_ParseTuple(args, "On:softmax_", &xo, &threads)) return NULL;
    if (threads < 1 || threads > MAX_THREADS)
        return PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %zd", MAX_THREADS, threads);
    if (!avx512f()) return PyErr_Format(PyExc_RuntimeError, "softmax_ needs AVX-512F, which this CPU lacks");
    Py_buffer x;
    if (PyObject_GetBuffer(xo, &x, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
    if (x.itemsize != 4 || x.format == NULL || x.format[0] != 'f' || x.format[1] != '\0' || x.ndim < 1) {
        PyErr_Format(PyExc_TypeError, "x must be a float32 ('f') buffer of at least one dim, got format '%s', "
                                      "%d dims", x.format ? x.format : "B", x.ndim);
        PyBuffer_Release(&x);
        return NULL;
    }
#if HAVE_AVX512F
    const Py_ssize_t n = x.shape[x.ndim - 1], rows = n ? x.len / 4 / n : 0;
    float *base = x.buf;
    if (threads > rows) threads = rows > 0 ? rows : 1;
    Py_BEGIN_ALLOW_THREADS
    /* one contiguous share of the rows a thread */
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (Py_ssize_t t = 0; t < threads; t++)
        for (Py_ssize_t r = rows * t / threads; r < rows * (t + 1) / threads; r++) row(base + r * n, n);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"softmax_", softmax_, METH_VARARGS, "softmax_(x, threads): softmax over x's last dim, in place (AVX-512F)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_softmax", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__softmax(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0 ||
                      PyModule_AddIntConstant(m, "AVX512F", avx512f()) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
