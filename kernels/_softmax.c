/* kernels._softmax: softmax over the last dim of a float32 buffer, in place, with AVX-512F or AVX2.

   Each row in three passes over the row, which stays in the L1 cache between them: its max m,
   then y = exp(x - m) written back and summed, then y / sum. exp(t) for t <= 0: 0 below -104
   (where exp rounds to 0 in float32), a masked score's -inf among them, set, not computed; else
   t = k ln2 + r with k = round(t / ln2) (ln2 in two parts, Cody-Waite), exp(r) by Cephes'
   degree-7 polynomial for expf (within about 1 ulp on |r| <= ln2 / 2), then scaled by 2^k exactly
   (AVX-512F: vscalefps; AVX2: two normal factors 2^(k - k/2) 2^(k/2)), which rounds a result
   below the normal floats once, to a subnormal or 0. Such a result takes a microcode assist on
   Intel CPUs (floating-point underflow with flush-to-zero off), each instruction that makes one
   tens of times the cost of a plain one: a masked score computed that way made a row of 30%
   masked scores 6x slower than torch.softmax's on an Intel Xeon (evidence/softmax.py), so it
   is not computed. So a masked score (-inf) gets exactly 0, and a row with a NaN, with +inf, or
   with nothing but -inf gets NaN throughout, as torch.softmax gives. Lanes past a row's end
   compute exp(0).

   softmax_(x, threads, isa, causal=False)
                              x: writable C-contiguous float32 buffer of at least one dim; its rows
                              (the last dim) split over `threads` OpenMP threads; isa one of ISAS;
                              causal: x's rows are stacked n x n squares (n its last dim; the row
                              count a multiple of n), row r's softmax is over its first r % n + 1
                              entries (a query's keys up to its own position) and the rest are set
                              to 0, what -inf there would give, with no exp computed for them
   ISA                        the widest kernel this CPU runs: "avx512f", "avx2" (with FMA) or ""
                              (none: softmax_ raises)
   ISAS                       every kernel this CPU runs, widest first
   MAX_THREADS                the most threads softmax_ takes

   torch.softmax takes the same three passes with an exp of its own (evidence/softmax.py times
   the two). The team is torch's intra-op pool, as kernels/_nontemporal.c. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#define MAX_THREADS 256

/* x86-64 GCC 7 or later (the _mm512_reduce_* intrinsics) or clang; elsewhere the module is built
   without a kernel and ISA is "" */
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 7))
#include <immintrin.h>
#define HAVE_KERNELS 1

#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f /* ln2 = LN2_HI + LN2_LO, LN2_HI exact in few bits (Cody-Waite) */
#define LN2_LO -2.12194440e-4f
#define FLOOR -104.0f /* exp below it rounds to 0 in float32: those lanes are set to 0 */
/* Cephes' expf: exp(r) = 1 + r + r^2 (P0 r^5 + P1 r^4 + ... + P5) */
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

/* exp(t) = 2^k p for t clamped to [FLOOR, 0] or NaN, in the ops of one vector width W (256 or
   512; ROUND that width's round to nearest): k = round(t / ln2), r = t - k ln2 (Cody-Waite),
   p = exp(r) by the polynomial. Each kernel scales p by 2^k its own way. */
#define EXP_PARTS(W, ROUND, t, k, p)                                                        \
    do {                                                                                    \
        k = ROUND(_mm##W##_mul_ps(t, _mm##W##_set1_ps(LOG2E)));                             \
        __m##W r_ = _mm##W##_fnmadd_ps(k, _mm##W##_set1_ps(LN2_HI), t);                     \
        r_ = _mm##W##_fnmadd_ps(k, _mm##W##_set1_ps(LN2_LO), r_);                           \
        p = _mm##W##_fmadd_ps(_mm##W##_set1_ps(P0), r_, _mm##W##_set1_ps(P1));              \
        p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(P2));                                 \
        p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(P3));                                 \
        p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(P4));                                 \
        p = _mm##W##_fmadd_ps(p, r_, _mm##W##_set1_ps(P5));                                 \
        p = _mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r_, r_), _mm##W##_add_ps(r_, _mm##W##_set1_ps(1.0f))); \
    } while (0)
#define ROUND512(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND256(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* ---- AVX-512F: 16 lanes, tails by mask registers ---- */

/* Lanes [0, n) of 16 as a mask. */
#define LANES(n) ((__mmask16)((n) >= 16 ? 0xFFFF : (1u << (n)) - 1))

/* exp(t) lane by lane for t <= 0 or NaN (module note). */
__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 t) {
    /* lanes below FLOOR compute exp(0) and are zeroed: no underflow (module note); NaN stays live */
    const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(FLOOR), _CMP_NLT_UQ);
    t = _mm512_maskz_mov_ps(live, t);
    __m512 k, p;
    EXP_PARTS(512, ROUND512, t, k, p);
    return _mm512_maskz_scalef_ps(live, p, k);
}

/* Softmax of one row of n floats in place. */
__attribute__((target("avx512f"))) static void row16(float *x, Py_ssize_t n) {
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
        const __m512 y = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(top, k, x + i), top));
        _mm512_mask_storeu_ps(x + i, k, y);
        sum = _mm512_mask_add_ps(sum, k, sum, y);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (Py_ssize_t i = 0; i < n; i += 16) {
        const __mmask16 k = LANES(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    }
}

/* ---- AVX2 with FMA: 8 lanes, tails by lane masks in a vector ---- */

#define TARGET_AVX2_FMA __attribute__((target("avx2,fma")))

/* 2^e for integer lanes e in [-126, 127], built in the exponent bits. */
TARGET_AVX2_FMA static inline __m256 pow2(__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}

/* exp(t) lane by lane for t <= 0 or NaN (module note): as exp16, 2^k in two normal factors (pow2
   takes exponents up to 127: a t above 0 would wrap into the sign bit, not overflow). */
TARGET_AVX2_FMA static inline __m256 exp8(__m256 t) {
    /* lanes below FLOOR compute exp(0) and are zeroed: no underflow (module note); NaN stays live */
    const __m256 live = _mm256_cmp_ps(t, _mm256_set1_ps(FLOOR), _CMP_NLT_UQ);
    t = _mm256_and_ps(t, live);
    __m256 k, p;
    EXP_PARTS(256, ROUND256, t, k, p);
    /* k in [-150, 0]: k/2 (rounded down) and k - k/2 both in [-75, 0], each factor a normal float;
       p 2^(k/2) is exact, so the product rounds once (a NaN lane's bits do not matter: p is NaN) */
    const __m256i ki = _mm256_cvtps_epi32(k), half = _mm256_srai_epi32(ki, 1);
    return _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ki, half))), live);
}

/* Lanes [0, n) of 8 as a vector mask (all bits set in a lane that is in). */
TARGET_AVX2_FMA static inline __m256i lanes8(Py_ssize_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

TARGET_AVX2_FMA static inline float reduce_max8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
}

TARGET_AVX2_FMA static inline float reduce_add8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

/* Softmax of one row of n floats in place: whole vectors, then the tail's lanes by mask (masked
   stores are slow on some CPUs: one a pass at most). */
TARGET_AVX2_FMA static void row8(float *x, Py_ssize_t n) {
    const Py_ssize_t whole = n / 8 * 8;
    const __m256i k = lanes8(n - whole); /* the tail's lanes, none where n divides by 8 */
    const __m256 in = _mm256_castsi256_ps(k), lowest = _mm256_set1_ps(-INFINITY);
    __m256 m = lowest;
    for (Py_ssize_t i = 0; i < whole; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    if (whole < n) /* lanes past the row read -inf */
        m = _mm256_max_ps(m, _mm256_blendv_ps(lowest, _mm256_maskload_ps(x + whole, k), in));
    const __m256 top = _mm256_set1_ps(reduce_max8(m));
    __m256 sum = _mm256_setzero_ps();
    for (Py_ssize_t i = 0; i < whole; i += 8) {
        const __m256 y = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), top));
        _mm256_storeu_ps(x + i, y);
        sum = _mm256_add_ps(sum, y);
    }
    if (whole < n) { /* lanes past the row read top: exp(0), as row16's */
        const __m256 y = exp8(_mm256_sub_ps(_mm256_blendv_ps(top, _mm256_maskload_ps(x + whole, k), in), top));
        _mm256_maskstore_ps(x + whole, k, y);
        sum = _mm256_add_ps(sum, _mm256_and_ps(y, in));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / reduce_add8(sum));
    for (Py_ssize_t i = 0; i < whole; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    if (whole < n) _mm256_maskstore_ps(x + whole, k, _mm256_mul_ps(_mm256_maskload_ps(x + whole, k), inv));
}
#else
#define HAVE_KERNELS 0
#endif

typedef void (*Row)(float *, Py_ssize_t);

/* The work of the first r causal rows of n x n squares, a row of `keep` entries counted as its
   softmax's three passes over them and one write of the n - keep zeros: 3 keep + n. */
static double causal_work(Py_ssize_t r, Py_ssize_t n) {
    const double squares = (double)(r / n), rest = (double)(r % n), m = (double)n;
    return squares * (3.0 * m * (m + 1.0) / 2.0 + m * m) + 3.0 * rest * (rest + 1.0) / 2.0 + rest * m;
}

/* The first row whose work up to it reaches `work`: a thread's share starts there (all rows when
   no row does). */
static Py_ssize_t causal_start(double work, Py_ssize_t rows, Py_ssize_t n) {
    Py_ssize_t lo = 0, hi = rows;
    while (lo < hi) {
        const Py_ssize_t mid = lo + (hi - lo) / 2;
        if (causal_work(mid, n) < work) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The kernel named `isa` where this CPU runs it, else NULL. */
static Row kernel(const char *isa) {
#if HAVE_KERNELS
    if (strcmp(isa, "avx512f") == 0 && __builtin_cpu_supports("avx512f")) return row16;
    if (strcmp(isa, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return row8;
#else
    (void)isa;
#endif
    return NULL;
}

static PyObject *softmax_(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    Py_ssize_t threads;
    const char *isa;
    int causal = 0;
    if (!PyArg_ParseTuple(args, "Ons|p:softmax_", &xo, &threads, &isa, &causal)) return NULL;
    if (threads < 1 || threads > MAX_THREADS)
        return PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %zd", MAX_THREADS, threads);
    const Row row = kernel(isa);
    if (row == NULL)
        return PyErr_Format(PyExc_ValueError, "isa must name a kernel this CPU runs (the module's ISAS), got '%s'", isa);
    Py_buffer x;
    if (PyObject_GetBuffer(xo, &x, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
    if (x.itemsize != 4 || x.format == NULL || x.format[0] != 'f' || x.format[1] != '\0' || x.ndim < 1) {
        PyErr_Format(PyExc_TypeError, "x must be a float32 ('f') buffer of at least one dim, got format '%s', "
                                      "%d dims", x.format ? x.format : "B", x.ndim);
        PyBuffer_Release(&x);
        return NULL;
    }
    const Py_ssize_t n = x.shape[x.ndim - 1], rows = n ? x.len / 4 / n : 0;
    if (causal && rows % (n ? n : 1)) {
        PyErr_Format(PyExc_ValueError, "causal: x must be stacked n x n squares (n = %zd, its last dim), got %zd "
                                       "rows", n, rows);
        PyBuffer_Release(&x);
        return NULL;
    }
    float *base = x.buf;
    if (threads > rows) threads = rows > 0 ? rows : 1;
    Py_BEGIN_ALLOW_THREADS
    if (causal && rows > 0) {
        /* row r of a stack of n x n squares keeps its first r % n + 1 entries, the rest set to 0;
           a contiguous share of the rows a thread, of equal work (causal_work), not of equal rows:
           one square halved would give one thread its short rows and the other its long ones */
        const double total = causal_work(rows, n);
        #pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (Py_ssize_t t = 0; t < threads; t++) {
            const Py_ssize_t stop = causal_start(total * (t + 1) / threads, rows, n);
            for (Py_ssize_t r = causal_start(total * t / threads, rows, n); r < stop; r++) {
                const Py_ssize_t keep = r % n + 1;
                row(base + r * n, keep);
                memset(base + r * n + keep, 0, (size_t)(n - keep) * sizeof(float));
            }
        }
    } else {
        /* one contiguous share of the rows a thread */
        #pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (Py_ssize_t t = 0; t < threads; t++)
            for (Py_ssize_t r = rows * t / threads; r < rows * (t + 1) / threads; r++) row(base + r * n, n);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"softmax_", softmax_, METH_VARARGS,
     "softmax_(x, threads, isa, causal=False): softmax over x's last dim, in place, by the kernel `isa` (one of "
     "ISAS); causal: row r of its stacked n x n squares over its first r % n + 1 entries, the rest 0"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_softmax", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__softmax(void) {
    static const char *const names[] = {"avx512f", "avx2"}; /* widest first */
    const char *runs[sizeof names / sizeof *names];
    Py_ssize_t count = 0;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (kernel(names[i]) != NULL) runs[count++] = names[i];
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *isas = PyTuple_New(count);
    for (Py_ssize_t i = 0; isas != NULL && i < count; i++) {
        PyObject *name = PyUnicode_FromString(runs[i]);
        if (name == NULL) Py_CLEAR(isas);
        else PyTuple_SET_ITEM(isas, i, name);
    }
    const int failed = isas == NULL || PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0 ||
                       PyModule_AddStringConstant(m, "ISA", count ? runs[0] : "") < 0 ||
                       PyModule_AddObjectRef(m, "ISAS", isas) < 0;
    Py_XDECREF(isas);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
