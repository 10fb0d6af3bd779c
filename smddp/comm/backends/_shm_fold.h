/* The shared-memory core's reductions: dtypes, ops, half precision, and fold (rank order).
 * Included by _shm_native.c (one translation unit). */
#ifndef SMDDP_SHM_FOLD_H
#define SMDDP_SHM_FOLD_H

enum { T_F32, T_F64, T_F16, T_BF16, T_I8, T_U8, T_I16, T_I32, T_I64, T_COUNT };
enum { R_SUM, R_AVG, R_MIN, R_MAX, R_PROD, R_COUNT };
static const int ELEMENT_SIZE[T_COUNT] = {4, 8, 2, 2, 1, 1, 2, 4, 8};

/* ------------------------------------------------------------------ half precision */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__FLT16_MAX__)
#define HAVE_F16 1
static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
static inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
#else
#define HAVE_F16 0
#endif

/* ------------------------------------------------------------------ reductions
 * fold: out[i] = parts[0][i] op parts[1][i] op ... (rank order); AVERAGE divides by
 * ``divisor`` at the end (integers round toward zero).  A block at a time through a local
 * accumulator, so ``out`` may be any of the parts; ``out2`` (may be NULL) receives a second
 * copy of the result.
 */
#define FOLD_BLOCK 1024

/* torch.minimum / torch.maximum: a NaN on either side wins. */
#define MIN_OF(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define MAX_OF(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define IMIN_OF(a, b) ((a) < (b) ? (a) : (b))
#define IMAX_OF(a, b) ((a) > (b) ? (a) : (b))

#define FDIV(T, a, d) ((T)((a) / (T)(d)))
#define IDIV(T, a, d) ((T)((long long)(a) / (long long)(d)))

#define FOLD_DIRECT(T, U, MINF, MAXF, DIV)                                                    \
    static void fold_##T(T *out, T *out2, T *const *parts, int nparts, Py_ssize_t n,      \
                         int op, int divisor) {                                            \
        T acc[FOLD_BLOCK];                                                                 \
        Py_ssize_t base, i, len;                                                           \
        int k;                                                                             \
        for (base = 0; base < n; base += FOLD_BLOCK) {                                     \
            const T *p0 = parts[0] + base;                                                 \
            len = n - base < FOLD_BLOCK ? n - base : FOLD_BLOCK;                           \
            if (nparts == 1) {                                                             \
                memcpy(acc, p0, len * sizeof(T));                                          \
            } else {                                                                       \
                const T *p1 = parts[1] + base;                                             \
                if (op == R_SUM || op == R_AVG)                                            \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)p0[i] + (U)p1[i]);           \
                else if (op == R_MIN)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MINF(p0[i], p1[i]);                 \
                else if (op == R_MAX)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MAXF(p0[i], p1[i]);                 \
                else                                                                       \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)p0[i] * (U)p1[i]);           \
            }                                                                              \
            for (k = 2; k < nparts; k++) {                                                 \
                const T *p = parts[k] + base;                                              \
                if (op == R_SUM || op == R_AVG)                                            \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)acc[i] + (U)p[i]);           \
                else if (op == R_MIN)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MINF(acc[i], p[i]);                 \
                else if (op == R_MAX)                                                      \
                    for (i = 0; i < len; i++) acc[i] = MAXF(acc[i], p[i]);                 \
                else                                                                       \
                    for (i = 0; i < len; i++) acc[i] = (T)((U)acc[i] * (U)p[i]);           \
            }                                                                              \
            if (op == R_AVG && divisor > 1)                                                \
                for (i = 0; i < len; i++) acc[i] = DIV(T, acc[i], divisor);                \
            memcpy(out + base, acc, len * sizeof(T));                                      \
            if (out2 != NULL) memcpy(out2 + base, acc, len * sizeof(T));                   \
        }                                                                                  \
    }

/* Integer sums and products wrap, as torch's do: computed in the unsigned type. */
FOLD_DIRECT(float, float, MIN_OF, MAX_OF, FDIV)
FOLD_DIRECT(double, double, MIN_OF, MAX_OF, FDIV)
FOLD_DIRECT(int8_t, uint8_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(uint8_t, uint8_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(int16_t, uint16_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(int32_t, uint32_t, IMIN_OF, IMAX_OF, IDIV)
FOLD_DIRECT(int64_t, uint64_t, IMIN_OF, IMAX_OF, IDIV)

/* Half types: a block at a time in float32, rounded once. */
#define HALF_BLOCK 256
static void fold_half(uint16_t *out, uint16_t *out2, uint16_t *const *parts, int nparts, Py_ssize_t n,
                      int op, int divisor, int is_bf16) {
    float acc[HALF_BLOCK], v[HALF_BLOCK];
    Py_ssize_t base, i, len;
    int k;
    for (base = 0; base < n; base += HALF_BLOCK) {
        len = n - base < HALF_BLOCK ? n - base : HALF_BLOCK;
        for (i = 0; i < len; i++)
#if HAVE_F16
            acc[i] = is_bf16 ? bf16_to_f32(parts[0][base + i]) : f16_to_f32(parts[0][base + i]);
#else
            acc[i] = bf16_to_f32(parts[0][base + i]);
#endif
        for (k = 1; k < nparts; k++) {
            for (i = 0; i < len; i++)
#if HAVE_F16
                v[i] = is_bf16 ? bf16_to_f32(parts[k][base + i]) : f16_to_f32(parts[k][base + i]);
#else
                v[i] = bf16_to_f32(parts[k][base + i]);
#endif
            if (op == R_SUM || op == R_AVG) {
                for (i = 0; i < len; i++) acc[i] += v[i];
            } else if (op == R_MIN) {
                for (i = 0; i < len; i++) acc[i] = MIN_OF(acc[i], v[i]);
            } else if (op == R_MAX) {
                for (i = 0; i < len; i++) acc[i] = MAX_OF(acc[i], v[i]);
            } else {
                for (i = 0; i < len; i++) acc[i] *= v[i];
            }
        }
        if (op == R_AVG && divisor > 1)
            for (i = 0; i < len; i++) acc[i] /= (float)divisor;
        for (i = 0; i < len; i++) {
#if HAVE_F16
            uint16_t h = is_bf16 ? f32_to_bf16(acc[i]) : f32_to_f16(acc[i]);
#else
            uint16_t h = f32_to_bf16(acc[i]);
#endif
            out[base + i] = h;
            if (out2 != NULL) out2[base + i] = h;
        }
    }
}

static void fold(int dtype, char *out, char *out2, char *const *parts, int nparts, Py_ssize_t n, int op,
                 int divisor) {
    switch (dtype) {
    case T_F32: fold_float((float *)out, (float *)out2, (float *const *)parts, nparts, n, op, divisor); break;
    case T_F64: fold_double((double *)out, (double *)out2, (double *const *)parts, nparts, n, op, divisor); break;
    case T_F16: fold_half((uint16_t *)out, (uint16_t *)out2, (uint16_t *const *)parts, nparts, n, op, divisor, 0); break;
    case T_BF16: fold_half((uint16_t *)out, (uint16_t *)out2, (uint16_t *const *)parts, nparts, n, op, divisor, 1); break;
    case T_I8: fold_int8_t((int8_t *)out, (int8_t *)out2, (int8_t *const *)parts, nparts, n, op, divisor); break;
    case T_U8: fold_uint8_t((uint8_t *)out, (uint8_t *)out2, (uint8_t *const *)parts, nparts, n, op, divisor); break;
    case T_I16: fold_int16_t((int16_t *)out, (int16_t *)out2, (int16_t *const *)parts, nparts, n, op, divisor); break;
    case T_I32: fold_int32_t((int32_t *)out, (int32_t *)out2, (int32_t *const *)parts, nparts, n, op, divisor); break;
    default: fold_int64_t((int64_t *)out, (int64_t *)out2, (int64_t *const *)parts, nparts, n, op, divisor); break;
    }
}

#endif
