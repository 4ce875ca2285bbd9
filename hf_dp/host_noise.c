/* The host engine's noise in one pass: numpy's Philox4x64-10 words, Box-Muller in float64, the rounded sum.
 *
 * hf_dp/host_kernel.py compiles this file at first use (x86-64 with AVX2 and FMA, glibc's libmvec) and calls it
 * through ctypes, which releases the GIL, so torch's intra-op threads each noise a chunk. It computes, for element
 * e of parameter j (e counts in the whole tensor), what hf_dp/noise.py's `_host_words`, `_host_normals` and
 * `_add_on_host` compute with numpy and torch, tile by tile of PAIRS pairs that stay in cache:
 *
 * - pair p = e / 2 takes the Philox4x64-10 block at counter (p, j, 0, 0) under the step's 128-bit key: numpy's
 *   words, bit for bit (tests/test_host_kernel.py compares them), each shifted right by 11 to 53 bits; computed by a
 *   scalar loop or, on CPUs with AVX-512F and DQ where it is faster, 16 pairs a time in vectors beside 4 on the
 *   scalar multiplier (the same words);
 * - u1 = ((w0 2^106 + w1 2^53) + (w2 + 1)) 2^-159, R = sqrt(-2 ln u1), theta = w3 2pi 2^-53, in the same float64
 *   operations and order; element e is R cos theta for even e, R sin theta for odd e;
 * - the gradient plus std times the normal, in float64, divided by the quantum, rounded half to even, multiplied
 *   back, then cast to the gradient's dtype.
 *
 * log, cos, sin and sqrt are the functions torch's own CPU ops call where hf_dp_use is given them (MKL VML's, in
 * torch's x86 wheels): the normals and sums are then the numpy path's bit for bit. Otherwise they are glibc's
 * libmvec (at most 4 ulp from the correctly rounded value) and IEEE sqrt: a normal may differ from the numpy
 * path's in its last bits, and a rounded sum only where the float64 sum falls within those bits of a boundary of
 * the quantum grid (2^-24 std), about once in 10^8 elements. Built with -ffp-contract=off: every product and sum is
 * rounded on its own, as numpy's separate passes round them.
 */
#include <immintrin.h>
#include <stdint.h>

#define PAIRS 512 /* pairs per tile: the tile's words and normals stay in L1 and L2 */
#define M0 0xD2E7470EE14C6C93ULL
#define M1 0xCA5A826395121157ULL
#define W0 0x9E3779B97F4A7C15ULL
#define W1 0xBB67AE8584CAA73BULL
#define TURN (2.0 * 3.14159265358979311599796346854 * 0x1p-53) /* 2 pi 2^-53, as Python's 2.0 * math.pi * 2.0**-53 */

typedef unsigned __int128 u128;
typedef void (*array_function)(int64_t, const double *, double *); /* y[i] = f(a[i]), i < n: MKL VML's form */

__m256d _ZGVdN4v_log(__m256d);
__m256d _ZGVdN4v_cos(__m256d);
__m256d _ZGVdN4v_sin(__m256d);

#define LIBMVEC(name)                                                          \
    static void libmvec_##name(int64_t n, const double *a, double *y) {        \
        int64_t i = 0;                                                         \
        for (; i + 4 <= n; i += 4) {                                           \
            _mm256_storeu_pd(y + i, _ZGVdN4v_##name(_mm256_loadu_pd(a + i)));  \
        }                                                                      \
        if (i < n) {                                                           \
            double in[4] = {1.0, 1.0, 1.0, 1.0}, out[4];                       \
            for (int k = 0; i + k < n; k++) in[k] = a[i + k];                  \
            _mm256_storeu_pd(out, _ZGVdN4v_##name(_mm256_loadu_pd(in)));       \
            for (int k = 0; i + k < n; k++) y[i + k] = out[k];                 \
        }                                                                      \
    }
LIBMVEC(log)
LIBMVEC(cos)
LIBMVEC(sin)

static void ieee_sqrt(int64_t n, const double *a, double *y) {
    for (int64_t i = 0; i < n; i++) y[i] = __builtin_sqrt(a[i]);
}

/* log, cos, sin and sqrt over arrays: glibc's libmvec and IEEE sqrt by default; hf_dp_use sets torch's own (MKL
 * VML's vdLn, vdCos, vdSin and vdSqrt, where torch's CPU ops call them: torch's sqrt of a float64 is VML's, not
 * always the correctly rounded one), so the normals are the numpy path's bit for bit. */
static array_function vector_log = libmvec_log, vector_cos = libmvec_cos, vector_sin = libmvec_sin;
static array_function vector_sqrt = ieee_sqrt;
static int (*set_threads)(int) = 0; /* MKL's MKL_Set_Num_Threads_Local, with torch's functions */

void hf_dp_use(void *log, void *cos, void *sin, void *sqrt, void *threads) {
    vector_log = log ? (array_function)log : libmvec_log;
    vector_cos = cos ? (array_function)cos : libmvec_cos;
    vector_sin = sin ? (array_function)sin : libmvec_sin;
    vector_sqrt = sqrt ? (array_function)sqrt : ieee_sqrt;
    set_threads = (int (*)(int))threads;
}

/* MKL on one thread during a call: each caller is already one of torch's threads (MKL's own threads, started from
 * several callers at once, would oversubscribe the cores). Returns the caller's setting, for `restore`. */
static int one_thread(void) { return set_threads ? set_threads(1) : 0; }
static void restore(int previous) {
    if (set_threads) set_threads(previous);
}

/* The four 53-bit words of pairs [pair + start, pair + count), count <= PAIRS, in columns [start, count). */
static void words_scalar(uint64_t k0, uint64_t k1, uint64_t param, uint64_t pair, int start, int count,
                         uint64_t w[4][PAIRS]) {
    for (int i = start; i < count; i++) {
        uint64_t c0 = pair + (uint64_t)i, c1 = param, c2 = 0, c3 = 0, a = k0, b = k1;
        for (int r = 0; r < 10; r++) {
            u128 p0 = (u128)c0 * M0, p1 = (u128)c2 * M1;
            uint64_t hi0 = (uint64_t)(p0 >> 64), lo0 = (uint64_t)p0;
            uint64_t hi1 = (uint64_t)(p1 >> 64), lo1 = (uint64_t)p1;
            c0 = hi1 ^ c1 ^ a;
            c1 = lo1;
            c2 = hi0 ^ c3 ^ b;
            c3 = lo0;
            a += W0;
            b += W1;
        }
        w[0][i] = c0 >> 11;
        w[1][i] = c1 >> 11;
        w[2][i] = c2 >> 11;
        w[3][i] = c3 >> 11;
    }
}

/* The same words with AVX-512: 16 pairs in two vectors of 8 lanes, each 64 x 64-bit product from four 32 x 32-bit
 * ones (the high half) and vpmullq (the low), and 4 more pairs on the scalar multiplier in the same loop, which the
 * vector units leave idle. Integer arithmetic throughout: the words are the scalar loop's, bit for bit. */
#define VECTOR_PAIRS 16
#define SCALAR_PAIRS 4
#define AVX512 __attribute__((target("avx512f,avx512dq")))

AVX512 static inline void product(__m512i x, __m512i m, __m512i m_high, __m512i *high, __m512i *low) {
    const __m512i mask = _mm512_set1_epi64(0xFFFFFFFFLL);
    __m512i x_high = _mm512_srli_epi64(x, 32);
    __m512i ll = _mm512_mul_epu32(x, m), lh = _mm512_mul_epu32(x, m_high);
    __m512i hl = _mm512_mul_epu32(x_high, m), hh = _mm512_mul_epu32(x_high, m_high);
    __m512i t = _mm512_add_epi64(lh, _mm512_srli_epi64(ll, 32));   /* < 2^64: (2^32 - 1)^2 + 2^32 - 1 */
    __m512i middle = _mm512_add_epi64(_mm512_and_si512(t, mask), hl); /* likewise */
    *high = _mm512_add_epi64(_mm512_add_epi64(hh, _mm512_srli_epi64(t, 32)), _mm512_srli_epi64(middle, 32));
    *low = _mm512_mullo_epi64(x, m);
}

#define XOR3(a, b, c) _mm512_ternarylogic_epi64(a, b, c, 0x96)

AVX512 static void words_avx512(uint64_t k0, uint64_t k1, uint64_t param, uint64_t pair, int count,
                                uint64_t w[4][PAIRS]) {
    const __m512i m0 = _mm512_set1_epi64((long long)M0), m0_high = _mm512_set1_epi64((long long)(M0 >> 32));
    const __m512i m1 = _mm512_set1_epi64((long long)M1), m1_high = _mm512_set1_epi64((long long)(M1 >> 32));
    const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), zero = _mm512_setzero_si512();
    int i = 0;
    for (; i + VECTOR_PAIRS + SCALAR_PAIRS <= count; i += VECTOR_PAIRS + SCALAR_PAIRS) {
        __m512i a0 = _mm512_add_epi64(_mm512_set1_epi64((long long)(pair + (uint64_t)i)), lanes);
        __m512i b0 = _mm512_add_epi64(a0, _mm512_set1_epi64(8));
        __m512i a1 = _mm512_set1_epi64((long long)param), b1 = a1, a2 = zero, b2 = zero, a3 = zero, b3 = zero;
        uint64_t c0[SCALAR_PAIRS], c1[SCALAR_PAIRS], c2[SCALAR_PAIRS], c3[SCALAR_PAIRS];
        for (int l = 0; l < SCALAR_PAIRS; l++) {
            c0[l] = pair + (uint64_t)(i + VECTOR_PAIRS + l);
            c1[l] = param;
            c2[l] = c3[l] = 0;
        }
        uint64_t a = k0, b = k1;
        for (int r = 0; r < 10; r++) {
            __m512i ka = _mm512_set1_epi64((long long)a), kb = _mm512_set1_epi64((long long)b);
            __m512i ha0, la0, ha2, la2, hb0, lb0, hb2, lb2;
            product(a0, m0, m0_high, &ha0, &la0);
            product(a2, m1, m1_high, &ha2, &la2);
            product(b0, m0, m0_high, &hb0, &lb0);
            product(b2, m1, m1_high, &hb2, &lb2);
            a0 = XOR3(ha2, a1, ka); /* the scalar loop's round, on 8 lanes */
            a1 = la2;
            a2 = XOR3(ha0, a3, kb);
            a3 = la0;
            b0 = XOR3(hb2, b1, ka);
            b1 = lb2;
            b2 = XOR3(hb0, b3, kb);
            b3 = lb0;
            for (int l = 0; l < SCALAR_PAIRS; l++) {
                u128 p0 = (u128)c0[l] * M0, p1 = (u128)c2[l] * M1;
                c0[l] = (uint64_t)(p1 >> 64) ^ c1[l] ^ a;
                c1[l] = (uint64_t)p1;
                c2[l] = (uint64_t)(p0 >> 64) ^ c3[l] ^ b;
                c3[l] = (uint64_t)p0;
            }
            a += W0;
            b += W1;
        }
        __m512i vectors[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
        for (int k = 0; k < 4; k++) {
            _mm512_storeu_si512(w[k] + i, _mm512_srli_epi64(vectors[0][k], 11));
            _mm512_storeu_si512(w[k] + i + 8, _mm512_srli_epi64(vectors[1][k], 11));
        }
        for (int l = 0; l < SCALAR_PAIRS; l++) {
            int at = i + VECTOR_PAIRS + l;
            w[0][at] = c0[l] >> 11;
            w[1][at] = c1[l] >> 11;
            w[2][at] = c2[l] >> 11;
            w[3][at] = c3[l] >> 11;
        }
    }
    words_scalar(k0, k1, param, pair, i, count, w);
}

static int use_avx512 = 0; /* hf_dp_words_engine sets it: host_kernel.py keeps the faster engine on this CPU */

/* The four 53-bit words of pairs [pair, pair + count), count <= PAIRS, in four columns. */
static void tile_words(uint64_t k0, uint64_t k1, uint64_t param, uint64_t pair, int count, uint64_t w[4][PAIRS]) {
    if (use_avx512) {
        words_avx512(k0, k1, param, pair, count, w);
    } else {
        words_scalar(k0, k1, param, pair, 0, count, w);
    }
}

/* The words' engine: 1 for AVX-512 with the scalar multiplier beside it, where the CPU and the OS support it, 0 for
 * the scalar loop. Returns the engine now in use. */
int hf_dp_words_engine(int avx512) {
    use_avx512 = avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return use_avx512;
}

/* A 53-bit integer as a double, exactly: its high 27 and low 26 bits through the exponent of 2^52. */
static inline __m256d exact_double(__m256i word) {
    const __m256i exponent = _mm256_set1_epi64x(0x4330000000000000LL);
    const __m256d offset = _mm256_set1_pd(0x1p52);
    __m256i high_bits = _mm256_srli_epi64(word, 26);
    __m256i low_bits = _mm256_and_si256(word, _mm256_set1_epi64x((1LL << 26) - 1));
    __m256d high = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(high_bits, exponent)), offset);
    __m256d low = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(low_bits, exponent)), offset);
    return _mm256_add_pd(_mm256_mul_pd(high, _mm256_set1_pd(0x1p26)), low);
}

/* The normals of pairs [pair, pair + count): out[2i] = R cos theta, out[2i + 1] = R sin theta. */
static void tile_normals(uint64_t k0, uint64_t k1, uint64_t param, uint64_t pair, int count, double *out) {
    static __thread uint64_t w[4][PAIRS] __attribute__((aligned(64)));
    static __thread double uniform[PAIRS] __attribute__((aligned(64))), angle[PAIRS] __attribute__((aligned(64)));
    static __thread double logs[PAIRS] __attribute__((aligned(64))), cosines[PAIRS] __attribute__((aligned(64)));
    static __thread double sines[PAIRS] __attribute__((aligned(64)));
    tile_words(k0, k1, param, pair, count, w);
    int padded = (count + 3) & ~3;
    for (int i = count; i < padded; i++) {
        w[0][i] = w[1][i] = w[2][i] = w[3][i] = 0;
    }
    for (int i = 0; i < padded; i += 4) {
        __m256d high = exact_double(_mm256_loadu_si256((const __m256i *)(w[0] + i)));
        __m256d middle = exact_double(_mm256_loadu_si256((const __m256i *)(w[1] + i)));
        __m256d low = exact_double(_mm256_loadu_si256((const __m256i *)(w[2] + i)));
        __m256d turn = exact_double(_mm256_loadu_si256((const __m256i *)(w[3] + i)));
        __m256d sum = _mm256_add_pd(_mm256_mul_pd(high, _mm256_set1_pd(0x1p106)),
                                    _mm256_mul_pd(middle, _mm256_set1_pd(0x1p53)));
        sum = _mm256_add_pd(sum, _mm256_add_pd(low, _mm256_set1_pd(1.0)));
        _mm256_storeu_pd(uniform + i, _mm256_mul_pd(sum, _mm256_set1_pd(0x1p-159)));
        _mm256_storeu_pd(angle + i, _mm256_mul_pd(turn, _mm256_set1_pd(TURN)));
    }
    vector_log(count, uniform, logs);
    for (int i = 0; i < count; i++) logs[i] *= -2.0;
    vector_sqrt(count, logs, uniform); /* the radii */
    vector_cos(count, angle, cosines);
    vector_sin(count, angle, sines);
    for (int i = 0; i < count; i++) {
        out[2 * i] = uniform[i] * cosines[i];
        out[2 * i + 1] = uniform[i] * sines[i];
    }
}

/* The tile of pairs from `pair` within elements [first, end): computes its normals, returns the first of the
 * segment's elements it holds (`*at`, counted from `first`), how many (`*n`), and a pointer to their normals. */
static const double *tile(uint64_t k0, uint64_t k1, uint64_t param, uint64_t first, uint64_t end, uint64_t pair,
                          double *normals, int64_t *at, int64_t *n) {
    uint64_t pair_end = (end + 1) / 2 < pair + PAIRS ? (end + 1) / 2 : pair + PAIRS;
    tile_normals(k0, k1, param, pair, (int)(pair_end - pair), normals);
    uint64_t lo = 2 * pair > first ? 2 * pair : first, hi = 2 * pair_end < end ? 2 * pair_end : end;
    *at = (int64_t)(lo - first);
    *n = (int64_t)(hi - lo);
    return normals + (lo - 2 * pair);
}

/* The 53-bit words of pairs [pair, pair + count) of parameter `param`, four per pair (tests compare them). */
void hf_dp_words(uint64_t k0, uint64_t k1, uint64_t param, uint64_t pair, int64_t count, uint64_t *out) {
    uint64_t w[4][PAIRS];
    for (int64_t start = 0; start < count; start += PAIRS) {
        int n = count - start < PAIRS ? (int)(count - start) : PAIRS;
        tile_words(k0, k1, param, pair + (uint64_t)start, n, w);
        for (int i = 0; i < n; i++) {
            for (int k = 0; k < 4; k++) {
                out[4 * (start + i) + k] = w[k][i];
            }
        }
    }
}

/* The normals of elements [first, first + count) of parameter `param` (tests compare them with the numpy path). */
void hf_dp_normals(uint64_t k0, uint64_t k1, uint64_t param, uint64_t first, int64_t count, double *out) {
    static __thread double normals[2 * PAIRS];
    int64_t at, n;
    int previous = one_thread();
    for (uint64_t pair = first / 2, end = first + (uint64_t)count; 2 * pair < end; pair += PAIRS) {
        const double *z = tile(k0, k1, param, first, end, pair, normals, &at, &n);
        for (int64_t i = 0; i < n; i++) {
            out[at + i] = z[i];
        }
    }
    restore(previous);
}

/* round((std * z + g) / quantum) * quantum, four at a time and one at a time: the same roundings. */
static inline __m256d rounded4(__m256d z, __m256d g, __m256d scale, __m256d step) {
    __m256d total = _mm256_add_pd(_mm256_mul_pd(z, scale), g);
    total = _mm256_round_pd(_mm256_div_pd(total, step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_mul_pd(total, step);
}

static inline double rounded1(double z, double g, double std, double quantum) {
    double total = z * std;
    total = total + g;
    return __builtin_roundeven(total / quantum) * quantum;
}

/* The noised, rounded sum into float32 gradients (`f32`) or float64 ones (`f64`, when f32 is NULL). */
static void add(uint64_t k0, uint64_t k1, uint64_t param, uint64_t first, int64_t count, float *f32, double *f64,
                double std, double quantum) {
    static __thread double normals[2 * PAIRS];
    const __m256d scale = _mm256_set1_pd(std), step = _mm256_set1_pd(quantum);
    int64_t at, n;
    int previous = one_thread();
    for (uint64_t pair = first / 2, end = first + (uint64_t)count; 2 * pair < end; pair += PAIRS) {
        const double *z = tile(k0, k1, param, first, end, pair, normals, &at, &n);
        int64_t i = 0;
        if (f32) {
            float *g = f32 + at;
            for (; i + 4 <= n; i += 4) {
                __m256d sum = rounded4(_mm256_loadu_pd(z + i), _mm256_cvtps_pd(_mm_loadu_ps(g + i)), scale, step);
                _mm_storeu_ps(g + i, _mm256_cvtpd_ps(sum));
            }
            for (; i < n; i++) g[i] = (float)rounded1(z[i], (double)g[i], std, quantum);
        } else {
            double *g = f64 + at;
            for (; i + 4 <= n; i += 4) {
                _mm256_storeu_pd(g + i, rounded4(_mm256_loadu_pd(z + i), _mm256_loadu_pd(g + i), scale, step));
            }
            for (; i < n; i++) g[i] = rounded1(z[i], g[i], std, quantum);
        }
    }
    restore(previous);
}

/* grad[i] <- round((grad[i] + std * normal of element first + i) / quantum) * quantum, in float64, then float32. */
void hf_dp_add_f32(uint64_t k0, uint64_t k1, uint64_t param, uint64_t first, int64_t count, float *grad, double std,
                   double quantum) {
    add(k0, k1, param, first, count, grad, 0, std, quantum);
}

/* As hf_dp_add_f32, for float64 gradients. */
void hf_dp_add_f64(uint64_t k0, uint64_t k1, uint64_t param, uint64_t first, int64_t count, double *grad,
                   double std, double quantum) {
    add(k0, k1, param, first, count, 0, grad, std, quantum);
}
