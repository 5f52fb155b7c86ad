/* BD3LM's block-diffusion attention on CPU in one pass per query tile: flash-attention forward and
 * backward over exactly the key ranges the block-diffusion pattern allows, no mask tensor.
 *
 * Layout [x_t ; x_0] (2L rows, both halves at the same positions), block size bs:
 *   x_0 row p sees x_0 keys [0, (blk(p) + 1) * bs)            (block-causal on the clean half)
 *   x_t row p sees x_0 keys [0, blk(p) * bs) and x_t keys [blk(p) * bs, (blk(p) + 1) * bs).
 * Queries are all 2L rows, or x_t's L rows alone (a last layer). Every row has at least its own
 * block's keys, so no row is empty (documents and a window keep a row's own position). float32 only; rows of D values are contiguous, every other
 * stride is free (the caller passes views, nothing is gathered). Matrix products go through the
 * sgemm_ the caller hands over (torch's MKL); threads through OpenMP (torch's libgomp, which
 * the process has loaded already).
 *
 * Built and loaded by bd_fused.py (plain C, no torch headers: compiles in about a second).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* BLAS's Fortran sgemm (column-major, arguments by address): torch's MKL exports it as sgemm_ */
typedef void (*sgemm_fn)(const char *ta, const char *tb, const int *m, const int *n, const int *k, const float *alpha,
                         const float *a, const int *lda, const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);
static sgemm_fn blas_sgemm;
enum { NO_TRANS, TRANS };

/* Row-major C[m, n] = alpha * op(A) op(B) + beta * C: column-major on the transposes, C^T = op(B)^T op(A)^T */
static void gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                 const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    int im = (int)m, in = (int)n, ik = (int)k, ilda = (int)lda, ildb = (int)ldb, ildc = (int)ldc;
    blas_sgemm(tb ? "T" : "N", ta ? "T" : "N", &in, &im, &ik, &alpha, b, &ildb, a, &ilda, &beta, c, &ildc);
}

typedef struct {
    float *p;
    int64_t sb, sh, sr; /* strides of batch, head, row (elements); a row's D values are adjacent */
} View;

typedef struct {
    int64_t B, H, K, Q, L, D, bs, tile, key_tile;
    float scale;
    View q, k, v, out, lse, grad, dq, dk, dv; /* lse: [B, H, Q] (sr = 1); dk/dv: per query head [B, H, 2L, D] */
    const int32_t *doc_lo, *doc_hi;           /* [B or 1, L]: position p's document is [doc_lo, doc_hi); NULL: one */
    int64_t doc_sb, window;                   /* doc arrays' batch stride (0: shared); window 0: none */
} Args;

/* exp for x <= 0 (and a little above): 2^n * poly(r) with Cephes' expf coefficients, ~2 ulp.
 * Scalar here; 8 lanes at a time below when the compiler targets AVX2 and FMA. */
static inline float exp_approx(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return y * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#else
#define LANES 1
#endif

static float max_of(const float *x, int64_t n, float m) {
    int64_t j = 0;
#if LANES == 8
    if (n >= 8) {
        __m256 acc = _mm256_loadu_ps(x);
        for (j = 8; j + 8 <= n; j += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + j));
        float v = hmax8(acc);
        m = v > m ? v : m;
    }
#endif
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* x[j] = exp(x[j] - shift) for j < n; returns their sum */
static float exp_shifted(float *x, int64_t n, float shift) {
    float sum = 0.0f;
    int64_t j = 0;
#if LANES == 8
    __m256 acc = _mm256_setzero_ps(), sh = _mm256_set1_ps(shift);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), sh));
        _mm256_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; j < n; j++) {
        x[j] = exp_approx(x[j] - shift);
        sum += x[j];
    }
    return sum;
}

static inline float *at(const View *t, int64_t b, int64_t h, int64_t r) { return t->p + b * t->sb + h * t->sh + r * t->sr; }

/* The keys row r (query index = layout index: x_t rows come first) may see, as one range of global key
 * indices [lo, hi) per part: x_0's keys (part 0) or x_t's (part 1). A document and a window cut each part
 * to one range as well (a document is one run of positions). The range is empty when hi <= lo. */
static inline void row_range(const Args *a, int64_t b, int64_t r, int part, int64_t *lo, int64_t *hi) {
    int64_t L = a->L, bs = a->bs, p = r % L, blk = p / bs, l, h;
    if (part == 0) {
        l = 0;
        h = (blk + (r >= L ? 1 : 0)) * bs;
    } else {
        l = blk * bs;
        h = l + bs;
    }
    if (a->doc_lo) {
        int64_t dl = a->doc_lo[b * a->doc_sb + p], dh = a->doc_hi[b * a->doc_sb + p];
        l = l > dl ? l : dl;
        h = h < dh ? h : dh;
    }
    if (a->window) {
        int64_t wl = p - a->window + 1, wh = p + a->window;
        l = l > wl ? l : wl;
        h = h < wh ? h : wh;
    }
    int64_t base = part == 0 ? L : 0;
    *lo = base + l;
    *hi = base + (h > l ? h : l);
}

/* One key segment of a query tile: keys [k0, k0 + n) of the 2L sequence, all of one part. */
typedef struct {
    int64_t k0, n;
    int part;
} Segment;

/* The segments of rows [r0, r1) of one half: per part, the keys from the first to the last any row
 * sees, cut into pieces of at most key_tile keys (the x_t part is one piece: see key_columns). */
static int segments(const Args *a, int64_t b, int64_t r0, int64_t r1, Segment *seg, int max_seg) {
    int ns = 0;
    for (int part = 0; part < (r0 >= a->L ? 1 : 2); part++) {
        int64_t first = INT64_MAX, last = INT64_MIN;
        for (int64_t r = r0; r < r1; r++) {
            int64_t lo, hi;
            row_range(a, b, r, part, &lo, &hi);
            if (hi > lo) {
                first = lo < first ? lo : first;
                last = hi > last ? hi : last;
            }
        }
        int64_t step = part == 0 ? a->key_tile : last - first;
        for (int64_t s = first; s < last && ns < max_seg; s += step) {
            seg[ns].k0 = s;
            seg[ns].n = last - s < step ? last - s : step;
            seg[ns].part = part;
            ns++;
        }
    }
    return ns;
}

/* Row r may see keys [lo, hi) of segment seg (local indices, possibly empty). */
static inline void bounds(const Args *a, int64_t b, int64_t r, const Segment *seg, int64_t *lo, int64_t *hi) {
    int64_t glo, ghi;
    row_range(a, b, r, seg->part, &glo, &ghi);
    int64_t l = glo - seg->k0, h = ghi - seg->k0;
    l = l < 0 ? 0 : (l > seg->n ? seg->n : l);
    h = h > seg->n ? seg->n : h;
    *lo = l;
    *hi = h < l ? l : h;
}

/* the widest segment: a key_tile piece of x_0, or x_t's blocks under a tile (T rows from any offset
 * inside a block reach at most T + 2 * bs - 2 keys) */
static int64_t key_columns(const Args *a) {
    int64_t xt = a->tile + 2 * a->bs;
    return a->key_tile > xt ? a->key_tile : xt;
}

static int64_t tiles_per_half(const Args *a) { return (a->L + a->tile - 1) / a->tile; }

/* the rows [r0, r1) of tile t (tiles never straddle the two halves) */
static void tile_rows(const Args *a, int64_t t, int64_t *r0, int64_t *r1) {
    int64_t per = tiles_per_half(a), half = t / per, i = t % per;
    *r0 = half * a->L + i * a->tile;
    *r1 = *r0 + a->tile;
    if (*r1 > (half + 1) * a->L) *r1 = (half + 1) * a->L;
}

/* segments of one tile: x_0's keys in key_tile pieces, plus x_t's */
static int64_t max_segments(const Args *a) { return a->L / a->key_tile + 3; }

void bd_forward(const Args *a, sgemm_fn sgemm, int threads) {
    blas_sgemm = sgemm;
    int64_t tiles = tiles_per_half(a) * (a->Q / a->L), tasks = a->B * a->H * tiles, D = a->D;
    int64_t T = a->tile, KT = key_columns(a);
#pragma omp parallel num_threads(threads)
    {
        float *S = malloc(sizeof(float) * T * KT);
        float *O = malloc(sizeof(float) * T * D);
        float *m = malloc(sizeof(float) * T), *l = malloc(sizeof(float) * T);
        Segment *seg = malloc(sizeof(Segment) * max_segments(a));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = task / (a->H * tiles), h = (task / tiles) % a->H, t = task % tiles, kh = h / (a->H / a->K);
            int64_t r0, r1;
            tile_rows(a, t, &r0, &r1);
            int64_t rows = r1 - r0;
            int ns = segments(a, b, r0, r1, seg, (int)max_segments(a));
            for (int64_t i = 0; i < rows; i++) m[i] = -INFINITY, l[i] = 0.0f;
            memset(O, 0, sizeof(float) * rows * D);
            for (int s = 0; s < ns; s++) {
                int64_t n = seg[s].n;
                gemm(NO_TRANS, TRANS, rows, n, D, a->scale, at(&a->q, b, h, r0), a->q.sr,
                     at(&a->k, b, kh, seg[s].k0), a->k.sr, 0.0f, S, n);
                for (int64_t i = 0; i < rows; i++) {
                    int64_t lo, hi;
                    bounds(a, b, r0 + i, &seg[s], &lo, &hi);
                    float *row = S + i * n;
                    if (lo >= hi) {
                        memset(row, 0, sizeof(float) * n);
                        continue;
                    }
                    float mx = max_of(row + lo, hi - lo, m[i]);
                    float alpha = m[i] == -INFINITY ? 0.0f : exp_approx(m[i] - mx);
                    float sum = exp_shifted(row + lo, hi - lo, mx);
                    memset(row, 0, sizeof(float) * lo);
                    memset(row + hi, 0, sizeof(float) * (n - hi));
                    m[i] = mx;
                    l[i] = l[i] * alpha + sum;
                    if (alpha != 1.0f)
                        for (int64_t d = 0; d < D; d++) O[i * D + d] *= alpha;
                }
                gemm(NO_TRANS, NO_TRANS, rows, D, n, 1.0f, S, n, at(&a->v, b, kh, seg[s].k0), a->v.sr, 1.0f,
                     O, D);
            }
            for (int64_t i = 0; i < rows; i++) {
                float inv = 1.0f / l[i], *dst = at(&a->out, b, h, r0 + i);
                for (int64_t d = 0; d < D; d++) dst[d] = O[i * D + d] * inv;
                *at(&a->lse, b, h, r0 + i) = m[i] + logf(l[i]);
            }
        }
        free(S), free(O), free(m), free(l), free(seg);
    }
}

/* dq, and per query head dk/dv (summed over the heads sharing a key/value head by the caller); dk/dv
 * are accumulated into, so the caller zeroes them. One task per (batch, query head): it owns its rows. */
void bd_backward(const Args *a, sgemm_fn sgemm, int threads) {
    blas_sgemm = sgemm;
    int64_t tiles = tiles_per_half(a) * (a->Q / a->L), tasks = a->B * a->H, D = a->D;
    int64_t T = a->tile, KT = key_columns(a);
#pragma omp parallel num_threads(threads)
    {
        float *P = malloc(sizeof(float) * T * KT), *dP = malloc(sizeof(float) * T * KT);
        float *dQ = malloc(sizeof(float) * T * D), *delta = malloc(sizeof(float) * T);
        Segment *seg = malloc(sizeof(Segment) * max_segments(a));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = task / a->H, h = task % a->H, kh = h / (a->H / a->K);
            for (int64_t t = 0; t < tiles; t++) {
                int64_t r0, r1;
                tile_rows(a, t, &r0, &r1);
                int64_t rows = r1 - r0;
                int ns = segments(a, b, r0, r1, seg, (int)max_segments(a));
                for (int64_t i = 0; i < rows; i++) { /* delta_i = <dO_i, O_i> */
                    const float *g = at(&a->grad, b, h, r0 + i), *o = at(&a->out, b, h, r0 + i);
                    float acc = 0.0f;
                    for (int64_t d = 0; d < D; d++) acc += g[d] * o[d];
                    delta[i] = acc;
                }
                memset(dQ, 0, sizeof(float) * rows * D);
                const float *q = at(&a->q, b, h, r0), *g = at(&a->grad, b, h, r0);
                for (int s = 0; s < ns; s++) {
                    int64_t n = seg[s].n;
                    const float *k = at(&a->k, b, kh, seg[s].k0), *v = at(&a->v, b, kh, seg[s].k0);
                    gemm(NO_TRANS, TRANS, rows, n, D, a->scale, q, a->q.sr, k, a->k.sr, 0.0f, P, n);
                    for (int64_t i = 0; i < rows; i++) {
                        int64_t lo, hi;
                        bounds(a, b, r0 + i, &seg[s], &lo, &hi);
                        float lse = *at(&a->lse, b, h, r0 + i), *row = P + i * n;
                        exp_shifted(row + lo, hi - lo, lse);
                        memset(row, 0, sizeof(float) * lo);
                        memset(row + hi, 0, sizeof(float) * (n - hi));
                    }
                    /* dV += P^T dO ; dP = dO V^T */
                    gemm(TRANS, NO_TRANS, n, D, rows, 1.0f, P, n, g, a->grad.sr, 1.0f,
                         at(&a->dv, b, h, seg[s].k0), a->dv.sr);
                    gemm(NO_TRANS, TRANS, rows, n, D, 1.0f, g, a->grad.sr, v, a->v.sr, 0.0f, dP, n);
                    for (int64_t i = 0; i < rows; i++) { /* dS = P * (dP - delta), in place of dP */
                        const float *restrict pr = P + i * n;
                        float *restrict dr = dP + i * n, di = delta[i];
#pragma omp simd
                        for (int64_t j = 0; j < n; j++) dr[j] = pr[j] * (dr[j] - di);
                    }
                    /* dQ += scale dS K ; dK += scale dS^T Q */
                    gemm(NO_TRANS, NO_TRANS, rows, D, n, a->scale, dP, n, k, a->k.sr, 1.0f, dQ, D);
                    gemm(TRANS, NO_TRANS, n, D, rows, a->scale, dP, n, q, a->q.sr, 1.0f,
                         at(&a->dk, b, h, seg[s].k0), a->dk.sr);
                }
                for (int64_t i = 0; i < rows; i++) memcpy(at(&a->dq, b, h, r0 + i), dQ + i * D, sizeof(float) * D);
            }
        }
        free(P), free(dP), free(dQ), free(delta), free(seg);
    }
}
