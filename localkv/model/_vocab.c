/* The vocabulary's tokens with given attributes, scanned in C (see prompt/markup.py).
 *
 * Finding the control tokens asks llama.cpp for every token's attributes:
 * 49,152 calls for the default model, 262,144 for Gemma 3. Through ctypes
 * each call costs about a microsecond of Python work, held under the GIL
 * (48 ms for the default model, measured); here the loop calls llama.cpp's
 * own llama_vocab_get_attr through its address, with the GIL released.
 * scan(get_attr, vocab, n_tokens, mask) returns the ids whose attributes
 * share a bit with mask, as int32 in the machine's byte order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

typedef int (*get_attr_fn)(const void *vocab, int32_t token);

static PyObject *scan(PyObject *self, PyObject *args)
{
    unsigned long long fn_address, vocab_address;
    long long n_tokens;
    int mask;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKLi", &fn_address, &vocab_address, &n_tokens, &mask))
        return NULL;
    if (fn_address == 0 || vocab_address == 0) {
        PyErr_SetString(PyExc_ValueError, "null function or vocabulary pointer");
        return NULL;
    }
    if (n_tokens < 0 || n_tokens > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "token count out of range");
        return NULL;
    }
    get_attr_fn get_attr = (get_attr_fn)(uintptr_t)fn_address;
    const void *vocab = (const void *)(uintptr_t)vocab_address;
    int32_t *found = malloc(sizeof(int32_t) * (size_t)(n_tokens > 0 ? n_tokens : 1));
    if (found == NULL)
        return PyErr_NoMemory();
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int32_t token = 0; token < (int32_t)n_tokens; token++) {
        if (get_attr(vocab, token) & mask)
            found[count++] = token;
    }
    Py_END_ALLOW_THREADS
    PyObject *out = PyBytes_FromStringAndSize((const char *)found, count * (Py_ssize_t)sizeof(int32_t));
    free(found);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(get_attr, vocab, n_tokens, mask): the ids (int32 bytes, native order) of the "
     "tokens whose llama_vocab_get_attr shares a bit with mask; get_attr and vocab are "
     "addresses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_vocab", "The vocabulary's tokens with given attributes.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__vocab(void)
{
    return PyModule_Create(&module);
}
