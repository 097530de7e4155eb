/* Joining the byte planes of compact block files (see planes.py).
 *
 * join(hi, items): items is a sequence of (lo, out) buffer pairs. For each
 * pair in turn, out[2i] = lo[i] and out[2i+1] = the next byte of hi; hi must
 * be used up exactly. One call joins a whole block file, and the loop runs
 * with the GIL released, so the store's reader threads join blocks in
 * parallel. numpy needs three passes per pair for the same result; planes.py
 * falls back to them where this module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

static void join_pair(const uint8_t *lo, const uint8_t *hi, uint8_t *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        out[2 * i] = lo[i];
        out[2 * i + 1] = hi[i];
    }
}

static int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = (const char *)a->buf, *b0 = (const char *)b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

static PyObject *join(PyObject *self, PyObject *args)
{
    Py_buffer hi;
    PyObject *items, *seq = NULL, *result = NULL;
    Py_buffer *views = NULL; /* lo0, out0, lo1, out1, ... */
    Py_ssize_t n = 0, held = 0, used = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O:join", &hi, &items))
        return NULL;
    seq = PySequence_Fast(items, "items must be a sequence of (lo, out) pairs");
    if (seq == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    views = PyMem_Calloc((size_t)(n > 0 ? 2 * n : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, k);
        Py_buffer *lo = &views[2 * k], *out = &views[2 * k + 1];
        if (!PyArg_ParseTuple(pair, "y*w*:join item", lo, out))
            goto done;
        held = k + 1;
        if (out->len != 2 * lo->len) {
            PyErr_Format(PyExc_ValueError, "item %zd: %zd low bytes cannot fill %zd bytes", k,
                         lo->len, out->len);
            goto done;
        }
        if (overlaps(out, lo) || overlaps(out, &hi)) {
            PyErr_Format(PyExc_ValueError, "item %zd: the output overlaps a plane", k);
            goto done;
        }
        used += lo->len;
    }
    if (used != hi.len) {
        PyErr_Format(PyExc_ValueError, "the items take %zd high bytes, %zd given", used, hi.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *h = (const uint8_t *)hi.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        const Py_buffer *lo = &views[2 * k], *out = &views[2 * k + 1];
        join_pair((const uint8_t *)lo->buf, h, (uint8_t *)out->buf, lo->len);
        h += lo->len;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (views != NULL) {
        for (Py_ssize_t k = 0; k < held; k++) {
            PyBuffer_Release(&views[2 * k]);
            PyBuffer_Release(&views[2 * k + 1]);
        }
        PyMem_Free(views);
    }
    Py_XDECREF(seq);
    PyBuffer_Release(&hi);
    return result;
}

static PyMethodDef methods[] = {
    {"join", join, METH_VARARGS,
     "join(hi, items): for each (lo, out) in items, out[2i] = lo[i], out[2i+1] = the next "
     "byte of hi."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes", "Joining the byte planes of compact block files.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__planes(void)
{
    return PyModule_Create(&module);
}
