// What the paged-attention kernels (attention.cpp, attention_dot_bf16.cpp) share: one call's
// arguments, where a context's keys live in the cache, and the two parts of a row group's
// attention with their merges:
// - the shared blocks (keys wholly before every query, no mask, read once for every row):
//   split_merge splits the keys into one range of whole tiles per thread, each range's task
//   covering every KV head (the cache interleaves the heads, so a task reads its range's memory
//   once, in order), then merges the ranges' partial results. Splitting by heads and query
//   blocks only, as SDPA's flash kernel does, leaves a decode step with fewer KV heads than
//   threads with idle threads, and reads the keys once per head;
// - each sequence's own blocks, causal: own_part runs one task per (sequence, block of rows,
//   part of the KV heads), reading each tile of keys once for the part's heads, and merges each
//   row with the shared part's result as it writes it.
// With a sliding window of W keys a query at position p sees the keys at p - W + 1 .. p; the
// shared blocks then lie wholly inside every query's window, and a sequence's own blocks start
// at the block of the first key its first query sees (Args::own_start). Without one (W = 0) a
// query sees the keys at 0 .. p and the own blocks start after the shared ones.
// A partial result is an online softmax per row, in log2 units: a running max m of the scaled
// scores (a probability is 2^(score * scale2 - m), scale2 the attention scale times log2(e)),
// the sum l of the probabilities and the unnormalized output o. Two merge exactly through their
// maxes.
//
// Everything here has internal linkage (the unnamed namespace): attention_dot_bf16.cpp compiles
// it for AVX-512, and no copy of it may stand in for attention.cpp's AVX2 one at link time.
#pragma once
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <type_traits>

namespace spyre_attention {
namespace {

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// f(std::integral_constant<int64_t, D>()) for a head_dim D of 64 or 128; `otherwise` for any
// other.
template <typename R, class F>
inline R with_head_dim(int64_t head_dim, R otherwise, F f) {
    if (head_dim == 64) return f(std::integral_constant<int64_t, 64>());
    if (head_dim == 128) return f(std::integral_constant<int64_t, 128>());
    return otherwise;
}

// torch's rounding to bfloat16: to nearest, ties to even, NaN to 0x7FC0 (vcvtneps2bf16 would
// flush denormals).
inline uint16_t round_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// An output element from float32: float, or uint16_t holding bfloat16.
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) { *dst = round_bf16(x); }

// One call's arguments (their contract: spyre_paged_attention_f32 in attention.cpp).
// A windowed sequence's own keys start on a grid of this many blocks (192 keys with blocks of
// 64), which every kernel's key tile divides (48 keys in attention.cpp, 64 in
// attention_dot_bf16.cpp): a query's keys then fall in the same tiles, in the same order, in any
// step, so its result has the same bits (paged_attention.py, KEY_GRID_BLOCKS).
constexpr int64_t kKeyGridBlocks = 3;

template <typename T>
struct Args {
    const T* q;
    const T* k_cache;
    const T* v_cache;
    int64_t bs, H, G, n, nq;
    const int64_t* shared_blocks;
    int64_t num_shared;
    const int64_t* own_blocks;
    int64_t num_own;
    const int64_t* positions;
    int64_t window;  // 0: none
    float scale;
    int64_t threads;
    float* scratch;
    T* out;

    int64_t Rb() const { return nq * G; }  // rows per KV head of one sequence
    int64_t R() const { return n * Rb(); }  // rows per KV head
    int64_t shared_len() const { return num_shared * bs; }
    float scale2() const { return scale * 1.44269504088896341f; }  // log2(e): powers of 2
    // Where row r = (b * nq + i) * G + g of KV head h is in q's and out's layout, in rows.
    int64_t token_row(int64_t r, int64_t h) const { return (r / G) * H * G + h * G + r % G; }
    // The position of sequence b's first own key: 0 without a window, else the start of the
    // block of the first key its first query sees, rounded down to a multiple of
    // kKeyGridBlocks blocks (paged_attention.KEY_GRID_BLOCKS, the plan's rule).
    int64_t own_start(int64_t b) const {
        if (window <= 0) return 0;
        const int64_t first = positions[b * nq] - window + 1;
        const int64_t grid = kKeyGridBlocks * bs;
        return first > 0 ? first / grid * grid : 0;
    }
};

// Where a context's keys and values live in the cache [num_blocks][bs][H][D]: the context's key
// j of head h at (blocks[j / bs] * bs + j % bs) * ldk + h * D.
template <typename T>
struct Context {
    const T* k;
    const T* v;
    const int64_t* blocks;
    int64_t bs;
    int64_t ldk;  // H * D

    // f(j, offset) for the keys t0 + j, j in [0, nk): head 0 of the key at k + offset, of its
    // value at v + offset.
    template <class F>
    void keys(int64_t t0, int64_t nk, F f) const {
        int64_t block = t0 / bs, in_block = t0 % bs;
        for (int64_t j = 0; j < nk; j++) {
            f(j, (blocks[block] * bs + in_block) * ldk);
            if (++in_block == bs) { in_block = 0; block++; }
        }
    }
};

// Reads the values [off, off + count) of the key and value rows of keys [t0, t0 + nk) of ctx in
// address order, one load per cache line, before a tile's compute uses them. The compute reads
// one head's slice of each row at a time (a transposed column, a value row), which leaves most
// of a decode step's cache misses serial; these loads are independent and in order, so many are
// in flight and the hardware prefetcher follows them.
template <typename T>
inline void touch_rows(const Context<T>& ctx, int64_t t0, int64_t nk, int64_t off, int64_t count) {
    constexpr int64_t kLine = 64 / sizeof(T);
    uint32_t acc = 0;
    ctx.keys(t0, nk, [&](int64_t, int64_t at) {
        for (int64_t c = off; c < off + count; c += kLine) {
            acc += *reinterpret_cast<const volatile uint32_t*>(ctx.k + at + c);
            acc += *reinterpret_cast<const volatile uint32_t*>(ctx.v + at + c);
        }
    });
    __asm__ __volatile__("" : : "r"(acc));  // the loads are kept: their value is "used"
}

// The queries of every KV head, together: qs [H][ld][D] (ld >= R), row r of head h =
// convert(q's row), zeros past R.
template <int64_t D, typename T, typename Q, class Convert>
void gather_queries(const Args<T>& a, Q* qs, int64_t ld, Convert convert) {
    const int64_t R = a.R();
    for (int64_t h = 0; h < a.H; h++) {
        for (int64_t r = 0; r < R; r++) {
            const T* src = a.q + a.token_row(r, h) * D;
            Q* dst = qs + (h * ld + r) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = convert(src[d]);
        }
        for (int64_t i = R * D; i < ld * D; i++) qs[h * ld * D + i] = 0;
    }
}

// The partial results of `rows` rows, in slots of numel(rows) floats: o [rows][D], m [rows] and
// l [rows][Lanes] (a row's sum in Lanes partial sums). With rows a multiple of 16, every part
// of a slot keeps the 64-byte alignment of its base.
template <int64_t D, int64_t Lanes>
struct States {
    float* base;
    int64_t rows;

    static int64_t numel(int64_t rows) { return rows * (D + 1 + Lanes); }
    float* o(int64_t slot) const { return base + slot * numel(rows); }
    float* m(int64_t slot) const { return o(slot) + rows * D; }
    float* l(int64_t slot) const { return m(slot) + rows; }
    // Rows [0, n) of the slot before their first key.
    void reset(int64_t slot, int64_t n) const {
        float *os = o(slot), *ms = m(slot), *ls = l(slot);
        for (int64_t i = 0; i < n * D; i++) os[i] = 0.0f;
        for (int64_t i = 0; i < n; i++) ms[i] = -INFINITY;
        for (int64_t i = 0; i < n * Lanes; i++) ls[i] = 0.0f;
    }
};

// What a kernel runs around each thread's use of its compute unit (Unit::begin(), Unit::end()):
// nothing here.
struct NoUnit {
    static void begin() {}
    static void end() {}
};

// The shared blocks: keys [0, L) in `splits` ranges of whole Tile-key tiles, one task per range
// on its own thread, over every head: tile(sp, t0, nk) attends keys [t0, t0 + nk) of range sp
// into state slots h * splits + sp of st (reset before). Then per head h and row r < R the
// ranges' results are merged into out [H][st.rows][D] (normalized) and lse [H][st.rows] (in
// log2 units); sum(l) is a row's sum from its Lanes partial sums.
template <class Unit, int64_t Tile, int64_t D, int64_t Lanes, class TileFn, class Sum>
void split_merge(int64_t H, int64_t R, int64_t L, int64_t splits, const States<D, Lanes>& st,
                 TileFn tile, Sum sum, float* out, float* lse) {
    const int64_t range = ((L + splits - 1) / splits + Tile - 1) / Tile * Tile;
    #pragma omp parallel for schedule(static) num_threads(splits)
    for (int64_t sp = 0; sp < splits; sp++) {
        Unit::begin();
        const int64_t k0 = sp * range, k1 = (sp + 1) * range < L ? (sp + 1) * range : L;
        for (int64_t h = 0; h < H; h++) st.reset(h * splits + sp, st.rows);
        for (int64_t t0 = k0; t0 < k1; t0 += Tile) tile(sp, t0, k1 - t0 < Tile ? k1 - t0 : Tile);
        Unit::end();
    }
    const int64_t Rp = st.rows;
    #pragma omp parallel for schedule(static) num_threads(splits)
    for (int64_t hr = 0; hr < H * R; hr++) {
        const int64_t h = hr / R, r = hr % R;
        float max = -INFINITY;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float mm = st.m(h * splits + sp)[r];
            max = mm > max ? mm : max;
        }
        float total = 0.0f;
        alignas(64) float acc[D] = {};
        for (int64_t sp = 0; sp < splits; sp++) {
            const int64_t slot = h * splits + sp;
            const float l = sum(st.l(slot) + Lanes * r);
            if (l == 0.0f) continue;  // an empty range
            const float f = exp2f(st.m(slot)[r] - max);
            total += l * f;
            const float* o = st.o(slot) + r * D;
            for (int64_t d = 0; d < D; d++) acc[d] += o[d] * f;
        }
        for (int64_t d = 0; d < D; d++) out[(h * Rp + r) * D + d] = acc[d] / total;
        lse[h * Rp + r] = max + log2f(total);
    }
}

// One head of one task of own_part: KV head h of sequence b, its rows r0 .. r0 + rows - 1 (of
// the sequence's Rb).
template <int64_t D, int64_t Lanes, typename T>
struct OwnTask {
    int64_t b, h, r0, rows;
    Context<T> ctx;          // the sequence's own blocks
    const int64_t* firsts;   // row r0 + i sees the own keys from firsts[i] (0 without a window)
    const int64_t* limits;   // ... up to before limits[i]; both 0 past `rows`
    float* scratch;          // the thread's
    States<D, Lanes> st;     // slot 0: the rows' results for head h
};

// Most KV heads one task of own_part covers: a thread's scratch holds this many States of the
// task's rows.
constexpr int64_t kOwnHeads = 8;

// Parts of the H KV heads for own_part's tasks: a task reads its part's slices of every key row
// (the cache interleaves the heads), and narrow slices read memory poorly (a strided pass of a
// few lines of each row), so a sequence's heads are cut only as far as the threads need: into
// ceil(threads * its keys / (all sequences' keys * row blocks)) parts, at least enough that a
// part has at most kOwnHeads heads, at most H. The parts change which thread computes a head,
// never a row's arithmetic. first[b]: sequence b's first task (tasks of one sequence are
// consecutive, row block by row block); first[n] the number of tasks. Both live in the call's
// scratch: numel(R) floats of it (n <= R), a multiple of 16 so what follows stays aligned.
struct OwnTasks {
    int64_t* first;  // [n + 1]
    int64_t* parts;  // [n]

    static int64_t numel(int64_t R) { return round16(2 * (2 * R + 1)); }
    template <typename T>
    static OwnTasks in(const Args<T>& a) {
        int64_t* plan = reinterpret_cast<int64_t*>(a.scratch);
        return OwnTasks{plan, plan + a.n + 1};
    }

    template <typename T>
    void plan(const Args<T>& a, int64_t row_blocks) const {
        const int64_t least = (a.H + kOwnHeads - 1) / kOwnHeads;
        int64_t total = 0;  // parts[b] holds sequence b's keys until it holds its parts
        for (int64_t b = 0; b < a.n; b++) total += parts[b] = seen_keys(a, b);
        first[0] = 0;
        for (int64_t b = 0; b < a.n; b++) {
            const int64_t want = (a.threads * parts[b] + total * row_blocks - 1) / (total * row_blocks);
            parts[b] = want < least ? least : want > a.H ? a.H : want;
            first[b + 1] = first[b] + row_blocks * parts[b];
        }
    }

    // The sequence whose tasks hold `task` (< first[n]): the last b with first[b] <= task.
    int64_t sequence(int64_t task, int64_t n) const {
        int64_t lo = 0, hi = n - 1;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= task) lo = mid; else hi = mid - 1;
        }
        return lo;
    }

    // The own keys sequence b's last row sees (at least 1).
    template <typename T>
    static int64_t seen_keys(const Args<T>& a, int64_t b) {
        const int64_t start = a.own_start(b);
        const int64_t last = a.positions[b * a.nq + a.nq - 1] + 1 - start - a.shared_len();
        const int64_t from = a.window > 0 ? a.positions[b * a.nq + a.nq - 1] - a.window + 1 - start : 0;
        const int64_t keys = last - (from > 0 ? from : 0);
        return keys > 1 ? keys : 1;
    }
};

// The rows of own task t (head t.h), their results in t.st slot 0, merged with the shared part's
// result through the log-sum-exps (shared_out [H][Rp][D] and shared_lse [H][Rp], where there are
// shared blocks), into a.out's layout.
template <int64_t D, int64_t Lanes, typename T, class Sum>
void write_rows(const Args<T>& a, const OwnTask<D, Lanes, T>& t, const float* shared_out,
                const float* shared_lse, int64_t Rp, Sum sum) {
    const float *o = t.st.o(0), *m = t.st.m(0), *l = t.st.l(0);
    for (int64_t i = 0; i < t.rows; i++) {
        const int64_t r = t.b * a.Rb() + t.r0 + i;
        T* dst = a.out + a.token_row(r, t.h) * D;
        float own_w = 1.0f, shared_w = 0.0f;
        const float* so = shared_out + (t.h * Rp + r) * D;
        if (a.num_shared > 0) {
            const float s_lse = shared_lse[t.h * Rp + r];
            const float mx = m[i] > s_lse ? m[i] : s_lse;
            own_w = exp2f(m[i] - mx);
            shared_w = exp2f(s_lse - mx);
        }
        const float inv = 1.0f / (sum(l + Lanes * i) * own_w + shared_w);
        for (int64_t d = 0; d < D; d++)
            store(dst + d, (o[i * D + d] * own_w + (shared_w != 0.0f ? so[d] * shared_w : 0.0f)) * inv);
    }
}

// The own blocks: one task per (sequence, block of OwnRows rows, part of the KV heads), causal,
// dynamically over a.threads threads (Unit::begin() and end() around each thread's). A task
// walks its keys a tile at a time: it reads the tile's rows of its part's heads in order
// (touch_rows), then attends every head of the part to the tile before the next. The cache
// interleaves the heads, so the part's slices of a key's row are contiguous; tasks of one head
// would each read a small piece of every 1 KB or more, out of order. Each row's arithmetic is
// the same either way. A thread's scratch is works + thread * stride, its task's results
// `offset` floats into it (one States of OwnRows rows per head of the part). Own key j of
// sequence b is at position own_start(b) + j before the shared keys and
// own_start(b) + shared_len + j after them, so row r0 + i's query, at position p, sees the own
// keys from max(0, p - W + 1 - own_start(b)) with a window W (else from 0) up to before
// p + 1 - own_start(b) - shared_len; tile(task, t0, nk) attends the task's rows of one head to
// keys [t0, t0 + nk), for the tiles of Tile keys from the one holding its first row's first key
// to the one holding its last row's last. Then write_rows merges and writes each head's rows.
template <class Unit, int64_t Tile, int64_t OwnRows, int64_t D, int64_t Lanes, typename T,
          class TileFn, class Sum>
void own_part(const Args<T>& a, float* works, int64_t stride, int64_t offset,
              const float* shared_out, const float* shared_lse, int64_t Rp, TileFn tile, Sum sum) {
    const int64_t Rb = a.Rb(), shared_len = a.shared_len();
    const int64_t row_blocks = (Rb + OwnRows - 1) / OwnRows;
    const OwnTasks tasks = OwnTasks::in(a);
    tasks.plan(a, row_blocks);
    #pragma omp parallel num_threads(a.threads)
    {
        Unit::begin();
        float* scratch = works + omp_get_thread_num() * stride;
        int64_t firsts[OwnRows + 16], limits[OwnRows + 16];  // a 16-row tile may run past them
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks.first[a.n]; task++) {
            const int64_t b = tasks.sequence(task, a.n);
            const int64_t parts = tasks.parts[b], in_sequence = task - tasks.first[b];
            const int64_t part = in_sequence % parts, r0 = in_sequence / parts * OwnRows;
            const int64_t h0 = a.H * part / parts, h1 = a.H * (part + 1) / parts;
            const int64_t rows = Rb - r0 < OwnRows ? Rb - r0 : OwnRows;
            const Context<T> ctx{a.k_cache, a.v_cache, a.own_blocks + b * a.num_own, a.bs, a.H * D};
            const int64_t start = a.own_start(b);
            for (int64_t i = 0; i < OwnRows + 16; i++) {
                const int64_t p = i < rows ? a.positions[b * a.nq + (r0 + i) / a.G] : -1;
                const int64_t first = a.window > 0 ? p - a.window + 1 - start : 0;
                firsts[i] = i < rows && first > 0 ? first : 0;
                limits[i] = i < rows ? p + 1 - start - shared_len : 0;
            }
            const auto head = [&](int64_t h) {
                float* results = scratch + offset + (h - h0) * States<D, Lanes>::numel(OwnRows);
                const States<D, Lanes> st{results, OwnRows};
                return OwnTask<D, Lanes, T>{b, h, r0, rows, ctx, firsts, limits, scratch, st};
            };
            for (int64_t h = h0; h < h1; h++) head(h).st.reset(0, round16(rows));
            // Positions ascend: the first row's window starts first, the last row sees most.
            const int64_t end = limits[rows - 1];
            for (int64_t t0 = firsts[0] / Tile * Tile; t0 < end; t0 += Tile) {
                const int64_t nk = end - t0 < Tile ? end - t0 : Tile;
                touch_rows(ctx, t0, nk, h0 * D, (h1 - h0) * D);
                for (int64_t h = h0; h < h1; h++) tile(head(h), t0, nk);
            }
            for (int64_t h = h0; h < h1; h++) write_rows(a, head(h), shared_out, shared_lse, Rp, sum);
        }
        Unit::end();
    }
}

}  // namespace
}  // namespace spyre_attention
