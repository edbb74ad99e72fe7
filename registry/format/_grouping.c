/* Exponent-grouped deltas and their sparse planes: the transforms of registry/format/codec.py that numpy
 * cannot do at speed.
 *
 * A delta element (new minus basis, zigzagged) is moved into the group of its basis element's key,
 * the 8 bits after the sign (bf16 and fp32: the exponent; fp16: the exponent and the top three
 * mantissa bits; fp64: the top of the exponent; all of them ordered by magnitude). A fine-tune moves weights by amounts
 * near a fixed absolute size, so a weight with a small exponent moves by many ulps and one with a
 * large exponent by none: grouped, each stretch of the delta holds one kind of value and zstd codes
 * it with its own Huffman table (full fine-tunes: 0.60 of the ungrouped size, see codec.py).
 * The decoder knows the basis, so it recomputes the groups and nothing about them is stored.
 *
 * numpy's equivalent is a stable argsort of the keys plus a gather, about 8 ns an element; these
 * counting-sort loops take about 1.6 (counting the keys, then grouping) and 1.4 (ungrouping) on
 * full-medical's chunks (1.9 and 2.0 before the elements went through a joined scratch buffer,
 * same machine), and decoding runs once per chunk on every pull. Two-byte elements ungroup faster
 * still with AVX-512 where the processor has it (unsub16_avx512). codec.py keeps the numpy
 * version for machines where this module was not built, and tests compare the three.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Elements are read and written as native integers and their bytes taken least significant first:
 * the stored formats are little-endian, and so must the machine be (elsewhere codec.py's numpy
 * versions run instead, as where no compiler is at hand). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "registry/format/_grouping.c assumes a little-endian machine"
#endif

/* Vector paths, chosen at run time from what the processor has (simd() turns them off: tests
 * compare their bytes with the plain loops'). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SIMD 1
/* AVX-512 VBMI2 (the expand loads) needs GCC 8, LLVM 8 (Apple clang 11) or later: an older compiler
 * builds the module without those paths rather than failing its build, which would lose the whole
 * module (grouped deltas written ungrouped, decoded in numpy). */
#if defined(__clang__)
#if (defined(__apple_build_version__) && __clang_major__ >= 11) || \
    (!defined(__apple_build_version__) && __clang_major__ >= 8)
#define HAVE_AVX512 1
#endif
#elif __GNUC__ >= 8
#define HAVE_AVX512 1
#endif
#ifdef HAVE_AVX512
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi2,bmi,bmi2,popcnt")))
#endif
static int have_ssse3, have_avx512;

static void detect_simd(void) {
    __builtin_cpu_init();
    have_ssse3 = __builtin_cpu_supports("ssse3") && __builtin_cpu_supports("popcnt");
#ifdef HAVE_AVX512
    /* (these checks include the operating system's support for the wide registers) */
    have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("bmi") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
#endif
}
#endif

#define NKEYS 256
/* Each element's group position comes from a counter that the previous element of its group just
 * incremented: a chain through memory (a store, then a load of the same address, about 4.5 cycles)
 * whenever neighbours share a key, which in weights they mostly do. So the chunk is cut into LANES
 * contiguous quarters, each with its own counters, and the loops step through the quarters side by
 * side: four chains in flight instead of one. Quarter q's elements of a group land after those of
 * quarters before it, so the order within every group, and so the stored bytes, are unchanged.
 * Elements are transformed a block at a time in a vectorisable loop apart from the scatter or
 * gather. */
#define LANES 4
#define BLOCK 1024

typedef int64_t hist_t[LANES][NKEYS];

/* Where quarter l starts and how long it is: three of n / LANES elements, the last one the rest. */
static inline Py_ssize_t lane_len(Py_ssize_t n) { return n / LANES; }

/* The differences are scattered into (or gathered from) a scratch buffer of whole elements, and a
 * sequential pass splits them into byte planes (plane k at k * stride) or joins them back: the
 * scatter and gather then touch one stream per group, not one per group and plane. Loads and
 * stores of elements go through memcpy: chunks are sliced from mmapped files at offsets that need
 * not be aligned, and the scratch buffer is the caller's. */
#define DEFINE_KERNELS(T, BITS)                                                                     \
    static inline T load_##BITS(const char *p, Py_ssize_t i) {                                     \
        T v;                                                                                        \
        memcpy(&v, p + i * (Py_ssize_t)sizeof(T), sizeof(T));                                      \
        return v;                                                                                   \
    }                                                                                               \
    static inline unsigned key_##BITS(T w) { return (unsigned)(w >> (BITS - 9)) & 0xffu; }         \
    static inline T zigzag_##BITS(T a, T b) {                                                       \
        T d = (T)(a - b);                                                                           \
        return (T)((T)(d << 1) ^ (T)((T)0 - (T)(d >> (BITS - 1)))); /* xor all ones if negative */ \
    }                                                                                               \
    static inline T unzigzag_##BITS(T b, T z) { return (T)(b + (T)((z >> 1) ^ (T)((T)0 - (T)(z & 1)))); } \
    static inline int put_##BITS(char *restrict joined, Py_ssize_t n, int64_t *restrict pos,        \
                                 unsigned key, T v) {                                               \
        Py_ssize_t p = pos[key]++;                                                                  \
        if (p >= n) return -1;                                                                      \
        memcpy(joined + p * (Py_ssize_t)sizeof(T), &v, sizeof(T));                                  \
        return 0;                                                                                   \
    }                                                                                               \
    /* The grouped elements split into byte planes in one sequential pass (the scatter writes one  \
     * stream per group, not one per group and plane): the inverse of join below. */               \
    static void split_##BITS(const char *restrict joined, Py_ssize_t n, unsigned char *restrict z,  \
                             Py_ssize_t stride) {                                                   \
        for (Py_ssize_t p = 0; p < n; p++) {                                                        \
            T w = load_##BITS(joined, p);                                                           \
            for (int k = 0; k < BITS / 8; k++) z[k * stride + p] = (unsigned char)(w >> (8 * k));  \
        }                                                                                           \
    }                                                                                               \
    static inline int get_##BITS(const char *restrict joined, Py_ssize_t n, int64_t *restrict pos,  \
                                 unsigned key, T *v) {                                              \
        Py_ssize_t p = pos[key]++;                                                                  \
        if (p >= n) return -1;                                                                      \
        *v = load_##BITS(joined, p);                                                                \
        return 0;                                                                                   \
    }                                                                                               \
    /* The planes joined into whole elements, still in group order: one sequential pass, so the    \
     * gather then reads one stream per group instead of one per group and plane (twice the       \
     * streams for bf16 than the prefetchers follow well). */                                       \
    static void join_##BITS(const unsigned char *restrict z, Py_ssize_t stride, Py_ssize_t n,       \
                            char *restrict joined) {                                                \
        for (Py_ssize_t p = 0; p < n; p++) {                                                        \
            T w = 0;                                                                                \
            for (int k = 0; k < BITS / 8; k++) w |= (T)((T)z[k * stride + p] << (8 * k));          \
            memcpy(joined + p * (Py_ssize_t)sizeof(T), &w, sizeof(T));                              \
        }                                                                                           \
    }                                                                                               \
    static void count_##BITS(const char *restrict b, Py_ssize_t n, hist_t h) {                      \
        memset(h, 0, sizeof(hist_t));                                                               \
        Py_ssize_t q = lane_len(n);                                                                 \
        for (Py_ssize_t j = 0; j < q; j++)                                                          \
            for (int l = 0; l < LANES; l++) h[l][key_##BITS(load_##BITS(b, l * q + j))]++;          \
        for (Py_ssize_t i = LANES * q; i < n; i++) h[LANES - 1][key_##BITS(load_##BITS(b, i))]++;   \
    }                                                                                               \
    /* Both return 0, or -1 if a position ran past n: only possible when the basis changed between \
     * counting and grouping (a writable buffer shared with another thread). */                    \
    static int sub_##BITS(const char *restrict a, const char *restrict b, unsigned char *restrict z,\
                          Py_ssize_t stride, Py_ssize_t n, hist_t pos, void *scratch) {             \
        T zz[LANES][BLOCK];                                                                         \
        char *restrict joined = scratch;                                                            \
        unsigned char keys[LANES][BLOCK];                                                           \
        Py_ssize_t q = lane_len(n);                                                                 \
        for (Py_ssize_t s = 0; s < q; s += BLOCK) {                                                 \
            Py_ssize_t m = q - s < BLOCK ? q - s : BLOCK;                                           \
            for (int l = 0; l < LANES; l++)                                                         \
                for (Py_ssize_t j = 0; j < m; j++) {                                                \
                    T bw = load_##BITS(b, l * q + s + j);                                           \
                    zz[l][j] = zigzag_##BITS(load_##BITS(a, l * q + s + j), bw);                    \
                    keys[l][j] = (unsigned char)key_##BITS(bw);                                     \
                }                                                                                   \
            for (Py_ssize_t j = 0; j < m; j++)                                                      \
                for (int l = 0; l < LANES; l++)                                                     \
                    if (put_##BITS(joined, n, pos[l], keys[l][j], zz[l][j])) return -1;             \
        }                                                                                           \
        for (Py_ssize_t i = LANES * q; i < n; i++) {  /* the last quarter's remainder */            \
            T bw = load_##BITS(b, i);                                                               \
            if (put_##BITS(joined, n, pos[LANES - 1], key_##BITS(bw), zigzag_##BITS(load_##BITS(a, i), bw))) \
                return -1;                                                                          \
        }                                                                                           \
        split_##BITS(joined, n, z, stride);                                                         \
        return 0;                                                                                   \
    }                                                                                               \
    static int unsub_##BITS(const unsigned char *restrict z, const char *restrict b,                \
                            char *restrict out, Py_ssize_t stride, Py_ssize_t n, hist_t pos,        \
                            void *scratch) {                                                        \
        T zz[LANES][BLOCK];                                                                         \
        char *restrict joined = scratch;                                                            \
        join_##BITS(z, stride, n, joined);                                                          \
        Py_ssize_t q = lane_len(n);                                                                 \
        for (Py_ssize_t s = 0; s < q; s += BLOCK) {                                                 \
            Py_ssize_t m = q - s < BLOCK ? q - s : BLOCK;                                           \
            for (Py_ssize_t j = 0; j < m; j++)                                                      \
                for (int l = 0; l < LANES; l++)                                                     \
                    if (get_##BITS(joined, n, pos[l], key_##BITS(load_##BITS(b, l * q + s + j)), &zz[l][j])) \
                        return -1;                                                                  \
            for (int l = 0; l < LANES; l++)                                                         \
                for (Py_ssize_t j = 0; j < m; j++) {                                                \
                    T v = unzigzag_##BITS(load_##BITS(b, l * q + s + j), zz[l][j]);                 \
                    memcpy(out + (l * q + s + j) * (Py_ssize_t)sizeof(T), &v, sizeof(T));           \
                }                                                                                   \
        }                                                                                           \
        for (Py_ssize_t i = LANES * q; i < n; i++) {                                                \
            T bw = load_##BITS(b, i), v;                                                            \
            if (get_##BITS(joined, n, pos[LANES - 1], key_##BITS(bw), &v)) return -1;               \
            v = unzigzag_##BITS(bw, v);                                                             \
            memcpy(out + i * (Py_ssize_t)sizeof(T), &v, sizeof(T));                                 \
        }                                                                                           \
        return 0;                                                                                   \
    }

DEFINE_KERNELS(uint16_t, 16)
DEFINE_KERNELS(uint32_t, 32)
DEFINE_KERNELS(uint64_t, 64)

/* Each group's size (counts), and where each quarter's elements of each group start: groups in key
 * order; within a group the quarters in order, so elements keep their order. */
static void starts_of(hist_t h, int64_t *counts, hist_t pos) {
    int64_t acc = 0;
    for (int k = 0; k < NKEYS; k++) {
        counts[k] = 0;
        for (int l = 0; l < LANES; l++) {
            pos[l][k] = acc;
            acc += h[l][k];
            counts[k] += h[l][k];
        }
    }
}

#ifdef HAVE_AVX512
/* Ungrouping two-byte elements with AVX-512 (VBMI2's expand), at about 2.5 times the speed of
 * unsub_16 on a bf16 LoRA chunk (3.3 -> 1.3 ms a 2 MiB chunk with its key count, Xeon; see
 * docs/design/deltas.md).
 *
 * Weights' keys (their exponents) crowd into a band of a few neighbouring values: a LoRA chunk's
 * 9 keys of 114-122 hold 99% of its elements. For each key of the band, one pass over a block of
 * keys finds, 64 elements at a time, which of them belong to it (a compare), and an expand load
 * takes that many next elements of its group into their places: no chain through a counter per
 * element. The few elements outside the band are listed in the pass that computes the keys and
 * taken one by one. The band is chosen on a sample of keys to cost least (a pass costs about as
 * much as UNSUB_PASS_SHARE of a pass's elements taken one by one); where it would hold under 7/8 of
 * the sample, or the list outgrows its room, the plain loop runs instead (random bytes, an
 * unusual tensor), before anything is written. */
#define UNSUB_SAMPLE 61     /* every 61st key is sampled to choose the band */
#define UNSUB_PASS_SHARE 0.25
#define UNSUB_BLOCK 4096    /* elements ungrouped at a time (their keys and output stay in cache) */
#define UNSUB_BAND_MAX 24

/* Bytes of scratch the vector path needs for n two-byte elements: the joined elements, their keys,
 * and the list of those outside the band (at most n / 4 of them, plus a vector's spill). */
static Py_ssize_t unsub16_scratch(Py_ssize_t n) { return 2 * n + 64 + n + 64 + 4 * (n / 4 + 64); }

static inline char *align64(char *p) { return (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* The band [*lo, *hi] for basis b of n elements; 0 where the plain loop should run instead. */
static int unsub16_band(const char *b, Py_ssize_t n, unsigned *lo, unsigned *hi) {
    uint32_t sample[NKEYS] = {0}, below[NKEYS + 1];
    uint32_t ns = 0;
    for (Py_ssize_t i = 0; i < n; i += UNSUB_SAMPLE, ns++) sample[key_16(load_16(b, i))]++;
    below[0] = 0;
    for (int k = 0; k < NKEYS; k++) below[k + 1] = below[k] + sample[k];
    double pass = (double)n / 64.0 * UNSUB_PASS_SHARE / UNSUB_SAMPLE, best = -1;
    for (unsigned a = 0; a < NKEYS; a++) {
        if (!sample[a]) continue;
        for (unsigned z = a; z < NKEYS && z < a + UNSUB_BAND_MAX; z++) {
            double cost = (z - a + 1) * pass + (double)(ns - (below[z + 1] - below[a]));
            if (best < 0 || cost < best) {
                best = cost;
                *lo = a;
                *hi = z;
            }
        }
    }
    return best >= 0 && (uint64_t)(below[*hi + 1] - below[*lo]) * 8 >= (uint64_t)ns * 7;
}

/* unsub_16 on the vector path: 1 done, 0 not started (the caller runs unsub_16). The counts come
 * from the keys computed here, not from the basis read again, so every expand load stays inside
 * its group whatever another thread does to the basis meanwhile (the output would then be wrong,
 * and its check against the chunk's id fails). The keys and the list live in the scratch, which
 * no other thread may write meanwhile (codec.py's is per thread). */
AVX512 static int unsub16_avx512(const unsigned char *restrict z, Py_ssize_t stride, const char *restrict b,
                                 char *restrict out, Py_ssize_t n, char *scratch, Py_ssize_t scratch_len) {
    unsigned c0 = 0, c1 = 0;
    if (n < 64 * 16 || n >= INT32_MAX || scratch_len < unsub16_scratch(n) || !unsub16_band(b, n, &c0, &c1)) return 0;
    char *joined = scratch;  /* (bytes: the caller's scratch need not be aligned) */
    uint8_t *keys = (uint8_t *)align64(scratch + 2 * n);
    uint32_t *rare = (uint32_t *)align64((char *)keys + n);
    Py_ssize_t cap = n / 4, nv = n / 64 * 64, nr = 0;
    const __m512i ff = _mm512_set1_epi16(0xff), lo = _mm512_set1_epi8((char)c0);
    const __m512i width = _mm512_set1_epi8((char)(c1 - c0));
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (Py_ssize_t i = 0; i < nv; i += 64) {
        __m512i k0 = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + 2 * i), 7), ff);
        __m512i k1 = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + 2 * i + 64), 7), ff);
        __m512i kk = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(k0)), _mm512_cvtepi16_epi8(k1), 1);
        _mm512_storeu_si512(keys + i, kk);
        uint64_t m = _mm512_cmpgt_epu8_mask(_mm512_sub_epi8(kk, lo), width);  /* outside the band */
        if (m == 0) continue;
        if (nr > cap) return 0;
        for (int q = 0; q < 4; q++) {  /* (a full store each: the list has a vector's room to spare) */
            __mmask16 mq = (__mmask16)(m >> (16 * q));
            __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(i + 16 * q)));
            _mm512_storeu_si512(rare + nr, _mm512_maskz_compress_epi32(mq, idx));
            nr += _mm_popcnt_u32(mq);
        }
    }
    if (nr > cap) return 0;
    int64_t cnt[NKEYS] = {0}, pos[NKEYS], acc = 0;
    for (Py_ssize_t i = nv; i < n; i++) cnt[keys[i] = (uint8_t)key_16(load_16(b, i))]++;
    for (Py_ssize_t r = 0; r < nr; r++) cnt[keys[rare[r]]]++;
    for (unsigned k = c0; k <= c1; k++) {
        __m512i kv = _mm512_set1_epi8((char)k);
        for (Py_ssize_t i = 0; i < nv; i += 64) cnt[k] += _mm_popcnt_u64(_mm512_cmpeq_epi8_mask(_mm512_loadu_si512(keys + i), kv));
    }
    for (int k = 0; k < NKEYS; k++) {
        pos[k] = acc;
        acc += cnt[k];
    }
    join_16(z, stride, n, joined);
    const __m512i one = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
    Py_ssize_t r = 0;
    for (Py_ssize_t s = 0; s < nv; s += UNSUB_BLOCK) {
        Py_ssize_t e = s + UNSUB_BLOCK < nv ? s + UNSUB_BLOCK : nv;
        /* the band's keys two at a time (one load and store of the output for both) */
        for (unsigned k = c0; k <= c1; k += 2) {
            unsigned k2 = k + 1 <= c1 ? k + 1 : 256;  /* 256: no key matches the second */
            __m512i ka = _mm512_set1_epi8((char)k), kb = _mm512_set1_epi8((char)k2);
            int64_t pa = pos[k], pb = k2 < NKEYS ? pos[k2] : 0;
            for (Py_ssize_t i = s; i < e; i += 64) {
                __m512i kk = _mm512_loadu_si512(keys + i);
                __mmask64 ma = _mm512_cmpeq_epi8_mask(kk, ka);
                __mmask64 mb = k2 < NKEYS ? _mm512_cmpeq_epi8_mask(kk, kb) : 0;
                for (int h = 0; h < 2; h++) {
                    __mmask32 a = (__mmask32)(ma >> (32 * h)), c = (__mmask32)(mb >> (32 * h));
                    /* the first pass writes every element before any is read: a load from a
                       fresh output page would map the zero page, and the store after it copy
                       it, flushing every core's TLB (an interrupt to each, costly in a VM) */
                    __m512i zz = k == c0 ? zero : _mm512_loadu_si512(out + 2 * i + 64 * h);
                    zz = _mm512_mask_expandloadu_epi16(zz, a, joined + 2 * pa);
                    zz = _mm512_mask_expandloadu_epi16(zz, c, joined + 2 * pb);
                    _mm512_storeu_si512(out + 2 * i + 64 * h, zz);
                    pa += _mm_popcnt_u32(a);
                    pb += _mm_popcnt_u32(c);
                }
            }
            pos[k] = pa;
            if (k2 < NKEYS) pos[k2] = pb;
        }
        for (; r < nr && rare[r] < e; r++) {
            uint32_t j = rare[r];
            memcpy(out + 2 * j, joined + 2 * pos[keys[j]]++, 2);
        }
        for (Py_ssize_t i = s; i < e; i += 32) {  /* b plus the un-zigzagged differences */
            __m512i d = _mm512_loadu_si512(out + 2 * i), bw = _mm512_loadu_si512(b + 2 * i);
            __m512i neg = _mm512_sub_epi16(zero, _mm512_and_si512(d, one));
            _mm512_storeu_si512(out + 2 * i, _mm512_add_epi16(bw, _mm512_xor_si512(_mm512_srli_epi16(d, 1), neg)));
        }
    }
    for (Py_ssize_t i = nv; i < n; i++) {
        uint16_t v = unzigzag_16(load_16(b, i), load_16(joined, pos[keys[i]]++));
        memcpy(out + 2 * i, &v, 2);
    }
    return 1;
}
#endif

typedef void (*count_fn)(const char *, Py_ssize_t, hist_t);

static int parse_width(int itemsize, count_fn *count) {
    switch (itemsize) {
    case 2: *count = count_16; return 0;
    case 4: *count = count_32; return 0;
    case 8: *count = count_64; return 0;
    }
    PyErr_Format(PyExc_ValueError, "itemsize %d: grouped deltas take 2, 4 or 8", itemsize);
    return -1;
}

/* Elements n (data and basis each n * itemsize bytes) and plane stride must fit the planes. */
static int check_sizes(Py_ssize_t elem_len, Py_ssize_t basis_len, Py_ssize_t planes_len, int itemsize,
                       Py_ssize_t stride) {
    if (elem_len != basis_len || elem_len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "data and basis must have one length, a multiple of itemsize");
        return -1;
    }
    Py_ssize_t n = elem_len / itemsize;
    /* planes_len >= (itemsize - 1) * stride + n, written so that nothing overflows */
    if (stride < n || planes_len < n || (planes_len - n) / (itemsize - 1) < stride) {
        PyErr_SetString(PyExc_ValueError, "the planes do not hold every element at this stride");
        return -1;
    }
    return 0;
}

static int overlap(const Py_buffer *a, const Py_buffer *b);

/* A scratch buffer for the joined elements: at least ``len`` bytes, sharing none with the others. */
static int check_scratch(const Py_buffer *scratch, Py_ssize_t len, const Py_buffer *a, const Py_buffer *b,
                         const Py_buffer *c) {
    if (scratch->len < len || overlap(scratch, a) || overlap(scratch, b) || overlap(scratch, c)) {
        PyErr_SetString(PyExc_ValueError, "scratch must hold as many bytes as the basis, apart from every other buffer");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(sub_grouped_doc,
    "sub_grouped(data, basis, itemsize, planes, stride, sizes, scratch)\n\n"
    "Write the zigzagged differences data - basis (wrapping itemsize-byte integers), grouped stably\n"
    "by the basis element's key (its 8 bits after the sign), as byte planes: byte k of each at\n"
    "planes[k * stride + position]. sizes (256 int64, writable) receives each group's size.\n"
    "scratch: a writable buffer of at least len(basis) bytes, for the grouped elements.");

static PyObject *sub_grouped(PyObject *self, PyObject *args) {
    Py_buffer a = {0}, b = {0}, z = {0}, sizes = {0}, scratch = {0};
    int itemsize;
    Py_ssize_t stride;
    count_fn count;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*iw*nw*w*", &a, &b, &itemsize, &z, &stride, &sizes, &scratch)) goto done;
    if (parse_width(itemsize, &count) || check_sizes(a.len, b.len, z.len, itemsize, stride)) goto done;
    if (check_scratch(&scratch, b.len, &a, &b, &z) || check_scratch(&scratch, b.len, &sizes, &sizes, &sizes)) goto done;
    if (sizes.len != NKEYS * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "sizes must hold 256 int64");
        goto done;
    }
    Py_ssize_t n = a.len / itemsize;
    int64_t *counts = sizes.buf;
    hist_t h, pos;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    count(b.buf, n, h);
    starts_of(h, counts, pos);
    switch (itemsize) {
    case 2: bad = sub_16(a.buf, b.buf, z.buf, stride, n, pos, scratch.buf); break;
    case 4: bad = sub_32(a.buf, b.buf, z.buf, stride, n, pos, scratch.buf); break;
    default: bad = sub_64(a.buf, b.buf, z.buf, stride, n, pos, scratch.buf); break;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "the basis changed while it was being read");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&z);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&scratch);
    return result;
}

PyDoc_STRVAR(unsub_grouped_doc,
    "unsub_grouped(planes, stride, basis, itemsize, tail, scratch[, out]) -> bytes or int\n\n"
    "Inverse of sub_grouped: basis + the ungrouped, un-zigzagged differences, followed by tail.\n"
    "scratch: a writable buffer of at least len(basis) bytes, for the joined planes (two-byte\n"
    "elements take the AVX-512 path only with 2 * len(basis) + 512 bytes: their keys and a list),\n"
    "which no other thread may write while this runs. Without out, written straight into a new\n"
    "bytes object (a numpy array and its tobytes() copy would fault in two fresh buffers per chunk,\n"
    "a third of a delta's decoding time). With out (writable, at least len(basis) + len(tail)\n"
    "bytes, apart from every other buffer) the result is written there and its length returned:\n"
    "a caller that only writes it on (a node cache's file) reuses one buffer. Where the basis\n"
    "changes while it is read, ValueError, and out holds a partial result.");

static PyObject *unsub_grouped(PyObject *self, PyObject *args) {
    Py_buffer z = {0}, b = {0}, tail = {0}, scratch = {0}, given = {0};
    int itemsize;
    Py_ssize_t stride;
    count_fn count;
    PyObject *result = NULL;
    char *out;
    if (!PyArg_ParseTuple(args, "y*ny*iy*w*|w*", &z, &stride, &b, &itemsize, &tail, &scratch, &given)) goto done;
    if (parse_width(itemsize, &count) || check_sizes(b.len, b.len, z.len, itemsize, stride) /* basis and output: one length */) goto done;
    if (check_scratch(&scratch, b.len, &z, &b, &tail)) goto done;
    if (given.obj != NULL) {  /* (buf may be NULL for an empty buffer) */
        if (given.len < b.len + tail.len || overlap(&given, &z) || overlap(&given, &b) || overlap(&given, &tail) ||
            overlap(&given, &scratch)) {
            PyErr_SetString(PyExc_ValueError, "out must hold len(basis) + len(tail) bytes, apart from every other buffer");
            goto done;
        }
        result = PyLong_FromSsize_t(b.len + tail.len);
        if (result == NULL) goto done;
        out = given.buf;
    } else {
        result = PyBytes_FromStringAndSize(NULL, b.len + tail.len);
        if (result == NULL) goto done;
        out = PyBytes_AS_STRING(result);
    }
    Py_ssize_t n = b.len / itemsize;
    int64_t counts[NKEYS];
    hist_t h, pos;
    int bad;
    void *joined = scratch.buf;
    int vector = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX512
    vector = itemsize == 2 && have_avx512 && unsub16_avx512(z.buf, stride, b.buf, out, n, joined, scratch.len);
#endif
    if (vector) {
        bad = 0;
    } else {
        count(b.buf, n, h);
        starts_of(h, counts, pos);
        switch (itemsize) {
        case 2: bad = unsub_16(z.buf, b.buf, out, stride, n, pos, joined); break;
        case 4: bad = unsub_32(z.buf, b.buf, out, stride, n, pos, joined); break;
        default: bad = unsub_64(z.buf, b.buf, out, stride, n, pos, joined); break;
        }
    }
    if (!bad) memcpy(out + b.len, tail.buf, tail.len);
    Py_END_ALLOW_THREADS
    if (bad) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, "the basis changed while it was being read");
    }
done:
    PyBuffer_Release(&z);
    PyBuffer_Release(&b);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&given);
    return result;
}

/* Sparse streams: a byte stream as one flag bit per byte (set where the byte is not zero, least
 * significant bit first) followed by its nonzero bytes. Grouped delta planes are often mostly zero
 * (p(0) about 0.6 in a retrained layer's high plane): Huffman spends at least a bit on every zero,
 * while flags packed eight to a byte let it code the zeros' pattern near its entropy (that plane:
 * 2.05 -> 1.81 bits an element). numpy's equivalent is packbits plus a boolean gather, and the
 * inverse a boolean scatter: several passes where these take one. */

static inline Py_ssize_t popcount8(unsigned x) {  /* portable: no compiler builtin needed */
    x = x - ((x >> 1) & 0x55u);
    x = (x & 0x33u) + ((x >> 2) & 0x33u);
    return (Py_ssize_t)((x + (x >> 4)) & 0x0Fu);
}

PyDoc_STRVAR(sparse_split_doc,
    "sparse_split(stream, flags, values[, ends, counts]) -> int\n\n"
    "Write stream's flag bits (ceil(len / 8) bytes, least significant bit first) into flags and its\n"
    "nonzero bytes into values (len(stream) bytes or more); return how many are nonzero. With ends\n"
    "(int64 offsets into the stream, ascending) and counts (int64, as many, writable), counts[j]\n"
    "receives how many of the bytes before ends[j] are nonzero: the encoder's blocks, counted in the\n"
    "same pass instead of one numpy call per block.");

/* Nonzero counts at the ends that fall in the block of `width` bytes starting at i, whose flag bits
 * are `bits` and before which `nnz` bytes were nonzero. */
static inline void count_ends(const int64_t *ends, Py_ssize_t nends, Py_ssize_t *j, int64_t *counts,
                              Py_ssize_t i, Py_ssize_t width, unsigned bits, Py_ssize_t nnz) {
    while (*j < nends && ends[*j] <= i + width) {
        unsigned r = (unsigned)(ends[*j] - i);
        uint32_t below = bits & (uint32_t)((1ull << r) - 1);
        Py_ssize_t c = 0;
        for (; below; below &= below - 1) c++;  /* a few bits at most: no popcount builtin needed */
        counts[(*j)++] = nnz + c;
    }
}

#ifdef HAVE_SIMD
/* Sixteen bytes a step: one compare gives their flag bits, and a byte shuffle per half packs the
 * nonzero bytes together (the shuffle for each 8-bit pattern comes from a table), with no branch
 * per byte. About five times the byte loop's speed on sparse planes; SSSE3, so chosen at run time. */
static unsigned char compact_lo[256][8], compact_hi[256][8];

static void init_split_tables(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        for (int j = 0; j < 8; j++)
            if (m >> j & 1) {
                compact_lo[m][k] = (unsigned char)j;
                compact_hi[m][k++] = (unsigned char)(j + 8);
            }
        for (; k < 8; k++) compact_lo[m][k] = compact_hi[m][k] = 0x80;  /* shuffles in a zero */
    }
}

/* Steps while 16 bytes remain; returns where it stopped. values has room for n bytes, and nnz <= i,
 * so each 8-byte store (ending at most at i + 16) stays inside it. */
__attribute__((target("ssse3,popcnt")))
static Py_ssize_t split_ssse3(const unsigned char *restrict src, Py_ssize_t n, unsigned char *restrict f,
                              unsigned char *restrict v, Py_ssize_t *nnz_io, const int64_t *ends,
                              Py_ssize_t nends, Py_ssize_t *j, int64_t *counts) {
    const __m128i zero = _mm_setzero_si128();
    Py_ssize_t i = 0, nnz = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i x = _mm_loadu_si128((const __m128i *)(src + i));
        unsigned m = ~(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(x, zero)) & 0xFFFFu;
        f[i / 8] = (unsigned char)m;
        f[i / 8 + 1] = (unsigned char)(m >> 8);
        if (counts != NULL) count_ends(ends, nends, j, counts, i, 16, m, nnz);
        if (m == 0) continue;
        unsigned lo = m & 0xFFu, hi = m >> 8;
        _mm_storel_epi64((__m128i *)(v + nnz), _mm_shuffle_epi8(x, _mm_loadl_epi64((const __m128i *)compact_lo[lo])));
        nnz += _mm_popcnt_u32(lo);
        _mm_storel_epi64((__m128i *)(v + nnz), _mm_shuffle_epi8(x, _mm_loadl_epi64((const __m128i *)compact_hi[hi])));
        nnz += _mm_popcnt_u32(hi);
    }
    *nnz_io = nnz;
    return i;
}
#endif

static PyObject *sparse_split(PyObject *self, PyObject *args) {
    Py_buffer in = {0}, flags = {0}, values = {0}, ends_buf = {0}, counts_buf = {0};
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*w*w*|y*w*", &in, &flags, &values, &ends_buf, &counts_buf)) goto done;
    Py_ssize_t n = in.len;
    if (flags.len < (n + 7) / 8 || values.len < n) {
        PyErr_SetString(PyExc_ValueError, "flags or values too small for the stream");
        goto done;
    }
    const int64_t *ends = ends_buf.buf;
    int64_t *counts = counts_buf.buf;
    Py_ssize_t nends = ends_buf.len / (Py_ssize_t)sizeof(int64_t);
    if ((ends_buf.buf == NULL) != (counts_buf.buf == NULL) || ends_buf.len % (Py_ssize_t)sizeof(int64_t) ||
        counts_buf.len != ends_buf.len) {
        PyErr_SetString(PyExc_ValueError, "ends and counts must come together, int64, one count per end");
        goto done;
    }
    for (Py_ssize_t k = 0; k < nends; k++)
        if (ends[k] < (k ? ends[k - 1] : 0) || ends[k] > n) {
            PyErr_SetString(PyExc_ValueError, "ends must ascend from 0 to the stream's length");
            goto done;
        }
    if (nends == 0) counts = NULL;
    const unsigned char *restrict src = in.buf;
    unsigned char *restrict f = flags.buf, *restrict v = values.buf;
    Py_ssize_t nnz = 0, i = 0, j = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_SIMD
    if (have_ssse3) i = split_ssse3(src, n, f, v, &nnz, ends, nends, &j, counts);
#endif
    for (; i < n; i += 8) {
        unsigned bits = 0;
        Py_ssize_t m = n - i < 8 ? n - i : 8, before = nnz;
        uint64_t w = 1;
        if (m == 8) memcpy(&w, src + i, 8);
        if (w != 0) {  /* eight zero bytes, the common case in sparse planes, need one test */
            for (Py_ssize_t k = 0; k < m; k++) {
                unsigned char c = src[i + k];
                v[nnz] = c;  /* written always, kept only when nonzero: no branch */
                nnz += c != 0;
                bits |= (unsigned)(c != 0) << k;
            }
        }
        f[i / 8] = (unsigned char)bits;
        if (counts != NULL) count_ends(ends, nends, &j, counts, i, m, bits, before);
    }
    if (counts != NULL) count_ends(ends, nends, &j, counts, n, 0, 0, nnz);  /* ends at n of an empty stream */
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(nnz);
done:
    PyBuffer_Release(&in);
    PyBuffer_Release(&flags);
    PyBuffer_Release(&values);
    PyBuffer_Release(&ends_buf);
    PyBuffer_Release(&counts_buf);
    return result;
}

PyDoc_STRVAR(sparse_join_doc,
    "sparse_join(flags, values, out) -> int\n\n"
    "Inverse of sparse_split: fill out (len(out) bytes) from flags and values; return how many\n"
    "values it used. Raises ValueError if the flags ask for more values than there are.");

#ifdef HAVE_AVX512
/* Sixty-four bytes a step: their flag bits are the mask of one expand load (VBMI2), which takes as
 * many values as bits are set and puts them where the bits are (zeros elsewhere): 0.49 -> 0.05 ms
 * for a 1 MiB plane (Xeon). Returns where it stopped: at the last whole step, or where the values
 * would run out (the byte loop goes on from there, and says so). */
AVX512 static Py_ssize_t sparse_join_avx512(const unsigned char *restrict f, const unsigned char *restrict v,
                                            unsigned char *restrict dst, Py_ssize_t n, Py_ssize_t avail,
                                            Py_ssize_t *used_io) {
    Py_ssize_t i = 0, used = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t m;
        memcpy(&m, f + i / 8, 8);
        Py_ssize_t c = (Py_ssize_t)_mm_popcnt_u64(m);
        if (used + c > avail) break;
        _mm512_storeu_si512(dst + i, _mm512_maskz_expandloadu_epi8(m, v + used));
        used += c;
    }
    *used_io = used;
    return i;
}
#endif

static PyObject *sparse_join(PyObject *self, PyObject *args) {
    Py_buffer flags = {0}, values = {0}, out = {0};
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*w*", &flags, &values, &out)) goto done;
    Py_ssize_t n = out.len;
    if (flags.len < (n + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "flags too short for the stream");
        goto done;
    }
    const unsigned char *restrict f = flags.buf, *restrict v = values.buf;
    unsigned char *restrict dst = out.buf;
    Py_ssize_t used = 0, avail = values.len;
    int short_values = 0;
    Py_ssize_t start = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX512
    if (have_avx512) start = sparse_join_avx512(f, v, dst, n, avail, &used);
#endif
    for (Py_ssize_t i = start; i < n; i += 8) {
        unsigned bits = f[i >> 3];
        Py_ssize_t m = n - i < 8 ? n - i : 8;
        if (m < 8) bits &= (1u << m) - 1;  /* flags past the end mean nothing */
        if (bits == 0) {
            /* a run of zero flag bytes takes one memset: a call per 8 bytes took a tenth of a
             * delta's decoding, as most flag bytes of a sparse plane are zero */
            Py_ssize_t end = i + 8;
            while (end < n && f[end >> 3] == 0) end += 8;
            if (end > n) end = n;
            memset(dst + i, 0, (size_t)(end - i));
            i = end - 8;  /* the loop steps to end */
            continue;
        }
        if (used + popcount8(bits) > avail) {
            short_values = 1;
            break;
        }
        if (used + 8 <= avail) {
            /* branchless: read a value for every byte, keep it where the flag is set (random
             * flags made a branch mispredict on every other byte: 3.1 -> under 1 ns a byte) */
            for (Py_ssize_t j = 0; j < m; j++) {
                unsigned bit = (bits >> j) & 1u;
                dst[i + j] = (unsigned char)(v[used] & (0u - bit));
                used += bit;
            }
        } else {
            for (Py_ssize_t j = 0; j < m; j++) {
                unsigned bit = (bits >> j) & 1u;
                dst[i + j] = bit ? v[used] : 0;
                used += bit;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (short_values) {
        PyErr_SetString(PyExc_ValueError, "sparse stream: the flags ask for more values than it holds");
        goto done;
    }
    result = PyLong_FromSsize_t(used);
done:
    PyBuffer_Release(&flags);
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

/* Byte planes and nibbles: numpy builds each of these from three to eight whole-array ufunc passes
 * (shifts, masks, casts, then a tobytes() copy into fresh pages); one loop each here, at about a
 * fifth of the time, and the joined chunk is written straight into the bytes object returned. */

/* Whether two buffers share any byte: the nibble loops read and write through restrict pointers. */
static int overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *pa = a->buf, *pb = b->buf;
    return a->len > 0 && b->len > 0 && pa < pb + b->len && pb < pa + a->len;
}

/* The (input, output) buffers of a nibble loop: the output as long as the input and apart from it.
 * Returns 0, or -1 with an exception set (the caller releases both buffers either way). */
static int nibble_buffers(PyObject *args, Py_buffer *in, Py_buffer *out) {
    if (!PyArg_ParseTuple(args, "y*w*", in, out)) return -1;
    if (out->len < in->len || overlap(in, out)) {
        PyErr_SetString(PyExc_ValueError, "out must be as long as the input and apart from it");
        return -1;
    }
    return 0;
}

/* None after a nibble loop, or NULL if nibble_buffers failed; releases both buffers. */
static PyObject *nibble_done(int ok, Py_buffer *in, Py_buffer *out) {
    PyBuffer_Release(in);
    PyBuffer_Release(out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(nibble_split_doc,
    "nibble_split(plane, out)\n\n"
    "Write plane (n bytes) into out as the low nibbles of its byte pairs (n // 2 bytes: e0 & 15 |\n"
    "(e1 & 15) << 4), then their high nibbles (e0 >> 4 | (e1 >> 4) << 4), then an odd last byte.");

static PyObject *nibble_split(PyObject *self, PyObject *args) {
    Py_buffer in = {0}, out = {0};
    if (nibble_buffers(args, &in, &out)) return nibble_done(0, &in, &out);
    const unsigned char *restrict src = in.buf;
    unsigned char *restrict lo = out.buf;
    Py_ssize_t k = in.len / 2;
    unsigned char *restrict hi = lo + k;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        unsigned e0 = src[2 * i], e1 = src[2 * i + 1];
        lo[i] = (unsigned char)((e0 & 15u) | (e1 & 15u) << 4);
        hi[i] = (unsigned char)((e0 >> 4) | (e1 & 0xF0u));
    }
    if (in.len & 1) hi[k] = src[2 * k];
    Py_END_ALLOW_THREADS
    return nibble_done(1, &in, &out);
}

PyDoc_STRVAR(nibble_join_doc,
    "nibble_join(packed, out)\n\n"
    "Inverse of nibble_split: fill out (len(packed) bytes or more) from packed.");

static PyObject *nibble_join(PyObject *self, PyObject *args) {
    Py_buffer in = {0}, out = {0};
    if (nibble_buffers(args, &in, &out)) return nibble_done(0, &in, &out);
    Py_ssize_t k = in.len / 2;
    const unsigned char *restrict lo = in.buf, *restrict hi = lo + k;
    unsigned char *restrict dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        unsigned l = lo[i], h = hi[i];
        dst[2 * i] = (unsigned char)((l & 15u) | (h & 15u) << 4);
        dst[2 * i + 1] = (unsigned char)((l >> 4) | (h & 0xF0u));
    }
    if (in.len & 1) dst[2 * k] = hi[k];
    Py_END_ALLOW_THREADS
    return nibble_done(1, &in, &out);
}

PyDoc_STRVAR(join_planes_doc,
    "join_planes(planes, itemsize) -> bytes\n\n"
    "Inverse of splitting itemsize-byte elements into byte planes: byte k of element i is\n"
    "planes[k * n + i], with n = len(planes) // itemsize (len(planes) a multiple of itemsize).");

static PyObject *join_planes(PyObject *self, PyObject *args) {
    Py_buffer in = {0};
    int itemsize;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*i", &in, &itemsize)) goto done;
    if (itemsize < 1 || itemsize > 8 || in.len % itemsize) {
        PyErr_SetString(PyExc_ValueError, "planes must hold whole elements of 1 to 8 bytes");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, in.len);
    if (result == NULL) goto done;
    const unsigned char *restrict p = in.buf;
    unsigned char *restrict dst = (unsigned char *)PyBytes_AS_STRING(result);
    Py_ssize_t n = in.len / itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 2) {  /* bf16 and fp16, nearly every chunk: a loop the compiler vectorises */
        for (Py_ssize_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)(p[i] | (unsigned)p[n + i] << 8);
            memcpy(dst + 2 * i, &v, 2);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            for (int k = 0; k < itemsize; k++) dst[i * itemsize + k] = p[k * n + i];
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&in);
    return result;
}

PyDoc_STRVAR(simd_doc,
    "simd(enabled) -> bool\n\n"
    "Turn the vector paths off (False) or back on where the processor has them; returns whether they\n"
    "were on. For tests, which compare both paths' bytes.");

static PyObject *simd(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
#ifdef HAVE_SIMD
    int was = have_ssse3 || have_avx512;
    have_ssse3 = have_avx512 = 0;
    if (on) detect_simd();
    return PyBool_FromLong(was);
#else
    return PyBool_FromLong(0);
#endif
}

PyDoc_STRVAR(vector_paths_doc,
    "vector_paths() -> tuple[str, ...]\n\n"
    "The vector paths on now: \"ssse3\" (the sparse split), \"avx512\" (the two-byte ungrouping and\n"
    "the sparse join); none where simd(False) turned them off or the processor lacks them.");

static PyObject *vector_paths(PyObject *self, PyObject *unused) {
#ifdef HAVE_SIMD
    if (have_ssse3 && have_avx512) return Py_BuildValue("(ss)", "ssse3", "avx512");
    if (have_ssse3) return Py_BuildValue("(s)", "ssse3");
    if (have_avx512) return Py_BuildValue("(s)", "avx512");
#endif
    return PyTuple_New(0);
}

static PyMethodDef methods[] = {
    {"simd", simd, METH_O, simd_doc},
    {"vector_paths", vector_paths, METH_NOARGS, vector_paths_doc},
    {"sub_grouped", sub_grouped, METH_VARARGS, sub_grouped_doc},
    {"unsub_grouped", unsub_grouped, METH_VARARGS, unsub_grouped_doc},
    {"sparse_split", sparse_split, METH_VARARGS, sparse_split_doc},
    {"sparse_join", sparse_join, METH_VARARGS, sparse_join_doc},
    {"nibble_split", nibble_split, METH_VARARGS, nibble_split_doc},
    {"nibble_join", nibble_join, METH_VARARGS, nibble_join_doc},
    {"join_planes", join_planes, METH_VARARGS, join_planes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_grouping", "Exponent-grouped delta kernels.", -1, methods};

PyMODINIT_FUNC PyInit__grouping(void) {
#ifdef HAVE_SIMD
    init_split_tables();
    detect_simd();
#endif
    return PyModule_Create(&module);
}
