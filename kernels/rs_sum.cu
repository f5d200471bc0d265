// tide kernels: fp32 reduction of the reduce-scatter and an SM byte copy for local copies.
//
// Compiled at run time by NVRTC for the device's sm_XY (src/cuda/kernels.rs embeds this file), and
// as plain C++ by the host-emulation test (tests/kernels_host.rs) with TIDE_HOST_EMULATION defined,
// which supplies threadIdx/blockIdx/blockDim/gridDim and the vector types. No CUDA headers: bf16 ->
// f32 is a bit shift, f16 -> f32 is the PTX instruction cvt.f32.f16.
//
// rs_sum_<src>_f32(dst, srcs, nsrc, n, accumulate, vectorized):
//   vectorized: 0 scalar; 1 (dst and every source 16-byte aligned) one 16-byte fp32 store per
//   thread: 2-byte sources by 8-byte source quads, so a warp store instruction writes 512 contiguous
//   bytes (2.2x the 16-byte-source-vector body at 16 CTAs on one H200, 2026-12-01); fp32 sources by
//   16-byte vectors. Both give the same bits.
//   dst[e] = ((f32(srcs[0][e]) + f32(srcs[1][e])) + ...) + f32(srcs[nsrc-1][e])   (accumulate == 0)
//   dst[e] = ((dst[e] + f32(srcs[0][e])) + ...) + f32(srcs[nsrc-1][e])          (accumulate != 0)
//   for e in [0, n), in exactly this order, fp32 adds (no fast math), so results are bitwise equal to
//   tide's CPU engine. A sum over more than TIDE_MAX_SRCS sources is several launches, the later ones
//   with accumulate = 1 (the same sequence of fp32 additions). vectorized != 0 promises that dst and
//   every source are 16-byte aligned (the host checks); elements past the last whole quad or vector
//   are done by a scalar tail. Grid-stride loops: any grid size is correct. The host launches each
//   reduction as short launches of at most TIDE_RS_MAX_CTAS CTAs over pieces of it (sum pieces,
//   src/cuda/schedule.rs), so a CTA lives microseconds (docs/design.md "Stealing nothing").
//
// tide_copy(dst, src, bytes, width): copies bytes; width (16, 8, 4, 2 or 1) divides both addresses.
//
// Into slices of larger buffers (a reduce-scatter that writes one slice of a (L, ...) gradient
// buffer, the slice index known only on the device: src/call.rs OutputAt):
// rs_sum_at_<src>_f32(dst, srcs, nsrc, n, accumulate, vectorized, at, count, stride, mask):
//   rs_sum_<src>_f32 with dst (mask bit 0) and source 0 (mask bit 1) moved s * stride bytes on,
//   s = clamp(i, 0, count - 1) with i = *at, plus count if negative (jax.lax.dynamic_update_slice's
//   rule: a negative index counts from the end; never outside the buffer).
//   The host passes vectorized != 0 only if stride keeps the 16-byte alignment.
// tide_zero_at(dst, bytes, at, count, stride): zeroes bytes at dst + s * stride (padding rows of a
//   result; 4-byte units where dst and bytes allow).
//
// The casting all-gather (src/cast.rs), on XLA's stream before the collective:
// tide_cast_at_f32_bf16(dst, src, n, at, count, stride, vectorized): dst[e] = bf16(src'[e]) for e in
//   [0, n), src' = src moved s * stride bytes on (s as above); round to nearest even, a NaN becomes a
//   quiet NaN of its sign: bit for bit `cast::f32_to_bf16` (the CPU engine's rounding).
//   vectorized != 0 promises src' 16-byte and dst 8-byte aligned (4 elements per thread and step).

// Threads per CTA: 512 unless the host compiles for TIDE_SM_THREADS (-DTIDE_THREADS=128 or 256).
// Every kernel is bounded to 64 registers per thread whatever the CTA size (TIDE_MIN_CTAS such CTAs
// fit one SM's 65,536 registers) and uses no shared memory, so a CTA of 256 threads holds 16,384
// registers and fits beside a compute kernel's CTA that leaves that many free (XLA's Triton GEMMs
// on an H100 leave 24,576): it runs beside it instead of waiting for it (issue #38).
#ifndef TIDE_THREADS
#define TIDE_THREADS 512
#endif
#define TIDE_MIN_CTAS (65536 / (TIDE_THREADS * 64))
#define TIDE_MAX_SRCS 8

#ifndef TIDE_HOST_EMULATION
#define TIDE_DEV __device__ __forceinline__
#else
#define TIDE_DEV inline
#define __grid_constant__
#endif

struct TideSrcs {
    const void* p[TIDE_MAX_SRCS];
};

// The grid a body strides over: the launch's (block = blockIdx.x, blocks = gridDim.x), or one CTA
// alone (block 0 of 1) for a segment of a batched launch (tide_copy_batch, rs_sum_batch_*).
struct TideGrid {
    unsigned long long block, blocks;
};

TIDE_DEV TideGrid tide_grid() {
    TideGrid g;
    g.block = blockIdx.x;
    g.blocks = gridDim.x;
    return g;
}

TIDE_DEV TideGrid tide_one_cta() {
    TideGrid g;
    g.block = 0;
    g.blocks = 1;
    return g;
}

TIDE_DEV float tide_bits_f32(unsigned int bits) {
#ifdef TIDE_HOST_EMULATION
    return tide_host_bits_f32(bits);
#else
    return __uint_as_float(bits);
#endif
}

TIDE_DEV float tide_f16_f32(unsigned short h) {
#ifdef TIDE_HOST_EMULATION
    return tide_host_f16_f32(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// Element traits: how one source element (and a 32-bit word of 2-byte ones, a 16-byte vector of fp32
// ones) becomes fp32. BYTES picks the body: 2-byte sources run the quad body, fp32 the vector body.
struct TideBf16 {
    enum { BYTES = 2 };
    static TIDE_DEV float one(const void* p, unsigned long long i) {
        return tide_bits_f32(((unsigned int)((const unsigned short*)p)[i]) << 16);
    }
    static TIDE_DEV void word(unsigned int w, float* out) {
        out[0] = tide_bits_f32(w << 16);
        out[1] = tide_bits_f32(w & 0xffff0000u);
    }
};

struct TideF16 {
    enum { BYTES = 2 };
    static TIDE_DEV float one(const void* p, unsigned long long i) {
        return tide_f16_f32(((const unsigned short*)p)[i]);
    }
    static TIDE_DEV void word(unsigned int w, float* out) {
        out[0] = tide_f16_f32((unsigned short)(w & 0xffffu));
        out[1] = tide_f16_f32((unsigned short)(w >> 16));
    }
};

struct TideF32 {
    enum { BYTES = 4, PER_VEC = 4 };
    static TIDE_DEV float one(const void* p, unsigned long long i) { return ((const float*)p)[i]; }
    static TIDE_DEV void unpack(const uint4& v, float* out) {
        out[0] = tide_bits_f32(v.x);
        out[1] = tide_bits_f32(v.y);
        out[2] = tide_bits_f32(v.z);
        out[3] = tide_bits_f32(v.w);
    }
};

// Vector body (fp32 sources, vectorized): each thread handles U vectors per iteration (U * NSRC
// independent 16-byte loads in flight before the first add), vectors v0, v0 + stride, ... so each
// warp's loads are coalesced.
template <class E, int NSRC, int U>
TIDE_DEV void tide_sum_vec(float* dst, const TideSrcs& srcs, unsigned long long nvec, int accumulate,
                           TideGrid g = tide_grid()) {
    const unsigned long long stride = g.blocks * blockDim.x;
    for (unsigned long long v0 = g.block * blockDim.x + threadIdx.x; v0 < nvec;
         v0 += stride * U) {
        uint4 raw[U][NSRC];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long v = v0 + (unsigned long long)u * stride;
            if (v < nvec) {
#pragma unroll
                for (int s = 0; s < NSRC; ++s) raw[u][s] = ((const uint4*)srcs.p[s])[v];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long v = v0 + (unsigned long long)u * stride;
            if (v < nvec) {
                float acc[E::PER_VEC];
                float x[E::PER_VEC];
                float4* out = (float4*)dst + v * (E::PER_VEC / 4);
                int first = 0;
                if (accumulate) {
#pragma unroll
                    for (int q = 0; q < E::PER_VEC / 4; ++q) {
                        const float4 d = out[q];
                        acc[4 * q + 0] = d.x;
                        acc[4 * q + 1] = d.y;
                        acc[4 * q + 2] = d.z;
                        acc[4 * q + 3] = d.w;
                    }
                } else {
                    E::unpack(raw[u][0], acc);
                    first = 1;
                }
#pragma unroll
                for (int s = 0; s < NSRC; ++s) {
                    if (s >= first) {
                        E::unpack(raw[u][s], x);
#pragma unroll
                        for (int k = 0; k < E::PER_VEC; ++k) acc[k] = acc[k] + x[k];
                    }
                }
#pragma unroll
                for (int q = 0; q < E::PER_VEC / 4; ++q) {
                    float4 d;
                    d.x = acc[4 * q + 0];
                    d.y = acc[4 * q + 1];
                    d.z = acc[4 * q + 2];
                    d.w = acc[4 * q + 3];
                    out[q] = d;
                }
            }
        }
    }
}

// Quad body (2-byte sources, vectorized): thread i of the grid sums elements [4q, 4q + 4) for
// quads q = i, i + stride, ... (U quads per iteration, U * NSRC independent 8-byte loads in flight):
// lane l of a warp loads 8 bytes at quad q0 + l and stores the float4 at q0 + l, so both the loads
// (256 bytes per warp instruction) and the fp32 stores (512 bytes) are contiguous.
template <class E, int NSRC, int U>
TIDE_DEV void tide_sum_quad(float* dst, const TideSrcs& srcs, unsigned long long nquad, int accumulate,
                            TideGrid g) {
    const unsigned long long stride = g.blocks * blockDim.x;
    for (unsigned long long q0 = g.block * blockDim.x + threadIdx.x; q0 < nquad;
         q0 += stride * U) {
        uint2 raw[U][NSRC];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long q = q0 + (unsigned long long)u * stride;
            if (q < nquad) {
#pragma unroll
                for (int s = 0; s < NSRC; ++s) raw[u][s] = ((const uint2*)srcs.p[s])[q];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long q = q0 + (unsigned long long)u * stride;
            if (q < nquad) {
                float acc[4];
                float x[4];
                float4* out = (float4*)dst + q;
                int first = 0;
                if (accumulate) {
                    const float4 d = *out;
                    acc[0] = d.x;
                    acc[1] = d.y;
                    acc[2] = d.z;
                    acc[3] = d.w;
                } else {
                    E::word(raw[u][0].x, acc + 0);
                    E::word(raw[u][0].y, acc + 2);
                    first = 1;
                }
#pragma unroll
                for (int s = 0; s < NSRC; ++s) {
                    if (s >= first) {
                        E::word(raw[u][s].x, x + 0);
                        E::word(raw[u][s].y, x + 2);
#pragma unroll
                        for (int k = 0; k < 4; ++k) acc[k] = acc[k] + x[k];
                    }
                }
                float4 d;
                d.x = acc[0];
                d.y = acc[1];
                d.z = acc[2];
                d.w = acc[3];
                *out = d;
            }
        }
    }
}

template <class E>
TIDE_DEV void tide_sum_quads(float* dst, const TideSrcs& srcs, int nsrc, unsigned long long nquad, int accumulate,
                             TideGrid g) {
    switch (nsrc) {
        // U * NSRC 8-byte loads in flight per thread (12 to 16 for 1 to 8 sources: about 128 bytes
        // per thread, 64 KiB per 512-thread CTA), within the 64 registers of
        // __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS) without spills (tests/kernels_nvrtc.rs). A
        // 512-thread CTA then holds half an SM's registers, a 256-thread one a quarter (issue #38).
        case 1: tide_sum_quad<E, 1, 12>(dst, srcs, nquad, accumulate, g); break;
        case 2: tide_sum_quad<E, 2, 8>(dst, srcs, nquad, accumulate, g); break;
        case 3: tide_sum_quad<E, 3, 4>(dst, srcs, nquad, accumulate, g); break;
        case 4: tide_sum_quad<E, 4, 4>(dst, srcs, nquad, accumulate, g); break;
        case 5: tide_sum_quad<E, 5, 2>(dst, srcs, nquad, accumulate, g); break;
        case 6: tide_sum_quad<E, 6, 2>(dst, srcs, nquad, accumulate, g); break;
        case 7: tide_sum_quad<E, 7, 2>(dst, srcs, nquad, accumulate, g); break;
        default: tide_sum_quad<E, 8, 2>(dst, srcs, nquad, accumulate, g); break;
    }
}

// Scalar body for elements [begin, n): the tail after the vectors, or everything when unaligned.
template <class E>
TIDE_DEV void tide_sum_scalar(float* dst, const TideSrcs& srcs, int nsrc, unsigned long long begin,
                              unsigned long long n, int accumulate, TideGrid g = tide_grid()) {
    const unsigned long long stride = g.blocks * blockDim.x;
    for (unsigned long long i = begin + g.block * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float acc;
        int s = 0;
        if (accumulate) {
            acc = dst[i];
        } else {
            acc = E::one(srcs.p[0], i);
            s = 1;
        }
        // Unrolled with constant indices so srcs stays in the parameter space (no local copy).
#pragma unroll
        for (int k = 0; k < TIDE_MAX_SRCS; ++k) {
            if (k >= s && k < nsrc) acc = acc + E::one(srcs.p[k], i);
        }
        dst[i] = acc;
    }
}

template <class E>
TIDE_DEV void tide_sum(float* dst, const TideSrcs& srcs, int nsrc, unsigned long long n, int accumulate,
                       int vectorized, TideGrid g = tide_grid()) {
    if (nsrc < 1 || nsrc > TIDE_MAX_SRCS) return;  // the host never launches this
    if constexpr (E::BYTES == 2) {
        const unsigned long long nquad = vectorized ? n / 4 : 0;
        if (nquad > 0) tide_sum_quads<E>(dst, srcs, nsrc, nquad, accumulate, g);
        tide_sum_scalar<E>(dst, srcs, nsrc, nquad * 4, n, accumulate, g);
    } else {
        const unsigned long long nvec = vectorized ? n / E::PER_VEC : 0;
        if (nvec > 0) {
            switch (nsrc) {
                // U * NSRC 16-byte loads in flight per thread (5 to 8; 128 bytes per thread for 1
                // to 4 sources, 64 KiB per 512-thread CTA), within the 64 registers of
                // __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS) without spills on sm_90 (tests/kernels_nvrtc.rs). On one
                // H200 an SM moves at most ~95 GB/s (read + written) whatever is in flight (read-only
                // 79, write-only 63: bench/results/2026-12-03-1h200), so more loads buy nothing.
                case 1: tide_sum_vec<E, 1, 8>(dst, srcs, nvec, accumulate, g); break;
                case 2: tide_sum_vec<E, 2, 4>(dst, srcs, nvec, accumulate, g); break;
                case 3: tide_sum_vec<E, 3, 2>(dst, srcs, nvec, accumulate, g); break;
                case 4: tide_sum_vec<E, 4, 2>(dst, srcs, nvec, accumulate, g); break;
                case 5: tide_sum_vec<E, 5, 1>(dst, srcs, nvec, accumulate, g); break;
                case 6: tide_sum_vec<E, 6, 1>(dst, srcs, nvec, accumulate, g); break;
                case 7: tide_sum_vec<E, 7, 1>(dst, srcs, nvec, accumulate, g); break;
                default: tide_sum_vec<E, 8, 1>(dst, srcs, nvec, accumulate, g); break;
            }
        }
        tide_sum_scalar<E>(dst, srcs, nsrc, nvec * E::PER_VEC, n, accumulate, g);
    }
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_bf16_f32(float* dst, TideSrcs srcs, int nsrc, unsigned long long n, int accumulate, int vectorized) {
    tide_sum<TideBf16>(dst, srcs, nsrc, n, accumulate, vectorized);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_f16_f32(float* dst, TideSrcs srcs, int nsrc, unsigned long long n, int accumulate, int vectorized) {
    tide_sum<TideF16>(dst, srcs, nsrc, n, accumulate, vectorized);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_f32_f32(float* dst, TideSrcs srcs, int nsrc, unsigned long long n, int accumulate, int vectorized) {
    tide_sum<TideF32>(dst, srcs, nsrc, n, accumulate, vectorized);
}

// ---------------------------------------------------------------------------------------------------
// Into slices: the slice's byte offset, read once per thread from device memory.
TIDE_DEV unsigned long long tide_at_offset(const int* at, unsigned long long count, unsigned long long stride) {
    long long s = *at;
    if (s < 0) s += (long long)count;  // counts from the end, as jax.lax's dynamic slices do
    if (s < 0) s = 0;
    if ((unsigned long long)s >= count) s = (long long)count - 1;
    return (unsigned long long)s * stride;
}

template <class E>
TIDE_DEV void tide_sum_at(float* dst, const TideSrcs& srcs, int nsrc, unsigned long long n, int accumulate,
                          int vectorized, const int* at, unsigned long long count, unsigned long long stride,
                          unsigned int mask) {
    const unsigned long long off = tide_at_offset(at, count, stride);
    TideSrcs s = srcs;
    if (mask & 2u) s.p[0] = (const unsigned char*)s.p[0] + off;
    if (mask & 1u) dst = (float*)((unsigned char*)dst + off);
    tide_sum<E>(dst, s, nsrc, n, accumulate, vectorized);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_at_bf16_f32(float* dst, TideSrcs srcs, int nsrc, unsigned long long n, int accumulate, int vectorized,
                   const int* at, unsigned long long count, unsigned long long stride, unsigned int mask) {
    tide_sum_at<TideBf16>(dst, srcs, nsrc, n, accumulate, vectorized, at, count, stride, mask);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_at_f16_f32(float* dst, TideSrcs srcs, int nsrc, unsigned long long n, int accumulate, int vectorized,
                  const int* at, unsigned long long count, unsigned long long stride, unsigned int mask) {
    tide_sum_at<TideF16>(dst, srcs, nsrc, n, accumulate, vectorized, at, count, stride, mask);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_at_f32_f32(float* dst, TideSrcs srcs, int nsrc, unsigned long long n, int accumulate, int vectorized,
                  const int* at, unsigned long long count, unsigned long long stride, unsigned int mask) {
    tide_sum_at<TideF32>(dst, srcs, nsrc, n, accumulate, vectorized, at, count, stride, mask);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
tide_zero_at(void* dst, unsigned long long bytes, const int* at, unsigned long long count, unsigned long long stride) {
    unsigned char* d = (unsigned char*)dst + tide_at_offset(at, count, stride);
    const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((((unsigned long long)d) | bytes) % 4 == 0) {
        for (unsigned long long i = tid; i < bytes / 4; i += threads) ((unsigned int*)d)[i] = 0u;
    } else {
        for (unsigned long long i = tid; i < bytes; i += threads) d[i] = 0;
    }
}

// fp32 bits -> bf16 bits (src/cast.rs f32_to_bf16).
TIDE_DEV unsigned int tide_bf16_bits(unsigned int b) {
    if ((b & 0x7fffffffu) > 0x7f800000u) return ((b >> 16) & 0x8000u) | 0x7fc0u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
tide_cast_at_f32_bf16(unsigned short* dst, const float* src, unsigned long long n, const int* at,
                      unsigned long long count, unsigned long long stride, int vectorized) {
    const unsigned int* s = (const unsigned int*)((const unsigned char*)src + tide_at_offset(at, count, stride));
    const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long nvec = vectorized ? n / 4 : 0;
    for (unsigned long long v = tid; v < nvec; v += threads) {
        const uint4 x = ((const uint4*)s)[v];
        uint2 y;
        y.x = tide_bf16_bits(x.x) | (tide_bf16_bits(x.y) << 16);
        y.y = tide_bf16_bits(x.z) | (tide_bf16_bits(x.w) << 16);
        ((uint2*)dst)[v] = y;
    }
    for (unsigned long long i = nvec * 4 + tid; i < n; i += threads) {
        dst[i] = (unsigned short)tide_bf16_bits(s[i]);
    }
}

// Byte copy in units of T (U units in flight per thread), then the bytes past the last whole unit.
template <class T, int U>
TIDE_DEV void tide_copy_units(void* dst, const void* src, unsigned long long bytes, TideGrid g = tide_grid()) {
    const unsigned long long stride = g.blocks * blockDim.x;
    const unsigned long long tid = g.block * blockDim.x + threadIdx.x;
    const unsigned long long n = bytes / sizeof(T);
    T* d = (T*)dst;
    const T* s = (const T*)src;
    for (unsigned long long i0 = tid; i0 < n; i0 += U * stride) {
        T r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long i = i0 + (unsigned long long)u * stride;
            if (i < n) r[u] = s[i];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long i = i0 + (unsigned long long)u * stride;
            if (i < n) d[i] = r[u];
        }
    }
    for (unsigned long long b = n * sizeof(T) + tid; b < bytes; b += stride) {
        ((unsigned char*)dst)[b] = ((const unsigned char*)src)[b];
    }
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
tide_copy(void* dst, const void* src, unsigned long long bytes, int width) {
    // 16-byte units: 8 in flight per thread (128 bytes; 64 KiB per CTA), so few CTAs still move
    // HBM-speed bytes.
    switch (width) {
        case 16: tide_copy_units<uint4, 8>(dst, src, bytes); break;
        case 8: tide_copy_units<unsigned long long, 4>(dst, src, bytes); break;
        case 4: tide_copy_units<unsigned int, 4>(dst, src, bytes); break;
        case 2: tide_copy_units<unsigned short, 4>(dst, src, bytes); break;
        default: tide_copy_units<unsigned char, 4>(dst, src, bytes); break;
    }
}

// ---------------------------------------------------------------------------------------------------
// Batched launches (TIDE_FUSE_BYTES): many small independent copies or sums in one launch, so a group
// of many small parameters costs one launch instead of one per parameter. Segment k of `count` is
// done by one CTA alone (a one-CTA grid; copies: CTA k, k + gridDim.x, ...; sums: CTA k, the
// launch has one CTA per segment), with the same bodies as the single
// kernels, so results are bitwise identical. The host batches only segments that touch disjoint
// bytes (none writes what another reads or writes). Descriptors travel in the kernel parameters
// (at most 4 KiB) as __grid_constant__, so indexing them by segment reads the parameter space
// instead of copying the struct to local memory.
#define TIDE_COPY_BATCH 32
#define TIDE_SUM_BATCH 16

struct TideCopyBatch {
    unsigned long long dst[TIDE_COPY_BATCH];
    unsigned long long src[TIDE_COPY_BATCH];
    unsigned long long bytes[TIDE_COPY_BATCH];
    int width[TIDE_COPY_BATCH];
};

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
tide_copy_batch(const __grid_constant__ TideCopyBatch b, int count) {
    for (int k = blockIdx.x; k < count; k += gridDim.x) {
        void* d = (void*)b.dst[k];
        const void* s = (const void*)b.src[k];
        const unsigned long long bytes = b.bytes[k];
        const TideGrid g = tide_one_cta();
        // 16-byte units 4 in flight (not tide_copy's 8): with the segment loop around it, 8 do not
        // fit 64 registers without spilling; a segment is small (TIDE_FUSE_BYTES).
        switch (b.width[k]) {
            case 16: tide_copy_units<uint4, 4>(d, s, bytes, g); break;
            case 8: tide_copy_units<unsigned long long, 4>(d, s, bytes, g); break;
            case 4: tide_copy_units<unsigned int, 4>(d, s, bytes, g); break;
            case 2: tide_copy_units<unsigned short, 4>(d, s, bytes, g); break;
            default: tide_copy_units<unsigned char, 4>(d, s, bytes, g); break;
        }
    }
}

struct TideSumBatch {
    unsigned long long dst[TIDE_SUM_BATCH];
    unsigned long long n[TIDE_SUM_BATCH];
    TideSrcs src[TIDE_SUM_BATCH];
    int nsrc[TIDE_SUM_BATCH];
    int accumulate[TIDE_SUM_BATCH];
    int vectorized[TIDE_SUM_BATCH];
};

// One CTA per segment: the host launches exactly `count` CTAs (count <= TIDE_RS_MAX_CTAS). A loop
// over segments around the inlined bodies spills to local memory on sm_90 (ptxas); this does not.
template <class E>
TIDE_DEV void tide_sum_batch(const TideSumBatch& b, int count) {
    const int k = blockIdx.x;
    if (k >= count) return;
    const TideSrcs s = b.src[k];
    tide_sum<E>((float*)b.dst[k], s, b.nsrc[k], b.n[k], b.accumulate[k], b.vectorized[k], tide_one_cta());
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_batch_bf16_f32(const __grid_constant__ TideSumBatch b, int count) {
    tide_sum_batch<TideBf16>(b, count);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_batch_f16_f32(const __grid_constant__ TideSumBatch b, int count) {
    tide_sum_batch<TideF16>(b, count);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, TIDE_MIN_CTAS)
rs_sum_batch_f32_f32(const __grid_constant__ TideSumBatch b, int count) {
    tide_sum_batch<TideF32>(b, count);
}
