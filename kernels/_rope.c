/* kernels._rope: the RoPE rotation of a float32 (B, H, S, D) tensor in one pass.

   Position s turns each pair of features (x_a, x_b) by its angle: y_a = x_a c - x_b s,
   y_b = x_a s + x_b c (with `inverse`, by minus the angle: sin negated). Each pair is read
   from where the input keeps it and written where the output keeps it:
       half-split  pair i at features (i, i + D/2)   (GPT-NeoX, LLaMA)
       interleaved pair i at features (2i, 2i + 1)   (GPT-J; the paired layout of attention)
   torch needs two passes for a change of layout (an interleaving copy, then the complex
   multiply) and four for a half-split output; this reads x once and writes out once.

   turn(x, out, cos, sin, x_pairs, out_pairs, inverse, threads)
       x         float32 buffer of 4 dims (B, H, S, D), any strides, the last one element
       out       float32 buffer of the same shape, any strides, the last one element,
                 overlapping neither x nor the tables (the caller's to guarantee: kernels/rope.py
                 passes a fresh one, or a view of one)
       cos, sin  C-contiguous float32 buffers (T, S, D/2), T = 1 (shared) or B (per batch row)
       x_pairs, out_pairs   1 where that tensor's pairs are interleaved, 0 where half-split
   The B*H*S rows split over an OpenMP team: with -fopenmp the module resolves libgomp.so.1 to
   the copy torch loaded, so the team is torch's intra-op pool (as kernels/_nontemporal.c).

   Every element is two float32 products and one sum, each rounded: built without contraction
   into fused multiply-adds (-ffp-contract=off), as torch's vectorized complex multiply rounds
   them (its scalar tail, the last elements of a row, may fuse one). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_THREADS 256

#include "_clones.h" /* CLONES: loops compiled for AVX-512, AVX2 and the baseline, the widest picked at load */

typedef struct {
    const char *x;                     /* bytes: strides are in bytes */
    char *out;
    const float *cos, *sin;
    Py_ssize_t B, H, S, D, sb, sh, ss; /* x's shape and byte strides of its first three dims */
    Py_ssize_t ob, oh, os;             /* out's byte strides of its first three dims */
    Py_ssize_t tables;                 /* T: 1 or B */
    int x_pairs, out_pairs;
    float sign;                        /* +1, or -1 for the inverse rotation */
} Job;

/* One row of D features: the pairs turned by the row's cos/sin (D/2 each). Inlined with the
   layouts as constants, so that each of the four loops is compiled (and vectorized) on its own. */
static inline __attribute__((always_inline)) void row(const float *restrict x, float *restrict o,
                                                      const float *restrict c, const float *restrict n,
                                                      Py_ssize_t h, float sign, const int x_pairs,
                                                      const int out_pairs) {
    const Py_ssize_t ia = x_pairs ? 2 : 1, ib = x_pairs ? 1 : h; /* pair i: a at i*ia, b at i*ia + ib */
    const Py_ssize_t oa = out_pairs ? 2 : 1, ob = out_pairs ? 1 : h;
    for (Py_ssize_t i = 0; i < h; i++) {
        const float a = x[i * ia], b = x[i * ia + ib], cc = c[i], sn = sign * n[i];
        o[i * oa] = a * cc - b * sn;
        o[i * oa + ob] = a * sn + b * cc;
    }
}

/* Rows [r0, r1) of the B*H*S rows, walking (b, head, s) without a division per row. */
#define ROWS(XP, OP)                                                                            \
    {                                                                                           \
        Py_ssize_t s = r0 % j->S, hh = r0 / j->S % j->H, b = r0 / j->S / j->H;                  \
        for (Py_ssize_t r = r0; r < r1; r++) {                                                  \
            const float *x = (const float *)(j->x + b * j->sb + hh * j->sh + s * j->ss);        \
            const Py_ssize_t t = (j->tables == 1 ? 0 : b) * j->S + s;                           \
            float *o = (float *)(j->out + b * j->ob + hh * j->oh + s * j->os);                  \
            row(x, o, j->cos + t * h, j->sin + t * h, h, j->sign, XP, OP);                       \
            if (++s == j->S) {                                                                  \
                s = 0;                                                                          \
                if (++hh == j->H) hh = 0, b++;                                                  \
            }                                                                                   \
        }                                                                                       \
    }

/* Rows [r0, r1) of the B*H*S rows, each layout pair its own loop. */
CLONES
static void run(const Job *j, Py_ssize_t r0, Py_ssize_t r1) {
    if (r0 >= r1) return; /* no rows (S or H of 0): nothing to divide them by */
    const Py_ssize_t h = j->D / 2;
    if (j->x_pairs && j->out_pairs) ROWS(1, 1)
    else if (j->x_pairs) ROWS(1, 0)
    else if (j->out_pairs) ROWS(0, 1)
    else ROWS(0, 0)
}

/* A float32 buffer or a Python error naming `name`; `flags` as PyObject_GetBuffer takes them. */
static int get(PyObject *obj, Py_buffer *view, int flags, const char *name) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize == 4 && view->format != NULL && view->format[0] == 'f' && view->format[1] == '\0') return 0;
    PyErr_Format(PyExc_TypeError, "%s must hold float32 ('f'), got format '%s'", name,
                 view->format ? view->format : "B");
    PyBuffer_Release(view);
    return -1;
}

static PyObject *turn(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *oo, *co, *so;
    int x_pairs, out_pairs, inverse;
    Py_ssize_t threads;
    if (!PyArg_ParseTuple(args, "OOOOpppn:turn", &xo, &oo, &co, &so, &x_pairs, &out_pairs, &inverse, &threads))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS)
        return PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %zd", MAX_THREADS, threads);
    Py_buffer x, out, c, n;
    if (get(xo, &x, PyBUF_STRIDES, "x") < 0) return NULL;
    if (get(oo, &out, PyBUF_STRIDES | PyBUF_WRITABLE, "out") < 0) { PyBuffer_Release(&x); return NULL; }
    if (get(co, &c, PyBUF_C_CONTIGUOUS, "cos") < 0) { PyBuffer_Release(&x); PyBuffer_Release(&out); return NULL; }
    if (get(so, &n, PyBUF_C_CONTIGUOUS, "sin") < 0) {
        PyBuffer_Release(&x); PyBuffer_Release(&out); PyBuffer_Release(&c); return NULL;
    }
    int bad = 1; /* until the shapes are checked */
    Py_ssize_t B = 0, H = 0, S = 0, D = 0, T = 0;
    if (x.ndim != 4 || out.ndim != 4 || c.ndim != 3 || n.ndim != 3) {
        PyErr_Format(PyExc_ValueError, "x and out must have 4 dims (B, H, S, D), cos and sin 3 (T, S, D/2); "
                           "got %d, %d, %d, %d", x.ndim, out.ndim, c.ndim, n.ndim);
    } else {
        B = x.shape[0], H = x.shape[1], S = x.shape[2], D = x.shape[3], T = c.shape[0];
        int same_out = 1, same_table = 1;
        for (int d = 0; d < 4; d++) same_out &= out.shape[d] == x.shape[d];
        for (int d = 0; d < 3; d++) same_table &= n.shape[d] == c.shape[d];
        if (!same_out || D % 2 || (D && (x.strides[3] != 4 || out.strides[3] != 4)))
            PyErr_Format(PyExc_ValueError, "out must have x's shape, x an even D, both a unit stride on it");
        else if (!same_table || c.shape[1] != S || c.shape[2] != D / 2 || (T != 1 && T != B))
            PyErr_Format(PyExc_ValueError, "cos and sin must be (1 or B, S, D/2) = (1 or %zd, %zd, %zd), "
                               "got cos (%zd, %zd, %zd) and sin (%zd, %zd, %zd)", B, S, D / 2,
                               c.shape[0], c.shape[1], c.shape[2], n.shape[0], n.shape[1], n.shape[2]);
        else
            bad = 0;
    }
    if (!bad) {
        Job job = {x.buf, out.buf, c.buf, n.buf, B, H, S, D, x.strides[0], x.strides[1], x.strides[2],
                   out.strides[0], out.strides[1], out.strides[2], T, x_pairs, out_pairs, inverse ? -1.0f : 1.0f};
        const Py_ssize_t rows = B * H * S;
        if (threads > rows) threads = rows > 0 ? rows : 1;
        Py_BEGIN_ALLOW_THREADS
        /* one contiguous share of the rows a thread */
        #pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (Py_ssize_t t = 0; t < threads; t++) run(&job, rows * t / threads, rows * (t + 1) / threads);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    PyBuffer_Release(&c);
    PyBuffer_Release(&n);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"turn", turn, METH_VARARGS,
     "turn(x, out, cos, sin, x_pairs, out_pairs, inverse, threads): the RoPE rotation of x into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rope", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rope(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
