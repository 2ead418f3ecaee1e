/* all-MiniLM-L6-v2 on a CPU with AMX, for `amx.py`: weights in bfloat16 tiles, every
   product on AMX.

   Documents (`kb_encode_documents`): a batch of texts packed one after another, layer by
   layer over all of its rows; what follows each product is done on its block while it is
   in cache (see "a whole encoder for document batches").

   Self-attention of a document (`attend`). For each head: scores S = Q K^T on AMX tiles
   (16 queries x 16 keys at a time, the 32 dims of a head in one tile step), a softmax of
   each row in fp32 with AVX-512 over the text's real keys only, then P V on tiles, divided
   by the row's sum and rounded to bfloat16 straight into the layer's output. Keys past the
   text are skipped rather than masked.

   A query (`kb_encode_query`): one text, activations in fp32 between the products,
   attention in fp32; a helper thread on a second core computes part of each product (see
   "a second core"). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define D 32 /* the head size this kernel computes */

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands AMX's tile state to a process only once it asks; 0 when granted. */
int kb_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

/* This thread's tiles as every routine below uses them: all eight, 16 rows of 64 bytes
   (16 x 32 bfloat16 or 16 x 16 fp32). In attention 0, 1 and 5 accumulate, 2 holds Q or P,
   3, 4 and 6 hold K or V; in `tile_products` the same with the input and the weights; in
   `block_product` 0-3 accumulate, 4-5 hold the input and 6-7 the weights. */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
    _tile_loadconfig(&config);
}

/* 2^t for t <= 0: 2^floor(t) (exact, by scalef, which floors its exponent) times 2^f for
   f = t - floor(t) in [0, 1), by a polynomial of degree 4 fitted to it (relative error
   2.7e-6, far below bfloat16's 3.9e-3). Scores far below the row's largest give 0. */
static inline __m512 exp2_nonpositive(__m512 t) {
    __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.3520616815e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2037519892e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4142734380e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300668062e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000025127f));
    return _mm512_scalef_ps(p, t);
}

static inline void store_bf16(uint16_t *dst, __m512 v) {
    __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256((__m256i *)dst, (__m256i)h);
}

static inline __mmask16 valid_lanes(int valid) {
    return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
}

/* out[16 rows][tiles x 16] = a[16 rows][steps x 32] (bfloat16) times w, whose tiles of 16
   outputs by 32 inputs (pairs of inputs interleaved, as AMX reads its second operand) lie
   one after another, `steps` of them per 16 outputs. Row strides in elements. Three output
   tiles at a time share each tile of `a`, so that they do not wait on each other; uses
   tiles 0-6 as `configure_tiles` sets them. */
static inline void tile_products(const uint16_t *a, long a_stride, int steps, const uint16_t *w,
                                 int tiles, float *out, long out_stride) {
    int t = 0;
    for (; t + 3 <= tiles; t += 3) {
        const uint16_t *w0 = w + (long)t * steps * 512, *w1 = w0 + steps * 512,
                       *w2 = w1 + steps * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(5);
        for (int i = 0; i < steps; i++) {
            _tile_loadd(2, a + i * 32, a_stride * 2);
            _tile_loadd(3, w0 + i * 512, 64);
            _tile_loadd(4, w1 + i * 512, 64);
            _tile_loadd(6, w2 + i * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
            _tile_dpbf16ps(5, 2, 6);
        }
        _tile_stored(0, out + t * 16, out_stride * 4);
        _tile_stored(1, out + (t + 1) * 16, out_stride * 4);
        _tile_stored(5, out + (t + 2) * 16, out_stride * 4);
    }
    for (; t < tiles; t++) {
        _tile_zero(0);
        for (int i = 0; i < steps; i++) {
            _tile_loadd(2, a + i * 32, a_stride * 2);
            _tile_loadd(3, w + ((long)t * steps + i) * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
        }
        _tile_stored(0, out + t * 16, out_stride * 4);
    }
}

/* Scores of 16 queries against the text's key tiles `kt`, into `s` ([16][stride]): a head's
   32 dimensions are one step. */
static inline void scores(const uint16_t *q, long row, const uint32_t *kt, int blocks, float *s,
                          int stride) {
    tile_products(q, row, 1, (const uint16_t *)kt, blocks, s, stride);
}

/* Lane r of the result: the largest (`max`) or the sum of the lanes of v[r], for 16 vectors
   at once. Rows reduced one by one each end in a chain of dependent shuffles that the
   softmax of the row has to wait for; four rounds over all 16 halve the lanes each time. */
#define REDUCE16(name, op)                                                                   \
    static inline __m512 name(const __m512 *v) {                                           \
        __m512 a[8], b[4], c[2];                                                           \
        for (int i = 0; i < 8; i++)                                                        \
            a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),                  \
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));                 \
        for (int i = 0; i < 4; i++)                                                        \
            b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),                  \
                      _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));                 \
        for (int i = 0; i < 2; i++)                                                        \
            c[i] = op(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),                     \
                      _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));                    \
        __m512 d = op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD)); \
        /* the rounds leave row r's result in lane 4 (r % 4) + r / 4 */                  \
        const __m512i rows =                                                               \
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);       \
        return _mm512_permutexvar_ps(rows, d);                                             \
    }

REDUCE16(max16, _mm512_max_ps)
REDUCE16(sum16, _mm512_add_ps)

/* Each row's e^(scale (s - max)) over the first `len` keys, rounded to bfloat16 into `p`
   ([16][kp], zeros past `len`), and 1 / their sum into `inverse_sum`. */
static inline void softmax(const float *s, int stride, int len, float scale, uint16_t *p, int kp,
                           float *inverse_sum) {
    const int blocks = (len + 15) / 16;
    const __mmask16 last = valid_lanes(len - 16 * (blocks - 1));
    const float factor = scale * 1.4426950408889634f; /* e^x = 2^(x log2 e) */
    const __m512 scaling = _mm512_set1_ps(factor);
    __m512 partial[16];
    for (int r = 0; r < 16; r++) {
        const float *scores = s + r * stride;
        __m512 m = _mm512_maskz_loadu_ps(last, scores + 16 * (blocks - 1));
        m = _mm512_mask_blend_ps(last, _mm512_set1_ps(-3.0e38f), m);
        for (int j = 0; j + 1 < blocks; j++) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + 16 * j));
        partial[r] = m;
    }
    const __m512 shifts = _mm512_mul_ps(max16(partial), scaling);
    for (int r = 0; r < 16; r++) {
        const float *scores = s + r * stride;
        uint16_t *numerators = p + r * kp;
        const __m512 shift = _mm512_permutexvar_ps(_mm512_set1_epi32(r), shifts);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < blocks; j++) {
            __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + 16 * j), scaling, shift);
            __m512 e = exp2_nonpositive(x);
            if (j == blocks - 1) e = _mm512_maskz_mov_ps(last, e);
            sum = _mm512_add_ps(sum, e);
            store_bf16(numerators + 16 * j, e);
        }
        for (int j = blocks * 16; j < kp; j += 16) store_bf16(numerators + j, _mm512_setzero_ps());
        partial[r] = sum;
    }
    _mm512_storeu_ps(inverse_sum, _mm512_div_ps(_mm512_set1_ps(1.0f), sum16(partial)));
}

/* P V for 16 queries over `steps` steps of 32 keys, divided by each row's sum, into 16 rows
   of `dst` (`hidden` apart) in bfloat16. */
static inline void weigh(const uint16_t *p, int kp, const uint32_t *vp, int steps,
                         const float *inverse_sum, float *o, uint16_t *dst, int hidden) {
    _tile_zero(0);
    _tile_zero(1);
    for (int t = 0; t < steps; t++) {
        _tile_loadd(2, p + t * 32, kp * 2);
        _tile_loadd(3, vp + t * 16 * D, D * 4);
        _tile_loadd(4, vp + t * 16 * D + 16, D * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, o, D * 4);
    _tile_stored(1, o + 16, D * 4);
    for (int r = 0; r < 16; r++) { /* a row of a head is one cache line: one store */
        __m512 w = _mm512_set1_ps(inverse_sum[r]);
        __m512bh both = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16), w),
                                            _mm512_mul_ps(_mm512_loadu_ps(o + r * D), w));
        _mm512_storeu_si512(dst + (long)r * hidden, (__m512i)both);
    }
}

/* Buffers of `attend` for texts of up to n rows. */
typedef struct {
    uint32_t *kt; /* [n/16][16 dim pairs][16 keys] */
    uint32_t *vp; /* [kp/2 key pairs][32 dims] */
    float *s;     /* scores, two blocks' [16][n] */
    uint16_t *p;  /* softmax numerators, [16][kp] */
    float *o;     /* one block's output, [16][32] */
} attention_buffers;

static int buffers_alloc(attention_buffers *b, int n) {
    const int kp = (n + 31) / 32 * 32;
    b->kt = aligned_alloc(64, (size_t)n * 16 * 4);
    b->vp = aligned_alloc(64, (size_t)kp / 2 * D * 4);
    b->s = aligned_alloc(64, (size_t)2 * 16 * n * 4);
    b->p = aligned_alloc(64, (size_t)16 * kp * 2);
    b->o = aligned_alloc(64, 16 * D * 4);
    return b->kt && b->vp && b->s && b->p && b->o;
}

static void buffers_free(attention_buffers *b) {
    free(b->kt), free(b->vp), free(b->s), free(b->p), free(b->o);
}

/* Self-attention of one text of `len` tokens (1 to the buffers' n), in len rounded up to 16
   rows: text: its rows of the fused projection's output (3 * heads * 32 wide); dst: its rows
   of the output (heads * 32 wide). `next_text` and `next_len`: the next text's rows and
   length, fetched into the cache meanwhile (NULL, 0: none). Tiles configured by the caller. */
static void attend(const uint16_t *text, uint16_t *dst, int len, int heads, float scale,
                   const uint16_t *next_text, int next_len, attention_buffers *buf) {
    const int n = (len + 15) / 16 * 16;
    const int hidden = heads * D;
    const long row = 3L * hidden;      /* elements from one token to the next in qkv */
    const int kp = (n + 31) / 32 * 32; /* keys rounded up to whole steps of P V */
    uint32_t *kt = buf->kt, *vp = buf->vp;
    float *s = buf->s, *o = buf->o;
    uint16_t *p = buf->p;

    /* Gather offsets of 16 keys' rows, and the interleaving of two value rows by pairs. */
    int32_t key_rows[16];
    int16_t low[32], high[32];
    for (int i = 0; i < 16; i++) {
        key_rows[i] = (int32_t)(i * (row / 2));
        low[2 * i] = (int16_t)i, low[2 * i + 1] = (int16_t)(32 + i);
        high[2 * i] = (int16_t)(16 + i), high[2 * i + 1] = (int16_t)(48 + i);
    }
    const __m512i gather = _mm512_loadu_si512(key_rows);
    const __m512i pair_low = _mm512_loadu_si512(low), pair_high = _mm512_loadu_si512(high);

    const int blocks = n / 16; /* blocks of 16 queries, and tiles of 16 keys */
    const int steps = (len + 31) / 32;  /* steps of 32 keys in P V */
    for (int h = 0; h < heads; h++) {
        const uint16_t *q = text + h * D;
        const uint32_t *k = (const uint32_t *)(text + hidden + h * D);
        const uint16_t *v = text + 2 * hidden + h * D;
        uint16_t *out = dst + h * D;
        /* The next head's queries, keys and values (a cache line per token each) are
           fetched while this one is computed, a share at each block of queries: without
           it a quarter of the time went waiting for them at their first touch. */
        const uint16_t *next = h + 1 < heads ? text + (h + 1) * D : next_text;
        const int ahead = !next ? 0 : h + 1 < heads ? len : next_len;
        const int share = (ahead + blocks - 1) / blocks;
        /* K^T as AMX wants it: tile j, row r = dims 2r and 2r+1 of keys 16j..16j+15. */
        for (int j = 0; j < blocks; j++) {
            const uint32_t *keys = k + (long)16 * j * (row / 2);
            for (int r = 0; r < 16; r++)
                _mm512_store_si512(kt + (j * 16 + r) * 16,
                                   _mm512_i32gather_epi32(gather, keys + r, 4));
        }
        /* V by pairs of keys; keys past the text are zeros, so P V ignores them. */
        for (int i = 0; i < steps * 16; i++) {
            __m512i even = 2 * i < len ? _mm512_loadu_si512(v + 2L * i * row)
                                       : _mm512_setzero_si512();
            __m512i odd = 2 * i + 1 < len ? _mm512_loadu_si512(v + (2L * i + 1) * row)
                                          : _mm512_setzero_si512();
            _mm512_store_si512(vp + i * D, _mm512_permutex2var_epi16(even, pair_low, odd));
            _mm512_store_si512(vp + i * D + 16, _mm512_permutex2var_epi16(even, pair_high, odd));
        }
        /* The next block's scores go to the tiles between this block's softmax and its
           P V, so that the tiles do not wait for P's stores. */
        scores(q, row, kt, blocks, s, n);
        for (int qb = 0; qb < blocks; qb++) {
            for (int t = qb * share; t < (qb + 1) * share && t < ahead; t++) {
                _mm_prefetch((const char *)(next + t * row), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + t * row + hidden), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + t * row + 2 * hidden), _MM_HINT_T0);
            }
            float inverse_sum[16];
            softmax(s + (qb & 1) * 16 * n, n, len, scale, p, kp, inverse_sum);
            if (qb + 1 < blocks)
                scores(q + (qb + 1) * 16 * row, row, kt, blocks, s + ((qb + 1) & 1) * 16 * n, n);
            weigh(p, kp, vp, steps, inverse_sum, o, out + (long)qb * 16 * hidden, hidden);
        }
    }
}

/* ---- a whole encoder for one query ---------------------------------------------------- */

#define HIDDEN 384
#define HEADS 12
#define INNER 1536
#define LAYERS 6
#define POSITIONS 512

/* e^(x ln 2) for any x: exp2_nonpositive's polynomial, the exponent floored at -126. */
static inline __m512 exp2_any(__m512 t) {
    return exp2_nonpositive(_mm512_max_ps(t, _mm512_set1_ps(-126.0f)));
}

/* BERT's exact GELU(x) = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, erf by Abramowitz and
   Stegun 7.1.26 (absolute error 1.5e-7), its division by a reciprocal estimate and one
   Newton step (a division took most of its time). */
static inline __m512 gelu_ps(__m512 v) {
    const __m512 x = _mm512_mul_ps(v, _mm512_set1_ps(0.70710678118654752f));
    const __m512 a = _mm512_abs_ps(x);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 d = _mm512_fmadd_ps(a, _mm512_set1_ps(0.3275911f), one);
    __m512 t = _mm512_rcp14_ps(d);
    t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));
    __m512 y = _mm512_set1_ps(1.061405429f);
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.453152027f));
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.421413741f));
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-0.284496736f));
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(0.254829592f));
    const __m512 e = exp2_any(_mm512_mul_ps(_mm512_mul_ps(a, a), _mm512_set1_ps(-1.4426950408889634f)));
    const __m512 r = _mm512_fnmadd_ps(_mm512_mul_ps(y, t), e, one); /* erf(|x|) */
    /* Phi = (1 + erf(x)) / 2 = (1 + sign(x) r) / 2 */
    const __m512 signed_r = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(r),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000))));
    return _mm512_mul_ps(v, _mm512_fmadd_ps(signed_r, _mm512_set1_ps(0.5f), _mm512_set1_ps(0.5f)));
}

static void round_bf16(const float *x, uint16_t *y, long n) { /* n a multiple of 32 */
    for (long i = 0; i < n; i += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(y + i, (__m512i)v);
    }
}

/* out[rows x n] = a[rows x k] (bfloat16) w + bias for output tiles [first, last) (16 outputs
   each), rows a multiple of 16; w in tiles as `amx.py` packs it: [n / 16][k / 32][16 pairs
   of inputs][16 outputs][2], so a range of output tiles is one stretch of memory. */
static void dense_tiles(const uint16_t *a, int rows, int k, const uint16_t *w, const float *bias,
                        float *out, int n, int first, int last) {
    for (int block = 0; block < rows / 16; block++) {
        float *o = out + (long)block * 16 * n;
        tile_products(a + (long)block * 16 * k, k, k / 32, w + (long)first * (k / 32) * 512,
                      last - first, o + first * 16, n);
        for (int r = 0; r < 16; r++)
            for (int j = first * 16; j < last * 16; j += 16) {
                float *at = o + (long)r * n + j;
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), _mm512_loadu_ps(bias + j)));
            }
    }
}

/* ---- a second core for a query's products -----------------------------------------------

   One query's products are too small to keep a core's arithmetic busy: each weight is read
   once, so the encode waits on memory, and one core draws only so many bytes a second from
   it (21 MB of bfloat16 weights, about 2.5 ms when they have left the caches, well under
   2 ms on two cores). So while a query encodes, a helper thread on another core takes part
   in each product.

   A product's output tiles are handed out CHUNK at a time from one counter, to the caller
   from the front and to the helper from the back. The caller never waits for the helper to
   arrive: when the helper is late (its core busy with other work), the caller takes every
   chunk, and waits only for a chunk the helper took and is still computing. The counter
   carries the product's number, so a helper that comes late takes nothing of a product
   that is over.

   The helper sleeps between encodes (a futex) and is woken by each, pinned first to a core
   other than the caller's: woken on the caller's own core, as the scheduler prefers, it
   would only run once the caller's part is done. Waits spin briefly, then sleep. One encode
   at a time has the helper; any other, one that starts before the helper is back from the
   last (its core busy), or one in a process with a single core, computes alone. */

#define CHUNK 3           /* output tiles taken at a time: tile_products' three */
#define BUSY_SPIN 200000L /* ns a wait spins within an encode before it sleeps */
#define IDLE_SPIN 100000L /* ns the helper spins after an encode, for the next one */

typedef struct {
    const uint16_t *a, *w;
    const float *bias;
    float *out;
    int rows, k, n;
} product;

static struct {
    pthread_mutex_t lock;
    pthread_t thread;
    pid_t pid;           /* the process that started it: a forked child has no helper */
    _Atomic int encode;  /* counts encodes: wakes the helper */
    _Atomic int posted;  /* the number of the product handed out (from 1), or -1: encode over */
    _Atomic int working; /* the product the helper may be computing a chunk of, or 0 */
    _Atomic int idle;    /* 1 while the helper waits for an encode */
    _Atomic int sleepers;
    _Atomic uint64_t chunks; /* the product's number << 32 | its chunks nobody has taken */
    product job;
} helper = {.lock = PTHREAD_MUTEX_INITIALIZER, .idle = 1};

static _Atomic long helped; /* encodes that had the helper, for `kb_helped_encodes` */

long kb_helped_encodes(void) {
    return atomic_load(&helped);
}

static long nanoseconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void futex(_Atomic int *word, int op, int value) {
    syscall(SYS_futex, word, op, value, NULL, NULL, 0);
}

/* Until *word differs from seen: spin for up to `spin` ns, then sleep. */
static int wait_change(_Atomic int *word, int seen, long spin) {
    int now;
    for (long until = nanoseconds() + spin;;) {
        for (int i = 0; i < 64; i++) {
            if ((now = atomic_load(word)) != seen) return now;
            _mm_pause();
        }
        if (nanoseconds() > until) break;
    }
    atomic_fetch_add(&helper.sleepers, 1);
    while ((now = atomic_load(word)) == seen) futex(word, FUTEX_WAIT_PRIVATE, seen);
    atomic_fetch_sub(&helper.sleepers, 1);
    return now;
}

static void publish(_Atomic int *word, int value) {
    atomic_store(word, value);
    if (atomic_load(&helper.sleepers)) futex(word, FUTEX_WAKE_PRIVATE, 1);
}

/* Whether a chunk of product `number` was left, and is now the caller's: the caller counts
   its chunks from the product's start, the helper from its end. */
static int take(int number) {
    uint64_t seen = atomic_load(&helper.chunks);
    while ((int)(seen >> 32) == number && (uint32_t)seen > 0)
        if (atomic_compare_exchange_weak(&helper.chunks, &seen, seen - 1)) return 1;
    return 0;
}

static void *helper_main(void *unused) {
    (void)unused;
    for (int encodes = 0;;) {
        encodes = wait_change(&helper.encode, encodes, IDLE_SPIN);
        configure_tiles();
        for (int number = 0;;) {
            number = wait_change(&helper.posted, number, BUSY_SPIN);
            if (number < 0) break;
            /* Announced before taking: the caller, out of chunks, waits while it sees this. */
            atomic_store(&helper.working, number);
            product p;
            for (int last = -1; take(number); last -= CHUNK) {
                if (last < 0) p = helper.job, last = p.n / 16; /* read once a chunk is ours */
                dense_tiles(p.a, p.rows, p.k, p.w, p.bias, p.out, p.n, last - CHUNK, last);
            }
            publish(&helper.working, 0);
        }
        _tile_release();
        publish(&helper.idle, 1);
    }
    return NULL;
}

/* Whether the helper is this encode's, on a core other than the caller's; 0: compute alone. */
static int helper_begin(void) {
    if (pthread_mutex_trylock(&helper.lock) != 0) return 0;
    if (helper.pid != getpid()) {
        atomic_store(&helper.encode, 0);
        atomic_store(&helper.posted, 0);
        atomic_store(&helper.idle, 1);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&helper.thread, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed) goto alone;
        helper.pid = getpid();
    }
    cpu_set_t cores;
    const int cpu = sched_getcpu();
    if (!atomic_load(&helper.idle) || cpu < 0 || sched_getaffinity(0, sizeof cores, &cores) != 0)
        goto alone;
    CPU_CLR(cpu, &cores);
    if (CPU_COUNT(&cores) == 0 ||
        pthread_setaffinity_np(helper.thread, sizeof cores, &cores) != 0)
        goto alone;
    atomic_store(&helper.idle, 0);
    atomic_store(&helper.posted, 0);
    publish(&helper.encode, atomic_load(&helper.encode) + 1);
    atomic_fetch_add(&helped, 1);
    return 1;
alone:
    pthread_mutex_unlock(&helper.lock);
    return 0;
}

static void helper_end(void) {
    publish(&helper.posted, -1);
    pthread_mutex_unlock(&helper.lock);
}

/* dense_tiles over all of out's tiles; with the helper (`shared`), product number ++*count. */
static void dense(const uint16_t *a, int rows, int k, const uint16_t *w, const float *bias,
                  float *out, int n, int shared, int *count) {
    const int tiles = n / 16;
    if (!shared) {
        dense_tiles(a, rows, k, w, bias, out, n, 0, tiles);
        return;
    }
    const int number = ++*count;
    helper.job = (product){a, w, bias, out, rows, k, n};
    atomic_store(&helper.chunks, (uint64_t)number << 32 | (uint32_t)(tiles / CHUNK));
    publish(&helper.posted, number);
    for (int first = 0; take(number); first += CHUNK)
        dense_tiles(a, rows, k, w, bias, out, n, first, first + CHUNK);
    for (int working = atomic_load(&helper.working); working == number;)
        working = wait_change(&helper.working, working, BUSY_SPIN);
}

/* r = layer norm of (r + y + bias) over HIDDEN (y, bias may be NULL), eps 1e-12 as BERT's;
   rounded to bfloat16 into `copy` too unless it is NULL. */
static inline void norm_row(float *r, const float *y, const float *bias, const float *gain,
                            const float *offset, uint16_t *copy) {
    __m512 v[HIDDEN / 16], sum = _mm512_setzero_ps(), squares = _mm512_setzero_ps();
    for (int j = 0; j < HIDDEN / 16; j++) {
        v[j] = _mm512_loadu_ps(r + 16 * j);
        if (y) v[j] = _mm512_add_ps(v[j], _mm512_loadu_ps(y + 16 * j));
        if (bias) v[j] = _mm512_add_ps(v[j], _mm512_loadu_ps(bias + 16 * j));
        sum = _mm512_add_ps(sum, v[j]);
    }
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / HIDDEN);
    for (int j = 0; j < HIDDEN / 16; j++) {
        v[j] = _mm512_sub_ps(v[j], mean);
        squares = _mm512_fmadd_ps(v[j], v[j], squares);
    }
    const __m512 inverse =
        _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / HIDDEN + 1e-12f));
    for (int j = 0; j < HIDDEN / 16; j += 2) {
        const __m512 lo = _mm512_fmadd_ps(_mm512_mul_ps(v[j], inverse),
                                          _mm512_loadu_ps(gain + 16 * j),
                                          _mm512_loadu_ps(offset + 16 * j));
        const __m512 hi = _mm512_fmadd_ps(_mm512_mul_ps(v[j + 1], inverse),
                                          _mm512_loadu_ps(gain + 16 * j + 16),
                                          _mm512_loadu_ps(offset + 16 * j + 16));
        _mm512_storeu_ps(r + 16 * j, lo);
        _mm512_storeu_ps(r + 16 * j + 16, hi);
        if (copy) _mm512_storeu_si512(copy + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* x = layer norm of (x + y), row by row (y may be NULL). */
static void add_norm(float *x, const float *y, int rows, const float *gain, const float *offset) {
    for (long i = 0; i < rows; i++)
        norm_row(x + i * HIDDEN, y ? y + i * HIDDEN : NULL, NULL, gain, offset, NULL);
}

/* x[len][HIDDEN] = the embedding layer's output for word pieces `ids`: word, position and
   token type 0 embeddings summed, then their layer norm. */
static void embed(const int32_t *ids, int len, const void *const *weights, float *x) {
    const float *word = weights[0], *position = weights[1], *type = weights[2];
    for (int i = 0; i < len; i++)
        for (int j = 0; j < HIDDEN; j += 16) {
            __m512 sum = _mm512_add_ps(_mm512_loadu_ps(word + (long)ids[i] * HIDDEN + j),
                                       _mm512_loadu_ps(position + (long)i * HIDDEN + j));
            sum = _mm512_add_ps(sum, _mm512_loadu_ps(type + j));
            _mm512_storeu_ps(x + (long)i * HIDDEN + j, sum);
        }
    add_norm(x, NULL, len, weights[3], weights[4]);
}

/* out[HIDDEN] = the unit-length mean of x's first `len` rows. */
static void pool(const float *x, int len, float *out) {
    __m512 pooled[HIDDEN / 16], squares = _mm512_setzero_ps();
    for (int j = 0; j < HIDDEN / 16; j++) pooled[j] = _mm512_setzero_ps();
    for (int i = 0; i < len; i++)
        for (int j = 0; j < HIDDEN / 16; j++)
            pooled[j] = _mm512_add_ps(pooled[j], _mm512_loadu_ps(x + (long)i * HIDDEN + 16 * j));
    for (int j = 0; j < HIDDEN / 16; j++) squares = _mm512_fmadd_ps(pooled[j], pooled[j], squares);
    const __m512 unit = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares)));
    for (int j = 0; j < HIDDEN / 16; j++)
        _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(pooled[j], unit));
}

/* Self-attention of `len` rows in fp32: qkv [rows x 3 HIDDEN] -> out [rows x HIDDEN]. */
static void attention_fp32(const float *qkv, int len, int rows, float *keys, float *scores,
                           float *out) {
    const long row = 3 * HIDDEN;
    const __m512 factor = _mm512_set1_ps(1.4426950408889634f / sqrtf(32.0f));
    for (int h = 0; h < HEADS; h++) {
        for (int j = 0; j < rows; j++) /* keys transposed: [32 dims][rows] */
            for (int d = 0; d < 32; d++)
                keys[d * rows + j] = j < len ? qkv[j * row + HIDDEN + h * 32 + d] : 0.0f;
        for (int i = 0; i < len; i++) {
            const float *q = qkv + i * row + h * 32;
            __m512 m = _mm512_set1_ps(-3.0e38f);
            for (int j = 0; j < rows; j += 16) {
                __m512 s = _mm512_setzero_ps();
                for (int d = 0; d < 32; d++)
                    s = _mm512_fmadd_ps(_mm512_set1_ps(q[d]),
                                        _mm512_loadu_ps(keys + d * rows + j), s);
                s = _mm512_mul_ps(s, factor);
                _mm512_storeu_ps(scores + j, s);
                m = _mm512_mask_max_ps(m, valid_lanes(len - j), m, s);
            }
            const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < rows; j += 16) {
                __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores + j), shift);
                __m512 e = _mm512_maskz_mov_ps(valid_lanes(len - j), exp2_nonpositive(x));
                _mm512_storeu_ps(scores + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
            __m512 low = _mm512_setzero_ps(), high = _mm512_setzero_ps();
            for (int j = 0; j < len; j++) {
                const float *v = qkv + j * row + 2 * HIDDEN + h * 32;
                const __m512 weight = _mm512_set1_ps(scores[j]);
                low = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v), low);
                high = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16), high);
            }
            _mm512_storeu_ps(out + (long)i * HIDDEN + h * 32, _mm512_mul_ps(low, inverse));
            _mm512_storeu_ps(out + (long)i * HIDDEN + h * 32 + 16, _mm512_mul_ps(high, inverse));
        }
    }
}

/* The unit-length mean-pooled embedding of one text's `len` word pieces `ids` into out[384].
   weights: word, position and token-type-0 embeddings and their layer norm's gain and
   offset (fp32), then for each layer: query/key/value tiles and bias, attention output
   tiles and bias, its layer norm's gain and offset, intermediate tiles and bias, output
   tiles and bias, its layer norm's gain and offset. Returns 0, or < 0 when it did nothing. */
int kb_encode_query(const int32_t *ids, int len, const void *const *weights, float *out) {
    if (len < 1 || len > POSITIONS) return -1;
    const int rows = (len + 15) / 16 * 16;
    float *x = aligned_alloc(64, (size_t)rows * HIDDEN * 4);
    float *wide = aligned_alloc(64, (size_t)rows * INNER * 4); /* query/key/value, or inner */
    float *narrow = aligned_alloc(64, (size_t)rows * HIDDEN * 4);
    uint16_t *input = aligned_alloc(64, (size_t)rows * INNER * 2); /* a product's input */
    float *keys = aligned_alloc(64, (size_t)32 * rows * 4);
    float *scores = aligned_alloc(64, (size_t)rows * 4);
    int status = -2;
    if (!x || !wide || !narrow || !input || !keys || !scores) goto done;
    memset(x, 0, (size_t)rows * HIDDEN * 4);
    embed(ids, len, weights, x);
    configure_tiles();
    const int shared = helper_begin();
    int products = 0;
    for (int l = 0; l < LAYERS; l++) {
        const void *const *w = weights + 5 + 12 * l;
        round_bf16(x, input, (long)rows * HIDDEN);
        dense(input, rows, HIDDEN, w[0], w[1], wide, 3 * HIDDEN, shared, &products);
        memset(narrow, 0, (size_t)rows * HIDDEN * 4);
        attention_fp32(wide, len, rows, keys, scores, narrow);
        round_bf16(narrow, input, (long)rows * HIDDEN);
        dense(input, rows, HIDDEN, w[2], w[3], narrow, HIDDEN, shared, &products);
        add_norm(x, narrow, len, w[4], w[5]);
        round_bf16(x, input, (long)rows * HIDDEN);
        dense(input, rows, HIDDEN, w[6], w[7], wide, INNER, shared, &products);
        for (long i = 0; i < (long)rows * INNER; i += 16)
            _mm512_storeu_ps(wide + i, gelu_ps(_mm512_loadu_ps(wide + i)));
        round_bf16(wide, input, (long)rows * INNER);
        dense(input, rows, INNER, w[8], w[9], narrow, HIDDEN, shared, &products);
        add_norm(x, narrow, len, w[10], w[11]);
    }
    if (shared) helper_end();
    _tile_release();
    pool(x, len, out);
    status = 0;
done:
    free(x), free(wide), free(narrow), free(input), free(keys), free(scores);
    return status;
}


/* ---- a whole encoder for document batches ---------------------------------------------

   The texts of a batch are packed one after another, each in whole blocks of 16 rows (its
   attention's blocks of queries), not padded to the batch's longest. Each product runs over
   all of the batch's rows in blocks of 32 rows by 32 outputs (four accumulating tiles, two
   of the input, two of the weights), and what follows it is done on the block while it is
   in cache: the bias, and GELU, rounded to bfloat16 for the next product; or the bias, the
   residual and the layer norm over whole rows, for the attention's output and the layer's.
   The residual stream stays in fp32, as in `kb_encode_query`; products take bfloat16. */

/* What follows a block's product, left for the next block's product to do a few rows at a
   time between its tile steps: AMX computes a block's products while AVX-512 finishes the
   last one's rows. Done one after the other, the tiles waited for each block's GELU or
   layer norm. */
typedef struct {
    int next, rows; /* the next row to finish, and how many there are (0: nothing to do) */
    const float *o; /* the block's products, `stride` floats a row */
    long stride;
    const float *bias;
    uint16_t *out; /* bias, GELU where `gelu`, rounded to bfloat16: 32 values a row */
    long n;
    int gelu;
    float *x; /* or else: x = layer norm of (x + product + bias), copied into xb */
    uint16_t *xb;
    const float *gain, *offset;
} pending;

static inline void finish(pending *p, int count) {
    const int end = p->next + count < p->rows ? p->next + count : p->rows;
    for (; p->next < end; p->next++) {
        const long i = p->next;
        const float *o = p->o + i * p->stride;
        if (p->x) {
            norm_row(p->x + i * HIDDEN, o, p->bias, p->gain, p->offset, p->xb + i * HIDDEN);
            continue;
        }
        __m512 lo = _mm512_add_ps(_mm512_load_ps(o), _mm512_loadu_ps(p->bias));
        __m512 hi = _mm512_add_ps(_mm512_load_ps(o + 16), _mm512_loadu_ps(p->bias + 16));
        if (p->gelu) lo = gelu_ps(lo), hi = gelu_ps(hi);
        _mm512_storeu_si512(p->out + i * p->n, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Rows r..r+31 of a[rows][k] times w (tiles as `dense_tiles` reads them), output tiles c and
   c+1, into `o` (32 rows of 32 fp32, `stride` apart), finishing `per_step` rows of `p` at
   each step. Tiles 0-3 accumulate, 4-5 hold the input, 6-7 the weights. */
static inline void block_product(const uint16_t *a, int k, const uint16_t *w, int c, float *o,
                                 long stride, pending *p, int per_step) {
    const int steps = k / 32;
    const uint16_t *w0 = w + (long)c * steps * 512, *w1 = w0 + steps * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int i = 0; i < steps; i++) {
        _tile_loadd(4, a + i * 32, k * 2);
        _tile_loadd(5, a + 16L * k + i * 32, k * 2);
        _tile_loadd(6, w0 + i * 512, 64);
        _tile_loadd(7, w1 + i * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        finish(p, per_step);
    }
    _tile_stored(0, o, stride * 4);
    _tile_stored(1, o + 16, stride * 4);
    _tile_stored(2, o + 16 * stride, stride * 4);
    _tile_stored(3, o + 16 * stride + 16, stride * 4);
}

/* out[rows][n] = bfloat16 of (a w + bias), through GELU where `gelu`; rows a multiple of 32. */
static void product_bf16(const uint16_t *a, int rows, int k, const uint16_t *w, const float *bias,
                         uint16_t *out, int n, int gelu) {
    static _Thread_local float o[2][32 * 32] __attribute__((aligned(64)));
    const int steps = k / 32, per_step = (32 + steps - 1) / steps;
    pending p = {.rows = 0};
    for (int r = 0, b = 0; r < rows; r += 32)
        for (int c = 0; c < n / 16; c += 2, b++) {
            block_product(a + (long)r * k, k, w, c, o[b & 1], 32, &p, per_step);
            finish(&p, 32);
            p = (pending){.rows = 32, .o = o[b & 1], .stride = 32, .bias = bias + c * 16,
                          .out = out + (long)r * n + c * 16, .n = n, .gelu = gelu};
        }
    finish(&p, 32);
}

/* x = layer norm of (x + a w + bias), rows of HIDDEN, and its bfloat16 copy into xb: each
   row read and written once, while its product is in cache. */
static void product_norm(const uint16_t *a, int rows, int k, const uint16_t *w, const float *bias,
                         float *x, uint16_t *xb, const float *gain, const float *offset) {
    static _Thread_local float o[2][32 * HIDDEN] __attribute__((aligned(64)));
    pending p = {.rows = 0};
    for (int r = 0, b = 0; r < rows; r += 32, b++) {
        for (int c = 0; c < HIDDEN / 16; c += 2)
            block_product(a + (long)r * k, k, w, c, o[b & 1] + c * 16, HIDDEN, &p, 1);
        finish(&p, 32);
        p = (pending){.rows = 32, .o = o[b & 1], .stride = HIDDEN, .bias = bias,
                      .x = x + (long)r * HIDDEN, .xb = xb + (long)r * HIDDEN, .gain = gain,
                      .offset = offset};
    }
    finish(&p, 32);
}

/* The unit-length mean-pooled embeddings of `count` texts into out[count][384]: text i has
   lengths[i] word pieces, one after another in `ids`. `weights` as for `kb_encode_query`.
   Returns 0, or < 0 when it did nothing. */
int kb_encode_documents(const int32_t *ids, const int32_t *lengths, int count,
                        const void *const *weights, float *out) {
    if (count < 1) return -1;
    long rows = 0;
    int longest = 16;
    for (int i = 0; i < count; i++) {
        if (lengths[i] < 1 || lengths[i] > POSITIONS) return -1;
        const int n = (lengths[i] + 15) / 16 * 16;
        rows += n;
        if (n > longest) longest = n;
    }
    rows = (rows + 31) / 32 * 32; /* whole blocks of products; the last rows belong to no text */
    float *x = aligned_alloc(64, (size_t)rows * HIDDEN * 4);
    uint16_t *xb = aligned_alloc(64, (size_t)rows * HIDDEN * 2);
    uint16_t *wide = aligned_alloc(64, (size_t)rows * INNER * 2); /* query/key/value, or inner */
    uint16_t *context = aligned_alloc(64, (size_t)rows * HIDDEN * 2);
    attention_buffers buf;
    const int buffers = buffers_alloc(&buf, longest);
    int status = -2;
    if (!x || !xb || !wide || !context || !buffers) goto done;
    memset(x, 0, (size_t)rows * HIDDEN * 4);
    memset(context, 0, (size_t)rows * HIDDEN * 2);
    long at = 0;
    for (int t = 0; t < count; ids += lengths[t++]) {
        embed(ids, lengths[t], weights, x + at * HIDDEN);
        at += (lengths[t] + 15) / 16 * 16;
    }
    round_bf16(x, xb, rows * HIDDEN);
    const float scale = 1.0f / sqrtf((float)D);
    configure_tiles();
    for (int l = 0; l < LAYERS; l++) {
        const void *const *w = weights + 5 + 12 * l;
        product_bf16(xb, (int)rows, HIDDEN, w[0], w[1], wide, 3 * HIDDEN, 0);
        at = 0;
        for (int t = 0; t < count; t++) {
            const int n = (lengths[t] + 15) / 16 * 16;
            const int next = t + 1 < count;
            attend(wide + at * 3 * HIDDEN, context + at * HIDDEN, lengths[t], HEADS, scale,
                   next ? wide + (at + n) * 3 * HIDDEN : NULL, next ? lengths[t + 1] : 0, &buf);
            at += n;
        }
        product_norm(context, (int)rows, HIDDEN, w[2], w[3], x, xb, w[4], w[5]);
        product_bf16(xb, (int)rows, HIDDEN, w[6], w[7], wide, INNER, 1);
        product_norm(wide, (int)rows, INNER, w[8], w[9], x, xb, w[10], w[11]);
    }
    _tile_release();
    at = 0;
    for (int t = 0; t < count; t++) {
        pool(x + at * HIDDEN, lengths[t], out + (long)t * HIDDEN);
        at += (lengths[t] + 15) / 16 * 16;
    }
    status = 0;
done:
    free(x), free(xb), free(wide), free(context);
    buffers_free(&buf);
    return status;
}
