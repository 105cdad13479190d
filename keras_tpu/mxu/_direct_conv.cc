// The MXU's convolutions on the host CPU's bfloat16 dot instructions (AVX-512 BF16).
//
// An MXU multiplies bfloat16 operands exactly and sums the products in float32. VDPBF16PS computes exactly
// that for 16 float32 lanes: each lane adds two exact bf16 products to its float32 sum. XLA:CPU has no
// convolution on it (its bf16 convolutions are converted to float32), so these kernels compute the
// convolutions directly, without im2col patches:
//
// * MxuConvForward: out[n, y, x, o] = sum_{i, j, c} in[n, y*sh + i*dh - pt, x*sw + j*dw - pl, c] w[i, j, c, o],
//   zeros outside the input. The input gradient of a stride-1 convolution is one too (its window given as
//   [KH][KW][O][C], io_swapped, and read back to front, flipped).
// * MxuConvWeightGrad: dw[i, j, c, o] = sum_{n, y, x} in[n, y*sh + i*dh - pt, x*sw + j*dw - pl, c] g[n, y, x, o].
//
// The instruction sums products in pairs along the contraction, so its operands are interleaved in pairs:
// the forward kernel's weights as [KH][KW][C/2][O][2], packed once per call (small), the weight gradient's
// input and output gradient along output columns (x, x+1), built chunk by chunk so they stay in cache. Both
// take their operands as XLA holds them (NHWC, HWIO): padding, odd feature counts and output features that
// are not a multiple of 16 are handled here, so XLA writes no rearranged copy of any operand. A convolution of at
// most 4 output features sums along its input features instead (FewOutputs), as 16 lanes of outputs would idle.
// Only the order of the float32 additions differs from any other summation order of the MXU's products;
// like the MXU, the instruction flushes denormal bf16 inputs and results to zero. Where it yields fewer products
// than float32 FMAs (MxuBf16DotSpeedup below 1: Intel's Emerald Rapids), the kernels widen the operands to
// float32 and sum on FMAs instead (the `fma` attribute): bf16 x bf16 products are exact in float32 too, and
// denormals then follow the thread's MXCSR flags, as in XLA's own float32 kernels.
//
// Work is split over XLA's intra-op thread pool (the caller's thread takes part).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// body(item, worker) for every item in [0, items), on up to `workers` threads of the pool (the caller is one).
// Items are claimed dynamically, so a pool thread that starts late (busy with other work) delays nothing.
// The caller waits for the items others still hold by spinning briefly, then asleep: on a loaded host a pool
// thread can be descheduled in the middle of an item, and a caller spinning until it returns would hold a CPU
// that thread may need to finish.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, int64_t workers, const F& body) {
  workers = std::max<int64_t>(1, std::min(workers, items));
  if (workers == 1) {
    for (int64_t i = 0; i < items; ++i) body(i, 0);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0}, worker{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  const F* fn = &body;
  // A pool task that starts after every item is claimed touches only `state`, which it keeps alive.
  auto work = [state, items, fn]() {
    int64_t worker = state->worker.fetch_add(1);
    for (int64_t i; (i = state->next.fetch_add(1)) < items;) {
      (*fn)(i, worker);
      if (state->done.fetch_add(1, std::memory_order_acq_rel) + 1 == items) {
        std::lock_guard<std::mutex> lock(state->mutex);   // the waiter checks `done` under it: no lost wake-up
        state->finished.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < workers; ++t) pool.Schedule([work]() { work(); });
  work();
  auto all_done = [&state, items]() { return state->done.load(std::memory_order_acquire) >= items; };
  for (int spin = 0; spin < 2000 && !all_done(); ++spin) _mm_pause();   // a few microseconds
  if (!all_done()) {
    std::unique_lock<std::mutex> lock(state->mutex);
    state->finished.wait(lock, all_done);
  }
}

int64_t PoolThreads(ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }

// Buffers the tiles load whole vectors from start on a cache line: a 64-byte load that spans two lines costs two
// of the core's load slots (malloc's 16-byte alignment split every other one).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using AlignedBuffer = std::vector<T, LineAligned<T>>;

inline __m512bh BroadcastPair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// Zero padding is the kernels' own (attributes pt, pl: the rows and columns of zeros before the input; fewer
// than zero crop it), applied as each work item copies the input rows it reads into a buffer of its own: XLA
// would otherwise write a padded copy of every activation, and compile a loop for each (ResNet-20's training
// program spent about a third of its generated code on them).

// dst[k] = src[k] as float32 (exact: a bfloat16 is the top half of a float32).
void Bf16ToF32(const uint16_t* src, int64_t n, float* dst) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
    _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
  for (; k < n; ++k) {
    uint32_t bits = uint32_t(src[k]) << 16;
    std::memcpy(dst + k, &bits, 4);
  }
}

// How a tile sums its products: on VDPBF16PS, two bf16 operands per lane and step (K = 2, operands
// interleaved in pairs along the contraction), or on float32 FMAs of the operands widened to float32, one per
// lane and step (K = 1). A host whose bf16 dot instruction runs at half its FMA rate (Intel's Sapphire and
// Emerald Rapids: one VDPBF16PS per two cycles, two FMAs per cycle) computes the same sums twice as fast on FMAs.
struct Bf16DotSums {
  using T = uint16_t;
  using Vec = __m512bh;
  static constexpr int K = 2;
  static Vec Load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec Broadcast(const T* p) { return BroadcastPair(p); }
  static __m512 Add(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void Copy(const uint16_t* src, int64_t n, T* dst) { std::memcpy(dst, src, n * sizeof(T)); }
  static T Value(uint16_t bits) { return bits; }
};

struct FmaSums {
  using T = float;
  using Vec = __m512;
  static constexpr int K = 1;
  static Vec Load(const T* p) { return _mm512_loadu_ps(p); }
  static Vec Broadcast(const T* p) { return _mm512_set1_ps(*p); }
  static __m512 Add(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  static void Copy(const uint16_t* src, int64_t n, T* dst) { Bf16ToF32(src, n, dst); }
  static T Value(uint16_t bits) {
    uint32_t wide = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
  }
};

// Row `r` of the padded input (`cols` columns from column 0 of the padding, `cp` >= c features each, the extra
// ones zero) into `dst`, as the tiles read it (S::T); rows and columns outside the input are zeros.
template <typename S>
void PaddedRow(const uint16_t* x, int64_t h, int64_t w, int64_t c, int64_t pt, int64_t pl, int64_t r,
               int64_t cols, int64_t cp, typename S::T* dst) {
  using T = typename S::T;
  const int64_t real = r - pt;
  const int64_t first = std::max<int64_t>(0, pl), last = std::min<int64_t>(cols, w + pl);  // columns read from x
  if (real < 0 || real >= h || first >= last) {
    std::memset(dst, 0, cols * cp * sizeof(T));
    return;
  }
  const uint16_t* src = x + real * w * c;
  std::memset(dst, 0, first * cp * sizeof(T));
  if (cp == c) {
    S::Copy(src + (first - pl) * c, (last - first) * c, dst + first * cp);
  } else {
    for (int64_t q = first; q < last; ++q) {
      S::Copy(src + (q - pl) * c, c, dst + q * cp);
      std::memset(dst + q * cp + c, 0, (cp - c) * sizeof(T));
    }
  }
  std::memset(dst + last * cp, 0, (cols - last) * cp * sizeof(T));
}

// The file compiles as two parts at once, one per core of a 2-core host (KERAS_TPU_PART 1: the forward kernel,
// 2: the weight gradient's; undefined: both), linked into one library.
#if KERAS_TPU_PART != 2

// ------------------------------------------------------------------------------------------------ forward

// PB output columns times CBV*16 output features, summed over the window and the input features (`steps` steps
// of S::K features; the weights packed as [KH][KW][steps][co][K]).
template <typename S, int PB, int CBV>
void ForwardTile(const typename S::T* in, int64_t in_row, int64_t in_col_step, int64_t in_pixel,
                 const typename S::T* w, int64_t kh, int64_t kw, int64_t steps, int64_t co, float* out) {
  __m512 acc[PB][CBV];
  for (int p = 0; p < PB; ++p)
    for (int v = 0; v < CBV; ++v) acc[p][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kh; ++i) {
    for (int64_t j = 0; j < kw; ++j) {
      const typename S::T* x = in + i * in_row + j * in_pixel;
      const typename S::T* wt = w + (i * kw + j) * steps * co * S::K;
      for (int64_t k = 0; k < steps; ++k) {
        typename S::Vec wv[CBV];
        for (int v = 0; v < CBV; ++v) wv[v] = S::Load(wt + (k * co + v * 16) * S::K);
        for (int p = 0; p < PB; ++p) {
          typename S::Vec xv = S::Broadcast(x + p * in_col_step + k * S::K);
          for (int v = 0; v < CBV; ++v) acc[p][v] = S::Add(acc[p][v], xv, wv[v]);
        }
      }
    }
  }
  for (int p = 0; p < PB; ++p)
    for (int v = 0; v < CBV; ++v) _mm512_storeu_ps(out + p * co + v * 16, acc[p][v]);
}

// ForwardTile<S, 1, CBV> ... ForwardTile<S, PB, CBV>, by columns - 1.
template <typename S, int CBV, int... P>
constexpr auto ForwardTiles(std::integer_sequence<int, P...>) {
  using TileFn = void (*)(const typename S::T*, int64_t, int64_t, int64_t, const typename S::T*, int64_t, int64_t,
                          int64_t, int64_t, float*);
  return std::array<TileFn, sizeof...(P)>{ForwardTile<S, P + 1, CBV>...};
}

// One output row: CBV*16 features at a time, over the fewest tiles of at most PB columns, as even as they can be
// (a row of 14 columns in tiles of 5, 5 and 4, not 6, 6 and 2). A tile reads each weight vector once for all its
// columns, and the weights stream from L2 (147 KB for 3x3x64->64 in float32): a tile of 2 columns read them at
// 64 bytes a cycle, more than L2 gives, and ran at a third of the FMA rate. Single thread, GFLOP/s, tiles of PB
// and a remainder / even tiles: 14 columns 64->64 136 / 149, 32 columns 32->32 176 / 197 (the FMA peak ~195).
// `in` holds the row's kh input rows one after another (in_row elements each, cp features per column); dw: the
// window's dilation in input columns.
template <typename S, int CBV, int PB>
void ForwardRow(const typename S::T* in, int64_t in_row, int64_t sw, int64_t cp, int64_t dw,
                const typename S::T* w, int64_t kh, int64_t kw, int64_t co, float* out, int64_t ow) {
  static constexpr auto tiles = ForwardTiles<S, CBV>(std::make_integer_sequence<int, PB>{});
  const int64_t step = sw * cp;
  // Without dilation a window row's taps read consecutive columns, cp features each, and their weights follow
  // one another too: one run of kw * cp features (few features, as a first layer's 3, then still fill a tile's
  // loop).
  const int64_t taps = dw == 1 ? 1 : kw, steps = (dw == 1 ? kw : 1) * cp / S::K;
  const int64_t count = (ow + PB - 1) / PB, narrow = ow / count, wide = ow % count;  // `wide` tiles of narrow + 1
  for (int64_t o = 0; o < co; o += CBV * 16) {
    int64_t x = 0;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t pb = narrow + (t < wide ? 1 : 0);
      tiles[pb - 1](in + x * step, in_row, step, cp * dw, w + o * S::K, kh, taps, steps, co, out + x * co + o);
      x += pb;
    }
  }
}

// Products per work item of the forward kernels (see ForwardOnTiles).
constexpr int64_t kItemProducts = int64_t(1) << 19;

// A convolution's geometry as the forward kernels see it (see ForwardImpl).
struct ForwardShape {
  int64_t n, h, w, c, kh, kw, co, oh, ow, sh, sw, dh, dw, pt, pl, io_swapped, flipped;
  // The window's weight of tap (i, j), input feature ci, output feature o, from XLA's HWIO (or HWOI) array;
  // `flipped`: the array holds the window back to front in both spatial dimensions (the input gradient's
  // window is the forward one reversed: read so, XLA writes no reversed copy of each kernel).
  int64_t WeightIndex(int64_t i, int64_t j, int64_t ci, int64_t o) const {
    const int64_t t = flipped ? (kh - 1 - i) * kw + (kw - 1 - j) : i * kw + j;
    return io_swapped ? (t * co + o) * c + ci : (t * c + ci) * co + o;
  }
  // The window rows [i0, i1) of output row `row` that read rows of the input, not its zero padding (i0 >= i1:
  // none, the output row is zero). A valid convolution's input gradient, padded by two rows on each side of a
  // 14-row input, skips 6 of its 48 row-taps.
  void RowsRead(int64_t row, int64_t& i0, int64_t& i1) const {
    const int64_t base = row * sh - pt;   // the input row tap 0 reads; tap i reads base + i * dh
    i0 = base >= 0 ? 0 : (-base + dh - 1) / dh;
    i1 = base > h - 1 ? 0 : std::min(kh, (h - 1 - base) / dh + 1);
  }
};

// row_fn(in, in_row, i0, i1, out) for every output row of the convolution that reads the input (the others are
// zeros): `in` points at the row's window row i0 (of the window rows [i0, i1) that fall on the input) in a buffer
// of padded input rows, `cols` columns of `cp` features each, in_row elements apart; `out` at the row's outputs.
// A work item is a block of output rows of one image of about kItemProducts products (`row_products` per row; at
// least 4 items per thread), whose input rows are copied once: one row of a 16-feature layer (32x32x16 -> 16: 74 K
// products) left the claiming of items and the copying of rows a noticeable part of the work.
template <typename S, typename RowFn>
void OnRowBlocks(ffi::ThreadPool& pool, const ForwardShape& f, const uint16_t* x, int64_t cols, int64_t cp,
                 int64_t row_products, float* y, const RowFn& row_fn) {
  const int64_t threads = PoolThreads(pool);
  int64_t block = std::max<int64_t>(1, std::min<int64_t>(f.oh, kItemProducts / std::max<int64_t>(1, row_products)));
  while (block > 1 && f.n * ((f.oh + block - 1) / block) < 4 * threads) block = (block + 1) / 2;
  const int64_t per_image = (f.oh + block - 1) / block;
  ParallelFor(pool, f.n * per_image, threads, [&](int64_t item, int64_t) {
    thread_local AlignedBuffer<typename S::T> rows;
    const int64_t b = item / per_image, r0 = (item % per_image) * block, r1 = std::min(f.oh, r0 + block);
    // The padded input rows the block's windows read, from its first output row's first window row.
    const int64_t span = (r1 - 1 - r0) * f.sh + (f.kh - 1) * f.dh + 1;
    rows.resize(span * cols * cp);
    for (int64_t q = 0; q < span; ++q)
      PaddedRow<S>(x + b * f.h * f.w * f.c, f.h, f.w, f.c, f.pt, f.pl, r0 * f.sh + q, cols, cp,
                   rows.data() + q * cols * cp);
    for (int64_t row = r0; row < r1; ++row) {
      float* out = y + (b * f.oh + row) * f.ow * f.co;
      int64_t i0, i1;
      f.RowsRead(row, i0, i1);
      if (i0 >= i1) std::memset(out, 0, f.ow * f.co * sizeof(float));
      else row_fn(rows.data() + ((row - r0) * f.sh + i0 * f.dh) * cols * cp, f.dh * cols * cp, i0, i1, out);
    }
  });
}

// out = the convolution on the tiles of S: weights packed once per call as [KH][KW][CP/K][OP][K] (CP: c rounded
// up to K, OP: co to 16, the extra ones zero), the input rows a block of output rows reads copied with their padding
// into a buffer of the work item's own.
template <typename S>
void ForwardOnTiles(ffi::ThreadPool& pool, const ForwardShape& f, const uint16_t* x, const uint16_t* wt, float* y) {
  using T = typename S::T;
  const int64_t cp = (f.c + S::K - 1) / S::K * S::K, op = (f.co + 15) / 16 * 16;
  const int64_t cols = (f.ow - 1) * f.sw + (f.kw - 1) * f.dw + 1;  // the padded input columns a row of outputs reads
  AlignedBuffer<T> packed(f.kh * f.kw * cp * op, T(0));
  for (int64_t i = 0; i < f.kh; ++i)
    for (int64_t j = 0; j < f.kw; ++j)
      for (int64_t ci = 0; ci < f.c; ++ci)
        for (int64_t o = 0; o < f.co; ++o)
          packed[(((i * f.kw + j) * (cp / S::K) + ci / S::K) * op + o) * S::K + ci % S::K] =
              S::Value(wt[f.WeightIndex(i, j, ci, o)]);
  OnRowBlocks<S>(pool, f, x, cols, cp, f.ow * op * f.kh * f.kw * cp, y,
                 [&](const T* in, int64_t in_row, int64_t i0, int64_t i1, float* out) {
    thread_local std::vector<float> padded_out;
    float* dst = out;
    if (op != f.co) {
      padded_out.resize(f.ow * op);
      dst = padded_out.data();
    }
    const T* w = packed.data() + i0 * f.kw * cp * op;
    if (op % 64 == 0) ForwardRow<S, 4, 6>(in, in_row, f.sw, cp, f.dw, w, i1 - i0, f.kw, op, dst, f.ow);
    else if (op % 32 == 0) ForwardRow<S, 2, 12>(in, in_row, f.sw, cp, f.dw, w, i1 - i0, f.kw, op, dst, f.ow);
    else ForwardRow<S, 1, 24>(in, in_row, f.sw, cp, f.dw, w, i1 - i0, f.kw, op, dst, f.ow);
    if (op != f.co)
      for (int64_t q = 0; q < f.ow; ++q) std::memcpy(out + q * f.co, dst + q * op, f.co * sizeof(float));
  });
}

// ---------------------------------------------------------------------------------------- few output features

// A convolution of at most kFewOutputs output features (a first layer's input gradient, 3 features for RGB
// images; a generator's output layer) would fill CO of a tile's 16 lanes above. Here the lanes run along the
// input features instead: each accumulator sums one output's products for 16 * K input features of one column,
// and is summed across its lanes once at the end. The operands are read as they lie (NHWC rows, weights packed
// [KH][CO][KW][CP]), so there is nothing to transpose. CIFAR-10's first-layer input gradient (128 images of
// 32x32x32 -> 3) ran 3x as fast as on the tiles above, which compute 16 outputs to keep 3.
constexpr int64_t kFewOutputs = 4;

// PB output columns (from `in`, a step of `col_step` elements apart) times CO output features, each summed over
// the window's `taps` rows (in_row elements apart in `in`, CO * run_w elements in `w`) and `runs` runs along
// them, of `steps` vectors each (run_x elements apart in `in`, run_w in `w`).
template <typename S, int CO, int PB>
void FewOutputsTile(const typename S::T* in, int64_t in_row, int64_t col_step, int64_t run_x, const typename S::T* w,
                    int64_t run_w, int64_t taps, int64_t runs, int64_t steps, float* out, int64_t valid) {
  __m512 acc[PB][CO];
  for (int p = 0; p < PB; ++p)
    for (int o = 0; o < CO; ++o) acc[p][o] = _mm512_setzero_ps();
  for (int64_t i = 0; i < taps; ++i) {
    for (int64_t j = 0; j < runs; ++j) {
      const typename S::T* xi = in + i * in_row + j * run_x;
      const typename S::T* wi = w + i * CO * run_w * runs + j * run_w;
      for (int64_t k = 0; k < steps; ++k) {
        typename S::Vec wv[CO];
        for (int o = 0; o < CO; ++o) wv[o] = S::Load(wi + o * run_w * runs + k * 16 * S::K);
        for (int p = 0; p < PB; ++p) {
          typename S::Vec xv = S::Load(xi + p * col_step + k * 16 * S::K);
          asm("" : "+v"(xv));   // one load for the CO products (the compiler would fold it into each)
          for (int o = 0; o < CO; ++o) acc[p][o] = S::Add(acc[p][o], xv, wv[o]);
        }
      }
    }
  }
  for (int p = 0; p < valid; ++p)
    for (int o = 0; o < CO; ++o) out[p * CO + o] = _mm512_reduce_add_ps(acc[p][o]);
}

// PB: enough columns for 24 accumulators (16 for one output: its loads, one per product, then bound it).
template <typename S, int CO>
void FewOutputs(ffi::ThreadPool& pool, const ForwardShape& f, const uint16_t* x, const uint16_t* wt, float* y) {
  using T = typename S::T;
  constexpr int PB = CO == 1 ? 16 : 24 / CO;
  constexpr int64_t lanes = 16 * S::K;
  const int64_t cp = (f.c + lanes - 1) / lanes * lanes;
  // A partial tile at a row's end reads PB columns and keeps the valid ones: the buffer has room for them.
  const int64_t buffer_cols = ((f.ow + PB - 1) / PB * PB - 1) * f.sw + (f.kw - 1) * f.dw + 1;
  // Without dilation a window row's taps read one run of kw * cp features (and its weights lie so too).
  const int64_t runs = f.dw == 1 ? 1 : f.kw, run = (f.dw == 1 ? f.kw : 1) * cp;
  AlignedBuffer<T> packed(f.kh * CO * f.kw * cp, T(0));   // [KH][CO][KW][CP]
  for (int64_t i = 0; i < f.kh; ++i)
    for (int64_t o = 0; o < CO; ++o)
      for (int64_t j = 0; j < f.kw; ++j)
        for (int64_t ci = 0; ci < f.c; ++ci)
          packed[((i * CO + o) * f.kw + j) * cp + ci] = S::Value(wt[f.WeightIndex(i, j, ci, o)]);
  OnRowBlocks<S>(pool, f, x, buffer_cols, cp, f.ow * CO * f.kh * f.kw * cp, y,
                 [&](const T* in, int64_t in_row, int64_t i0, int64_t i1, float* out) {
    const T* w = packed.data() + i0 * CO * f.kw * cp;
    for (int64_t q = 0; q < f.ow; q += PB)
      FewOutputsTile<S, CO, PB>(in + q * f.sw * cp, in_row, f.sw * cp, f.dw * cp, w, run, i1 - i0, runs,
                                run / lanes, out + q * CO, std::min<int64_t>(PB, f.ow - q));
  });
}

// in: [N, H, W, C] bf16; w: [KH, KW, C, O] bf16, or [KH, KW, O, C] with io_swapped, either reversed in KH and KW
// with flipped; out: [N, OH, OW, O] f32.
// The input is read as if padded by pt rows and pl columns of zeros before it (and zeros after it).
ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> in, ffi::Buffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> out, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt,
                       int64_t pl, int64_t io_swapped, int64_t flipped, int64_t fma) {
  auto xd = in.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || wd.size() != 4 || od.size() != 4)
    return ffi::Error::InvalidArgument("MxuConvForward: operands of rank 4 expected");
  const ForwardShape f{xd[0], xd[1], xd[2], xd[3], wd[0], wd[1], io_swapped ? wd[2] : wd[3], od[1], od[2],
                       sh, sw, dh, dw, pt, pl, io_swapped, flipped};
  if ((io_swapped ? wd[3] : wd[2]) != f.c || od[0] != f.n || od[3] != f.co || sh < 1 || sw < 1 || dh < 1 || dw < 1)
    return ffi::Error::InvalidArgument("MxuConvForward: shapes do not match");
  float* y = out->typed_data();
  if (f.n * f.oh * f.ow * f.co == 0) return ffi::Error::Success();
  const uint16_t* x = reinterpret_cast<const uint16_t*>(in.untyped_data());
  const uint16_t* wt = reinterpret_cast<const uint16_t*>(w.untyped_data());
  // Few outputs of many inputs: lanes along the inputs (fewer than 16 inputs would leave lanes empty there).
  if (f.co <= kFewOutputs && f.c >= 16) {
    switch (f.co * 2 + (fma ? 1 : 0)) {
      case 2: FewOutputs<Bf16DotSums, 1>(pool, f, x, wt, y); break;
      case 3: FewOutputs<FmaSums, 1>(pool, f, x, wt, y); break;
      case 4: FewOutputs<Bf16DotSums, 2>(pool, f, x, wt, y); break;
      case 5: FewOutputs<FmaSums, 2>(pool, f, x, wt, y); break;
      case 6: FewOutputs<Bf16DotSums, 3>(pool, f, x, wt, y); break;
      case 7: FewOutputs<FmaSums, 3>(pool, f, x, wt, y); break;
      case 8: FewOutputs<Bf16DotSums, 4>(pool, f, x, wt, y); break;
      default: FewOutputs<FmaSums, 4>(pool, f, x, wt, y); break;
    }
  } else if (fma) {
    ForwardOnTiles<FmaSums>(pool, f, x, wt, y);
  } else {
    ForwardOnTiles<Bf16DotSums>(pool, f, x, wt, y);
  }
  return ffi::Error::Success();
}

#endif  // KERAS_TPU_PART != 2
#if KERAS_TPU_PART != 1

// ----------------------------------------------------------------------------------------- weight gradient

// out[2k] = a[k], out[2k + 1] = b[k] (0 without b), k < len.
void Interleave(const uint16_t* a, const uint16_t* b, int64_t len, uint16_t* out) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  int64_t k = 0;
  for (; k + 32 <= len; k += 32) {
    __m512i va = _mm512_loadu_si512(a + k), vb = b ? _mm512_loadu_si512(b + k) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 2 * k, _mm512_permutex2var_epi16(va, lo, vb));
    _mm512_storeu_si512(out + 2 * k + 32, _mm512_permutex2var_epi16(va, hi, vb));
  }
  for (; k < len; ++k) {
    out[2 * k] = a[k];
    out[2 * k + 1] = b ? b[k] : 0;
  }
}

// CT input features times CBV*16 output features of one tap, summed over a chunk's rows and `count` steps along
// them (column pairs of the interleaved buffers with Bf16DotSums, columns with FmaSums; x_step elements apart in
// xq, co * K in gq).
template <typename S, int CT, int CBV>
void WeightGradTile(const typename S::T* xq, const typename S::T* gq, int64_t rows, int64_t x_row, int64_t g_row,
                    int64_t count, int64_t x_step, int64_t co, float* dw) {
  __m512 acc[CT][CBV];
  for (int c = 0; c < CT; ++c)
    for (int v = 0; v < CBV; ++v) acc[c][v] = _mm512_loadu_ps(dw + c * co + v * 16);
  for (int64_t r = 0; r < rows; ++r) {
    const typename S::T* xr = xq + r * x_row;
    const typename S::T* gr = gq + r * g_row;
    for (int64_t j = 0; j < count; ++j) {
      typename S::Vec gv[CBV];
      for (int v = 0; v < CBV; ++v) gv[v] = S::Load(gr + (j * co + v * 16) * S::K);
      const typename S::T* xj = xr + j * x_step;
      for (int c = 0; c < CT; ++c) {
        typename S::Vec xv = S::Broadcast(xj + c * S::K);
        for (int v = 0; v < CBV; ++v) acc[c][v] = S::Add(acc[c][v], xv, gv[v]);
      }
    }
  }
  for (int c = 0; c < CT; ++c)
    for (int v = 0; v < CBV; ++v) _mm512_storeu_ps(dw + c * co + v * 16, acc[c][v]);
}

// h, w: the input's rows and columns; cols: the padded input columns the taps read; co: the output gradient's
// features, op: those rounded up to 16 (the tiles' and the partial sums' width).
struct WeightGradShape {
  int64_t n, h, w, c, oh, ow, co, op, kh, kw, sh, sw, dh, dw, pt, pl, cols;
};

// Runs the tiles over every tap of a chunk's buffers (built by WeightGradChunk or WeightGradChunkF32): `rows` rows
// of the output gradient, `count` steps along each (x_step elements apart in xbuf), into dw.
template <typename S, int CT, int CBV>
void WeightGradTaps(const WeightGradShape& s, const typename S::T* xbuf, const typename S::T* gbuf, int64_t y0,
                    int64_t rows, int64_t x_row, int64_t g_row, int64_t count, int64_t x_step, float* dw) {
  using TileFn = void (*)(const typename S::T*, const typename S::T*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float*);
  static const TileFn tails[13] = {nullptr,
                                   WeightGradTile<S, 1, CBV>, WeightGradTile<S, 2, CBV>, WeightGradTile<S, 3, CBV>,
                                   WeightGradTile<S, 4, CBV>, WeightGradTile<S, 5, CBV>, WeightGradTile<S, 6, CBV>,
                                   WeightGradTile<S, 7, CBV>, WeightGradTile<S, 8, CBV>, WeightGradTile<S, 9, CBV>,
                                   WeightGradTile<S, 10, CBV>, WeightGradTile<S, 11, CBV>, WeightGradTile<S, 12, CBV>};
  // Without dilation a window row's taps read consecutive columns of c features each, and their gradients follow
  // one another in dw too: one run of kw * c features, tiled without a partial tile per tap.
  const int64_t taps = s.dw == 1 ? 1 : s.kw, features = (s.dw == 1 ? s.kw : 1) * s.c;
  for (int64_t i = 0; i < s.kh; ++i) {
    // The chunk's rows [r0, r1) whose window row i reads the input, not its padding of zeros (a same-padded 8x8
    // convolution's first and last rows skip a window row each).
    const int64_t base = y0 * s.sh + i * s.dh - s.pt;   // the input row output row r reads: base + r * sh
    const int64_t r0 = base >= 0 ? 0 : (-base + s.sh - 1) / s.sh;
    const int64_t r1 = base > s.h - 1 ? 0 : std::min(rows, (s.h - 1 - base) / s.sh + 1);
    if (r0 >= r1) continue;
    const typename S::T* gq = gbuf + r0 * g_row;
    for (int64_t j = 0; j < taps; ++j) {
      const typename S::T* xk = xbuf + (i * s.dh + r0 * s.sh) * x_row + j * s.dw * s.c * S::K;
      float* dwk = dw + (i * s.kw + j) * s.c * s.op;
      for (int64_t o = 0; o < s.op; o += CBV * 16) {
        int64_t c = 0;
        for (; c + CT <= features; c += CT)
          WeightGradTile<S, CT, CBV>(xk + c * S::K, gq + o * S::K, r1 - r0, s.sh * x_row, g_row, count, x_step, s.op,
                                     dwk + c * s.op + o);
        for (; c < features;) {
          int64_t ct = std::min<int64_t>(12, features - c);
          tails[ct](xk + c * S::K, gq + o * S::K, r1 - r0, s.sh * x_row, g_row, count, x_step, s.op,
                    dwk + c * s.op + o);
          c += ct;
        }
      }
    }
  }
}

// Adds the output rows [y0, y1) of image b to dw: interleaves their (padded) input rows and gradient rows into
// pairs of output columns, then runs the tiles over every tap.
template <int CT, int CBV>
void WeightGradChunk(const WeightGradShape& s, const uint16_t* x, const uint16_t* g, int64_t b, int64_t y0,
                     int64_t y1, AlignedBuffer<uint16_t>& xbuf, AlignedBuffer<uint16_t>& gbuf,
                     AlignedBuffer<uint16_t>& row, float* dw) {
  const int64_t pairs = (s.ow + 1) / 2, rows = y1 - y0;
  const int64_t in_rows = (rows - 1) * s.sh + (s.kh - 1) * s.dh + 1;
  const int64_t x_row = s.cols * s.c * 2, g_row = pairs * s.op * 2;
  xbuf.resize(in_rows * x_row);
  gbuf.resize(rows * g_row);
  row.resize((s.cols + s.sw) * s.c);   // the pair of the last column read reaches sw columns further
  for (int64_t r = 0; r < in_rows; ++r) {  // xq[w][c] = (x[w][c], x[w + sw][c])
    PaddedRow<Bf16DotSums>(x + b * s.h * s.w * s.c, s.h, s.w, s.c, s.pt, s.pl, y0 * s.sh + r, s.cols + s.sw, s.c,
                           row.data());
    for (int64_t col = 0; col < s.cols; ++col)
      Interleave(row.data() + col * s.c, row.data() + (col + s.sw) * s.c, s.c, xbuf.data() + r * x_row + col * s.c * 2);
  }
  for (int64_t r = 0; r < rows; ++r) {  // gq[j][o] = (g[2j][o], g[2j + 1][o]); features past co are zero
    const uint16_t* src = g + (b * s.oh + y0 + r) * s.ow * s.co;
    for (int64_t j = 0; j < pairs; ++j) {
      uint16_t* dst = gbuf.data() + r * g_row + j * s.op * 2;
      Interleave(src + 2 * j * s.co, 2 * j + 1 < s.ow ? src + (2 * j + 1) * s.co : nullptr, s.co, dst);
      std::memset(dst + 2 * s.co, 0, (s.op - s.co) * 2 * sizeof(uint16_t));
    }
  }
  // (the next pair of output columns is 2 * sw columns further in xbuf)
  WeightGradTaps<Bf16DotSums, CT, CBV>(s, xbuf.data(), gbuf.data(), y0, rows, x_row, g_row, pairs, 2 * s.sw * s.c * 2,
                                       dw);
}

// WeightGradChunk on float32 FMAs: the chunk's padded input rows and gradient rows widened to float32.
template <int CT, int CBV>
void WeightGradChunkF32(const WeightGradShape& s, const uint16_t* x, const uint16_t* g, int64_t b, int64_t y0,
                        int64_t y1, AlignedBuffer<float>& xbuf, AlignedBuffer<float>& gbuf, float* dw) {
  const int64_t rows = y1 - y0, in_rows = (rows - 1) * s.sh + (s.kh - 1) * s.dh + 1;
  const int64_t x_row = s.cols * s.c, g_row = s.ow * s.op;
  xbuf.resize(in_rows * x_row);
  gbuf.resize(rows * g_row);
  for (int64_t r = 0; r < in_rows; ++r)
    PaddedRow<FmaSums>(x + b * s.h * s.w * s.c, s.h, s.w, s.c, s.pt, s.pl, y0 * s.sh + r, s.cols, s.c,
                       xbuf.data() + r * x_row);
  for (int64_t r = 0; r < rows; ++r) {   // features past co are zero
    const uint16_t* src = g + (b * s.oh + y0 + r) * s.ow * s.co;
    float* dst = gbuf.data() + r * g_row;
    if (s.op == s.co) {
      Bf16ToF32(src, s.ow * s.co, dst);
    } else {
      for (int64_t j = 0; j < s.ow; ++j) {
        Bf16ToF32(src + j * s.co, s.co, dst + j * s.op);
        std::memset(dst + j * s.op + s.co, 0, (s.op - s.co) * sizeof(float));
      }
    }
  }
  WeightGradTaps<FmaSums, CT, CBV>(s, xbuf.data(), gbuf.data(), y0, rows, x_row, g_row, s.ow, s.sw * s.c, dw);
}

// in: [N, H, W, C] bf16, read as if padded by pt rows and pl columns of zeros before it (and zeros after it);
// g: [N, OH, OW, O] bf16; dw: [KH, KW, C, O] f32.
ffi::Error WeightGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> in, ffi::Buffer<ffi::BF16> grad,
                          ffi::ResultBuffer<ffi::F32> dw, int64_t sh, int64_t sw, int64_t dh, int64_t dwd,
                          int64_t pt, int64_t pl, int64_t fma) {
  auto xd = in.dimensions(), gd = grad.dimensions(), dd = dw->dimensions();
  if (xd.size() != 4 || gd.size() != 4 || dd.size() != 4)
    return ffi::Error::InvalidArgument("MxuConvWeightGrad: operands of rank 4 expected");
  const int64_t co = gd[3], op = (co + 15) / 16 * 16;
  const WeightGradShape s{xd[0], xd[1], xd[2], xd[3], gd[1], gd[2], co, op, dd[0], dd[1], sh, sw, dh, dwd, pt, pl,
                          (gd[2] - 1) * sw + (dd[1] - 1) * dwd + 1};
  if (dd[2] != s.c || dd[3] != co || gd[0] != s.n || sh < 1 || sw < 1 || dh < 1 || dwd < 1)
    return ffi::Error::InvalidArgument("MxuConvWeightGrad: shapes do not match");
  const uint16_t* x = reinterpret_cast<const uint16_t*>(in.untyped_data());
  const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.untyped_data());
  const int64_t size = s.kh * s.kw * s.c * co, padded_size = s.kh * s.kw * s.c * op;
  float* out = dw->typed_data();
  if (s.n == 0 || s.oh == 0 || s.ow == 0 || size == 0) {
    std::memset(out, 0, size * sizeof(float));
    return ffi::Error::Success();
  }
  // Chunks of a few output rows of one image (about 32 KiB of interleaved gradient), so that a chunk's pairs stay
  // in the core's cache while every tap reads them; each worker sums into its own copy of dw.
  const int64_t pairs = (s.ow + 1) / 2;
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(s.oh, (fma ? 8192 : 16384) / std::max<int64_t>(1, pairs * op)));
  const int64_t per_image = (s.oh + rows - 1) / rows, items = s.n * per_image;
  const int64_t workers = std::min(PoolThreads(pool), items);
  AlignedBuffer<float> partial(workers * padded_size, 0.0f);
  ParallelFor(pool, items, workers, [&](int64_t item, int64_t worker) {
    thread_local AlignedBuffer<uint16_t> xbuf, gbuf, row;
    thread_local AlignedBuffer<float> xbuf32, gbuf32;
    const int64_t b = item / per_image, y0 = (item % per_image) * rows, y1 = std::min(s.oh, y0 + rows);
    float* acc = partial.data() + worker * padded_size;
    if (fma) {
      if (op % 64 == 0) WeightGradChunkF32<6, 4>(s, x, g, b, y0, y1, xbuf32, gbuf32, acc);
      else if (op % 32 == 0) WeightGradChunkF32<12, 2>(s, x, g, b, y0, y1, xbuf32, gbuf32, acc);
      else WeightGradChunkF32<12, 1>(s, x, g, b, y0, y1, xbuf32, gbuf32, acc);
    } else if (op % 64 == 0) WeightGradChunk<6, 4>(s, x, g, b, y0, y1, xbuf, gbuf, row, acc);
    else if (op % 32 == 0) WeightGradChunk<12, 2>(s, x, g, b, y0, y1, xbuf, gbuf, row, acc);
    else WeightGradChunk<12, 1>(s, x, g, b, y0, y1, xbuf, gbuf, row, acc);
  });
  for (int64_t t = 0; t < s.kh * s.kw * s.c; ++t)
    for (int64_t o = 0; o < co; ++o) {
      float sum = partial[t * op + o];
      for (int64_t p = 1; p < workers; ++p) sum += partial[p * padded_size + t * op + o];
      out[t * co + o] = sum;
    }
  return ffi::Error::Success();
}

#endif  // KERAS_TPU_PART != 1

}  // namespace

#if KERAS_TPU_PART != 2

// How many times faster this core sums products with VDPBF16PS than with float32 FMAs (16 lanes each; a bf16 dot
// adds two products per lane, an FMA one): the kernels' `fma` attribute is set where this is below 1. Each
// instruction runs on 24 independent accumulators, so the figures are throughputs; the best of a few interleaved
// rounds of ~1 ms each.
extern "C" double MxuBf16DotSpeedup() {
  __m512 acc[24], f[24];
  for (int k = 0; k < 24; ++k) acc[k] = f[k] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1.0f);
  double best_dot = 1e30, best_fma = 1e30;
  const int64_t loops = 40000;
  for (int round = 0; round < 5; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < loops; ++i) {
#pragma GCC unroll 24
      for (int k = 0; k < 24; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], a, a);
      asm volatile("" : "+v"(a));
    }
    auto t1 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < loops; ++i) {
#pragma GCC unroll 24
      for (int k = 0; k < 24; ++k) f[k] = _mm512_fmadd_ps(x, y, f[k]);
      asm volatile("" : "+v"(x));
    }
    auto t2 = std::chrono::steady_clock::now();
    best_dot = std::min(best_dot, std::chrono::duration<double>(t1 - t0).count());
    best_fma = std::min(best_fma, std::chrono::duration<double>(t2 - t1).count());
  }
  float sink = 0;
  for (int k = 0; k < 24; ++k) sink += _mm512_reduce_add_ps(acc[k]) + _mm512_reduce_add_ps(f[k]);
  volatile float keep = sink;
  (void)keep;
  return 2.0 * best_fma / best_dot;   // products per second, bf16 dot over FMA
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MxuConvForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("dh")
                                  .Attr<int64_t>("dw")
                                  .Attr<int64_t>("pt")
                                  .Attr<int64_t>("pl")
                                  .Attr<int64_t>("io_swapped")
                                  .Attr<int64_t>("flipped")
                                  .Attr<int64_t>("fma"));

#endif  // KERAS_TPU_PART != 2
#if KERAS_TPU_PART != 1

XLA_FFI_DEFINE_HANDLER_SYMBOL(MxuConvWeightGrad, WeightGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("dh")
                                  .Attr<int64_t>("dw")
                                  .Attr<int64_t>("pt")
                                  .Attr<int64_t>("pl")
                                  .Attr<int64_t>("fma"));

#endif  // KERAS_TPU_PART != 1
