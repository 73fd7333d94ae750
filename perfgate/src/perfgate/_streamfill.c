/* perfgate._streamfill: the write rate a kernel's streaming stores reach.

   fill(address, nbytes, byte, threads) -> None
       Writes `byte` over [address, address + nbytes) with non-temporal (streaming) stores, whole
       64-byte lines, on `threads` threads of the OpenMP team (a contiguous block each), the GIL
       released. A streaming store writes a line without reading it first, as a kernel writing a
       result past the last-level cache does (kernels.nontemporal); torch's fill_ reads each line
       before its store, and libc's memset may or may not stream: the roofline's write rate takes
       the fastest of the three (perfgate.roofline._stream). address and nbytes: multiples of 64.
   STREAMING
       1 where this build has streaming stores (SSE2), 0 where fill raises.

   Built with -fopenmp, as perfgate._roundtrip: the team is the libgomp torch already loaded, since
   the caller (perfgate.roofline._stream) imports torch before this module. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

#define MAX_THREADS 1024

static PyObject *fill(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t nbytes;
    int byte, threads;
    if (!PyArg_ParseTuple(args, "Knii", &address, &nbytes, &byte, &threads)) return NULL;
    if (address % 64 || nbytes < 0 || nbytes % 64 || byte < 0 || byte > 255 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "fill(address, nbytes, byte, threads): address and nbytes multiples of 64, "
                     "byte 0-255, threads 1-%d; got %llu, %zd, %d, %d", MAX_THREADS, address, nbytes, byte,
                     threads);
        return NULL;
    }
#if STREAMING
    char *start = (char *)(uintptr_t)address;
    Py_ssize_t lines = nbytes / 64;
    __m128i v = _mm_set1_epi8((char)byte);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (Py_ssize_t i = 0; i < lines; i++) {
            __m128i *line = (__m128i *)(start + 64 * i);
            _mm_stream_si128(line, v);
            _mm_stream_si128(line + 1, v);
            _mm_stream_si128(line + 2, v);
            _mm_stream_si128(line + 3, v);
        }
        _mm_sfence(); /* this thread's streamed lines visible before the region ends */
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_NotImplementedError, "perfgate._streamfill: built without streaming stores (SSE2)");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS,
     "fill(address, nbytes, byte, threads): write byte over the range with streaming stores, a block a thread"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "perfgate._streamfill", NULL, -1, methods};

PyMODINIT_FUNC PyInit__streamfill(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) Py_CLEAR(m);
    return m;
}
