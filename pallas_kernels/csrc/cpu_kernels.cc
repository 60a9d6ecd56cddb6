// jaxserve's native CPU kernels, called from XLA:CPU through the typed FFI (jax.ffi).
//
// Built on first use by pallas_kernels/cpu_native.py (g++ -O3 -march=native, cached per source,
// compiler and CPU); every kernel has a pure-jnp twin that is its reference in the tests and the
// fallback where no compiler is found. Accelerators never load this file: TPU and GPU run the
// Pallas kernels.
//
//   jaxserve_gdn_recurrent: the gated delta rule token by token for selected rows, states
//   updated in place in their slots (the decode rows of pallas_kernels/gdn.py's "native" path).
//   jaxserve_ragged_attention: ragged paged attention, decode tokens and prefill chunks in one call
//   (impl "native" of pallas_kernels/ragged_paged_attention.py). XLA:CPU runs the jnp form as
//   ~10 GFLOP/s batched 3x64 dots, gathers and selects (~0.9 ms a layer for 16 decode rows of
//   ~200 tokens) and a while loop per prefill sequence; here each (token tile, KV head) reads
//   its pages in place.
//   jaxserve_bf16_matmul: x @ a bf16 weight packed once at load (the CPU plan's "packed" layout).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define JAXSERVE_AVX512BF16 1
#else
#define JAXSERVE_AVX512BF16 0
#endif

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------
// ParallelFor on XLA:CPU's own intra-op pool (the FFI `ThreadPool` context): fn(i) for i < n,
// shared out by an atomic counter among the calling thread and up to (threads - 1) pool tasks.
// No thread of our own: XLA's pool is already there, and a second pool would fight it for the
// same cores. The caller never waits for a task that has not started (a sleeping or busy pool
// thread): it waits only while some task is inside `fn`. The counters live on the heap, shared
// with the tasks, so a task that starts after the call returned finds no work and touches no
// dead frame.
struct ForState {
  explicit ForState(int64_t n) : n(n) {}
  const int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> working{0};
};

template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn&& fn) {
  const int64_t tasks = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (tasks <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<ForState>(n);
  const std::remove_reference_t<Fn>* body = &fn;
  for (int64_t t = 0; t < tasks; ++t) {
    pool.Schedule([state, body] {
      state->working.fetch_add(1);  // before claiming: the caller's wait below sees it
      for (int64_t i = state->next.fetch_add(1); i < state->n; i = state->next.fetch_add(1)) (*body)(i);
      state->working.fetch_sub(1);
    });
  }
  for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) fn(i);
  while (state->working.load() > 0) std::this_thread::yield();
}

// ---------------------------------------------------------------------------------------------
// Page element formats (the `kv_format` attribute).
enum KvFormat : int32_t { kF32 = 0, kBf16 = 1, kLut8 = 2 };

inline float Bf16ToF32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// n elements of a page block -> float32, times `scale`.
inline void LoadRow(const void* src, int64_t offset, int64_t n, int32_t format, const float* lut, float scale,
                    float* dst) {
  switch (format) {
    case kF32: {
      const float* s = static_cast<const float*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i] * scale;
      break;
    }
    case kBf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]) * scale;
      break;
    }
    default: {
      const uint8_t* s = static_cast<const uint8_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = lut[s[i]] * scale;
      break;
    }
  }
}

constexpr float kMaskValue = -0.7f * 3.4028234663852886e38f;

// exp(x) that the compiler vectorizes (std::exp stays a scalar libm call without -ffast-math):
// Cephes' expf, 2^n p(r) with |r| <= ln2 / 2, relative error < 2e-7; x clamped to [-87.3, 88.4]
// (exp(-87.3) ~ 1e-38, which a softmax reads as 0).
inline float VecExp(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365478515625f, x));
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

struct DecodeArgs {
  const float* q;            // [T, Hq, D]
  const void* k;             // [P, Hkv, ps, D]
  const void* v;
  const float* k_scale;      // [P, Hkv] when scaled
  const float* v_scale;
  const float* lut;          // [256] when kv_format == kLut8
  const int32_t* tables;     // [S, MB]
  const int32_t* kv_lens;    // [S]
  float* out;                // [T, Hq, D]
  int64_t P, Hq, Hkv, ps, MB, D;
  float sm_scale, soft_cap;
  int32_t sliding_window, kv_format, scaled;
  const float* sinks;        // [Hq] when has_sinks
  int32_t has_sinks;
};

// One decode token (query row r of sequence s) and KV head h: its G query heads against the
// sequence's keys, two passes over the pages (scores, then the weighted values). kD: the head
// dim as a constant (0: a runtime dim).
template <int kD>
void DecodeItem(const DecodeArgs& a, int64_t r, int64_t s, int64_t h) {
  const int64_t D = kD ? kD : a.D;
  const int64_t G = a.Hq / a.Hkv, ps = a.ps, block = ps * D;
  float* __restrict o = a.out + (r * a.Hq + h * G) * D;
  const int64_t n = std::min<int64_t>(a.kv_lens[s], a.MB * ps);
  if (n <= 0) {
    std::fill(o, o + G * D, 0.0f);
    return;
  }
  const int64_t first = a.sliding_window > 0 ? std::max<int64_t>(0, n - a.sliding_window) : 0;
  thread_local std::vector<float> scores_buf, page_buf, q_buf;
  scores_buf.resize(G * n);
  page_buf.resize(block);
  q_buf.resize(G * D);
  float* __restrict scores = scores_buf.data();
  float* __restrict page = page_buf.data();
  float* __restrict qs = q_buf.data();
  for (int64_t i = 0; i < G * D; ++i) qs[i] = a.q[(r * a.Hq + h * G) * D + i] * a.sm_scale;
  const int32_t* row_pages = a.tables + s * a.MB;
  auto page_id = [&](int64_t t0) {
    int64_t pid = row_pages[t0 / ps];
    return (pid < 0 || pid >= a.P) ? int64_t{0} : pid;
  };
  const int64_t start = first - first % ps;
  // The pages sit anywhere in a pool of hundreds of MB: ask for the next page's keys and this
  // page's values ahead of use (12.2 -> 7.2 ms for 30 layers of separate pools, 16 rows of ~200 bf16 tokens).
  const int64_t elem = a.kv_format == kF32 ? 4 : a.kv_format == kBf16 ? 2 : 1;
  auto prefetch = [&](const void* base, int64_t pid) {
    const char* p = static_cast<const char*>(base) + (pid * a.Hkv + h) * block * elem;
    for (int64_t off = 0; off < block * elem; off += 64) __builtin_prefetch(p + off);
  };
  // All of this item's key pages up front, then its value pages while the scores run: the pages
  // are random 2 KB blocks, so the misses are latency-bound unless many are in flight.
  for (int64_t t0 = start; t0 < n; t0 += ps) prefetch(a.k, page_id(t0));
  // Pass 1: scores[g, t] = q_g . k_t
  for (int64_t t0 = start; t0 < n; t0 += ps) {
    const int64_t pid = page_id(t0);
    prefetch(a.v, pid);
    LoadRow(a.k, (pid * a.Hkv + h) * block, block, a.kv_format, a.lut,
            a.scaled ? a.k_scale[pid * a.Hkv + h] : 1.0f, page);
    const int64_t lo = std::max(first, t0), hi = std::min(n, t0 + ps);
    for (int64_t t = lo; t < hi; ++t) {
      const float* __restrict key = page + (t - t0) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = qs + g * D;
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += qg[d] * key[d];
        scores[g * n + t] = s;
      }
    }
  }
  float l[64];
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict sg = scores + g * n;
    if (a.soft_cap > 0.0f)
      for (int64_t t = first; t < n; ++t) sg[t] = a.soft_cap * std::tanh(sg[t] / a.soft_cap);
    // A sink is one more logit in the softmax whose value row is zero.
    const float sink = a.has_sinks ? a.sinks[h * G + g] : kMaskValue;
    float m = sink;
    for (int64_t t = first; t < n; ++t) m = std::max(m, sg[t]);
    float sum = a.has_sinks ? VecExp(sink - m) : 0.0f;
    for (int64_t t = first; t < n; ++t) {
      sg[t] = VecExp(sg[t] - m);
      sum += sg[t];
    }
    l[g] = sum;
  }
  // Pass 2: o_g = sum_t p[g, t] v_t / l_g
  for (int64_t g = 0; g < G * D; ++g) o[g] = 0.0f;
  for (int64_t t0 = start; t0 < n; t0 += ps) {
    const int64_t pid = page_id(t0);
    LoadRow(a.v, (pid * a.Hkv + h) * block, block, a.kv_format, a.lut,
            a.scaled ? a.v_scale[pid * a.Hkv + h] : 1.0f, page);
    const int64_t lo = std::max(first, t0), hi = std::min(n, t0 + ps);
    for (int64_t g = 0; g < G; ++g) {
      float acc[kD ? kD : 1];
      float* __restrict og = o + g * D;
      if constexpr (kD > 0) {
        for (int64_t d = 0; d < kD; ++d) acc[d] = og[d];
        for (int64_t t = lo; t < hi; ++t) {
          const float p = scores[g * n + t];
          const float* __restrict val = page + (t - t0) * kD;
          for (int64_t d = 0; d < kD; ++d) acc[d] += p * val[d];
        }
        for (int64_t d = 0; d < kD; ++d) og[d] = acc[d];
      } else {
        for (int64_t t = lo; t < hi; ++t) {
          const float p = scores[g * n + t];
          const float* __restrict val = page + (t - t0) * D;
          for (int64_t d = 0; d < D; ++d) og[d] += p * val[d];
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[g * D + d] *= inv;
  }
}

// Up to kTileQ query tokens of one sequence (tokens r0 .. r0 + nq, at positions pos0 ..) and KV
// head h, all G query heads, against the keys each may see, 16 keys at a time with an online
// softmax. The 16 keys are gathered transposed ([D, 16]) so a query's 16 scores are one vector
// of FMAs, and the values [16, D] so the weighted sum is too.
constexpr int64_t kTileQ = 16;

template <int kD>
void PrefillTile(const DecodeArgs& a, int64_t r0, int64_t s, int64_t h, int64_t pos0, int64_t nq) {
  const int64_t D = kD ? kD : a.D;
  const int64_t G = a.Hq / a.Hkv, ps = a.ps, NQ = nq * G;
  const int64_t kv_len = std::min<int64_t>(a.kv_lens[s], a.MB * ps);
  thread_local std::vector<float> q_buf, acc_buf, ml_buf, kt_buf, v_buf, row_buf;
  q_buf.resize(NQ * D);
  acc_buf.assign(NQ * D, 0.0f);
  ml_buf.resize(2 * NQ);
  kt_buf.resize(D * 16);
  v_buf.resize(16 * D);
  row_buf.resize(D);
  float* __restrict qs = q_buf.data();
  float* __restrict acc = acc_buf.data();
  float* __restrict m = ml_buf.data();
  float* __restrict l = ml_buf.data() + NQ;
  float* __restrict kt = kt_buf.data();
  float* __restrict vb = v_buf.data();
  float* __restrict row = row_buf.data();
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < G * D; ++j) qs[i * G * D + j] = a.q[((r0 + i) * a.Hq + h * G) * D + j] * a.sm_scale;
  for (int64_t j = 0; j < NQ; ++j) {  // a sink: a first key of logit sinks[head], value zero
    m[j] = a.has_sinks ? a.sinks[h * G + j % G] : kMaskValue;
    l[j] = a.has_sinks ? 1.0f : 0.0f;
  }
  const int32_t* row_pages = a.tables + s * a.MB;
  auto page_id = [&](int64_t key) {
    int64_t pid = row_pages[key / ps];
    return (pid < 0 || pid >= a.P) ? int64_t{0} : pid;
  };
  const int64_t last = std::min(kv_len, pos0 + nq);  // keys [.., last) are visible to some query
  const int64_t first = a.sliding_window > 0 ? std::max<int64_t>(0, pos0 - a.sliding_window + 1) : 0;
  for (int64_t k0 = first - first % 16; k0 < last; k0 += 16) {
    const int64_t nk = std::min<int64_t>(16, last - k0);
    for (int64_t c = 0; c < 16; ++c) {
      if (c < nk && k0 + c >= first) {  // keys before the window may sit in pages holding NaN
        const int64_t key = k0 + c, pid = page_id(key);
        const int64_t offset = ((pid * a.Hkv + h) * ps + key % ps) * D;
        LoadRow(a.k, offset, D, a.kv_format, a.lut, a.scaled ? a.k_scale[pid * a.Hkv + h] : 1.0f, row);
        for (int64_t d = 0; d < D; ++d) kt[d * 16 + c] = row[d];
        LoadRow(a.v, offset, D, a.kv_format, a.lut, a.scaled ? a.v_scale[pid * a.Hkv + h] : 1.0f, vb + c * D);
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * 16 + c] = 0.0f;
        for (int64_t d = 0; d < D; ++d) vb[c * D + d] = 0.0f;
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t pos = pos0 + i;
      const int64_t lo = a.sliding_window > 0 ? pos - a.sliding_window + 1 : 0;
      if (k0 > pos || k0 + 16 <= lo) continue;  // no key of this block is visible to query i
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = i * G + g;
        const float* __restrict qj = qs + j * D;
        alignas(64) float sc[16];
#if defined(__AVX512F__)
        // One vector of 16 scores, one FMA per dim, in four independent chains (left to itself
        // the compiler vectorized this along d with permutes; one chain is FMA-latency-bound).
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t d = 0;
        for (; d + 4 <= D; d += 4) {
          s0 = _mm512_fmadd_ps(_mm512_set1_ps(qj[d]), _mm512_loadu_ps(kt + d * 16), s0);
          s1 = _mm512_fmadd_ps(_mm512_set1_ps(qj[d + 1]), _mm512_loadu_ps(kt + (d + 1) * 16), s1);
          s2 = _mm512_fmadd_ps(_mm512_set1_ps(qj[d + 2]), _mm512_loadu_ps(kt + (d + 2) * 16), s2);
          s3 = _mm512_fmadd_ps(_mm512_set1_ps(qj[d + 3]), _mm512_loadu_ps(kt + (d + 3) * 16), s3);
        }
        for (; d < D; ++d) s0 = _mm512_fmadd_ps(_mm512_set1_ps(qj[d]), _mm512_loadu_ps(kt + d * 16), s0);
        _mm512_store_ps(sc, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
        for (int64_t c = 0; c < 16; ++c) sc[c] = 0.0f;
        for (int64_t d = 0; d < D; ++d)
          for (int64_t c = 0; c < 16; ++c) sc[c] += qj[d] * kt[d * 16 + c];
#endif
        if (a.soft_cap > 0.0f)
          for (int64_t c = 0; c < 16; ++c) sc[c] = a.soft_cap * std::tanh(sc[c] / a.soft_cap);
        float mx = m[j];
        for (int64_t c = 0; c < 16; ++c) {
          const int64_t key = k0 + c;
          const bool visible = c < nk && key <= pos && key >= lo;
          sc[c] = visible ? sc[c] : kMaskValue;
          mx = std::max(mx, sc[c]);
        }
        const float alpha = VecExp(m[j] - mx);
        float sum = 0.0f;
        for (int64_t c = 0; c < 16; ++c) {
          sc[c] = sc[c] == kMaskValue ? 0.0f : VecExp(sc[c] - mx);
          sum += sc[c];
        }
        l[j] = l[j] * alpha + sum;
        m[j] = mx;
        float* __restrict aj = acc + j * D;
        if constexpr (kD > 0) {  // the row of acc in registers across the 16 keys
          float r[kD];
          for (int64_t d = 0; d < kD; ++d) r[d] = aj[d] * alpha;
          for (int64_t c = 0; c < nk; ++c) {
            const float pc = sc[c];
            const float* __restrict vc = vb + c * kD;
            for (int64_t d = 0; d < kD; ++d) r[d] += pc * vc[d];
          }
          for (int64_t d = 0; d < kD; ++d) aj[d] = r[d];
        } else {
          for (int64_t d = 0; d < D; ++d) aj[d] *= alpha;
          for (int64_t c = 0; c < nk; ++c) {
            const float pc = sc[c];
            const float* __restrict vc = vb + c * D;
            for (int64_t d = 0; d < D; ++d) aj[d] += pc * vc[d];
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = i * G + g;
      const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
      float* __restrict o = a.out + ((r0 + i) * a.Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[j * D + d] * inv;
    }
}

// ---------------------------------------------------------------------------------------------
// jaxserve_ragged_attention: ragged paged attention (pallas_kernels/ragged_paged_attention.py's
// spec) for the CPU: every live sequence's query tokens against its paged keys and values.
//
//   q        [T, Hq, D] f32          the batch's query tokens, sequence after sequence
//   k, v     [P, Hkv, ps, D]         f32 | bf16 bits (u16 / bf16) | FP8 bits (u8 / f8) via `lut`
//   k_scale, v_scale [P, Hkv] f32    per-page scales (FP8, `scaled` = 1), or [1, 1] ignored
//   lut      [256] f32               FP8 byte -> value (kv_format 2), else ignored
//   tables   [S, MB] s32             page ids of each sequence
//   kv_lens  [S] s32                 keys of each sequence, its new tokens included
//   cu_q_lens [S + 1] s32, num_seqs [1] s32   sequence s owns tokens cu[s] .. cu[s+1] (s < num_seqs)
//   -> out   [T, Hq, D] f32          zeros for tokens no live sequence owns
//   sinks    [Hq] f32                one extra softmax logit per query head (has_sinks), or [1] ignored
// Attributes: sm_scale, soft_cap (0: none), sliding_window (0: none), kv_format, scaled (0/1), has_sinks (0/1).
// Token i of a sequence with q_len tokens sits at position kv_len - q_len + i and sees keys
// max(0, position - window + 1) .. position. A one-token sequence (decode) is one work item per
// KV head (DecodeItem); longer ones are tiles of kTileQ tokens per KV head (PrefillTile).
ffi::Error RaggedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::F32> lut, ffi::Buffer<ffi::S32> tables,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                               ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                               int32_t sliding_window, int32_t kv_format, int32_t scaled, int32_t has_sinks,
                               ffi::ThreadPool pool) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("ragged_attention: q [T,Hq,D], k/v [P,Hkv,ps,D], tables [S,MB]");
  DecodeArgs a{q.typed_data(), k.untyped_data(), v.untyped_data(), k_scale.typed_data(), v_scale.typed_data(),
               lut.typed_data(), tables.typed_data(), kv_lens.typed_data(), out->typed_data(),
               kd[0], qd[1], kd[1], kd[2], td[1], qd[2], sm_scale, soft_cap, sliding_window, kv_format, scaled,
               sinks.typed_data(), has_sinks};
  const int64_t T = qd[0], S = td[0];
  if (kd[3] != a.D || a.Hq % a.Hkv != 0 || a.Hq / a.Hkv > 64 || kv_lens.element_count() != S ||
      cu_q_lens.element_count() != S + 1 || num_seqs.element_count() != 1 ||
      (has_sinks && sinks.element_count() != a.Hq))
    return ffi::Error::InvalidArgument("ragged_attention: shapes disagree");
  std::memset(a.out, 0, sizeof(float) * T * a.Hq * a.D);
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, S);
  struct Item {
    int64_t r0, s, pos0, nq;  // nq == 0: a decode token
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < live; ++s) {
    const int64_t begin = cu[s], end = cu[s + 1];
    if (begin < 0 || end < begin || end > T)
      return ffi::Error::InvalidArgument("ragged_attention: cu_q_lens is not ascending within [0, T]");
    if (end - begin == 1) {
      items.push_back({begin, s, 0, 0});
      continue;
    }
    const int64_t q_len = end - begin, kv_len = kv_lens.typed_data()[s];
    for (int64_t q0 = 0; q0 < q_len; q0 += kTileQ)
      items.push_back({begin + q0, s, kv_len - q_len + q0, std::min(kTileQ, q_len - q0)});
  }
  const int64_t n = static_cast<int64_t>(items.size()) * a.Hkv;
  auto run = [&](auto decode, auto tile) {
    ParallelFor(pool, n, [&](int64_t i) {
      const Item& it = items[i / a.Hkv];
      const int64_t h = i % a.Hkv;
      if (it.nq == 0) decode(a, it.r0, it.s, h);
      else tile(a, it.r0, it.s, h, it.pos0, it.nq);
    });
  };
  switch (a.D) {
    case 64: run(DecodeItem<64>, PrefillTile<64>); break;
    case 128: run(DecodeItem<128>, PrefillTile<128>); break;
    case 256: run(DecodeItem<256>, PrefillTile<256>); break;
    default: run(DecodeItem<0>, PrefillTile<0>); break;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// jaxserve_gdn_recurrent: the gated delta rule token by token (pallas_kernels/gdn.py's spec,
// `gated_delta_rule_reference`), for the rows `rows[s]` != 0, updating their state slots in place.
//
//   q, k   [T, Hk, K] f32     (q L2-normalised and scaled, k L2-normalised)
//   v      [T, H, V] f32;  g, beta [T, H] f32 (log-decay, write strength)
//   state  [N, H, K, V] f32   slot pool, aliased to the second result
//   cu_q_lens [S+1], slot_ids [S], has_initial_state [S], rows [S]  s32
//   -> o [T, H, V] f32 (zeros outside the selected rows' tokens), state
//
//   per token: S = exp(g) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T q
// Two passes over each [K, V] state per token (predict, reading only; then decay + update + read
// out), by
// (row, value head) across the pool's threads. XLA:CPU's per-token loop of gathers, einsums and
// scatters took ~4-6 ms a layer for 16 decode rows (H=8, K=V=128).
template <int kV>
void GdnItem(const float* q, const float* k, const float* v, const float* g, const float* beta, float* o, int64_t begin, int64_t end, int64_t h, int64_t Hk, int64_t H, int64_t K, int64_t Vdim,
             bool from_slot, float* __restrict S) {
  const int64_t V = kV ? kV : Vdim;
  const int64_t kh = h / (H / Hk);
  if (begin == end) return;  // no token: the slot is neither read nor written (as in the spec)
  if (!from_slot) std::fill(S, S + K * V, 0.0f);
  thread_local std::vector<float> pred_buf, u_buf;
  pred_buf.resize(V);
  u_buf.resize(V);
  float* __restrict pred = pred_buf.data();
  float* __restrict u = u_buf.data();
  for (int64_t t = begin; t < end; ++t) {
    const float* __restrict qt = q + (t * Hk + kh) * K;
    const float* __restrict kt = k + (t * Hk + kh) * K;
    const float* __restrict vt = v + (t * H + h) * V;
    const float alpha = std::exp(g[t * H + h]);
    const float b = beta[t * H + h];
    // The decay is folded in: S^T k of the decayed state is alpha (S^T k), and the update writes
    // alpha S + k u^T, so the first pass only reads the state (one store pass per token, not two).
    for (int64_t j = 0; j < V; ++j) pred[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      const float* __restrict row = S + i * V;
      const float ki = kt[i];
      for (int64_t j = 0; j < V; ++j) pred[j] += ki * row[j];
    }
    for (int64_t j = 0; j < V; ++j) u[j] = b * (vt[j] - alpha * pred[j]);
    float* __restrict ot = o + (t * H + h) * V;
    for (int64_t j = 0; j < V; ++j) ot[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      float* __restrict row = S + i * V;
      const float ki = kt[i], qi = qt[i];
      for (int64_t j = 0; j < V; ++j) {
        row[j] = alpha * row[j] + ki * u[j];
        ot[j] += qi * row[j];
      }
    }
  }
}

ffi::Error GdnRecurrentImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> state_in,
                            ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> slot_ids,
                            ffi::Buffer<ffi::S32> has_initial_state, ffi::Buffer<ffi::S32> rows,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> state,
                            ffi::ThreadPool pool) {
  auto qd = q.dimensions();
  auto vd = v.dimensions();
  auto sd = state_in.dimensions();
  if (qd.size() != 3 || vd.size() != 3 || sd.size() != 4)
    return ffi::Error::InvalidArgument("gdn_recurrent: q [T,Hk,K], v [T,H,V], state [N,H,K,V]");
  const int64_t T = qd[0], Hk = qd[1], K = qd[2], H = vd[1], V = vd[2], N = sd[0];
  const int64_t S = slot_ids.element_count();
  if (vd[0] != T || sd[1] != H || sd[2] != K || sd[3] != V || H % Hk != 0 || cu_q_lens.element_count() != S + 1 ||
      has_initial_state.element_count() != S || rows.element_count() != S)
    return ffi::Error::InvalidArgument("gdn_recurrent: shapes disagree");
  float* st = state->typed_data();
  if (st != state_in.typed_data())  // not aliased (never under the engine's donation): copy first
    std::memcpy(st, state_in.typed_data(), sizeof(float) * N * H * K * V);
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * H * V);
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* slots = slot_ids.typed_data();
  const int32_t* init = has_initial_state.typed_data();
  const int32_t* sel = rows.typed_data();
  for (int64_t s = 0; s < S; ++s) {
    if (!sel[s]) continue;
    if (slots[s] < 0 || slots[s] >= N || cu[s] < 0 || cu[s] > cu[s + 1] || cu[s + 1] > T)
      return ffi::Error::InvalidArgument("gdn_recurrent: a selected row's slot or tokens are out of range");
  }
  auto item = [&](int64_t i) {
    const int64_t s = i / H, h = i % H;
    if (!sel[s]) return;
    float* S_ = st + (static_cast<int64_t>(slots[s]) * H + h) * K * V;
    auto run = [&](auto kernel) {
      kernel(q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), beta.typed_data(), o, cu[s],
             cu[s + 1], h, Hk, H, K, V, init[s] != 0, S_);
    };
    if (V == 128) run(GdnItem<128>);
    else if (V == 64) run(GdnItem<64>);
    else run(GdnItem<0>);
  };
  ParallelFor(pool, S * H, item);
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// jaxserve_bf16_matmul: x [M, K] bf16 @ W -> [M, N] bf16 (float32 accumulation, rounded to
// nearest even) or float32, W held packed once at load time (`pack_bf16_weight` in cpu_native.py):
//
//   wp [NB, KP, 32] bf16, NB = ceil(N / 16), KP = ceil(K / 2);
//   wp[nb, kp, 2 * i + j] = W[k = 2 kp + j, n = 16 nb + i]  (zero past K or N)
//
// so one 64-byte vector holds 16 output columns x 2 input rows, the operand of AVX512-BF16's
// vdpbf16ps, and each thread streams its columns' weights once, front to back. XLA:CPU's dot
// re-packs the [K, N] weight on every call: for decode-sized M that packing, not the
// arithmetic, is most of a projection's time. The rows of x go 16 at a time over one column
// block, whose weights (KP x 64 bytes) stay in L1/L2 for the next 16 rows.
// Without AVX512-BF16 (another CPU) the same loop runs in scalar float32.
//
// `valid_rows` [1] s32: only rows m < valid_rows are computed, the rest of `out` is zeros. A
// step's token count is padded up to its compiled bucket (150 tokens run as 256); the real
// tokens are the first rows, so the padding costs no matmul work (cpu_native.token_rows).
inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct MatmulArgs {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [NB, KP, 32]
  void* out;          // [M, N] bf16 (out_f32 = false) or f32
  int64_t M, K, N, KP;
  bool out_f32;
};

#if JAXSERVE_AVX512BF16

// Rows m0 .. m0 + MR of x against column block nb.
template <int MR>
inline void MatmulTile(const MatmulArgs& a, int64_t m0, int64_t nb) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const uint16_t* __restrict wb = a.w + nb * a.KP * 32;
  const uint16_t* __restrict xr = a.x + m0 * a.K;
  const int64_t full = a.K / 2;  // pairs wholly inside x's rows
  for (int64_t kp = 0; kp < full; ++kp) {
    // 4 KB ahead: the hardware prefetcher alone leaves the weight stream and the arithmetic
    // serialised once a vector feeds 16 rows (30 SmolLM2 layers, 16 rows, one thread: 28 -> 19 ms).
    _mm_prefetch(reinterpret_cast<const char*>(wb + (kp + 64) * 32), _MM_HINT_T0);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(wb + kp * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr + r * a.K + 2 * kp, sizeof(pair));
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), b);
    }
  }
  if (a.K & 1) {  // odd K: the last input row pairs with zero
    const __m512bh b = (__m512bh)_mm512_loadu_si512(wb + full * 32);
    for (int r = 0; r < MR; ++r) {
      const int32_t pair = xr[r * a.K + a.K - 1];
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), b);
    }
  }
  const int64_t n0 = nb * 16, cols = std::min<int64_t>(16, a.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  if (a.out_f32) {
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(static_cast<float*>(a.out) + (m0 + r) * a.N + n0, mask, acc[r]);
    return;
  }
  for (int r = 0; r < MR; ++r) {
    const __m256i packed = (__m256i)_mm512_cvtneps_pbh(acc[r]);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + (m0 + r) * a.N + n0, mask, packed);
  }
}

void MatmulBlock(const MatmulArgs& a, int64_t nb) {
  int64_t m0 = 0;
  for (; m0 + 16 <= a.M; m0 += 16) MatmulTile<16>(a, m0, nb);
  switch (a.M - m0) {
#define JAXSERVE_TAIL(n) case n: MatmulTile<n>(a, m0, nb); break;
    JAXSERVE_TAIL(1) JAXSERVE_TAIL(2) JAXSERVE_TAIL(3) JAXSERVE_TAIL(4) JAXSERVE_TAIL(5) JAXSERVE_TAIL(6)
    JAXSERVE_TAIL(7) JAXSERVE_TAIL(8) JAXSERVE_TAIL(9) JAXSERVE_TAIL(10) JAXSERVE_TAIL(11) JAXSERVE_TAIL(12)
    JAXSERVE_TAIL(13) JAXSERVE_TAIL(14) JAXSERVE_TAIL(15)
#undef JAXSERVE_TAIL
    default: break;
  }
}
constexpr int32_t kMatmulSimd = 1;
#else
void MatmulBlock(const MatmulArgs& a, int64_t nb) {
  const int64_t n0 = nb * 16, cols = std::min<int64_t>(16, a.N - n0);
  const uint16_t* wb = a.w + nb * a.KP * 32;
  for (int64_t m = 0; m < a.M; ++m) {
    float acc[16] = {0.0f};
    for (int64_t k = 0; k < a.K; ++k) {
      const float xv = Bf16ToF32(a.x[m * a.K + k]);
      const uint16_t* wk = wb + (k / 2) * 32 + (k & 1);
      for (int64_t i = 0; i < 16; ++i) acc[i] += xv * Bf16ToF32(wk[2 * i]);
    }
    for (int64_t i = 0; i < cols; ++i) {
      if (a.out_f32) static_cast<float*>(a.out)[m * a.N + n0 + i] = acc[i];
      else static_cast<uint16_t*>(a.out)[m * a.N + n0 + i] = F32ToBf16(acc[i]);
    }
  }
}
constexpr int32_t kMatmulSimd = 0;
#endif

// x [M, K] bf16, wp [NB, KP, 32] bf16 -> out [M, N] bf16 or f32 (NB = ceil(N / 16)).
ffi::Error Bf16MatmulImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> wp, ffi::Buffer<ffi::S32> valid_rows,
                          ffi::Result<ffi::AnyBuffer> out, ffi::ThreadPool pool) {
  auto xd = x.dimensions();
  auto wd = wp.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != 32)
    return ffi::Error::InvalidArgument("bf16_matmul: x [M, K], wp [NB, KP, 32], out [M, N]");
  const auto out_type = out->element_type();
  if (out_type != ffi::DataType::BF16 && out_type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("bf16_matmul: the result is bf16 or f32");
  MatmulArgs a{x.typed_data(), wp.typed_data(), out->untyped_data(), xd[0], xd[1], od[1], wd[1],
               out_type == ffi::DataType::F32};
  const int64_t NB = wd[0];
  if (od[0] != a.M || a.KP != (a.K + 1) / 2 || NB != (a.N + 15) / 16 || valid_rows.element_count() != 1)
    return ffi::Error::InvalidArgument("bf16_matmul: shapes disagree");
  const int64_t valid = std::clamp<int64_t>(valid_rows.typed_data()[0], 0, a.M);
  if (valid < a.M) {  // the bucket's padding rows: zeros, not computed
    const size_t row_bytes = static_cast<size_t>(a.N) * (a.out_f32 ? sizeof(float) : sizeof(uint16_t));
    std::memset(static_cast<char*>(a.out) + valid * row_bytes, 0, (a.M - valid) * row_bytes);
    a.M = valid;
  }
  if (a.M == 0 || a.N == 0) return ffi::Error::Success();
  // Column blocks in contiguous groups: each thread streams its share of the weights in order.
  const int64_t group = std::max<int64_t>(1, NB / (8 * std::max<int64_t>(1, pool.num_threads())));
  const int64_t groups = (NB + group - 1) / group;
  ParallelFor(pool, groups, [&](int64_t gi) {
    for (int64_t nb = gi * group, end = std::min(NB, nb + group); nb < end; ++nb) MatmulBlock(a, nb);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedAttention, RaggedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("kv_format")
                                  .Attr<int32_t>("scaled")
                                  .Attr<int32_t>("has_sinks")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGdnRecurrent, GdnRecurrentImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // state (aliased to the 2nd result)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // has_initial_state
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // state
                                  .Ctx<ffi::ThreadPool>());

// Whether jaxserve_bf16_matmul runs the AVX512-BF16 loop (1) or the scalar one (0).
extern "C" int32_t JaxserveBf16MatmulSimd() { return kMatmulSimd; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wp [NB, KP, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // valid_rows [1]
                                  .Ret<ffi::AnyBuffer>()          // out [M, N] bf16 | f32
                                  .Ctx<ffi::ThreadPool>());
