/* NVFP4 quantization of bf16 weights, hand-vectorized for AVX-512, or AVX2 where the CPU has no
 * AVX-512 (g4.quantizers.nvfp4, NATIVE and NATIVE_MSE): g4_nvfp4_max_bf16 (modelopt's max
 * calibration) and g4_nvfp4_mse_bf16 (the mse block-scale search). The arithmetic is
 * _quantize_blocks' and _quantize_blocks_mse's in quantizers/nvfp4.py, in the same order and with the
 * same IEEE operations (no contraction into fused multiply-adds: -ffp-contract=off), so the bytes
 * are the same (the Python side checks them against the eager kernel on a probe before use;
 * tests/quantizers/test_nvfp4_native.py on every bf16 block amax):
 *   block scale  max: s = amax(|x|) / (6 g), 1 for an all-zero block, clamped to [2^-9, 448],
 *                rounded to E4M3 (float8_e4m3fn, nearest, ties to even);
 *                mse: of the E4M3 codes from 16 below max's to 16 above (clamped to the positive
 *                finite ones), tried in the order max's, -16..-1, +1..+16, the first with the least
 *                block error sum((x - q(x / (s g)) s g)^2), the 16 squares added in halves, level
 *                by level: e[k] + e[k + 8], then 4, 2 and 1 apart (nvfp4.block_sum);
 *                With AVX-512 the mse search runs 16 blocks at a time, one per lane (mse_group);
 *                with AVX2, and for the last blocks of a range, one block at a time (mse_scale);
 *   codes        E2M1 of x / (s g) (true division), nearest, ties to even, saturating at 6,
 *                +8 for a negative value; two per byte, the even element in the low nibble.
 * The format is NVIDIA modelopt's (NVIDIA/Model-Optimizer modelopt/torch/quantization/qtensor/
 * nvfp4_tensor.py). Built by g4 with the machine's C compiler: cc -O3 -march=native
 * -ffp-contract=off -pthread -shared -fPIC -x c (g4.quantizers.native.CFLAGS). */
#if !defined(__AVX512F__) && !defined(__AVX2__)
#error "the native NVFP4 kernel needs AVX-512 (AVX512F) or AVX2; g4 uses its torch.compile kernel instead"
#endif
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#define ROUND_EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* s in [2^-9, 448] rounded to E4M3, nearest, ties to even: returns the E4M3 byte, *value its value. */
static inline uint8_t e4m3_round(float s, float *value) {
    if (s < 0.015625f) { /* below 2^-6: the subnormals, multiples of 2^-9 (8 * 2^-9 is 2^-6, code 8) */
        float q = nearbyintf(s * 512.0f);
        *value = q * (1.0f / 512.0f);
        return (uint8_t)q;
    }
    uint32_t u, r;
    memcpy(&u, &s, 4);
    r = (u + 0x7FFFFu + ((u >> 20) & 1u)) & 0xFFF00000u; /* 3 mantissa bits, ties to even */
    memcpy(value, &r, 4);
    return (uint8_t)((((int)(r >> 23) - 120) << 3) | ((r >> 20) & 7u)); /* exponent bias 127 -> 7 */
}

/* The block's E4M3 scale byte into *code; returns the divisor s8 * g. A NaN s gives E4M3's NaN
 * with the NaN's sign, as torch's cast does: 0x7F for a NaN in the block (its magnitude's NaN),
 * 0xFF for an Inf under a global scale whose 6 g overflows (Inf / Inf, the CPU's negative NaN). */
static inline float block_divisor(float amax, float g, uint8_t *code) {
    float s = amax / (6.0f * g), s8;
    if (s != s) {
        *code = signbit(s) ? 0xFF : 0x7F;
        return s;
    }
    if (s == 0.0f) s = 1.0f;
    if (s < 0.001953125f) s = 0.001953125f;
    if (s > 448.0f) s = 448.0f;
    *code = e4m3_round(s, &s8);
    return s8 * g;
}

/* The positive finite E4M3 values by code (1..126): m 2^-9 for exponent 0, else (1 + m/8) 2^(e-7). */
static void e4m3_values(float *table) {
    for (int code = 0; code < 128; code++) {
        int e = code >> 3, m = code & 7;
        table[code] = e == 0 ? (float)m / 512.0f : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    }
}

/* The E2M1 magnitude nearest a >= 0 (ties to even, 6 at most): the vector kernels' per lane. */
static inline float e2m1_magnitude(float a) {
    return a < 2.0f ? nearbyintf(a * 2.0f) * 0.5f : a < 4.0f ? nearbyintf(a) : a > 5.0f ? 6.0f : 4.0f;
}

#if defined(__AVX512F__)
static inline __m512 load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The 16 E2M1 codes of one block, packed into 8 bytes at out. */
static inline void pack_block(__m512 v, float divisor, uint8_t *out) {
    const __m512 two = _mm512_set1_ps(2.f), four = _mm512_set1_ps(4.f), five = _mm512_set1_ps(5.f);
    __m512 y = _mm512_div_ps(v, _mm512_set1_ps(divisor));
    __m512 a = _mm512_abs_ps(y);
    __m512 low = _mm512_roundscale_ps(_mm512_mul_ps(a, two), ROUND_EVEN);          /* a < 2: round(2a) */
    __m512 mid = _mm512_add_ps(_mm512_roundscale_ps(a, ROUND_EVEN), two);          /* a < 4: round(a) + 2 */
    __m512 high = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, five, _CMP_GT_OQ),     /* else 6 + (a > 5) */
                                       _mm512_set1_ps(6.f), _mm512_set1_ps(7.f));
    __m512 idx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, four, _CMP_LT_OQ), high, mid);
    idx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, two, _CMP_LT_OQ), idx, low);
    idx = _mm512_mask_add_ps(idx, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), idx, _mm512_set1_ps(8.f));
    /* as 8 int64 lanes, lane k holds code 2k in bits 0-3 and code 2k+1 in bits 32-35 */
    __m512i c = _mm512_cvttps_epi32(idx);
    __m512i pairs = _mm512_or_si512(_mm512_and_si512(c, _mm512_set1_epi64(0xF)), _mm512_srli_epi64(c, 28));
    _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(pairs));
}

/* The max of magnitudes taken on their bits as integers: the same order as the floats', and a NaN
 * (above every other bit pattern) wins, where the float max instructions would drop it. */
static inline __m512 max_bits(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

/* Of 16 vectors of magnitudes: lane L of the result holds the max over the 16 lanes of
 * v[(L % 4) * 4 + L / 4]. */
static inline __m512 max_of_each(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int k = 0; k < 8; k++)
        a[k] = max_bits(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                        _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)
        b[k] = max_bits(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                        _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        c[k] = max_bits(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44),
                        _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
    return max_bits(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

static void quantize_range(const uint16_t *x, int64_t b0, int64_t b1, float g, uint8_t *packed, uint8_t *scales) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    int64_t b = b0;
    for (; b + 16 <= b1; b += 16) { /* 16 blocks at a time: their amaxes in one reduction tree */
        __m512 v[16], a[16];
        float amax[16], divisor[16];
        for (int k = 0; k < 16; k++) {
            v[k] = load_bf16(x + 16 * (b + k));
            a[k] = _mm512_and_ps(v[k], magnitude);
        }
        _mm512_storeu_ps(amax, max_of_each(a));
        for (int lane = 0; lane < 16; lane++) {
            int k = (lane & 3) * 4 + (lane >> 2);
            divisor[k] = block_divisor(amax[lane], g, scales + b + k);
        }
        for (int k = 0; k < 16; k++) pack_block(v[k], divisor[k], packed + 8 * (b + k));
    }
    for (; b < b1; b++) {
        __m512 v = load_bf16(x + 16 * b);
        float amax;
        int32_t bits = _mm512_reduce_max_epi32(_mm512_castps_si512(_mm512_abs_ps(v)));
        memcpy(&amax, &bits, 4);
        pack_block(v, block_divisor(amax, g, scales + b), packed + 8 * b);
    }
}


/* E2M1 rounding of each lane of y (nearest, ties to even, saturating at 6; the sign kept). */
static inline __m512 e2m1_round(__m512 y) {
    const __m512 two = _mm512_set1_ps(2.f), four = _mm512_set1_ps(4.f);
    __m512 a = _mm512_abs_ps(y);
    __m512 low = _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, two), ROUND_EVEN), _mm512_set1_ps(0.5f));
    __m512 high = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(5.f), _CMP_GT_OQ), four,
                                       _mm512_set1_ps(6.f));
    __m512 mag = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, four, _CMP_LT_OQ), high, _mm512_roundscale_ps(a, ROUND_EVEN));
    mag = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, two, _CMP_LT_OQ), mag, low);
    return _mm512_or_ps(mag, _mm512_and_ps(y, _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u))));
}

/* sum((x - e2m1(x / sg) sg)^2) over the 16 fp32 values at x, the squares added as nvfp4.block_sum does:
 * each element with the one 8 on, then 4 on, 2 on, 1 on. */
static inline float block_error(const float *x, float sg) {
    __m512 v = _mm512_loadu_ps(x), s = _mm512_set1_ps(sg);
    __m512 d = _mm512_sub_ps(v, _mm512_mul_ps(e2m1_round(_mm512_div_ps(v, s)), s));
    __m512 e = _mm512_mul_ps(d, d);
    e = _mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, 0x4E));   /* lane k < 8: e[k] + e[k + 8] */
    e = _mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, 0xB1));   /* lane k < 4: those of k and k + 4 */
    e = _mm512_add_ps(e, _mm512_permute_ps(e, 0x4E));         /* lane k < 2: those of k and k + 2 */
    e = _mm512_add_ps(e, _mm512_permute_ps(e, 0xB1));         /* lane 0: those of 0 and 1 */
    return _mm512_cvtss_f32(e);
}

static inline void pack_block_f32(const float *x, float divisor, uint8_t *out) {
    pack_block(_mm512_loadu_ps(x), divisor, out);
}

/* Each lane's block error under its divisor sg, for 16 blocks (xt[k]: element k of each, lane b
 * block b), the squares added as nvfp4.block_sum does: e[k] + e[k + 8], then 4, 2 and 1 apart. */
static inline __m512 group_error(const __m512 *xt, __m512 sg) {
    __m512 e[16];
    for (int k = 0; k < 16; k++) {
        __m512 d = _mm512_sub_ps(xt[k], _mm512_mul_ps(e2m1_round(_mm512_div_ps(xt[k], sg)), sg));
        e[k] = _mm512_mul_ps(d, d);
    }
    for (int n = 8; n >= 1; n /= 2)
        for (int k = 0; k < n; k++) e[k] = _mm512_add_ps(e[k], e[k + n]);
    return e[0];
}

/* The mse block scales of 16 blocks at once (bf16 at x), one block per lane, in the eager order
 * (max's, -16..-1, +1..+16; strict improvement, so the first least error wins): their E4M3 bytes
 * into codes_out and their divisors s g. A candidate is skipped when no lane can take it: its
 * amax element's own squared error is no less than the lane's best block error, and the block's
 * error, a sum of non-negative terms rounded at each step, is at least each term (rounding is
 * monotonic). A NaN, infinite or zero block keeps max's scale and divisor (every candidate's
 * error is NaN, infinite or 0 alike). */
static void mse_group(const uint16_t *x, float g, const float *table, uint8_t *codes_out, float *divisors) {
    float buf[16][16], amax_l[16], d0[16];
    uint8_t base_l[16];
    __m512 xt[16];
    for (int b = 0; b < 16; b++) {
        uint32_t top = 0;
        for (int k = 0; k < 16; k++) {
            uint32_t bits = (uint32_t)x[16 * b + k] << 16;
            memcpy(&buf[k][b], &bits, 4);
            bits &= 0x7FFFFFFFu;
            top = bits > top ? bits : top;
        }
        memcpy(&amax_l[b], &top, 4);
        d0[b] = block_divisor(amax_l[b], g, &base_l[b]);
    }
    for (int k = 0; k < 16; k++) xt[k] = _mm512_loadu_ps(buf[k]);
    const __m512 amax = _mm512_loadu_ps(amax_l);
    const __m512i base = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)base_l));
    __m512 sg = _mm512_loadu_ps(d0);
    __m512 best = group_error(xt, sg);
    __m512i best_code = base;
    for (int k = -16; k <= 16; k++) {
        if (k == 0) continue;
        __m512i code = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(k)),
                                                         _mm512_set1_epi32(1)), _mm512_set1_epi32(126));
        __m512 s = _mm512_mul_ps(_mm512_i32gather_ps(code, table, 4), _mm512_set1_ps(g));
        /* the amax element's own squared error per lane: a lower bound of the block's */
        __m512 da = _mm512_sub_ps(amax, _mm512_mul_ps(e2m1_round(_mm512_div_ps(amax, s)), s));
        if (!_mm512_cmp_ps_mask(_mm512_mul_ps(da, da), best, _CMP_LT_OQ)) continue;
        __m512 err = group_error(xt, s);
        __mmask16 better = _mm512_cmp_ps_mask(err, best, _CMP_LT_OQ);
        best = _mm512_mask_blend_ps(better, best, err);
        best_code = _mm512_mask_blend_epi32(better, best_code, code);
    }
    int32_t bc[16];
    _mm512_storeu_si512(bc, best_code);
    for (int b = 0; b < 16; b++) {
        codes_out[b] = (uint8_t)bc[b];
        divisors[b] = bc[b] == base_l[b] ? d0[b] : table[bc[b]] * g; /* max's own: NaN for a NaN block */
    }
}
#define HAVE_MSE_GROUP 1
#else /* AVX2: a block is two 8-lane halves */
static inline void load_bf16x16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}

static inline __m256 e2m1_index(__m256 v, __m256 divisor) {
    const __m256 two = _mm256_set1_ps(2.f), four = _mm256_set1_ps(4.f), five = _mm256_set1_ps(5.f);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 y = _mm256_div_ps(v, divisor);
    __m256 a = _mm256_and_ps(y, magnitude);
    __m256 low = _mm256_round_ps(_mm256_mul_ps(a, two), ROUND_EVEN);
    __m256 mid = _mm256_add_ps(_mm256_round_ps(a, ROUND_EVEN), two);
    __m256 high = _mm256_blendv_ps(_mm256_set1_ps(6.f), _mm256_set1_ps(7.f), _mm256_cmp_ps(a, five, _CMP_GT_OQ));
    __m256 idx = _mm256_blendv_ps(high, mid, _mm256_cmp_ps(a, four, _CMP_LT_OQ));
    idx = _mm256_blendv_ps(idx, low, _mm256_cmp_ps(a, two, _CMP_LT_OQ));
    __m256 negative = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_add_ps(idx, _mm256_and_ps(negative, _mm256_set1_ps(8.f)));
}

static inline void pack_block(__m256 lo, __m256 hi, float divisor, uint8_t *out) {
    __m256 d = _mm256_set1_ps(divisor);
    __m256i clo = _mm256_cvttps_epi32(e2m1_index(lo, d)), chi = _mm256_cvttps_epi32(e2m1_index(hi, d));
    /* the 16 codes as 16-bit lanes in order, then each 32-bit lane's pair into its low byte */
    __m256i c16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(clo, chi), 0xD8);
    __m256i pairs = _mm256_or_si256(_mm256_and_si256(c16, _mm256_set1_epi32(0xF)),
                                    _mm256_and_si256(_mm256_srli_epi32(c16, 12), _mm256_set1_epi32(0xF0)));
    __m256i bytes = _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, -1, -1));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64((__m128i *)out, _mm256_castsi256_si128(bytes));
}

static void quantize_range(const uint16_t *x, int64_t b0, int64_t b1, float g, uint8_t *packed, uint8_t *scales) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t b = b0; b < b1; b++) {
        __m256 lo, hi;
        load_bf16x16(x + 16 * b, &lo, &hi);
        /* on the magnitudes' bits as integers, so that a NaN wins (as in the AVX-512 path) */
        __m256i m = _mm256_max_epi32(_mm256_castps_si256(_mm256_and_ps(lo, magnitude)),
                                     _mm256_castps_si256(_mm256_and_ps(hi, magnitude)));
        __m128i q = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        q = _mm_max_epi32(q, _mm_shuffle_epi32(q, 0x4E));
        q = _mm_max_epi32(q, _mm_shuffle_epi32(q, 0xB1));
        pack_block(lo, hi, block_divisor(_mm_cvtss_f32(_mm_castsi128_ps(q)), g, scales + b), packed + 8 * b);
    }
}

static inline __m256 e2m1_round(__m256 y) {
    const __m256 two = _mm256_set1_ps(2.f), four = _mm256_set1_ps(4.f);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    __m256 a = _mm256_andnot_ps(sign, y);
    __m256 low = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, two), ROUND_EVEN), _mm256_set1_ps(0.5f));
    __m256 high = _mm256_blendv_ps(four, _mm256_set1_ps(6.f), _mm256_cmp_ps(a, _mm256_set1_ps(5.f), _CMP_GT_OQ));
    __m256 mag = _mm256_blendv_ps(high, _mm256_round_ps(a, ROUND_EVEN), _mm256_cmp_ps(a, four, _CMP_LT_OQ));
    mag = _mm256_blendv_ps(mag, low, _mm256_cmp_ps(a, two, _CMP_LT_OQ));
    return _mm256_or_ps(mag, _mm256_and_ps(y, sign));
}

static inline __m256 squared_errors(__m256 v, __m256 s) {
    __m256 d = _mm256_sub_ps(v, _mm256_mul_ps(e2m1_round(_mm256_div_ps(v, s)), s));
    return _mm256_mul_ps(d, d);
}

/* sum((x - e2m1(x / sg) sg)^2) over the 16 fp32 values at x, the squares added as nvfp4.block_sum does. */
static inline float block_error(const float *x, float sg) {
    __m256 s = _mm256_set1_ps(sg);
    __m256 e = _mm256_add_ps(squared_errors(_mm256_loadu_ps(x), s), squared_errors(_mm256_loadu_ps(x + 8), s));
    e = _mm256_add_ps(e, _mm256_permute2f128_ps(e, e, 1));    /* lane k < 4: those of k and k + 4 */
    e = _mm256_add_ps(e, _mm256_permute_ps(e, 0x4E));         /* lane k < 2: those of k and k + 2 */
    e = _mm256_add_ps(e, _mm256_permute_ps(e, 0xB1));         /* lane 0: those of 0 and 1 */
    return _mm256_cvtss_f32(e);
}

static inline void pack_block_f32(const float *x, float divisor, uint8_t *out) {
    pack_block(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), divisor, out);
}
#endif

/* The mse block scale of the 16 fp32 values at x (amax: the largest magnitude, a NaN if any is
 * one): the E4M3 byte, *divisor its s g. A NaN, infinite or zero amax gives max's: every
 * candidate's error is then NaN, infinite or 0 alike, and ties keep max's. The eager kernel keeps
 * the first least error in the order max's, -16..-1, +1..+16 (position 0..32); here the candidates
 * are tried nearest first, so a close best is found early, and the least (error, position) is
 * kept: the same choice. A candidate is skipped when the amax element's own squared error already
 * exceeds the best (or equals it from a later position): the block's error, a sum of non-negative
 * terms rounded at each step, is at least each term (rounding is monotonic), so it could not win. */
static inline uint8_t mse_scale(const float *x, float amax, float g, const float *table, float *divisor) {
    static const signed char nearest_first[32] = {-1, 1, -2, 2, -3, 3, -4, 4, -5, 5, -6, 6, -7, 7, -8, 8,
                                                  -9, 9, -10, 10, -11, 11, -12, 12, -13, 13, -14, 14, -15, 15, -16, 16};
    uint8_t code;
    *divisor = block_divisor(amax, g, &code);
    if (!(amax > 0.0f) || amax == INFINITY) return code;
    float best = block_error(x, *divisor);
    int best_code = code, best_position = 0;
    for (int i = 0; i < 32; i++) {
        int k = nearest_first[i], position = k < 0 ? k + 17 : k + 16;
        int c = code + k < 1 ? 1 : code + k > 126 ? 126 : code + k;
        float sg = table[c] * g;
        float da = amax - e2m1_magnitude(amax / sg) * sg;
        if (da * da > best || (da * da == best && position > best_position)) continue;
        float err = block_error(x, sg);
        if (err < best || (err == best && position < best_position)) {
            best = err;
            best_code = c;
            best_position = position;
        }
    }
    *divisor = table[best_code] * g;
    return (uint8_t)best_code;
}

static void mse_range(const uint16_t *x, int64_t b0, int64_t b1, float g, uint8_t *packed, uint8_t *scales,
                      const float *table) {
    int64_t b = b0;
#ifdef HAVE_MSE_GROUP
    for (; b + 16 <= b1; b += 16) {
        float divisors[16];
        mse_group(x + 16 * b, g, table, scales + b, divisors);
        for (int k = 0; k < 16; k++) pack_block(load_bf16(x + 16 * (b + k)), divisors[k], packed + 8 * (b + k));
    }
#endif
    for (; b < b1; b++) {
        float f[16], amax, divisor;
        uint32_t bits, top = 0;
        for (int k = 0; k < 16; k++) {
            bits = (uint32_t)x[16 * b + k] << 16;
            memcpy(&f[k], &bits, 4);
            bits &= 0x7FFFFFFFu; /* the magnitudes' bits as integers: a NaN wins, as in the max kernel */
            top = bits > top ? bits : top;
        }
        memcpy(&amax, &top, 4);
        scales[b] = mse_scale(f, amax, g, table, &divisor);
        pack_block_f32(f, divisor, packed + 8 * b);
    }
}

typedef struct {
    const uint16_t *x;
    int64_t b0, b1;
    float g;
    uint8_t *packed, *scales;
    const float *table; /* the E4M3 values for mse; NULL: max */
} range_t;

static void *run_range(void *p) {
    range_t *r = (range_t *)p;
    if (r->table)
        mse_range(r->x, r->b0, r->b1, r->g, r->packed, r->scales, r->table);
    else
        quantize_range(r->x, r->b0, r->b1, r->g, r->packed, r->scales);
    return NULL;
}

/* Split nblocks over `threads` threads (table NULL: max, else mse with these E4M3 values). */
static int run(const uint16_t *x, int64_t nblocks, float g, uint8_t *packed, uint8_t *scales, int threads,
               const float *table) {
    enum { MAX_THREADS = 256, MIN_BLOCKS = 4096 };
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((int64_t)threads > nblocks / MIN_BLOCKS) threads = (int)(nblocks / MIN_BLOCKS);
    if (threads < 1) threads = 1;
    range_t ranges[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    int64_t per = ((nblocks + threads - 1) / threads + 15) / 16 * 16;
    for (int t = 0; t < threads; t++) {
        int64_t b0 = per * t < nblocks ? per * t : nblocks, b1 = per * (t + 1) < nblocks ? per * (t + 1) : nblocks;
        ranges[t] = (range_t){x, b0, b1, g, packed, scales, table};
        started[t] = t > 0 && pthread_create(&ids[t], NULL, run_range, &ranges[t]) == 0;
    }
    run_range(&ranges[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_range(&ranges[t]); /* no thread to be had: this one does its share */
    }
    return 0;
}

/* Quantize nblocks 16-element blocks of bf16 x (nblocks * 16 values, contiguous) under the fp32
 * global scale g (> 0, finite) into packed (nblocks * 8 bytes) and scales (nblocks E4M3 bytes),
 * split over `threads` threads, with max's block scales. A NaN in x gives its block E4M3's NaN
 * scale and code 6 for every element, an Inf the scale 448 and code 7 (15 negative), as the eager
 * kernel. Returns 0. */
__attribute__((visibility("default")))
int g4_nvfp4_max_bf16(const uint16_t *x, int64_t nblocks, float g, uint8_t *packed, uint8_t *scales, int threads) {
    return run(x, nblocks, g, packed, scales, threads, NULL);
}

/* g4_nvfp4_max_bf16 with mse's block scales (a block with a NaN or an Inf keeps max's, as in the
 * eager kernel). Returns 0. */
__attribute__((visibility("default")))
int g4_nvfp4_mse_bf16(const uint16_t *x, int64_t nblocks, float g, uint8_t *packed, uint8_t *scales, int threads) {
    float table[128];
    e4m3_values(table);
    return run(x, nblocks, g, packed, scales, threads, table);
}
