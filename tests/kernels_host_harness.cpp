// Host emulation of kernels/rs_sum.cu: the kernels compiled as plain C++, every CTA and thread run in
// turn (the kernels share nothing between threads, so any order is a legal schedule), checked bitwise
// against a straightforward sequential reference. Driven by tests/kernels_host.rs.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define TIDE_HOST_EMULATION 1
#define __global__
#define __launch_bounds__(...)
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct float4 { float x, y, z, w; };
struct TideDim { unsigned int x; };
static TideDim threadIdx, blockIdx, blockDim, gridDim;

static inline float tide_host_bits_f32(unsigned int b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
static inline float tide_host_f16_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int exp = (h >> 10) & 0x1fu;
    const unsigned int mant = h & 0x3ffu;
    unsigned int bits;
    if (exp == 0) {
        if (mant == 0) return tide_host_bits_f32(sign);
        float f = (float)mant * (1.0f / 16777216.0f);  // mant * 2^-24, exact
        return sign ? -f : f;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return tide_host_bits_f32(bits);
}

#include "rs_sum.cu"

typedef void (*SumKernel)(float*, TideSrcs, int, unsigned long long, int, int);

template <class F>
static void launch(unsigned grid, unsigned block, F f) {
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (unsigned t = 0; t < block; ++t) {
            threadIdx.x = t;
            f();
        }
    }
}

static float ref_one(int dtype, const unsigned char* p, size_t i) {
    if (dtype == 0) {  // bf16
        unsigned short h;
        std::memcpy(&h, p + 2 * i, 2);
        return tide_host_bits_f32((unsigned int)h << 16);
    } else if (dtype == 1) {  // f16
        unsigned short h;
        std::memcpy(&h, p + 2 * i, 2);
        return tide_host_f16_f32(h);
    }
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
}

static unsigned int f32_bits(float f) {
    unsigned int b;
    std::memcpy(&b, &f, 4);
    return b;
}

// A finite value of the dtype with a mix of signs, magnitudes, zeros, -0 and subnormals.
static void random_elem(int dtype, std::mt19937_64& rng, unsigned char* out) {
    const int kind = (int)(rng() % 16);
    if (dtype == 2) {
        float f;
        if (kind == 0) f = 0.0f;
        else if (kind == 1) f = -0.0f;
        else if (kind == 2) f = tide_host_bits_f32((unsigned int)(rng() % 0x7fffffu));  // subnormal
        else f = (float)((double)(int64_t)(rng() % 2000001) - 1000000.0) * 1e-3f;
        std::memcpy(out, &f, 4);
        return;
    }
    unsigned short h;
    if (kind == 0) h = 0;
    else if (kind == 1) h = 0x8000;
    else {
        // Avoid the all-ones exponent (inf / NaN) of either format.
        do { h = (unsigned short)rng(); } while (dtype == 0 ? ((h & 0x7f80) == 0x7f80) : ((h & 0x7c00) == 0x7c00));
    }
    std::memcpy(out, &h, 2);
}

static int failures = 0;
static long checks = 0;

static void check_sum(int dtype, int nsrc, size_t n, int accumulate, size_t misalign, unsigned grid,
                      unsigned block, std::mt19937_64& rng) {
    static const SumKernel kernels[3] = {rs_sum_bf16_f32, rs_sum_f16_f32, rs_sum_f32_f32};
    const size_t esize = dtype == 2 ? 4 : 2;
    // Buffers over-allocated so a 16-byte-aligned base plus `misalign` elements stays in bounds.
    std::vector<std::vector<unsigned char>> store(nsrc, std::vector<unsigned char>((n + 64) * esize + 64));
    TideSrcs srcs;
    std::memset(&srcs, 0, sizeof(srcs));
    std::vector<const unsigned char*> sp(nsrc);
    for (int s = 0; s < nsrc; ++s) {
        uintptr_t base = ((uintptr_t)store[s].data() + 15) & ~(uintptr_t)15;
        unsigned char* p = (unsigned char*)base + misalign * esize;
        for (size_t i = 0; i < n; ++i) random_elem(dtype, rng, p + i * esize);
        sp[s] = p;
        srcs.p[s] = p;
    }
    std::vector<unsigned char> dstore((n + 8) * 4 + 64);
    float* dst = (float*)((((uintptr_t)dstore.data() + 15) & ~(uintptr_t)15));
    std::vector<float> expect(n);
    for (size_t i = 0; i < n; ++i) {
        unsigned char tmp[4];
        random_elem(2, rng, tmp);
        float init;
        std::memcpy(&init, tmp, 4);
        dst[i] = init;
        float acc;
        int s = 0;
        if (accumulate) acc = init;
        else { acc = ref_one(dtype, sp[0], i); s = 1; }
        for (; s < nsrc; ++s) acc = acc + ref_one(dtype, sp[s], i);
        expect[i] = acc;
    }
    // Aligned: the quad (2-byte sources) or 16-byte vector (fp32) body and a scalar tail;
    // unaligned: scalar.
    const int vectorized = misalign == 0 ? 1 : 0;
    SumKernel k = kernels[dtype];
    launch(grid, block, [&] { k(dst, srcs, nsrc, (unsigned long long)n, accumulate, vectorized); });
    for (size_t i = 0; i < n; ++i) {
        ++checks;
        if (f32_bits(dst[i]) != f32_bits(expect[i])) {
            if (failures < 20)
                std::printf("MISMATCH sum dtype=%d nsrc=%d n=%zu acc=%d misalign=%zu grid=%u block=%u at %zu: got %a want %a\n",
                            dtype, nsrc, n, accumulate, misalign, grid, block, i, dst[i], expect[i]);
            ++failures;
            return;
        }
    }
}

static void check_copy(size_t bytes, size_t dst_off, size_t src_off, unsigned grid, unsigned block,
                       std::mt19937_64& rng) {
    std::vector<unsigned char> a(bytes + 64), b(bytes + 64, 0xee);
    for (auto& x : a) x = (unsigned char)rng();
    unsigned char* src = (unsigned char*)((((uintptr_t)a.data() + 15) & ~(uintptr_t)15)) + src_off;
    unsigned char* dst = (unsigned char*)((((uintptr_t)b.data() + 15) & ~(uintptr_t)15)) + dst_off;
    const uintptr_t both = (uintptr_t)src | (uintptr_t)dst;
    int width = 1;
    for (int w = 16; w > 1; w /= 2) {
        if (both % (uintptr_t)w == 0) { width = w; break; }
    }
    std::vector<unsigned char> before(b);
    launch(grid, block, [&] { tide_copy(dst, src, (unsigned long long)bytes, width); });
    ++checks;
    if (std::memcmp(dst, src, bytes) != 0) {
        std::printf("MISMATCH copy bytes=%zu width=%d\n", bytes, width);
        ++failures;
    }
    // Nothing outside [dst, dst + bytes) may change.
    for (size_t i = 0; i < b.size(); ++i) {
        unsigned char* p = b.data() + i;
        if ((p < dst || p >= dst + bytes) && b[i] != before[i]) {
            std::printf("OUT OF BOUNDS copy bytes=%zu width=%d at %zd\n", bytes, width, (ssize_t)(p - dst));
            ++failures;
            break;
        }
    }
}

// Batched launches: `count` segments of random sizes (one dtype), each checked like check_sum /
// check_copy; every CTA of the grid takes segments k, k + grid, ...
static void check_sum_batch(int dtype, int count, unsigned grid, unsigned block, std::mt19937_64& rng) {
    typedef void (*BatchKernel)(const TideSumBatch, int);
    static const BatchKernel kernels[3] = {rs_sum_batch_bf16_f32, rs_sum_batch_f16_f32, rs_sum_batch_f32_f32};
    const size_t esize = dtype == 2 ? 4 : 2;
    TideSumBatch b;
    std::memset(&b, 0, sizeof(b));
    std::vector<std::vector<unsigned char>> store;
    std::vector<std::vector<float>> expect(count);
    std::vector<float*> dsts(count);
    for (int k = 0; k < count; ++k) {
        const int nsrc = 1 + (int)(rng() % TIDE_MAX_SRCS);
        const size_t n = (size_t)(rng() % 300);
        const int acc = (int)(rng() % 2);
        const size_t mis = (rng() % 3 == 0) ? 1 : 0;
        std::vector<const unsigned char*> sp(nsrc);
        for (int s = 0; s < nsrc; ++s) {
            store.emplace_back((n + 64) * esize + 64);
            unsigned char* p = (unsigned char*)((((uintptr_t)store.back().data() + 15) & ~(uintptr_t)15)) + mis * esize;
            for (size_t i = 0; i < n; ++i) random_elem(dtype, rng, p + i * esize);
            sp[s] = p;
            b.src[k].p[s] = p;
        }
        store.emplace_back((n + 8) * 4 + 64);
        float* dst = (float*)((((uintptr_t)store.back().data() + 15) & ~(uintptr_t)15));
        dsts[k] = dst;
        expect[k].resize(n);
        for (size_t i = 0; i < n; ++i) {
            unsigned char tmp[4];
            random_elem(2, rng, tmp);
            float init;
            std::memcpy(&init, tmp, 4);
            dst[i] = init;
            float a_;
            int s = 0;
            if (acc) a_ = init;
            else { a_ = ref_one(dtype, sp[0], i); s = 1; }
            for (; s < nsrc; ++s) a_ = a_ + ref_one(dtype, sp[s], i);
            expect[k][i] = a_;
        }
        b.dst[k] = (unsigned long long)(uintptr_t)dst;
        b.n[k] = n;
        b.nsrc[k] = nsrc;
        b.accumulate[k] = acc;
        b.vectorized[k] = mis == 0 ? 1 : 0;
    }
    launch(grid, block, [&] { kernels[dtype](b, count); });
    for (int k = 0; k < count; ++k)
        for (size_t i = 0; i < expect[k].size(); ++i) {
            ++checks;
            if (f32_bits(dsts[k][i]) != f32_bits(expect[k][i])) {
                if (failures < 20)
                    std::printf("MISMATCH sum batch dtype=%d count=%d grid=%u segment %d at %zu: got %a want %a\n", dtype, count,
                                grid, k, i, dsts[k][i], expect[k][i]);
                ++failures;
                return;
            }
        }
}

static void check_copy_batch(int count, unsigned grid, unsigned block, std::mt19937_64& rng) {
    TideCopyBatch b;
    std::memset(&b, 0, sizeof(b));
    std::vector<std::vector<unsigned char>> srcs(count), dsts(count);
    std::vector<unsigned char*> sp(count), dp(count);
    std::vector<size_t> len(count);
    for (int k = 0; k < count; ++k) {
        len[k] = (size_t)(rng() % 5000);
        srcs[k].resize(len[k] + 64);
        dsts[k].assign(len[k] + 64, 0xee);
        for (auto& x : srcs[k]) x = (unsigned char)rng();
        sp[k] = (unsigned char*)((((uintptr_t)srcs[k].data() + 15) & ~(uintptr_t)15)) + (rng() % 2) * 8;
        dp[k] = (unsigned char*)((((uintptr_t)dsts[k].data() + 15) & ~(uintptr_t)15)) + (rng() % 3) * 2;
        const uintptr_t both = (uintptr_t)sp[k] | (uintptr_t)dp[k];
        int width = 1;
        for (int w = 16; w > 1; w /= 2) {
            if (both % (uintptr_t)w == 0) { width = w; break; }
        }
        b.dst[k] = (unsigned long long)(uintptr_t)dp[k];
        b.src[k] = (unsigned long long)(uintptr_t)sp[k];
        b.bytes[k] = len[k];
        b.width[k] = width;
    }
    std::vector<std::vector<unsigned char>> before(dsts);
    launch(grid, block, [&] { tide_copy_batch(b, count); });
    for (int k = 0; k < count; ++k) {
        ++checks;
        if (std::memcmp(dp[k], sp[k], len[k]) != 0) {
            std::printf("MISMATCH copy batch segment %d bytes=%zu\n", k, len[k]);
            ++failures;
        }
        for (size_t i = 0; i < dsts[k].size(); ++i) {
            unsigned char* p = dsts[k].data() + i;
            if ((p < dp[k] || p >= dp[k] + len[k]) && dsts[k][i] != before[k][i]) {
                std::printf("OUT OF BOUNDS copy batch segment %d\n", k);
                ++failures;
                break;
            }
        }
    }
}

// The kernels' IEEE contract on fixed values (src/engine/cpu.rs [Note: IEEE arithmetic]): 8
// subnormal FLT_MIN/4 sources sum to 2 * FLT_MIN (nothing flushed; on the GPU NVRTC's default
// -ftz=false), all -0.0 sources to -0.0, -0.0 and +0.0 to +0.0; every body (scalar, and the quad or
// vector body).
static void check_ieee() {
    static const SumKernel kernels[3] = {rs_sum_bf16_f32, rs_sum_f16_f32, rs_sum_f32_f32};
    const float quarter_min = 2.9387358770557188e-39f;  // FLT_MIN / 4
    struct Case { int dtype; unsigned int bits; float one; };
    // bf16 0x0020 = FLT_MIN / 4; f16 0x0001 = 2^-24 (a subnormal half).
    const Case subnormal[3] = {{0, 0x0020, quarter_min}, {1, 0x0001, 5.9604644775390625e-08f}, {2, 0x00200000, quarter_min}};
    const size_t n = 35;  // vectors, quads and a scalar tail
    for (int neg_zero = 0; neg_zero < 3; ++neg_zero) {
        for (const Case& c : subnormal) {
            const size_t esize = c.dtype == 2 ? 4 : 2;
            const unsigned int nz = c.dtype == 2 ? 0x80000000u : 0x8000u;
            std::vector<std::vector<unsigned char>> store(8, std::vector<unsigned char>(n * esize + 64));
            TideSrcs srcs;
            std::memset(&srcs, 0, sizeof(srcs));
            for (int s = 0; s < 8; ++s) {
                unsigned char* p = (unsigned char*)((((uintptr_t)store[s].data() + 15) & ~(uintptr_t)15));
                // neg_zero 0: subnormals; 1: all -0.0; 2: source 0 +0.0, the rest -0.0.
                const unsigned int bits = neg_zero == 0 ? c.bits : (neg_zero == 2 && s == 0 ? 0u : nz);
                for (size_t i = 0; i < n; ++i) std::memcpy(p + i * esize, &bits, esize);
                srcs.p[s] = p;
            }
            for (int vectorized = 0; vectorized <= 1; ++vectorized) {
                std::vector<unsigned char> dstore(n * 4 + 64);
                float* dst = (float*)((((uintptr_t)dstore.data() + 15) & ~(uintptr_t)15));
                launch(2, 32, [&] { kernels[c.dtype](dst, srcs, 8, (unsigned long long)n, 0, vectorized); });
                const unsigned int want = neg_zero == 0 ? f32_bits(8.0f * c.one) : (neg_zero == 1 ? 0x80000000u : 0u);
                for (size_t i = 0; i < n; ++i) {
                    ++checks;
                    if (f32_bits(dst[i]) != want) {
                        std::printf("IEEE MISMATCH dtype=%d case=%d vectorized=%d at %zu: got %a want bits %08x\n",
                                    c.dtype, neg_zero, vectorized, i, dst[i], want);
                        ++failures;
                        break;
                    }
                }
            }
        }
    }
}

// rs_sum_at_* / tide_zero_at: the same sums into slice clamp(index, 0, count - 1) of a buffer of
// `count` slices `stride` bytes apart (and, with mask bit 1, source 0 read from that slice: the
// accumulate of the multi-node plan); every other slice left as it was.
typedef void (*SumAtKernel)(float*, TideSrcs, int, unsigned long long, int, int, const int*, unsigned long long,
                            unsigned long long, unsigned int);

static void check_sum_at(int dtype, int nsrc, size_t n, int accumulate, int index, size_t count, size_t stride_pad,
                         unsigned mask, unsigned grid, unsigned block, std::mt19937_64& rng) {
    static const SumAtKernel kernels[3] = {rs_sum_at_bf16_f32, rs_sum_at_f16_f32, rs_sum_at_f32_f32};
    const size_t esize = dtype == 2 ? 4 : 2;
    const size_t stride = n * 4 + stride_pad * 4;  // bytes between slices
    std::vector<unsigned char> bstore(count * stride + 64);
    unsigned char* buf = (unsigned char*)((((uintptr_t)bstore.data() + 15) & ~(uintptr_t)15));
    for (size_t i = 0; i < count * stride / 4; ++i) random_elem(2, rng, buf + 4 * i);
    std::vector<unsigned char> before(buf, buf + count * stride);
    std::vector<std::vector<unsigned char>> store(nsrc, std::vector<unsigned char>(n * esize + 64));
    TideSrcs srcs;
    std::memset(&srcs, 0, sizeof(srcs));
    std::vector<const unsigned char*> sp(nsrc);
    for (int k = 0; k < nsrc; ++k) {
        unsigned char* p = (unsigned char*)((((uintptr_t)store[k].data() + 15) & ~(uintptr_t)15));
        for (size_t i = 0; i < n; ++i) random_elem(dtype, rng, p + i * esize);
        sp[k] = p;
        srcs.p[k] = p;
    }
    long long wrapped = index < 0 ? (long long)index + (long long)count : index;
    const size_t slice = wrapped < 0 ? 0 : ((size_t)wrapped >= count ? count - 1 : (size_t)wrapped);
    float* dst_at = (float*)(buf + slice * stride);
    // Source 0 from the slice (f32 only: the slice holds fp32), as the host passes it: slice 0.
    if (mask & 2u) {
        sp[0] = (const unsigned char*)dst_at;
        srcs.p[0] = buf;
    }
    std::vector<float> expect(n);
    for (size_t i = 0; i < n; ++i) {
        float acc;
        int k = 0;
        if (accumulate) acc = dst_at[i];
        else { acc = ref_one(dtype, sp[0], i); k = 1; }
        for (; k < nsrc; ++k) acc = acc + ref_one(dtype, sp[k], i);
        expect[i] = acc;
    }
    const int vectorized = (stride % 16 == 0) ? 1 : 0;
    int idx = index;
    SumAtKernel kern = kernels[dtype];
    launch(grid, block, [&] {
        kern((float*)buf, srcs, nsrc, (unsigned long long)n, accumulate, vectorized, &idx, count, stride, mask | 1u);
    });
    for (size_t b = 0; b < count * stride; ++b) {
        const bool in_slice = b >= slice * stride && b < slice * stride + n * 4;
        if (in_slice) continue;
        ++checks;
        if (buf[b] != before[b]) {
            if (failures < 20) std::printf("MISMATCH sum_at wrote outside its slice: byte %zu (slice %zu)\n", b, slice);
            ++failures;
            return;
        }
    }
    for (size_t i = 0; i < n; ++i) {
        ++checks;
        if (f32_bits(dst_at[i]) != f32_bits(expect[i])) {
            if (failures < 20)
                std::printf("MISMATCH sum_at dtype=%d nsrc=%d n=%zu acc=%d index=%d count=%zu mask=%u at %zu: got %a want %a\n",
                            dtype, nsrc, n, accumulate, index, count, mask, i, dst_at[i], expect[i]);
            ++failures;
            return;
        }
    }
    // tide_zero_at: `n` fp32 of the slice (and bytes at an odd size: the byte loop).
    for (size_t bytes : {n * 4, n * 4 > 0 ? n * 4 - 1 : 0}) {
        std::vector<unsigned char> b2(buf, buf + count * stride);
        launch(grid, block, [&] { tide_zero_at(buf, (unsigned long long)bytes, &idx, count, stride); });
        for (size_t b = 0; b < count * stride; ++b) {
            ++checks;
            const bool in = b >= slice * stride && b < slice * stride + bytes;
            if (buf[b] != (in ? 0 : b2[b])) {
                if (failures < 20) std::printf("MISMATCH zero_at bytes=%zu index=%d at byte %zu\n", bytes, index, b);
                ++failures;
                return;
            }
        }
    }
}

// bf16 nearest to x, ties to even, by distances in double (not the kernel's bit trick); NaN -> a
// quiet NaN of its sign (0x7fc0 | sign), infinities stay.
static unsigned short ref_bf16(unsigned int bits) {
    float x = tide_host_bits_f32(bits);
    if (x != x) return (unsigned short)(((bits >> 16) & 0x8000u) | 0x7fc0u);
    const unsigned short lo = (unsigned short)(bits >> 16);
    if ((bits & 0x7fffffffu) == 0x7f800000u) return lo;
    const unsigned short hi = (unsigned short)(lo + 1);
    auto val = [](unsigned short b) {
        double v = (double)tide_host_bits_f32((unsigned int)b << 16);
        if (v > 3.5e38) return 340282366920938463463374607431768211456.0;  // 2^128 for +inf
        if (v < -3.5e38) return -340282366920938463463374607431768211456.0;
        return v;
    };
    const double dl = x - val(lo) < 0 ? val(lo) - x : x - val(lo);
    const double dh = val(hi) - x < 0 ? x - val(hi) : val(hi) - x;
    return (dl < dh || (dl == dh && (lo & 1) == 0)) ? lo : hi;
}

// tide_cast_at_f32_bf16: slice `index` of `count` fp32 slices `stride` bytes apart, rounded into a
// bf16 buffer at `doff` elements past an 8-byte boundary; nothing written outside [0, n).
static void check_cast(size_t n, int index, size_t count, size_t pad, size_t doff, unsigned grid, unsigned block,
                       std::mt19937_64& rng) {
    const size_t stride = (n + pad) * 4;
    std::vector<unsigned char> sstore(count * stride + 64);
    unsigned char* src = (unsigned char*)((((uintptr_t)sstore.data() + 15) & ~(uintptr_t)15));
    for (size_t i = 0; i < count * stride / 4; ++i) {
        unsigned int b;
        const int kind = (int)(rng() % 8);
        if (kind == 0) b = (unsigned int)rng();  // anything: NaNs, infinities, subnormals
        else if (kind == 1) b = ((unsigned int)rng() & 0xffff0000u) | 0x8000u;  // a tie
        else if (kind == 2) b = (unsigned int)(rng() % 0x800000u) | ((unsigned int)(rng() & 1) << 31);  // subnormal
        else if (kind == 3) b = 0x7f7f8000u + (unsigned int)(rng() % 0x10000u);  // near overflow
        else { float f = (float)((double)(int64_t)(rng() % 2000001) - 1000000.0) * 1e-3f; std::memcpy(&b, &f, 4); }
        std::memcpy(src + 4 * i, &b, 4);
    }
    std::vector<unsigned char> dstore((n + 16) * 2 + 64);
    unsigned short* dst = (unsigned short*)((((uintptr_t)dstore.data() + 15) & ~(uintptr_t)15)) + doff;
    const unsigned short canary = 0xa5a5;
    for (size_t i = 0; i < n + 8; ++i) dst[i] = canary;
    long long wrapped = index < 0 ? (long long)index + (long long)count : index;
    const size_t slice = wrapped < 0 ? 0 : ((size_t)wrapped >= count ? count - 1 : (size_t)wrapped);
    const int vectorized = (stride % 16 == 0 && ((uintptr_t)dst % 8) == 0) ? 1 : 0;
    int idx = index;
    launch(grid, block, [&] {
        tide_cast_at_f32_bf16(dst, (const float*)src, (unsigned long long)n, &idx, count, stride, vectorized);
    });
    for (size_t i = 0; i < n + 8; ++i) {
        ++checks;
        unsigned int b;
        std::memcpy(&b, src + slice * stride + 4 * i, 4);
        const unsigned short want = i < n ? ref_bf16(b) : canary;
        if (dst[i] != want) {
            if (failures < 20)
                std::printf("MISMATCH cast n=%zu index=%d count=%zu pad=%zu doff=%zu at %zu: %08x -> got %04x want %04x\n",
                            n, index, count, pad, doff, i, i < n ? b : 0u, dst[i], want);
            ++failures;
            return;
        }
    }
}

int main() {
    std::mt19937_64 rng(12345);
    check_ieee();
    const size_t sizes[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 255, 1000, 4099};
    const unsigned grids[][2] = {{1, 1}, {1, 32}, {3, 32}, {2, 512}, {16, 64}};
    for (int dtype = 0; dtype < 3; ++dtype)
        for (int nsrc = 1; nsrc <= TIDE_MAX_SRCS; ++nsrc)
            for (size_t n : sizes)
                for (int acc = 0; acc < 2; ++acc)
                    for (size_t mis : {(size_t)0, (size_t)1, (size_t)3})
                        for (auto& g : grids) check_sum(dtype, nsrc, n, acc, mis, g[0], g[1], rng);
    for (size_t bytes : {0, 1, 2, 15, 16, 17, 100, 4096, 5003})
        for (size_t doff : {0, 1, 2, 4, 8})
            for (size_t soff : {0, 2, 8})
                for (auto& g : grids) check_copy(bytes, doff, soff, g[0], g[1], rng);
    for (int dtype = 0; dtype < 3; ++dtype)
        for (int count : {1, 5, TIDE_SUM_BATCH})
            for (unsigned block : {1u, 32u, 64u}) check_sum_batch(dtype, count, (unsigned)count, block, rng);
    for (int count : {1, 7, TIDE_COPY_BATCH})
        for (auto& g : grids) check_copy_batch(count, g[0], g[1], rng);
    for (int dtype = 0; dtype < 3; ++dtype)
        for (int nsrc : {1, 2, 3, TIDE_MAX_SRCS})
            for (size_t n : {(size_t)0, (size_t)1, (size_t)5, (size_t)64, (size_t)1000})
                for (int index : {-5, -3, -1, 0, 1, 2, 3, 1000})
                    for (size_t pad : {(size_t)0, (size_t)1, (size_t)4})
                        for (auto& g : grids) {
                            check_sum_at(dtype, nsrc, n, 0, index, 3, pad, 0u, g[0], g[1], rng);
                            check_sum_at(dtype, nsrc, n, 1, index, 3, pad, 0u, g[0], g[1], rng);
                            if (dtype == 2 && n > 0) check_sum_at(dtype, nsrc, n, 0, index, 3, pad, 2u, g[0], g[1], rng);
                        }
    for (int index : {0, 5}) check_sum_at(0, 2, 77, 0, index, 1, 0, 0u, 3, 32, rng);
    for (size_t n : {(size_t)0, (size_t)1, (size_t)3, (size_t)4, (size_t)5, (size_t)64, (size_t)1001, (size_t)4096})
        for (int index : {-4, -1, 0, 2, 1000})
            for (size_t pad : {(size_t)0, (size_t)1, (size_t)4})
                for (size_t doff : {(size_t)0, (size_t)1, (size_t)4})
                    for (auto& g : grids) check_cast(n, index, 3, pad, doff, g[0], g[1], rng);
    for (unsigned int b : {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0xff7f8000u, 0x00008000u,
                           0x00018000u, 0x7f800001u, 0xffc00000u, 0x80000000u}) {
        ++checks;
        if (tide_bf16_bits(b) != ref_bf16(b)) {
            std::printf("MISMATCH bf16 bits %08x: got %04x want %04x\n", b, tide_bf16_bits(b), ref_bf16(b));
            ++failures;
        }
    }
    std::printf("%ld checks, %d failures\n", checks, failures);
    if (failures == 0) std::printf("ALL OK\n");
    return failures == 0 ? 0 : 1;
}
