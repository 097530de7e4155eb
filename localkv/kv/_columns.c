/* V rows into llama.cpp's transposed V columns (see localkv/kv/columns.py).
 *
 * to_columns(src, dst, at, rows, width, itemsize): src holds `rows` rows of
 * `width` elements of `itemsize` bytes (token-major, as a block stores a
 * layer's V); dst holds `width` columns of equal length (the state's tokens,
 * `stride`), and element (r, c) goes to column c at row `at + r`. The copy runs
 * in square tiles, so that both sides stay in the cache, without the GIL:
 * the store's reader threads transpose their blocks in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define COLUMNS_SSE2 1
#include <emmintrin.h>
#endif

#define TILE 32
/* the SSE2 copy's run of rows: each group of 8 columns gets this many rows in a
 * row (a few whole cache lines of each column) before the next group */
#define RUN 256

#define TRANSPOSE(T)                                                                    \
    static void to_columns_##T(const T *src, T *dst, Py_ssize_t rows, Py_ssize_t width, \
                               Py_ssize_t stride)                                      \
    {                                                                                   \
        for (Py_ssize_t r0 = 0; r0 < rows; r0 += TILE) {                                \
            Py_ssize_t r1 = r0 + TILE < rows ? r0 + TILE : rows;                        \
            for (Py_ssize_t c0 = 0; c0 < width; c0 += TILE) {                           \
                Py_ssize_t c1 = c0 + TILE < width ? c0 + TILE : width;                  \
                for (Py_ssize_t c = c0; c < c1; c++) {                                  \
                    T *out = dst + c * stride;                                          \
                    for (Py_ssize_t r = r0; r < r1; r++)                                \
                        out[r] = src[r * width + c];                                    \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    }

TRANSPOSE(uint8_t)
TRANSPOSE(uint16_t)
TRANSPOSE(uint32_t)

#ifdef COLUMNS_SSE2
/* 2-byte elements, 8 rows by 8 columns at a time with SSE2 unpacks; the edges
 * that do not fill a square of 8 go through the scalar copy. */
static void to_columns_2(const uint16_t *src, uint16_t *dst, Py_ssize_t rows, Py_ssize_t width,
                         Py_ssize_t stride)
{
    Py_ssize_t rows8 = rows & ~(Py_ssize_t)7, width8 = width & ~(Py_ssize_t)7;
    for (Py_ssize_t r0 = 0; r0 < rows8; r0 += RUN) {
        Py_ssize_t r1 = r0 + RUN < rows8 ? r0 + RUN : rows8;
        for (Py_ssize_t c = 0; c < width8; c += 8) {
            for (Py_ssize_t r = r0; r < r1; r += 8) {
                const uint16_t *s = src + r * width + c;
                __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * width));
                __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * width));
                __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * width));
                __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * width));
                __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * width));
                __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * width));
                __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * width));
                __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * width));
                __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
                __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
                __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
                __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
                __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
                __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
                __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
                __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
                uint16_t *d = dst + c * stride + r;
                _mm_storeu_si128((__m128i *)(d + 0 * stride), _mm_unpacklo_epi64(c0, c4));
                _mm_storeu_si128((__m128i *)(d + 1 * stride), _mm_unpackhi_epi64(c0, c4));
                _mm_storeu_si128((__m128i *)(d + 2 * stride), _mm_unpacklo_epi64(c1, c5));
                _mm_storeu_si128((__m128i *)(d + 3 * stride), _mm_unpackhi_epi64(c1, c5));
                _mm_storeu_si128((__m128i *)(d + 4 * stride), _mm_unpacklo_epi64(c2, c6));
                _mm_storeu_si128((__m128i *)(d + 5 * stride), _mm_unpackhi_epi64(c2, c6));
                _mm_storeu_si128((__m128i *)(d + 6 * stride), _mm_unpacklo_epi64(c3, c7));
                _mm_storeu_si128((__m128i *)(d + 7 * stride), _mm_unpackhi_epi64(c3, c7));
            }
        }
    }
    /* the edges: columns past the last square of 8 (all rows), rows past it */
    for (Py_ssize_t c = width8; c < width; c++)
        for (Py_ssize_t r = 0; r < rows; r++)
            dst[c * stride + r] = src[r * width + c];
    for (Py_ssize_t c = 0; c < width8; c++)
        for (Py_ssize_t r = rows8; r < rows; r++)
            dst[c * stride + r] = src[r * width + c];
}
#else
#define to_columns_2 to_columns_uint16_t
#endif

static PyObject *to_columns(PyObject *self, PyObject *args)
{
    Py_buffer src, dst;
    Py_ssize_t at, rows, width, itemsize, stride = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*nnnn:to_columns", &src, &dst, &at, &rows, &width, &itemsize))
        return NULL;
    PyObject *result = NULL;
    if (width > 0 && itemsize > 0)
        stride = dst.len / itemsize / width;
    if (rows < 0 || width <= 0 || at < 0 || at + rows > stride ||
        (itemsize != 1 && itemsize != 2 && itemsize != 4) || dst.len != stride * width * itemsize) {
        PyErr_Format(PyExc_ValueError,
                     "to_columns: rows %zd..%zd of %zd columns of %zd bytes, item %zd", at,
                     at + rows, width, dst.len, itemsize);
        goto done;
    }
    if (src.len < rows * width * itemsize) {
        PyErr_Format(PyExc_ValueError, "to_columns: source of %zd bytes, %zd needed", src.len,
                     rows * width * itemsize);
        goto done;
    }
    {
        const char *s0 = (const char *)src.buf, *d0 = (const char *)dst.buf;
        if (src.len > 0 && dst.len > 0 && s0 < d0 + dst.len && d0 < s0 + src.len) {
            PyErr_SetString(PyExc_ValueError, "to_columns: source and target overlap");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    char *out = (char *)dst.buf + at * itemsize;
    if (itemsize == 2)
        to_columns_2((const uint16_t *)src.buf, (uint16_t *)out, rows, width, stride);
    else if (itemsize == 4)
        to_columns_uint32_t((const uint32_t *)src.buf, (uint32_t *)out, rows, width, stride);
    else
        to_columns_uint8_t((const uint8_t *)src.buf, (uint8_t *)out, rows, width, stride);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"to_columns", to_columns, METH_VARARGS,
     "to_columns(src, dst, at, rows, width, itemsize): token-major rows into columns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_columns", "V rows into llama.cpp's transposed V columns.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__columns(void)
{
    return PyModule_Create(&module);
}
