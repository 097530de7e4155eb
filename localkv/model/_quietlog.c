/* llama.cpp's log, filtered before it reaches Python (see native.py).
 *
 * llama.cpp calls its log callback thousands of times while it loads a model
 * and creates a context, nearly all of them debug and info lines. A Python
 * callback takes the GIL for each, so a model loading in one thread waits at
 * every line for Python work in another (the server's worker and the chat
 * app open the model beside other Python work). install(forward, detail) returns
 * the address of a C callback that passes warnings and errors, and the lines
 * continuing them, to forward (a C function pointer: the Python callback),
 * and debug and info lines only while detail is set (set_detail).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the last) */
#define LEVEL_WARN 3
#define LEVEL_CONT 5

typedef void (*log_fn)(int level, const char *text, void *user_data);

static log_fn forward_fn = NULL;
static volatile int detail = 0;
static volatile int last_level = 0;

static void filtered(int level, const char *text, void *user_data)
{
    if (level != LEVEL_CONT)
        last_level = level;
    if (forward_fn != NULL && (detail || last_level >= LEVEL_WARN))
        forward_fn(level, text, user_data);
}

static PyObject *install(PyObject *self, PyObject *args)
{
    unsigned long long forward;
    int want_detail;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kp", &forward, &want_detail))
        return NULL;
    if (forward == 0) {
        PyErr_SetString(PyExc_ValueError, "forward is a null function pointer");
        return NULL;
    }
    forward_fn = (log_fn)(uintptr_t)forward;
    detail = want_detail;
    return PyLong_FromVoidPtr((void *)filtered);
}

static PyObject *set_detail(PyObject *self, PyObject *arg)
{
    int want = PyObject_IsTrue(arg);
    (void)self;
    if (want < 0)
        return NULL;
    detail = want;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS,
     "install(forward, detail): the address of a log callback for llama_log_set that "
     "passes warnings and errors to the C function at forward, and debug and info "
     "lines while detail is set."},
    {"set_detail", set_detail, METH_O, "set_detail(on): pass debug and info lines too."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_quietlog", "llama.cpp's log, filtered before it reaches Python.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__quietlog(void)
{
    return PyModule_Create(&module);
}
