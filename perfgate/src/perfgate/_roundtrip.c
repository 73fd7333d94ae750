/* perfgate._roundtrip: how far apart the host placed the threads of torch's OpenMP team.

   round_trip(threads, bounces, reps) -> tuple of float
       The median nanoseconds, over `reps` stretches of `bounces` round trips each, for a cache
       line to go from thread 0 of the team to thread k and back, for k = 1 .. threads - 1 (one
       entry each). A round trip is two stores the other thread spins to see. Cores that share a
       last-level cache pass a line in tens of ns; cores on two dies or sockets take several times
       that, and a kernel whose threads hand each other data (one op's rows, the next op's columns)
       slows with it. A stretch that spins longer than 50 ms (the partner not running) reads inf.

   The team is torch's intra-op pool: built with -fopenmp, the module needs libgomp.so.1, which
   the loader resolves to the copy torch already loaded (timing.RoundTrip imports torch first), so
   the threads measured are the ones a kernel's parallel regions run on, and no thread of ours
   competes with that pool's spinning workers for a core. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define MAX_THREADS 1024
#define GIVE_UP_S 0.05

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The line the two threads pass: alone in its cache line, so nothing else moves with it. */
typedef struct {
    _Alignas(64) _Atomic long turn;
    _Atomic int gave_up;
    char pad[64 - sizeof(long) - sizeof(int)];
} Line;

/* `bounces` round trips between thread 0 (`me` == 0) and its partner, seconds each; inf where a
   side waited longer than GIVE_UP_S for the other. Thread 0 stores even turns, the partner odd. */
static double bounce(Line *line, int me, long bounces) {
    double start = now();
    for (long i = 0; i < bounces; i++) {
        long want = me == 0 ? 2 * i : 2 * i + 1;
        for (long spins = 0; atomic_load_explicit(&line->turn, memory_order_acquire) != want; spins++) {
            if ((spins & 1023) == 1023 && (atomic_load(&line->gave_up) || now() - start > GIVE_UP_S)) {
                atomic_store(&line->gave_up, 1);
                return INFINITY;
            }
        }
        atomic_store(&line->turn, want + 1); /* sequentially consistent: an xchg, which takes the line at once */
    }
    return (now() - start) / (double)bounces;
}

static PyObject *round_trip(PyObject *self, PyObject *args) {
    int threads, reps;
    long bounces;
    if (!PyArg_ParseTuple(args, "ili", &threads, &bounces, &reps)) return NULL;
    if (threads < 2 || threads > MAX_THREADS || bounces < 1 || reps < 1 || reps > 1000) {
        PyErr_Format(PyExc_ValueError, "round_trip(threads, bounces, reps): threads 2-%d, bounces >= 1, "
                     "reps 1-1000; got %d, %ld, %d", MAX_THREADS, threads, bounces, reps);
        return NULL;
    }
    double *ns = calloc((size_t)threads * (size_t)reps, sizeof(double));
    Line *line = aligned_alloc(64, sizeof(Line));
    if (ns == NULL || line == NULL) {
        free(ns);
        free(line);
        return PyErr_NoMemory();
    }
    int team = threads;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        int me = omp_get_thread_num();
#pragma omp single
        team = omp_get_num_threads();
        for (int partner = 1; partner < team; partner++) {
            for (int r = 0; r < reps; r++) {
#pragma omp single
                {
                    atomic_store(&line->turn, 0);
                    atomic_store(&line->gave_up, 0);
                }  /* the single's barrier: every thread sees the reset before anyone bounces */
                if (me == 0 || me == partner) {
                    double s = bounce(line, me == 0 ? 0 : 1, bounces);
                    if (me == 0) ns[partner * reps + r] = 1e9 * s;
                }
#pragma omp barrier
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *out = PyTuple_New(team - 1);
    for (int partner = 1; out != NULL && partner < team; partner++) {
        double *mine = ns + partner * reps;
        qsort(mine, (size_t)reps, sizeof(double), by_value);
        PyObject *v = PyFloat_FromDouble(mine[reps / 2]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, partner - 1, v);
    }
    free(ns);
    free(line);
    return out;
}

static PyMethodDef methods[] = {
    {"round_trip", round_trip, METH_VARARGS,
     "round_trip(threads, bounces, reps) -> median ns of a cache-line round trip from thread 0 of the "
     "OpenMP team to each other thread"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "perfgate._roundtrip", NULL, -1, methods};

PyMODINIT_FUNC PyInit__roundtrip(void) { return PyModule_Create(&module); }
