// The MXU's convolutions on the host CPU's bfloat16 dot instructions (AVX-512 BF16).
//
// An MXU multiplies bfloat16 operands exactly and sums the products in float32. VDPBF16PS computes exactly
// that for 16 float32 lanes: each lane adds two exact bf16 products to its float32 sum. XLA:CPU has no
// convolution on it (its bf16 convolutions are converted to float32), so these kernels compute the
// convolutions directly, without im2col patches:
//
// * MxuConvForward: out[n, y, x, o] = sum_{i, j, c} in[n, y*sh + i*dh, x*sw + j*dw, c] w[i, j, c, o] over an
//   input already padded (a "valid" convolution). The input gradient of a stride-1 convolution is one too.
// * MxuConvWeightGrad: dw[i, j, c, o] = sum_{n, y, x} in[n, y*sh + i*dh, x*sw + j*dw, c] g[n, y, x, o].
//
// The instruction sums products in pairs along the contraction, so its operands are interleaved in pairs:
// the forward kernel's weights as [KH][KW][C/2][O][2] (prepared by the caller, small), the weight gradient's
// input and output gradient along output columns (x, x+1), built here chunk by chunk so they stay in cache.
// Only the order of the float32 additions differs from any other summation order of the MXU's products;
// like the MXU, the instruction flushes denormal bf16 inputs and results to zero.
//
// Work is split over XLA's intra-op thread pool (the caller's thread takes part).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
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

inline __m512bh BroadcastPair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// ------------------------------------------------------------------------------------------------ forward

// PB output columns times CBV*16 output features, summed over the window and the input features.
template <int PB, int CBV>
void ForwardTile(const uint16_t* in, int64_t in_row, int64_t in_col_step, int64_t in_pixel,
                 const uint16_t* w, int64_t kh, int64_t kw, int64_t cpairs, int64_t co, float* out) {
  __m512 acc[PB][CBV];
  for (int p = 0; p < PB; ++p)
    for (int v = 0; v < CBV; ++v) acc[p][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kh; ++i) {
    for (int64_t j = 0; j < kw; ++j) {
      const uint16_t* x = in + i * in_row + j * in_pixel;
      const uint16_t* wt = w + (i * kw + j) * cpairs * co * 2;
      for (int64_t cp = 0; cp < cpairs; ++cp) {
        __m512bh wv[CBV];
        for (int v = 0; v < CBV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wt + cp * co * 2 + v * 32);
        for (int p = 0; p < PB; ++p) {
          __m512bh xv = BroadcastPair(x + p * in_col_step + cp * 2);
          for (int v = 0; v < CBV; ++v) acc[p][v] = _mm512_dpbf16_ps(acc[p][v], xv, wv[v]);
        }
      }
    }
  }
  for (int p = 0; p < PB; ++p)
    for (int v = 0; v < CBV; ++v) _mm512_storeu_ps(out + p * co + v * 16, acc[p][v]);
}

using ForwardTileFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                               int64_t, int64_t, float*);

// One output row: PB columns at a time (fewer at the row's end), CBV*16 features at a time.
// (dh, dw: the window's dilation, in input rows and columns.)
template <int CBV, int PB>
void ForwardRow(const uint16_t* in, int64_t in_row, int64_t sw, int64_t cp, int64_t dh, int64_t dw,
                const uint16_t* w, int64_t kh, int64_t kw, int64_t co, float* out, int64_t ow) {
  static const ForwardTileFn tails[8] = {nullptr,
                                         ForwardTile<1, CBV>, ForwardTile<2, CBV>, ForwardTile<3, CBV>,
                                         ForwardTile<4, CBV>, ForwardTile<5, CBV>, ForwardTile<6, CBV>,
                                         ForwardTile<7, CBV>};
  const int64_t step = sw * cp;
  for (int64_t o = 0; o < co; o += CBV * 16) {
    int64_t x = 0;
    for (; x + PB <= ow; x += PB)
      ForwardTile<PB, CBV>(in + x * step, in_row * dh, step, cp * dw, w + o * 2, kh, kw, cp / 2, co,
                           out + x * co + o);
    while (x < ow) {
      int64_t pb = std::min<int64_t>(7, ow - x);
      tails[pb](in + x * step, in_row * dh, step, cp * dw, w + o * 2, kh, kw, cp / 2, co, out + x * co + o);
      x += pb;
    }
  }
}

// in: [N, Hp, Wp, C] bf16 (C even), w: [KH, KW, C/2, O, 2] bf16 (O % 16 == 0), out: [N, OH, OW, O] f32.
ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> in, ffi::Buffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> out, int64_t sh, int64_t sw, int64_t dh, int64_t dw) {
  auto xd = in.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 4 || wd.size() != 5 || od.size() != 4)
    return ffi::Error::InvalidArgument("MxuConvForward: operands of rank 4, 5 and 4 expected");
  const int64_t n = xd[0], hp = xd[1], wp = xd[2], c = xd[3];
  const int64_t kh = wd[0], kw = wd[1], co = wd[3], oh = od[1], ow = od[2];
  if (c != 2 * wd[2] || wd[4] != 2 || co % 16 != 0 || od[0] != n || od[3] != co || sh < 1 || sw < 1 || dh < 1 ||
      dw < 1 || (oh - 1) * sh + (kh - 1) * dh + 1 > hp || (ow - 1) * sw + (kw - 1) * dw + 1 > wp)
    return ffi::Error::InvalidArgument("MxuConvForward: shapes do not match");
  const uint16_t* x = reinterpret_cast<const uint16_t*>(in.untyped_data());
  const uint16_t* wt = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* y = out->typed_data();
  const int64_t in_row = wp * c;
  ParallelFor(pool, n * oh, PoolThreads(pool), [&](int64_t r, int64_t) {
    const int64_t b = r / oh, row = r % oh;
    const uint16_t* xr = x + (b * hp + row * sh) * in_row;
    float* yr = y + r * ow * co;
    if (co % 64 == 0) ForwardRow<4, 6>(xr, in_row, sw, c, dh, dw, wt, kh, kw, co, yr, ow);
    else if (co % 32 == 0) ForwardRow<2, 12>(xr, in_row, sw, c, dh, dw, wt, kh, kw, co, yr, ow);
    else ForwardRow<1, 24>(xr, in_row, sw, c, dh, dw, wt, kh, kw, co, yr, ow);
  });
  return ffi::Error::Success();
}

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

// CT input features times CBV*16 output features of one tap, summed over a chunk's rows and column pairs.
template <int CT, int CBV>
void WeightGradTile(const uint16_t* xq, const uint16_t* gq, int64_t rows, int64_t x_row, int64_t g_row,
                    int64_t pairs, int64_t x_pair, int64_t co, float* dw) {
  __m512 acc[CT][CBV];
  for (int c = 0; c < CT; ++c)
    for (int v = 0; v < CBV; ++v) acc[c][v] = _mm512_loadu_ps(dw + c * co + v * 16);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = xq + r * x_row;
    const uint16_t* gr = gq + r * g_row;
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh gv[CBV];
      for (int v = 0; v < CBV; ++v) gv[v] = (__m512bh)_mm512_loadu_si512(gr + j * co * 2 + v * 32);
      const uint16_t* xj = xr + j * x_pair;
      for (int c = 0; c < CT; ++c) {
        __m512bh xv = BroadcastPair(xj + c * 2);
        for (int v = 0; v < CBV; ++v) acc[c][v] = _mm512_dpbf16_ps(acc[c][v], xv, gv[v]);
      }
    }
  }
  for (int c = 0; c < CT; ++c)
    for (int v = 0; v < CBV; ++v) _mm512_storeu_ps(dw + c * co + v * 16, acc[c][v]);
}

using WeightGradTileFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, float*);

struct WeightGradShape {
  int64_t n, hp, wp, c, oh, ow, co, kh, kw, sh, sw, dh, dw;
};

// Adds the output rows [y0, y1) of image b to dw: interleaves their input rows and gradient rows into pairs of
// output columns, then runs the tiles over every tap.
template <int CT, int CBV>
void WeightGradChunk(const WeightGradShape& s, const uint16_t* x, const uint16_t* g, int64_t b, int64_t y0,
                     int64_t y1, std::vector<uint16_t>& xbuf, std::vector<uint16_t>& gbuf, float* dw) {
  static const WeightGradTileFn tails[13] = {nullptr,
                                              WeightGradTile<1, CBV>, WeightGradTile<2, CBV>, WeightGradTile<3, CBV>,
                                              WeightGradTile<4, CBV>, WeightGradTile<5, CBV>, WeightGradTile<6, CBV>,
                                              WeightGradTile<7, CBV>, WeightGradTile<8, CBV>, WeightGradTile<9, CBV>,
                                              WeightGradTile<10, CBV>, WeightGradTile<11, CBV>,
                                              WeightGradTile<12, CBV>};
  const int64_t pairs = (s.ow + 1) / 2, rows = y1 - y0;
  const int64_t in_rows = (rows - 1) * s.sh + (s.kh - 1) * s.dh + 1;
  const int64_t x_row = s.wp * s.c * 2, g_row = pairs * s.co * 2;
  xbuf.resize(in_rows * x_row);
  gbuf.resize(rows * g_row);
  for (int64_t r = 0; r < in_rows; ++r) {  // xq[w][c] = (x[w][c], x[w + sw][c])
    const uint16_t* src = x + (b * s.hp + y0 * s.sh + r) * s.wp * s.c;
    for (int64_t col = 0; col < s.wp; ++col)
      Interleave(src + col * s.c, col + s.sw < s.wp ? src + (col + s.sw) * s.c : nullptr, s.c,
                 xbuf.data() + r * x_row + col * s.c * 2);
  }
  for (int64_t r = 0; r < rows; ++r) {  // gq[j][o] = (g[2j][o], g[2j + 1][o])
    const uint16_t* src = g + (b * s.oh + y0 + r) * s.ow * s.co;
    for (int64_t j = 0; j < pairs; ++j)
      Interleave(src + 2 * j * s.co, 2 * j + 1 < s.ow ? src + (2 * j + 1) * s.co : nullptr, s.co,
                 gbuf.data() + r * g_row + j * s.co * 2);
  }
  const int64_t x_pair = 2 * s.sw * s.c * 2;  // the next pair of output columns, in xq's elements
  for (int64_t i = 0; i < s.kh; ++i) {
    for (int64_t j = 0; j < s.kw; ++j) {
      const uint16_t* xk = xbuf.data() + i * s.dh * x_row + j * s.dw * s.c * 2;
      float* dwk = dw + (i * s.kw + j) * s.c * s.co;
      for (int64_t o = 0; o < s.co; o += CBV * 16) {
        int64_t c = 0;
        for (; c + CT <= s.c; c += CT)
          WeightGradTile<CT, CBV>(xk + c * 2, gbuf.data() + o * 2, rows, s.sh * x_row, g_row, pairs, x_pair, s.co,
                                  dwk + c * s.co + o);
        for (; c < s.c;) {
          int64_t ct = std::min<int64_t>(12, s.c - c);
          tails[ct](xk + c * 2, gbuf.data() + o * 2, rows, s.sh * x_row, g_row, pairs, x_pair, s.co,
                    dwk + c * s.co + o);
          c += ct;
        }
      }
    }
  }
}

// in: [N, Hp, Wp, C] bf16, g: [N, OH, OW, O] bf16 (O % 16 == 0), dw: [KH, KW, C, O] f32.
ffi::Error WeightGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> in, ffi::Buffer<ffi::BF16> grad,
                          ffi::ResultBuffer<ffi::F32> dw, int64_t sh, int64_t sw, int64_t dh, int64_t dwd) {
  auto xd = in.dimensions(), gd = grad.dimensions(), dd = dw->dimensions();
  if (xd.size() != 4 || gd.size() != 4 || dd.size() != 4)
    return ffi::Error::InvalidArgument("MxuConvWeightGrad: operands of rank 4 expected");
  const WeightGradShape s{xd[0], xd[1], xd[2], xd[3], gd[1], gd[2], gd[3], dd[0], dd[1], sh, sw, dh, dwd};
  if (dd[2] != s.c || dd[3] != s.co || s.co % 16 != 0 || gd[0] != s.n || sh < 1 || sw < 1 || dh < 1 || dwd < 1 ||
      (s.oh - 1) * sh + (s.kh - 1) * dh + 1 > s.hp || (s.ow - 1) * sw + (s.kw - 1) * dwd + 1 > s.wp)
    return ffi::Error::InvalidArgument("MxuConvWeightGrad: shapes do not match");
  const uint16_t* x = reinterpret_cast<const uint16_t*>(in.untyped_data());
  const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.untyped_data());
  const int64_t size = s.kh * s.kw * s.c * s.co;
  float* out = dw->typed_data();
  if (s.n == 0 || s.oh == 0 || s.ow == 0) {
    std::memset(out, 0, size * sizeof(float));
    return ffi::Error::Success();
  }
  // Chunks of a few output rows of one image (about 32 KiB of interleaved gradient), so that a chunk's pairs stay
  // in the core's cache while every tap reads them; each worker sums into its own copy of dw.
  const int64_t pairs = (s.ow + 1) / 2;
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(s.oh, 16384 / std::max<int64_t>(1, pairs * s.co)));
  const int64_t per_image = (s.oh + rows - 1) / rows, items = s.n * per_image;
  const int64_t workers = std::min(PoolThreads(pool), items);
  std::vector<float> partial(workers * size, 0.0f);
  ParallelFor(pool, items, workers, [&](int64_t item, int64_t worker) {
    thread_local std::vector<uint16_t> xbuf, gbuf;
    const int64_t b = item / per_image, y0 = (item % per_image) * rows, y1 = std::min(s.oh, y0 + rows);
    float* acc = partial.data() + worker * size;
    if (s.co % 64 == 0) WeightGradChunk<6, 4>(s, x, g, b, y0, y1, xbuf, gbuf, acc);
    else if (s.co % 32 == 0) WeightGradChunk<12, 2>(s, x, g, b, y0, y1, xbuf, gbuf, acc);
    else WeightGradChunk<12, 1>(s, x, g, b, y0, y1, xbuf, gbuf, acc);
  });
  std::memcpy(out, partial.data(), size * sizeof(float));
  for (int64_t p = 1; p < workers; ++p)
    for (int64_t i = 0; i < size; ++i) out[i] += partial[p * size + i];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MxuConvForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("dh")
                                  .Attr<int64_t>("dw"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MxuConvWeightGrad, WeightGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("dh")
                                  .Attr<int64_t>("dw"));
