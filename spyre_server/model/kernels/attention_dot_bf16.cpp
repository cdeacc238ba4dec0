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
// products differ between the units (struct Amx, struct Avx512Bf16). The parts are
// attention.cpp's: the shared blocks (no mask, every row, the keys split into one range per
// thread) and each sequence's own blocks (causal, one task per sequence, head and 64 rows),
// merged through their log-sum-exps (in log2 units here).
//
// A compiler without AMX intrinsics (GCC before 11, clang before 12), or SPYRE_NO_DOT_BF16
// defined, builds the entry points as stubs: spyre_dot_bf16_compiled() says 0 and the kernels
// refuse (return 2), so the rest of the library still builds and runs there.
#include <stdint.h>

#if !defined(SPYRE_NO_DOT_BF16) && \
    (defined(__clang__) ? __clang_major__ >= 12 : defined(__GNUC__) && __GNUC__ >= 11)
#define SPYRE_DOT_BF16 1
#endif

#ifdef SPYRE_DOT_BF16
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <math.h>
#include <omp.h>

namespace {

constexpr int64_t kKeys = 64;       // keys per tile: four score tiles
constexpr int64_t kRows = 16;       // query rows per tile
constexpr int64_t kOwnRows = 64;    // rows per task of the own blocks' part
constexpr int64_t kTileBf16 = 512;  // bfloat16 values of one 16 x 64-byte tile

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

alignas(64) const uint16_t kZeros[128] = {};  // a missing key's row (past the context's end)

struct TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

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

// Where a context's keys and values live in the cache [num_blocks][bs][H][D]: the context's key
// j of head h at (blocks[j / bs] * bs + j % bs) * ldk + h * D.
struct Context {
    const uint16_t* k;
    const uint16_t* v;
    const int64_t* blocks;
    int64_t bs;
    int64_t ldk;  // H * D
};

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
void load_tile(const Context& ctx, int64_t h, int64_t t0, int64_t nk, Work<D>& w) {
    const uint16_t* krows[kKeys];
    const uint16_t* vrows[kKeys];
    int64_t block = t0 / ctx.bs, in_block = t0 % ctx.bs;
    for (int64_t j = 0; j < kKeys; j++) {
        if (j < nk) {
            const int64_t off = (ctx.blocks[block] * ctx.bs + in_block) * ctx.ldk + h * D;
            krows[j] = ctx.k + off;
            vrows[j] = ctx.v + off;
            if (++in_block == ctx.bs) { in_block = 0; block++; }
        } else {
            krows[j] = vrows[j] = kZeros;
        }
    }
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

// The 16 rows q [kRows][D] (bfloat16) against the tile in w: row i sees the tile's first
// visible[i] keys (0: none, and its state is untouched). Their online-softmax states are
// o [kRows][D], m [kRows] (in log2 units: scale2 is the scale times log2(e)) and l [kRows][16]
// (each row's sum in 16 lanes, added at the end).
template <class Unit, int64_t D>
void attend_rows(const uint16_t* q, const int64_t* visible, float scale2, Work<D>& w, float* o,
                 float* m, float* l) {
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
            mk[k] = visible_mask(nv, k);
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
inline void reset_state(float* o, float* m, float* l, int64_t rows) {
    for (int64_t i = 0; i < rows * D; i++) o[i] = 0.0f;
    for (int64_t i = 0; i < rows; i++) m[i] = -INFINITY;
    for (int64_t i = 0; i < rows * 16; i++) l[i] = 0.0f;
}

template <int64_t D>
struct Layout {
    // Floats of scratch, each part 64-byte aligned, in order: qs [H][Rq][D] bfloat16 (the rows
    // of each head, zero past R: a 16-row tile may start at any row); shared out [H][Rp][D] and
    // lse [H][Rp]; per (head, split) shared states o [Rp][D], m [Rp], l [Rp][16]; per thread a Work
    // and an own task's o [kOwnRows][D], m [kOwnRows], l [kOwnRows][16].
    int64_t H, R, threads;
    int64_t Rp() const { return round16(R); }
    int64_t Rq() const { return round16(R) + kRows; }
    int64_t state() const { return Rp() * D + Rp() + 16 * Rp(); }
    static int64_t thread_work() { return round16(Work<D>::kFloats + kOwnRows * D + 17 * kOwnRows); }
    int64_t qs() const { return round16(H * Rq() * D / 2); }
    int64_t numel() const {
        return qs() + H * Rp() * D + H * Rp() + H * threads * state() + threads * thread_work();
    }
};

// The shared blocks: every row of every head against keys [0, L) of ctx, in `threads` key ranges
// (one task per range, over every head), merged into out [H][Rp][D] and lse [H][Rp] (log2).
template <class Unit, int64_t D>
void shared_part(const uint16_t* qs, const Layout<D>& lay, const Context& ctx, int64_t L,
                 float scale2, float* states, float* works, float* out, float* lse) {
    const int64_t H = lay.H, R = lay.R, Rp = lay.Rp(), Rq = lay.Rq(), splits = lay.threads;
    const int64_t state = lay.state();
    const int64_t range = ((L + splits - 1) / splits + kKeys - 1) / kKeys * kKeys;
    #pragma omp parallel for schedule(static) num_threads(lay.threads)
    for (int64_t sp = 0; sp < splits; sp++) {
        Unit::begin();
        const int64_t k0 = sp * range, k1 = (sp + 1) * range < L ? (sp + 1) * range : L;
        Work<D> w(works + sp * lay.thread_work());
        for (int64_t h = 0; h < H; h++) {
            float* o = states + (h * splits + sp) * state;
            reset_state<D>(o, o + Rp * D, o + Rp * D + Rp, Rp);
        }
        for (int64_t t0 = k0; t0 < k1; t0 += kKeys) {
            const int64_t nk = k1 - t0 < kKeys ? k1 - t0 : kKeys;
            int64_t visible[kRows];
            for (int64_t h = 0; h < H; h++) {
                load_tile<D>(ctx, h, t0, nk, w);
                float* o = states + (h * splits + sp) * state;
                for (int64_t r0 = 0; r0 < R; r0 += kRows) {
                    for (int64_t i = 0; i < kRows; i++) visible[i] = r0 + i < R ? nk : 0;
                    attend_rows<Unit, D>(qs + (h * Rq + r0) * D, visible, scale2, w, o + r0 * D,
                                   o + Rp * D + r0, o + Rp * D + Rp + 16 * r0);
                }
            }
        }
        Unit::end();
    }
    #pragma omp parallel for schedule(static) num_threads(lay.threads)
    for (int64_t hr = 0; hr < H * R; hr++) {
        const int64_t h = hr / R, r = hr % R;
        float max = -INFINITY;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float mm = states[(h * splits + sp) * state + Rp * D + r];
            max = mm > max ? mm : max;
        }
        float total = 0.0f;
        alignas(64) float acc[D] = {};
        for (int64_t sp = 0; sp < splits; sp++) {
            const float* st = states + (h * splits + sp) * state;
            const float l = row_sum(st + Rp * D + Rp + 16 * r);
            if (l == 0.0f) continue;  // an empty range
            const float f = exp2f(st[Rp * D + r] - max);
            total += l * f;
            for (int64_t d = 0; d < D; d++) acc[d] += st[r * D + d] * f;
        }
        for (int64_t d = 0; d < D; d++) out[(h * Rp + r) * D + d] = acc[d] / total;
        lse[h * Rp + r] = max + log2f(total);
    }
}

// torch's rounding to bfloat16: to nearest, ties to even, NaN to 0x7FC0 (vcvtneps2bf16 would
// flush denormals).
inline uint16_t round_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <class Unit, int64_t D>
void paged_attention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                     int64_t bs, int64_t H, int64_t G, int64_t n, int64_t nq,
                     const int64_t* shared_blocks, int64_t num_shared, const int64_t* own_blocks,
                     int64_t num_own, const int64_t* positions, float scale, int64_t threads,
                     float* scratch, uint16_t* out) {
    const int64_t Rb = nq * G;  // rows per head of one sequence
    const Layout<D> lay{H, n * Rb, threads};
    const float scale2 = scale * 1.44269504088896341f;  // the softmax in powers of 2
    const int64_t R = lay.R, Rp = lay.Rp(), Rq = lay.Rq(), ldk = H * D, shared_len = num_shared * bs;
    uint16_t* qs = reinterpret_cast<uint16_t*>(scratch);
    float* shared_out = scratch + lay.qs();
    float* shared_lse = shared_out + H * Rp * D;
    float* states = shared_lse + H * Rp;
    float* works = states + H * threads * lay.state();
    // qs[h][r] = q[b][i][h * G + g] for row r = (b * nq + i) * G + g; zeros past R.
    for (int64_t h = 0; h < H; h++) {
        for (int64_t r = 0; r < R; r++) {
            const uint16_t* src = q + ((r / G) * H * G + h * G + r % G) * D;
            uint16_t* dst = qs + (h * Rq + r) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d];
        }
        for (int64_t i = R * D; i < Rq * D; i++) qs[h * Rq * D + i] = 0;
    }
    if (num_shared > 0) {
        const Context ctx{k_cache, v_cache, shared_blocks, bs, ldk};
        shared_part<Unit, D>(qs, lay, ctx, shared_len, scale2, states, works, shared_out, shared_lse);
    }
    // The own blocks: one task per (sequence, head, block of kOwnRows rows), causal.
    const int64_t row_blocks = (Rb + kOwnRows - 1) / kOwnRows;
    #pragma omp parallel num_threads(threads)
    {
        Unit::begin();
        float* base = works + omp_get_thread_num() * lay.thread_work();
        Work<D> w(base);
        float* o = base + Work<D>::kFloats;
        float* m = o + kOwnRows * D;
        float* l = m + kOwnRows;
        int64_t limits[kOwnRows + kRows];
        int64_t visible[kRows];
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < n * H * row_blocks; task++) {
            const int64_t b = task / (H * row_blocks), h = task / row_blocks % H;
            const int64_t r0 = task % row_blocks * kOwnRows;
            const int64_t rows = Rb - r0 < kOwnRows ? Rb - r0 : kOwnRows;
            const Context ctx{k_cache, v_cache, own_blocks + b * num_own, bs, ldk};
            // Row r0 + i's query, at position p, sees the own keys before p + 1 - shared_len;
            // the rows of a 16-row tile past this task's rows see none.
            for (int64_t i = 0; i < kOwnRows + kRows; i++)
                limits[i] = i < rows ? positions[b * nq + (r0 + i) / G] + 1 - shared_len : 0;
            reset_state<D>(o, m, l, round16(rows));
            const uint16_t* qrows = qs + (h * Rq + b * Rb + r0) * D;
            const int64_t end = limits[rows - 1];  // positions ascend: the last row sees most
            for (int64_t t0 = 0; t0 < end; t0 += kKeys) {
                const int64_t nk = end - t0 < kKeys ? end - t0 : kKeys;
                load_tile<D>(ctx, h, t0, nk, w);
                for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
                    const int64_t last = rows - i0 < kRows ? rows - 1 : i0 + kRows - 1;
                    if (limits[last] <= t0) continue;  // the mask hides the tile from every row
                    for (int64_t i = 0; i < kRows; i++) {
                        const int64_t seen = limits[i0 + i] - t0;
                        visible[i] = seen < 0 ? 0 : seen < nk ? seen : nk;
                    }
                    attend_rows<Unit, D>(qrows + i0 * D, visible, scale2, w, o + i0 * D, m + i0, l + 16 * i0);
                }
            }
            // Merge with the shared part through the log-sum-exps, into out's layout.
            for (int64_t i = 0; i < rows; i++) {
                const int64_t r = b * Rb + r0 + i;
                uint16_t* dst = out + ((r / G) * H * G + h * G + r % G) * D;
                float own_w = 1.0f, shared_w = 0.0f;
                const float* so = shared_out + (h * Rp + r) * D;
                if (num_shared > 0) {
                    const float s_lse = shared_lse[h * Rp + r];
                    const float mx = m[i] > s_lse ? m[i] : s_lse;
                    own_w = exp2f(m[i] - mx);
                    shared_w = exp2f(s_lse - mx);
                }
                const float inv = 1.0f / (row_sum(l + 16 * i) * own_w + shared_w);
                for (int64_t d = 0; d < D; d++)
                    dst[d] = round_bf16((o[i * D + d] * own_w + (shared_w != 0.0f ? so[d] * shared_w : 0.0f)) * inv);
            }
        }
        Unit::end();
    }
}

template <class Unit>
int paged_attention_on(int64_t head_dim, const uint16_t* q, const uint16_t* k_cache,
                       const uint16_t* v_cache, int64_t bs, int64_t H, int64_t G, int64_t n,
                       int64_t nq, const int64_t* shared_blocks, int64_t num_shared,
                       const int64_t* own_blocks, int64_t num_own, const int64_t* positions,
                       float scale, int64_t threads, float* scratch, uint16_t* out) {
    if (head_dim == 64)
        paged_attention<Unit, 64>(q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks, num_shared,
                                  own_blocks, num_own, positions, scale, threads, scratch, out);
    else if (head_dim == 128)
        paged_attention<Unit, 128>(q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks, num_shared,
                                   own_blocks, num_own, positions, scale, threads, scratch, out);
    else
        return 1;
    return 0;
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
    if (head_dim == 64) return Layout<64>{H, rows, threads}.numel();
    if (head_dim == 128) return Layout<128>{H, rows, threads}.numel();
    return -1;
#endif
}

// spyre_paged_attention_bf16's contract (attention.cpp) on AMX; the scratch size above. Only on
// a CPU with the features above, in a process Linux granted the AMX tile state (arch_prctl).
// Returns 1 for a head_dim other than 64 and 128, 2 for the stub (nothing written).
int spyre_paged_attention_amx(int64_t head_dim, const uint16_t* q, const uint16_t* k_cache,
                              const uint16_t* v_cache, int64_t bs, int64_t H, int64_t G,
                              int64_t n, int64_t nq, const int64_t* shared_blocks,
                              int64_t num_shared, const int64_t* own_blocks, int64_t num_own,
                              const int64_t* positions, float scale, int64_t threads,
                              float* scratch, uint16_t* out) {
#ifndef SPYRE_DOT_BF16
    return 2;
#else
    return paged_attention_on<Amx>(head_dim, q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks,
                                   num_shared, own_blocks, num_own, positions, scale, threads,
                                   scratch, out);
#endif
}

// The same on AVX512-BF16 dot products (CPUs with AVX512-BF16/BW/VL/DQ, no AMX needed).
int spyre_paged_attention_avx512_bf16(int64_t head_dim, const uint16_t* q, const uint16_t* k_cache,
                                      const uint16_t* v_cache, int64_t bs, int64_t H, int64_t G,
                                      int64_t n, int64_t nq, const int64_t* shared_blocks,
                                      int64_t num_shared, const int64_t* own_blocks,
                                      int64_t num_own, const int64_t* positions, float scale,
                                      int64_t threads, float* scratch, uint16_t* out) {
#ifndef SPYRE_DOT_BF16
    return 2;
#else
    return paged_attention_on<Avx512Bf16>(head_dim, q, k_cache, v_cache, bs, H, G, n, nq,
                                          shared_blocks, num_shared, own_blocks, num_own,
                                          positions, scale, threads, scratch, out);
#endif
}

}  // extern "C"
