// Paged attention for bfloat16 caches with both products as bfloat16 dot products (float32
// accumulation): on the AMX tile unit (spyre_paged_attention_amx) or as AVX512-BF16 vector dot
// products (spyre_paged_attention_avx512_bf16). The same contract as spyre_paged_attention_bf16
// (attention.cpp); the softmax in float32 AVX-512, as SDPA's flash kernel computes bfloat16 (the
// probabilities are rounded to bfloat16 for the product with the values).
//
// The AMX kernel is only entered on CPUs with AMX-BF16 and AVX512-BF16/BW/VL/DQ, in a process that
// Linux granted the AMX tile state (native_kernels.amx_unsupported_reason checks both); the
// AVX512-BF16 one on CPUs with AVX512-BF16/BW/VL/DQ. Every function here is compiled for those
// features (the pragma below) and has internal linkage: no inline function of this file can stand
// in for one of the AVX2 files'.
//
// Per tile of kKeys (64) keys of one KV head, the keys are transposed once into the tile unit's
// pair-interleaved ("VNNI") layout and the values interleaved by key pairs; then every 16-row
// tile of queries that sees the tile computes its scores = q . k^T, the online softmax of its
// rows (in powers of 2, each row's sum in 16 lanes), and o = o * rescale + p . v. Only the two
// products differ between the units (struct Amx, struct Avx512Bf16). The parts (the shared
// blocks split across threads, each sequence's own blocks causal, in tasks of 64 rows) and their
// merges are attention_common.h's.
//
// A compiler without AMX intrinsics (GCC before 11, clang before 12), or SPYRE_NO_DOT_BF16
// defined, builds the entry points as stubs: spyre_dot_bf16_compiled() says 0 and the kernels
// refuse (return 2), so the rest of the library still builds and runs there.
#include <stdint.h>

#include "dot_bf16_compiled.h"

#ifdef SPYRE_DOT_BF16
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "attention_common.h"

namespace {

using namespace spyre_attention;

constexpr int64_t kKeys = 64;       // keys per tile: four score tiles
constexpr int64_t kRows = 16;       // query rows per tile
constexpr int64_t kOwnRows = 64;    // rows per task of the own blocks' part
constexpr int64_t kTileBf16 = 512;  // bfloat16 values of one 16 x 64-byte tile

alignas(64) const uint16_t kZeros[128] = {};  // a missing key's row (past the context's end)

using spyre_amx::TileConfig;

// Every tile 16 rows of 64 bytes. The configuration is per thread: each parallel region sets it.
inline void configure_tiles() {
    alignas(64) TileConfig cfg = {};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

// 2^y for y <= 0 (larger y are not needed: y is a scaled score minus its row's max); relative
// error ~3e-6 (a degree-5 polynomial on [-1/2, 1/2]), 1000 times finer than the bfloat16 the
// probabilities are rounded to. Below -126 it is 2^-126.
inline __m512 exp2_512(__m512 y) {
    y = _mm512_max_ps(y, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// Transposes the 16 x 16 32-bit matrix r in place.
inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // u[4 * i + j] holds, in its 128-bit lane L, column 4L + j of rows 4i .. 4i + 3.
    for (int j = 0; j < 4; j++) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        const __m512i x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

// One key tile of one head in the tile unit's layouts, and the buffers of one 16-row product.
template <int64_t D>
struct Work {
    // kt: tile 4c + j at (4c + j) * kTileBf16: row r, column n = dims 32c + 2r, 32c + 2r + 1 of
    // key 16j + n. vt: tile 2e + half at (2e + half) * kTileBf16: row r = dims 16e .. 16e + 15
    // of keys 32 half + 2r and 32 half + 2r + 1, interleaved. s: [kRows][kKeys] scores;
    // p: [kRows][kKeys] bfloat16; ot: [kRows][D].
    static constexpr int64_t kFloats = D * kKeys + kRows * kKeys + kRows * kKeys / 2 + kRows * D;
    uint16_t* kt;
    uint16_t* vt;
    float* s;
    uint16_t* p;
    float* ot;
    explicit Work(float* base)
        : kt(reinterpret_cast<uint16_t*>(base)),
          vt(reinterpret_cast<uint16_t*>(base + D * kKeys / 2)),
          s(base + D * kKeys),
          p(reinterpret_cast<uint16_t*>(base + D * kKeys + kRows * kKeys)),
          ot(base + D * kKeys + kRows * kKeys + kRows * kKeys / 2) {}
};

// Puts keys [t0, t0 + nk) of head h of ctx (nk <= kKeys) into w.kt and w.vt (zeros past nk).
template <int64_t D>
void load_tile(const Context<uint16_t>& ctx, int64_t h, int64_t t0, int64_t nk, Work<D>& w) {
    const uint16_t* krows[kKeys];
    const uint16_t* vrows[kKeys];
    ctx.keys(t0, nk, [&](int64_t j, int64_t off) {
        krows[j] = ctx.k + off + h * D;
        vrows[j] = ctx.v + off + h * D;
    });
    for (int64_t j = nk; j < kKeys; j++) krows[j] = vrows[j] = kZeros;
    for (int64_t c = 0; c < D / 32; c++)
        for (int64_t j = 0; j < kKeys / 16; j++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512(krows[16 * j + n] + 32 * c);
            transpose16(r);
            uint16_t* dst = w.kt + (kKeys / 16 * c + j) * kTileBf16;
            for (int n = 0; n < 16; n++) _mm512_store_si512(dst + 32 * n, r[n]);
        }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t pair = 0; pair < kKeys / 2; pair++) {
        const int64_t half = pair / 16, r = pair % 16;
        for (int64_t f = 0; f < D / 32; f++) {
            const __m512i a = _mm512_loadu_si512(vrows[2 * pair] + 32 * f);
            const __m512i b = _mm512_loadu_si512(vrows[2 * pair + 1] + 32 * f);
            _mm512_store_si512(w.vt + (2 * (2 * f) + half) * kTileBf16 + 32 * r,
                               _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512(w.vt + (2 * (2 * f + 1) + half) * kTileBf16 + 32 * r,
                               _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

// The first nv bits of a 16-key slice k of a kKeys-key row.
inline __mmask16 visible_mask(int64_t nv, int64_t k) {
    const int64_t n = nv - 16 * k;
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// The two products of a 16-row tile, on the AMX tile unit. begin/end bracket a thread's use
// of the unit. scores: s = q . k^T for w's key tile. values: o = o * rescale + p . v, for the
// rows with visible > 0 (the others' o is left as it is: their rescale is 1, or o is 0).
struct Amx {
    static void begin() { configure_tiles(); }
    static void end() { _tile_release(); }

    template <int64_t D>
    static void scores(const uint16_t* q, const int64_t*, Work<D>& w) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < D / 32; c++) {
            const uint16_t* kt = w.kt + 4 * c * kTileBf16;
            _tile_loadd(4, q + 32 * c, D * 2);
            _tile_loadd(5, kt, 64);
            _tile_loadd(6, kt + kTileBf16, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(7, kt + 2 * kTileBf16, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, kt + 3 * kTileBf16, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, w.s, kKeys * 4);
        _tile_stored(1, w.s + 16, kKeys * 4);
        _tile_stored(2, w.s + 32, kKeys * 4);
        _tile_stored(3, w.s + 48, kKeys * 4);
    }

    template <int64_t D>
    static void values(const int64_t*, const float* rescale, Work<D>& w, float* o) {
        _tile_loadd(4, w.p, kKeys * 2);
        _tile_loadd(5, w.p + 32, kKeys * 2);
        for (int64_t e0 = 0; e0 < D / 16; e0 += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint16_t* vt = w.vt + 2 * e0 * kTileBf16;
            _tile_loadd(6, vt, 64);
            _tile_loadd(7, vt + kTileBf16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 7);
            _tile_loadd(6, vt + 2 * kTileBf16, 64);
            _tile_loadd(7, vt + 3 * kTileBf16, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(1, 5, 7);
            _tile_loadd(6, vt + 4 * kTileBf16, 64);
            _tile_loadd(7, vt + 5 * kTileBf16, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(2, 5, 7);
            _tile_loadd(6, vt + 6 * kTileBf16, 64);
            _tile_loadd(7, vt + 7 * kTileBf16, 64);
            _tile_dpbf16ps(3, 4, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_stored(0, w.ot + 16 * e0, D * 4);
            _tile_stored(1, w.ot + 16 * (e0 + 1), D * 4);
            _tile_stored(2, w.ot + 16 * (e0 + 2), D * 4);
            _tile_stored(3, w.ot + 16 * (e0 + 3), D * 4);
        }
        for (int64_t i = 0; i < kRows; i++) {
            const __m512 r = _mm512_set1_ps(rescale[i]);
            for (int64_t d = 0; d < D; d += 16) {
                float* od = o + i * D + d;
                _mm512_store_ps(od, _mm512_fmadd_ps(_mm512_load_ps(od), r, _mm512_load_ps(w.ot + i * D + d)));
            }
        }
    }
};

// The same products as AVX512-BF16 dot products (vdpbf16ps) from the same layouts: a tile row of
// kt or vt is one vector of 16 key (or dimension) lanes, each a bfloat16 pair, against a query's
// (or probability row's) pair broadcast. kBlock rows at a time; a block whose rows all see
// nothing is skipped (a decode step's rows fill few of a tile's 16).
struct Avx512Bf16 {
    static constexpr int64_t kBlock = 4;  // rows per register block: 16 accumulators

    static void begin() {}
    static void end() {}

    static bool sees_nothing(const int64_t* visible, int64_t i0) {
        for (int64_t i = i0; i < i0 + kBlock; i++)
            if (visible[i] > 0) return false;
        return true;
    }

    static __m512bh pair(const uint16_t* p) {
        int32_t bits;
        __builtin_memcpy(&bits, p, 4);
        return (__m512bh)_mm512_set1_epi32(bits);
    }

    template <int64_t D>
    static void scores(const uint16_t* q, const int64_t* visible, Work<D>& w) {
        for (int64_t i0 = 0; i0 < kRows; i0 += kBlock) {
            if (sees_nothing(visible, i0)) continue;
            __m512 acc[kBlock][4];
            for (int64_t i = 0; i < kBlock; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < D / 32; c++)
                for (int64_t r = 0; r < 16; r++) {
                    const uint16_t* kt = w.kt + 4 * c * kTileBf16 + 32 * r;
                    __m512bh k[4];
                    for (int j = 0; j < 4; j++) k[j] = (__m512bh)_mm512_load_si512(kt + j * kTileBf16);
                    for (int64_t i = 0; i < kBlock; i++) {
                        const __m512bh qp = pair(q + (i0 + i) * D + 32 * c + 2 * r);
                        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qp, k[j]);
                    }
                }
            for (int64_t i = 0; i < kBlock; i++)
                for (int j = 0; j < 4; j++) _mm512_store_ps(w.s + (i0 + i) * kKeys + 16 * j, acc[i][j]);
        }
    }

    template <int64_t D>
    static void values(const int64_t* visible, const float* rescale, Work<D>& w, float* o) {
        for (int64_t i0 = 0; i0 < kRows; i0 += kBlock) {
            if (sees_nothing(visible, i0)) continue;
            for (int64_t e0 = 0; e0 < D / 16; e0 += 4) {
                __m512 acc[kBlock][4];
                for (int64_t i = 0; i < kBlock; i++) {
                    const __m512 r = _mm512_set1_ps(rescale[i0 + i]);
                    for (int e = 0; e < 4; e++)
                        acc[i][e] = _mm512_mul_ps(_mm512_load_ps(o + (i0 + i) * D + 16 * (e0 + e)), r);
                }
                for (int64_t kp = 0; kp < kKeys / 2; kp++) {
                    const uint16_t* vt = w.vt + (2 * e0 + kp / 16) * kTileBf16 + 32 * (kp % 16);
                    __m512bh v[4];
                    for (int e = 0; e < 4; e++) v[e] = (__m512bh)_mm512_load_si512(vt + 2 * e * kTileBf16);
                    for (int64_t i = 0; i < kBlock; i++) {
                        const __m512bh pp = pair(w.p + (i0 + i) * kKeys + 2 * kp);
                        for (int e = 0; e < 4; e++) acc[i][e] = _mm512_dpbf16_ps(acc[i][e], pp, v[e]);
                    }
                }
                for (int64_t i = 0; i < kBlock; i++)
                    for (int e = 0; e < 4; e++)
                        _mm512_store_ps(o + (i0 + i) * D + 16 * (e0 + e), acc[i][e]);
            }
        }
    }
};

// The 16 rows q [kRows][D] (bfloat16) against the tile in w: row i sees the tile's keys from
// from[i] (0 without a window) before visible[i] (visible[i] 0: none, and its state is
// untouched; from[i] < visible[i] otherwise). Their online-softmax states are o [kRows][D],
// m [kRows] (in log2 units: scale2 is the scale times log2(e)) and l [kRows][16] (each row's
// sum in 16 lanes, added at the end).
template <class Unit, int64_t D>
void attend_rows(const uint16_t* q, const int64_t* from, const int64_t* visible, float scale2,
                 Work<D>& w, float* o, float* m, float* l) {
    static_assert(kKeys == 64, "four score tiles, two probability tiles");
    Unit::template scores<D>(q, visible, w);
    // Per row: the tile's max, the probabilities 2^(scale2 * s - new max), their sum. The old
    // maxes' rescale factors are computed after, for the 16 rows at once.
    alignas(64) float old_max[kRows], new_max[kRows], rescale[kRows];
    alignas(64) float sums[kRows][16];
    const __m512 vscale = _mm512_set1_ps(scale2);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < kRows; i++) {
        const int64_t nv = visible[i];
        __m512i* prow = reinterpret_cast<__m512i*>(w.p + i * kKeys);
        old_max[i] = new_max[i] = m[i];
        if (nv <= 0) {
            _mm512_store_si512(prow, _mm512_setzero_si512());
            _mm512_store_si512(prow + 1, _mm512_setzero_si512());
            _mm512_store_ps(sums[i], _mm512_setzero_ps());
            continue;
        }
        __m512 x[4];
        __mmask16 mk[4];
        __m512 vmax = ninf;
        for (int k = 0; k < 4; k++) {
            mk[k] = visible_mask(nv, k) & static_cast<__mmask16>(~visible_mask(from[i], k));
            x[k] = _mm512_load_ps(w.s + i * kKeys + 16 * k);
            vmax = _mm512_mask_max_ps(vmax, mk[k], vmax, x[k]);
        }
        const float tile_max = _mm512_reduce_max_ps(vmax) * scale2;  // scale2 > 0
        const float row_max = tile_max > m[i] ? tile_max : m[i];
        const __m512 vnew = _mm512_set1_ps(row_max);
        __m512 e[4];
        for (int k = 0; k < 4; k++)
            e[k] = _mm512_maskz_mov_ps(mk[k], exp2_512(_mm512_fmsub_ps(x[k], vscale, vnew)));
        _mm512_store_ps(sums[i], _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
        m[i] = new_max[i] = row_max;
        _mm512_store_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        _mm512_store_si512(prow + 1, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
    }
    // 1 for a row whose max did not move (or that saw nothing); ~0 on a row's first tile
    // (old max -inf), where o and l are 0.
    _mm512_store_ps(rescale, exp2_512(_mm512_sub_ps(_mm512_load_ps(old_max), _mm512_load_ps(new_max))));
    for (int64_t i = 0; i < kRows; i++)
        _mm512_store_ps(l + 16 * i, _mm512_fmadd_ps(_mm512_load_ps(l + 16 * i), _mm512_set1_ps(rescale[i]),
                                                    _mm512_load_ps(sums[i])));
    Unit::template values<D>(visible, rescale, w, o);
}

inline float row_sum(const float* l) { return _mm512_reduce_add_ps(_mm512_load_ps(l)); }

template <int64_t D>
struct Layout {
    // Floats of scratch, each part 64-byte aligned, in order: own_part's task plan (OwnTasks);
    // qs [H][Rq][D] bfloat16 (the rows of each head, zero past R: a 16-row tile may start at any
    // row); shared out [H][Rp][D] and lse [H][Rp]; per (head, split) the shared part's results
    // (States of Rp rows, each row's sum in 16 lanes); per thread a Work and an own task's
    // results (States of kOwnRows rows for each of up to kOwnHeads heads).
    int64_t H, R, threads;
    int64_t Rp() const { return round16(R); }
    int64_t Rq() const { return round16(R) + kRows; }
    int64_t state() const { return States<D, 16>::numel(Rp()); }
    int64_t own_heads() const { return H < kOwnHeads ? H : kOwnHeads; }
    int64_t thread_work() const {
        return round16(Work<D>::kFloats + own_heads() * States<D, 16>::numel(kOwnRows));
    }
    int64_t qs() const { return round16(H * Rq() * D / 2); }
    int64_t numel() const {
        return OwnTasks::numel(R) + qs() + H * Rp() * D + H * Rp() + H * threads * state() +
               threads * thread_work();
    }
};

template <class Unit, int64_t D>
void paged_attention(const Args<uint16_t>& a) {
    const Layout<D> lay{a.H, a.R(), a.threads};
    const int64_t R = lay.R, Rp = lay.Rp(), Rq = lay.Rq(), H = a.H, splits = a.threads;
    const float scale2 = a.scale2();
    uint16_t* qs = reinterpret_cast<uint16_t*>(a.scratch + OwnTasks::numel(R));
    float* shared_out = a.scratch + OwnTasks::numel(R) + lay.qs();
    float* shared_lse = shared_out + H * Rp * D;
    float* states = shared_lse + H * Rp;
    float* works = states + H * splits * lay.state();
    gather_queries<D>(a, qs, Rq, [](uint16_t x) { return x; });
    const auto sum = [](const float* l) { return row_sum(l); };
    if (a.num_shared > 0) {
        const Context<uint16_t> ctx{a.k_cache, a.v_cache, a.shared_blocks, a.bs, H * D};
        const States<D, 16> st{states, Rp};
        const auto tile = [&](int64_t sp, int64_t t0, int64_t nk) {
            Work<D> w(works + sp * lay.thread_work());
            int64_t from[kRows] = {}, visible[kRows];
            for (int64_t h = 0; h < H; h++) {
                load_tile<D>(ctx, h, t0, nk, w);
                const int64_t slot = h * splits + sp;
                for (int64_t r0 = 0; r0 < R; r0 += kRows) {
                    for (int64_t i = 0; i < kRows; i++) visible[i] = r0 + i < R ? nk : 0;
                    attend_rows<Unit, D>(qs + (h * Rq + r0) * D, from, visible, scale2, w,
                                         st.o(slot) + r0 * D, st.m(slot) + r0, st.l(slot) + 16 * r0);
                }
            }
        };
        split_merge<Unit, kKeys>(H, R, a.shared_len(), splits, st, tile, sum, shared_out, shared_lse);
    }
    const auto own_tile = [&](const OwnTask<D, 16, uint16_t>& t, int64_t t0, int64_t nk) {
        Work<D> w(t.scratch);
        load_tile<D>(t.ctx, t.h, t0, nk, w);
        const uint16_t* q = qs + (t.h * Rq + t.b * a.Rb() + t.r0) * D;
        int64_t from[kRows], visible[kRows];
        for (int64_t i0 = 0; i0 < t.rows; i0 += kRows) {
            const int64_t last = t.rows - i0 < kRows ? t.rows - 1 : i0 + kRows - 1;
            if (t.limits[last] <= t0) continue;  // the mask hides the tile from every row
            if (t.firsts[i0] >= t0 + nk) break;  // every row's window starts after the tile
            for (int64_t i = 0; i < kRows; i++) {
                const int64_t seen = t.limits[i0 + i] - t0, skipped = t.firsts[i0 + i] - t0;
                visible[i] = seen < 0 ? 0 : seen < nk ? seen : nk;
                from[i] = skipped < 0 ? 0 : skipped;
                if (from[i] >= visible[i]) from[i] = visible[i] = 0;  // sees none of the tile
            }
            attend_rows<Unit, D>(q + i0 * D, from, visible, scale2, w, t.st.o(0) + i0 * D,
                                 t.st.m(0) + i0, t.st.l(0) + 16 * i0);
        }
    };
    own_part<Unit, kKeys, kOwnRows, D, 16>(a, works, lay.thread_work(), Work<D>::kFloats, shared_out,
                                           shared_lse, Rp, own_tile, sum);
}

template <class Unit>
int paged_attention_on(int64_t head_dim, const Args<uint16_t>& a) {
    return with_head_dim(head_dim, 1, [&](auto d) {
        paged_attention<Unit, decltype(d)::value>(a);
        return 0;
    });
}

}  // namespace
#endif  // SPYRE_DOT_BF16

extern "C" {

// 1 where the kernels below were compiled, 0 for the stubs.
int spyre_dot_bf16_compiled() {
#ifdef SPYRE_DOT_BF16
    return 1;
#else
    return 0;
#endif
}

// Floats of scratch either kernel below needs (64-byte aligned), -1 for a head_dim other than
// 64 and 128.
int64_t spyre_paged_attention_dot_bf16_scratch_numel(int64_t head_dim, int64_t H, int64_t rows,
                                                     int64_t threads) {
#ifndef SPYRE_DOT_BF16
    return -1;
#else
    return with_head_dim(head_dim, int64_t{-1}, [&](auto d) {
        return Layout<decltype(d)::value>{H, rows, threads}.numel();
    });
#endif
}

// spyre_paged_attention_bf16's contract (attention.cpp) on AMX; the scratch size above. Only on
// a CPU with the features above, in a process Linux granted the AMX tile state (arch_prctl).
// Returns 1 for a head_dim other than 64 and 128, 2 for the stub (nothing written).
int spyre_paged_attention_amx(int64_t head_dim, const uint16_t* q, const uint16_t* k_cache,
                              const uint16_t* v_cache, int64_t bs, int64_t H, int64_t G,
                              int64_t n, int64_t nq, const int64_t* shared_blocks,
                              int64_t num_shared, const int64_t* own_blocks, int64_t num_own,
                              const int64_t* positions, int64_t window, float scale,
                              int64_t threads, float* scratch, uint16_t* out) {
#ifndef SPYRE_DOT_BF16
    return 2;
#else
    const Args<uint16_t> a{q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks, num_shared,
                           own_blocks, num_own, positions, window, scale, threads, scratch, out};
    return paged_attention_on<Amx>(head_dim, a);
#endif
}

// The same on AVX512-BF16 dot products (CPUs with AVX512-BF16/BW/VL/DQ, no AMX needed).
int spyre_paged_attention_avx512_bf16(int64_t head_dim, const uint16_t* q, const uint16_t* k_cache,
                                      const uint16_t* v_cache, int64_t bs, int64_t H, int64_t G,
                                      int64_t n, int64_t nq, const int64_t* shared_blocks,
                                      int64_t num_shared, const int64_t* own_blocks,
                                      int64_t num_own, const int64_t* positions, int64_t window,
                                      float scale, int64_t threads, float* scratch, uint16_t* out) {
#ifndef SPYRE_DOT_BF16
    return 2;
#else
    const Args<uint16_t> a{q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks, num_shared,
                           own_blocks, num_own, positions, window, scale, threads, scratch, out};
    return paged_attention_on<Avx512Bf16>(head_dim, a);
#endif
}

}  // extern "C"
