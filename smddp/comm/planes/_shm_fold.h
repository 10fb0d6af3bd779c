/* The shared-memory core's reductions: dtypes, ops, half precision, and fold (rank order).
 * Included by _shm_native.c (one translation unit). */
#ifndef SMDDP_SHM_FOLD_H
#define SMDDP_SHM_FOLD_H

/* The codes are the fingerprint's (smddp.comm.mismatch.fingerprint: DTYPES, OPS, in smddp.comm.base.Op's
 * order). bool is reduced as its bytes, 0 and 1 (see fold). */
enum { T_F32, T_F64, T_F16, T_BF16, T_I8, T_U8, T_I16, T_I32, T_I64, T_BOOLEAN, T_COUNT };
enum { R_SUM, R_AVG, R_MIN, R_MAX, R_PROD, R_BAND, R_BOR, R_BXOR, R_COUNT };
static const int ELEMENT_SIZE[T_COUNT] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1};

/* Whether tensors of ``dtype`` have reduction ``op`` (gloo's rules, as smddp.comm.base's
 * check_reduction): the bitwise ops are for integers and bool, AVERAGE is not for bool. */
static int reducible(int dtype, int op) {
    int floating = dtype == T_F32 || dtype == T_F64 || dtype == T_F16 || dtype == T_BF16;
    if (op == R_BAND || op == R_BOR || op == R_BXOR)
        return !floating;
    return !(op == R_AVG && dtype == T_BOOLEAN);
}

/* ------------------------------------------------------------------ half precision
 * Conversions in integer arithmetic, exact as torch's (c10::Half, c10::BFloat16): round to
 * nearest even, subnormals kept, overflow to infinity; a NaN becomes a quiet one (its sign kept
 * for float16, as c10::Half does; 0x7fc0 for bfloat16, as c10::BFloat16 does). No _Float16 and
 * no conversion instructions: GCC's _Float16 without F16C calls a library routine per element,
 * which made a float16 all-reduce 30 times slower than a float32 one of the same bytes. */
static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    /* normal: rebias the exponent (15 -> 127); infinity and NaN: the top exponent, payload kept */
    uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
    uint32_t special = 0x7f800000u | (mantissa << 13);
    /* zero and subnormal: mantissa * 2^-24, exact in float32 */
    uint32_t tiny = f32_to_bits((float)mantissa * 0x1p-24f);
    return bits_to_f32(sign | (exponent == 0 ? tiny : exponent == 0x1f ? special : normal));
}

static inline uint16_t f32_to_f16(float f) {
    /* Every case computed, one kept: branch-free, so a loop of these vectorizes. Magnitudes
     * compare as signed 32-bit integers (they fit): SSE2 has no unsigned compare. */
    int32_t bits = (int32_t)f32_to_bits(f), magnitude = bits & 0x7fffffff;
    uint32_t sign = ((uint32_t)bits >> 16) & 0x8000u;
    /* normal (2^-14 and up): round the 13 dropped mantissa bits to nearest even (a carry moves
     * into the exponent), then rebias the exponent (127 -> 15) */
    int32_t normal = ((magnitude + 0xfff + ((magnitude >> 13) & 1)) >> 13) - (112 << 10);
    /* subnormal or zero (below 2^-14): float32's own addition rounds |f| to a multiple of
     * 2^-24 (the spacing of float32 just above 0.5), nearest even; the count of them is the
     * half's mantissa (1024 when it rounds up to 2^-14, the smallest normal half: right too) */
    int32_t tiny = (int32_t)f32_to_bits(bits_to_f32((uint32_t)magnitude) + 0.5f) - 0x3f000000;
    int32_t h = magnitude >= 0x38800000 ? normal : tiny;
    h = magnitude >= 0x477ff000 ? 0x7c00 : h; /* from 65520, halfway past 65504: infinity */
    h = magnitude > 0x7f800000 ? 0x7e00 : h;  /* NaN */
    return (uint16_t)(sign | (uint32_t)h);
}

/* ------------------------------------------------------------------ reductions
 * fold: out[i] = parts[0][i] op parts[1][i] op ... (rank order); AVERAGE divides by
 * ``divisor`` at the end (integers round toward zero).  A block at a time through a local
 * accumulator, so ``out`` may be any of the parts; ``out2`` (may be NULL) receives a second
 * copy of the result.
 */
#define FOLD_BLOCK 1024

/* x86-64 with glibc: each fold is built twice, for AVX2 and for the baseline (SSE2), and the
 * loader picks one by the CPU (GCC's and clang's target_clones). The same C, the same
 * arithmetic in the same order, no fused multiply-add (setup.py: -ffp-contract=off): the same
 * bits on every CPU, twice the vector width where AVX2 is. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define FOLD_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef FOLD_CLONES
#define FOLD_CLONES
#endif

/* torch.minimum / torch.maximum: a NaN on either side wins. */
#define MIN_OF(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define MAX_OF(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define IMIN_OF(a, b) ((a) < (b) ? (a) : (b))
#define IMAX_OF(a, b) ((a) > (b) ? (a) : (b))

#define FDIV(T, a, d) ((T)((a) / (T)(d)))
#define IDIV(T, a, d) ((T)((long long)(a) / (long long)(d)))

/* The bitwise ops' loops, dst[i] = a[i] op b[i], in the unsigned type: for the integer folds
 * (BITS_OF); the floating-point ones have none (NO_BITS: reducible() refuses them). */
#define BITS_OF(T, U, dst, a, b)                                                              \
    else if (op == R_BAND) for (i = 0; i < len; i++) dst[i] = (T)((U)a[i] & (U)b[i]);         \
    else if (op == R_BOR) for (i = 0; i < len; i++) dst[i] = (T)((U)a[i] | (U)b[i]);          \
    else if (op == R_BXOR) for (i = 0; i < len; i++) dst[i] = (T)((U)a[i] ^ (U)b[i]);
#define NO_BITS(T, U, dst, a, b)

#define FOLD_DIRECT(T, U, MINF, MAXF, DIV, BITS)                                              \
    FOLD_CLONES static void fold_##T(T *out, T *out2, T *const *parts, int nparts, Py_ssize_t n,      \
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
                BITS(T, U, acc, p0, p1)                                                    \
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
                BITS(T, U, acc, acc, p)                                                    \
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
FOLD_DIRECT(float, float, MIN_OF, MAX_OF, FDIV, NO_BITS)
FOLD_DIRECT(double, double, MIN_OF, MAX_OF, FDIV, NO_BITS)
FOLD_DIRECT(int8_t, uint8_t, IMIN_OF, IMAX_OF, IDIV, BITS_OF)
FOLD_DIRECT(uint8_t, uint8_t, IMIN_OF, IMAX_OF, IDIV, BITS_OF)
FOLD_DIRECT(int16_t, uint16_t, IMIN_OF, IMAX_OF, IDIV, BITS_OF)
FOLD_DIRECT(int32_t, uint32_t, IMIN_OF, IMAX_OF, IDIV, BITS_OF)
FOLD_DIRECT(int64_t, uint64_t, IMIN_OF, IMAX_OF, IDIV, BITS_OF)

/* Half types: a block at a time in float32, rounded once. One function per type, the
 * conversions inside the folds' loops (no branch per element, no pass of their own), so the
 * compiler vectorizes each loop whole. */
#define HALF_BLOCK 512
#define FOLD_HALF(NAME, TO_F32, FROM_F32)                                                     \
    FOLD_CLONES static void NAME(uint16_t *out, uint16_t *out2, uint16_t *const *parts, int nparts,       \
                     Py_ssize_t n, int op, int divisor) {                                     \
        float acc[HALF_BLOCK];                                                                \
        Py_ssize_t base, i, len;                                                              \
        int k;                                                                                \
        for (base = 0; base < n; base += HALF_BLOCK) {                                        \
            const uint16_t *p0 = parts[0] + base;                                             \
            len = n - base < HALF_BLOCK ? n - base : HALF_BLOCK;                              \
            if (nparts == 1) {                                                                \
                for (i = 0; i < len; i++) acc[i] = TO_F32(p0[i]);                             \
            } else {                                                                          \
                const uint16_t *p1 = parts[1] + base;                                         \
                if (op == R_SUM || op == R_AVG)                                               \
                    for (i = 0; i < len; i++) acc[i] = TO_F32(p0[i]) + TO_F32(p1[i]);         \
                else if (op == R_MIN)                                                         \
                    for (i = 0; i < len; i++) acc[i] = MIN_OF(TO_F32(p0[i]), TO_F32(p1[i]));  \
                else if (op == R_MAX)                                                         \
                    for (i = 0; i < len; i++) acc[i] = MAX_OF(TO_F32(p0[i]), TO_F32(p1[i]));  \
                else                                                                          \
                    for (i = 0; i < len; i++) acc[i] = TO_F32(p0[i]) * TO_F32(p1[i]);         \
            }                                                                                 \
            for (k = 2; k < nparts; k++) {                                                    \
                const uint16_t *p = parts[k] + base;                                          \
                if (op == R_SUM || op == R_AVG)                                               \
                    for (i = 0; i < len; i++) acc[i] += TO_F32(p[i]);                         \
                else if (op == R_MIN)                                                         \
                    for (i = 0; i < len; i++) acc[i] = MIN_OF(acc[i], TO_F32(p[i]));          \
                else if (op == R_MAX)                                                         \
                    for (i = 0; i < len; i++) acc[i] = MAX_OF(acc[i], TO_F32(p[i]));          \
                else                                                                          \
                    for (i = 0; i < len; i++) acc[i] *= TO_F32(p[i]);                         \
            }                                                                                 \
            if (op == R_AVG && divisor > 1)                                                   \
                for (i = 0; i < len; i++) acc[i] /= (float)divisor;                           \
            for (i = 0; i < len; i++) out[base + i] = FROM_F32(acc[i]);                       \
            if (out2 != NULL) memcpy(out2 + base, out + base, len * sizeof(uint16_t));        \
        }                                                                                     \
    }

FOLD_HALF(fold_bf16, bf16_to_f32, f32_to_bf16)
FOLD_HALF(fold_f16, f16_to_f32, f32_to_f16)

/* bool folds as its bytes, 0 and 1 (uint8): SUM and PRODUCT as MAX and MIN, a logical or and a
 * logical and (torch's and gloo's bool arithmetic: no 1 + 1 = 2); the other ops act on 0 and 1 as
 * logic does. */
static int bool_op(int op) {
    return op == R_SUM ? R_MAX : op == R_PROD ? R_MIN : op;
}

static void fold(int dtype, char *out, char *out2, char *const *parts, int nparts, Py_ssize_t n, int op,
                 int divisor) {
    switch (dtype) {
    case T_F32: fold_float((float *)out, (float *)out2, (float *const *)parts, nparts, n, op, divisor); break;
    case T_F64: fold_double((double *)out, (double *)out2, (double *const *)parts, nparts, n, op, divisor); break;
    case T_F16: fold_f16((uint16_t *)out, (uint16_t *)out2, (uint16_t *const *)parts, nparts, n, op, divisor); break;
    case T_BF16: fold_bf16((uint16_t *)out, (uint16_t *)out2, (uint16_t *const *)parts, nparts, n, op, divisor); break;
    case T_I8: fold_int8_t((int8_t *)out, (int8_t *)out2, (int8_t *const *)parts, nparts, n, op, divisor); break;
    case T_U8: fold_uint8_t((uint8_t *)out, (uint8_t *)out2, (uint8_t *const *)parts, nparts, n, op, divisor); break;
    case T_I16: fold_int16_t((int16_t *)out, (int16_t *)out2, (int16_t *const *)parts, nparts, n, op, divisor); break;
    case T_I32: fold_int32_t((int32_t *)out, (int32_t *)out2, (int32_t *const *)parts, nparts, n, op, divisor); break;
    case T_BOOLEAN:
        fold_uint8_t((uint8_t *)out, (uint8_t *)out2, (uint8_t *const *)parts, nparts, n, bool_op(op), divisor);
        break;
    default: fold_int64_t((int64_t *)out, (int64_t *)out2, (int64_t *const *)parts, nparts, n, op, divisor); break;
    }
}

#endif
