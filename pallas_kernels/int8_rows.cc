// An out-major int8 weight's product with a few fp32 activation rows, for XLA:CPU through the FFI:
//   y[t, o] = scale[o] * sum_i w[o, i] * x[t, i]     w int8 [out, in], scale fp32 [out], x fp32 [rows, in]
// Each activation row is quantized to int16 in chunks of kChunk inputs (a chunk's largest magnitude at 32767, its
// step kept), each weight widened to int16, and pairs of products summed into int32 (`madd`, AVX2 or AVX-512BW);
// each chunk's int32 sums move into fp32 accumulators times its step, so none can overflow
// (kChunk * 127 * 32767 < 2^31). A tile of 4 output rows against
// up to 4 activation rows widens each weight vector once. Output rows are split in blocks over XLA's intra-op
// threads. The pure-jnp reference is `int8_rows.py`'s `int8_rows_reference`.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 256;  // output rows per task
constexpr int64_t kChunk = 256;  // inputs summed in int32 before fp32
constexpr int64_t kAhead = 4096;  // bytes of a weight row prefetched ahead of its product
#if defined(__AVX512BW__)
constexpr int kLanes = 32;  // int16 lanes of one vector
using Ints = __m512i;
using Floats = __m512;
inline Ints WidenWeights(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Ints LoadActs(const int16_t* p) { return _mm512_loadu_si512(p); }
inline Ints MulAdd(Ints w, Ints x, Ints acc) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
inline Ints ZeroInts() { return _mm512_setzero_si512(); }
inline Floats ZeroFloats() { return _mm512_setzero_ps(); }
inline Floats AddInts(Floats f, Ints i, float step) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(step), f);
}
inline float Sum(Floats v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 16;
using Ints = __m256i;
using Floats = __m256;
inline Ints WidenWeights(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Ints LoadActs(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Ints MulAdd(Ints w, Ints x, Ints acc) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
inline Ints ZeroInts() { return _mm256_setzero_si256(); }
inline Floats ZeroFloats() { return _mm256_setzero_ps(); }
inline Floats AddInts(Floats f, Ints i, float step) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(step), f);
}
inline float Sum(Floats v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr int kLanes = 1;
using Ints = int32_t;
using Floats = float;
inline Ints WidenWeights(const int8_t* p) { return *p; }
inline Ints LoadActs(const int16_t* p) { return *p; }
inline Ints MulAdd(Ints w, Ints x, Ints acc) { return acc + w * x; }
inline Ints ZeroInts() { return 0; }
inline Floats ZeroFloats() { return 0.0f; }
inline Floats AddInts(Floats f, Ints i, float step) { return f + static_cast<float>(i) * step; }
inline float Sum(Floats v) { return v; }
#endif

inline int64_t Chunks(int64_t in) { return (in + kChunk - 1) / kChunk; }

// Output rows [o, o + R) against activation rows [t, t + T): R * T accumulators, each weight vector widened once.
template <int R, int T>
void Tile(const int8_t* w, const int16_t* x, const float* x_step, const float* scale, float* y, int64_t in,
          int64_t out, int64_t o, int64_t t) {
  Floats acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < T; ++u) acc[r][u] = ZeroFloats();
  const int64_t whole = in - in % kLanes, chunks = Chunks(in);
  for (int64_t c = 0; c < whole; c += kChunk) {
    Ints part[R][T];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < T; ++u) part[r][u] = ZeroInts();
    const int64_t stop = std::min(whole, c + kChunk);
    for (int64_t i = c; i < stop; i += kLanes) {
      Ints wide[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* p = w + (o + r) * in + i;
        __builtin_prefetch(p + kAhead);
        wide[r] = WidenWeights(p);
      }
      for (int u = 0; u < T; ++u) {
        const Ints xv = LoadActs(x + (t + u) * in + i);
        for (int r = 0; r < R; ++r) part[r][u] = MulAdd(wide[r], xv, part[r][u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < T; ++u)
        acc[r][u] = AddInts(acc[r][u], part[r][u], x_step[(t + u) * chunks + c / kChunk]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < T; ++u) {
      float s = Sum(acc[r][u]);
      for (int64_t i = whole; i < in; ++i)
        s += static_cast<float>(w[(o + r) * in + i] * x[(t + u) * in + i]) * x_step[(t + u) * chunks + i / kChunk];
      y[(t + u) * out + o + r] = s * scale[o + r];
    }
  }
}

template <int R>
void Rows(const int8_t* w, const int16_t* x, const float* x_step, const float* scale, float* y, int64_t in,
          int64_t out, int64_t rows, int64_t o) {
  int64_t t = 0;
  for (; t + 4 <= rows; t += 4) Tile<R, 4>(w, x, x_step, scale, y, in, out, o, t);
  switch (rows - t) {
    case 3: Tile<R, 3>(w, x, x_step, scale, y, in, out, o, t); break;
    case 2: Tile<R, 2>(w, x, x_step, scale, y, in, out, o, t); break;
    case 1: Tile<R, 1>(w, x, x_step, scale, y, in, out, o, t); break;
    default: break;
  }
}

void Block(const int8_t* w, const int16_t* x, const float* x_step, const float* scale, float* y, int64_t in,
           int64_t out, int64_t rows, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) Rows<4>(w, x, x_step, scale, y, in, out, rows, o);
  for (; o < end; ++o) Rows<1>(w, x, x_step, scale, y, in, out, rows, o);
}

// One product's state, shared with the pool's tasks (which may start after it is done: they then find no block).
struct Work {
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t in, out, rows, blocks;
  std::vector<int16_t> x;  // [rows, in]
  std::vector<float> x_step;  // [rows, Chunks(in)]: x ~ x_int16 * its chunk's step
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
      Block(w, x.data(), x_step.data(), scale, y, in, out, rows, b * kBlock, std::min(out, (b + 1) * kBlock));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2 || xd[1] != wd[1] || static_cast<int64_t>(scale.element_count()) != wd[0])
    return ffi::Error::InvalidArgument("int8 rows product: expected w [out, in], x [rows, in], scale [out]");
  auto work = std::make_shared<Work>();
  work->w = w.typed_data();
  work->scale = scale.typed_data();
  work->y = y->typed_data();
  work->out = wd[0];
  work->in = wd[1];
  work->rows = xd[0];
  work->blocks = (wd[0] + kBlock - 1) / kBlock;
  work->x.resize(xd[0] * xd[1]);
  const int64_t chunks = Chunks(xd[1]);
  work->x_step.resize(xd[0] * chunks);
  const float* acts = x.typed_data();
  for (int64_t t = 0; t < xd[0]; ++t) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = t * xd[1] + c * kChunk, end = t * xd[1] + std::min(xd[1], (c + 1) * kChunk);
      float top = 0.0f;
      bool finite = true;
      for (int64_t i = begin; i < end; ++i) {
        top = std::max(top, std::abs(acts[i]));
        finite = finite && std::isfinite(acts[i]);
      }
      // a NaN or infinite activation makes its chunk's step NaN, so its products are NaN, as the reference's are
      const float step = !finite ? std::nanf("") : top > 0.0f ? top / 32767.0f : 1.0f;
      work->x_step[t * chunks + c] = step;
      for (int64_t i = begin; i < end; ++i)
        work->x[i] = finite ? static_cast<int16_t>(std::lrint(acts[i] / step)) : 0;
    }
  }
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->blocks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Run(); });
  work->Run();  // blocks a task has taken finish on its thread; wait for them
  while (work->done.load(std::memory_order_acquire) < work->blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8RowsProduct, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
