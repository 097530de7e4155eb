/* Decoding the 6-bit code of compact block files (see formats/q6.py).
 *
 * decode6(items, simd): each item is (lo, q6, tab, outs): a tensor's low
 * bytes, its packed 6-bit indices (48 bytes per group of 64 values), its
 * table (64 bytes, then the escaped high bytes in order) and the writable
 * buffers its 2-byte values go to, one after the other. The whole call runs
 * without the GIL, so the store's reader threads decode blocks in parallel;
 * with simd (and a CPU with AVX2) a group of 64 values is decoded with a
 * handful of vector instructions. q6.py falls back to numpy where this
 * module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define Q6_AVX2 1
#include <immintrin.h>
#endif

static int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = (const char *)a->buf, *b0 = (const char *)b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* ------------------------------------------------------------------ q6 */
#define Q6_GROUP 64
#define Q6_GROUP_BYTES 48
#define Q6_LUT 64
#define Q6_ESCAPE 63

typedef struct {
    Py_buffer lo, q6, tab;
    Py_buffer *outs;
    Py_ssize_t nouts, held;
    int parsed; /* lo, q6 and tab are held */
} Q6Item;

/* Decode m (1..64) values of one group into dst (2m bytes); *e counts the
 * escapes used of k. Returns -1 if the escapes run out. */
static int q6_group_scalar(const uint8_t *lo, const uint8_t *q, const uint8_t *lut,
                           const uint8_t *exc, Py_ssize_t k, Py_ssize_t *e, uint8_t *dst, int m)
{
    for (int j = 0; j < m; j++) {
        int nib = j < 32 ? (q[j] & 15) : (q[j - 32] >> 4);
        int two = (q[32 + (j & 15)] >> (2 * (j >> 4))) & 3;
        int idx = nib | (two << 4);
        uint8_t hi;
        if (idx == Q6_ESCAPE) {
            if (*e >= k)
                return -1;
            hi = exc[(*e)++];
        } else {
            hi = lut[idx];
        }
        dst[2 * j] = lo[j];
        dst[2 * j + 1] = hi;
    }
    return 0;
}

#ifdef Q6_AVX2
__attribute__((target("avx2"))) static inline __m256i q6_lut64(__m256i n, __m256i t,
                                                               const __m256i *L)
{
    __m256i r = _mm256_shuffle_epi8(L[0], n);
    r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(L[1], n), _mm256_cmpeq_epi8(t, _mm256_set1_epi8(1)));
    r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(L[2], n), _mm256_cmpeq_epi8(t, _mm256_set1_epi8(2)));
    r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(L[3], n), _mm256_cmpeq_epi8(t, _mm256_set1_epi8(3)));
    return r;
}

__attribute__((target("avx2"))) static inline int q6_patch(uint32_t mask, uint8_t *dst,
                                                           const uint8_t *exc, Py_ssize_t k,
                                                           Py_ssize_t *e)
{
    while (mask) {
        int j = __builtin_ctz(mask);
        mask &= mask - 1;
        if (*e >= k)
            return -1;
        dst[2 * j + 1] = exc[(*e)++];
    }
    return 0;
}

/* A whole group (64 values, 128 bytes out); as q6_group_scalar. */
__attribute__((target("avx2"))) static int q6_group_avx2(const uint8_t *lo, const uint8_t *q,
                                                         const __m256i *L, const uint8_t *exc,
                                                         Py_ssize_t k, Py_ssize_t *e, uint8_t *dst)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const __m256i all4 = _mm256_set1_epi8(15), all2 = _mm256_set1_epi8(3);
    __m256i nib = _mm256_loadu_si256((const __m256i *)q);
    __m128i two = _mm_loadu_si128((const __m128i *)(q + 32));
    __m256i nA = _mm256_and_si256(nib, m4);                         /* values 0..31 */
    __m256i nB = _mm256_and_si256(_mm256_srli_epi16(nib, 4), m4);  /* values 32..63 */
    __m256i tw = _mm256_set_m128i(_mm_srli_epi16(two, 2), two);
    __m256i tA = _mm256_and_si256(tw, m2);
    __m256i tB = _mm256_and_si256(_mm256_srli_epi16(tw, 4), m2);
    __m256i hA = q6_lut64(nA, tA, L), hB = q6_lut64(nB, tB, L);
    __m256i loA = _mm256_loadu_si256((const __m256i *)lo);
    __m256i loB = _mm256_loadu_si256((const __m256i *)(lo + 32));
    __m256i a0 = _mm256_unpacklo_epi8(loA, hA), a1 = _mm256_unpackhi_epi8(loA, hA);
    __m256i b0 = _mm256_unpacklo_epi8(loB, hB), b1 = _mm256_unpackhi_epi8(loB, hB);
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute2x128_si256(a0, a1, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + 32), _mm256_permute2x128_si256(a0, a1, 0x31));
    _mm256_storeu_si256((__m256i *)(dst + 64), _mm256_permute2x128_si256(b0, b1, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + 96), _mm256_permute2x128_si256(b0, b1, 0x31));
    uint32_t mA = (uint32_t)_mm256_movemask_epi8(
        _mm256_and_si256(_mm256_cmpeq_epi8(nA, all4), _mm256_cmpeq_epi8(tA, all2)));
    uint32_t mB = (uint32_t)_mm256_movemask_epi8(
        _mm256_and_si256(_mm256_cmpeq_epi8(nB, all4), _mm256_cmpeq_epi8(tB, all2)));
    if (q6_patch(mA, dst, exc, k, e) < 0 || q6_patch(mB, dst + 64, exc, k, e) < 0)
        return -1;
    return 0;
}

__attribute__((target("avx2"))) static void q6_tables(const uint8_t *lut, __m256i *L)
{
    for (int i = 0; i < 4; i++)
        L[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(lut + 16 * i)));
}
#endif

static int q6_has_avx2(void)
{
#ifdef Q6_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* Decode one item; returns 0, or -1 when the escapes do not match the indices. */
static int q6_decode_item(const Q6Item *it, int simd)
{
    const uint8_t *lo = (const uint8_t *)it->lo.buf, *q = (const uint8_t *)it->q6.buf;
    const uint8_t *lut = (const uint8_t *)it->tab.buf, *exc = lut + Q6_LUT;
    Py_ssize_t n = it->lo.len, k = it->tab.len - Q6_LUT, e = 0;
    Py_ssize_t groups = (n + Q6_GROUP - 1) / Q6_GROUP;
    Py_ssize_t o = 0, off = 0; /* the output being filled and the offset in it */
    uint8_t tmp[2 * Q6_GROUP], tlo[Q6_GROUP];
#ifdef Q6_AVX2
    __m256i L[4];
    if (simd)
        q6_tables(lut, L);
#endif
    for (Py_ssize_t g = 0; g < groups; g++) {
        int m = (int)(n - g * Q6_GROUP < Q6_GROUP ? n - g * Q6_GROUP : Q6_GROUP);
        const uint8_t *glo = lo + g * Q6_GROUP, *gq = q + g * Q6_GROUP_BYTES;
        while (o < it->nouts && off == it->outs[o].len) {
            o++;
            off = 0;
        }
        uint8_t *dst = tmp;
        int direct = m == Q6_GROUP && it->outs[o].len - off >= 2 * Q6_GROUP;
        if (direct)
            dst = (uint8_t *)it->outs[o].buf + off;
        int rc;
#ifdef Q6_AVX2
        if (simd && m == Q6_GROUP)
            rc = q6_group_avx2(glo, gq, L, exc, k, &e, dst);
        else
#endif
        {
            if (m < Q6_GROUP) {
                memcpy(tlo, glo, (size_t)m);
                glo = tlo;
            }
            rc = q6_group_scalar(glo, gq, lut, exc, k, &e, dst, m);
        }
        if (rc < 0)
            return -1;
        if (direct) {
            off += 2 * Q6_GROUP;
            continue;
        }
        /* spread the group over the outputs */
        Py_ssize_t left = 2 * (Py_ssize_t)m, at = 0;
        while (left > 0) {
            while (off == it->outs[o].len) {
                o++;
                off = 0;
            }
            Py_ssize_t take = it->outs[o].len - off < left ? it->outs[o].len - off : left;
            memcpy((uint8_t *)it->outs[o].buf + off, tmp + at, (size_t)take);
            off += take;
            at += take;
            left -= take;
        }
    }
    return e == k ? 0 : -1;
}

static void q6_release(Q6Item *items, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Q6Item *it = &items[i];
        for (Py_ssize_t j = 0; j < it->held; j++)
            PyBuffer_Release(&it->outs[j]);
        PyMem_Free(it->outs);
        if (it->parsed) {
            PyBuffer_Release(&it->lo);
            PyBuffer_Release(&it->q6);
            PyBuffer_Release(&it->tab);
        }
    }
    PyMem_Free(items);
}

static int q6_parse(PyObject *obj, Q6Item *it, Py_ssize_t index)
{
    PyObject *outs, *seq;
    if (!PyArg_ParseTuple(obj, "y*y*y*O:decode6 item", &it->lo, &it->q6, &it->tab, &outs))
        return -1;
    it->parsed = 1;
    Py_ssize_t n = it->lo.len, groups = (n + Q6_GROUP - 1) / Q6_GROUP;
    if (it->q6.len != groups * Q6_GROUP_BYTES) {
        PyErr_Format(PyExc_ValueError, "item %zd: %zd index bytes for %zd values, %zd expected",
                     index, it->q6.len, n, groups * Q6_GROUP_BYTES);
        return -1;
    }
    if (it->tab.len < Q6_LUT) {
        PyErr_Format(PyExc_ValueError, "item %zd: a table of %zd bytes, at least %d expected",
                     index, it->tab.len, Q6_LUT);
        return -1;
    }
    seq = PySequence_Fast(outs, "outs must be a sequence of writable buffers");
    if (seq == NULL)
        return -1;
    it->nouts = PySequence_Fast_GET_SIZE(seq);
    it->outs = PyMem_Calloc((size_t)(it->nouts > 0 ? it->nouts : 1), sizeof(Py_buffer));
    if (it->outs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < it->nouts; j++) {
        Py_buffer *out = &it->outs[j];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, j), out, PyBUF_WRITABLE) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        it->held = j + 1;
        if (overlaps(out, &it->lo) || overlaps(out, &it->q6) || overlaps(out, &it->tab)) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "item %zd: an output overlaps an input", index);
            return -1;
        }
        total += out->len;
    }
    Py_DECREF(seq);
    if (total != 2 * n) {
        PyErr_Format(PyExc_ValueError, "item %zd: outputs of %zd bytes for %zd values", index,
                     total, n);
        return -1;
    }
    return 0;
}

static PyObject *decode6(PyObject *self, PyObject *args)
{
    PyObject *items, *seq;
    int simd = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|p:decode6", &items, &simd))
        return NULL;
    seq = PySequence_Fast(items, "items must be a sequence of (lo, q6, tab, outs)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), parsed = 0, bad = -1;
    Q6Item *its = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(Q6Item));
    if (its == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (; parsed < n; parsed++) {
        if (q6_parse(PySequence_Fast_GET_ITEM(seq, parsed), &its[parsed], parsed) < 0) {
            q6_release(its, parsed + 1);
            Py_DECREF(seq);
            return NULL;
        }
    }
    simd = simd && q6_has_avx2();
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && bad < 0; i++)
        if (q6_decode_item(&its[i], simd) < 0)
            bad = i;
    Py_END_ALLOW_THREADS
    q6_release(its, n);
    Py_DECREF(seq);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "item %zd: its escaped values do not match its table",
                     bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *avx2(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(q6_has_avx2());
}

static PyMethodDef methods[] = {
    {"decode6", decode6, METH_VARARGS,
     "decode6(items, simd=True): for each (lo, q6, tab, outs) in items, decode the tensor's "
     "6-bit code (q6.py) into the buffers outs, one after the other."},
    {"avx2", avx2, METH_NOARGS, "avx2(): True if decode6 can use AVX2 on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes", "Decoding the 6-bit code of compact block files.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__planes(void)
{
    return PyModule_Create(&module);
}
