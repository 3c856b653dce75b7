/* NVFP4 "max" quantization of bf16 weights, hand-vectorized for AVX-512, or AVX2 where the CPU
 * has no AVX-512 (g4.quantizers.nvfp4, NATIVE). The arithmetic is _quantize_blocks' in
 * quantizers/nvfp4.py, in the same order and with the same IEEE operations, so the bytes are the
 * same (the Python side checks them against the eager kernel on a probe before use;
 * tests/quantizers/test_nvfp4_native.py on every bf16 block amax):
 *   block scale  s = amax(|x|) / (6 g), 1 for an all-zero block, clamped to [2^-9, 448],
 *                rounded to E4M3 (float8_e4m3fn, nearest, ties to even);
 *   codes        E2M1 of x / (s g) (true division), nearest, ties to even, saturating at 6,
 *                +8 for a negative value; two per byte, the even element in the low nibble.
 * The format is NVIDIA modelopt's (NVIDIA/Model-Optimizer modelopt/torch/quantization/qtensor/
 * nvfp4_tensor.py). Built by g4 with the machine's C compiler: cc -O3 -march=native -pthread
 * -shared -fPIC -x c (g4.quantizers.native.CFLAGS). */
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

/* The block's E4M3 scale byte into *code; returns the divisor s8 * g. A NaN amax (a NaN in the
 * block) gives E4M3's NaN, 0x7F, and a NaN divisor, as torch's cast does. */
static inline float block_divisor(float amax, float g, uint8_t *code) {
    float s = amax / (6.0f * g), s8;
    if (s != s) {
        *code = 0x7F;
        return s;
    }
    if (s == 0.0f) s = 1.0f;
    if (s < 0.001953125f) s = 0.001953125f;
    if (s > 448.0f) s = 448.0f;
    *code = e4m3_round(s, &s8);
    return s8 * g;
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
#endif

typedef struct {
    const uint16_t *x;
    int64_t b0, b1;
    float g;
    uint8_t *packed, *scales;
} range_t;

static void *run_range(void *p) {
    range_t *r = (range_t *)p;
    quantize_range(r->x, r->b0, r->b1, r->g, r->packed, r->scales);
    return NULL;
}

/* Quantize nblocks 16-element blocks of bf16 x (nblocks * 16 values, contiguous) under the fp32
 * global scale g (> 0, finite) into packed (nblocks * 8 bytes) and scales (nblocks E4M3 bytes),
 * split over `threads` threads. A NaN in x gives its block E4M3's NaN scale and code 6 for every
 * element, an Inf the scale 448 and code 7 (15 negative), as the eager kernel. Returns 0. */
__attribute__((visibility("default")))
int g4_nvfp4_max_bf16(const uint16_t *x, int64_t nblocks, float g, uint8_t *packed, uint8_t *scales, int threads) {
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
        ranges[t] = (range_t){x, b0, b1, g, packed, scales};
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
