// Probe kernels of examples/interference.rs: compiled by NVRTC after kernels/rs_sum.cu (so tide's
// bodies are in scope), for the device's sm_XY. Not part of the library.
//
// Every aggressor kernel takes (..., trace, trace_base, pdl): with trace != 0 thread 0 of CTA b
// writes {smid, t_start, t_end} (ns, %globaltimer) to trace[3 * (trace_base + b) ...], so the host
// can sum SM time (CTA lifetimes) and see which SMs were held. pdl != 0: the CTA signals
// griddepcontrol.launch_dependents after its work (programmatic dependent launch; the next launch
// of the stream may then start while this one drains).

typedef unsigned long long u64;

__device__ __forceinline__ u64 probe_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned probe_smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

__device__ __forceinline__ void probe_end(u64* trace, u64 base, u64 t0, int pdl) {
    if (pdl) {
        __syncthreads();
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    if (trace && threadIdx.x == 0) {
        u64* r = trace + 3 * (base + blockIdx.x);
        r[0] = probe_smid();
        r[1] = t0;
        r[2] = probe_now();
    }
}

__device__ __forceinline__ TideSrcs probe_two(const void* a, const void* b) {
    TideSrcs s;
#pragma unroll
    for (int i = 0; i < TIDE_MAX_SRCS; ++i) s.p[i] = 0;
    s.p[0] = a;
    s.p[1] = b;
    return s;
}

// tide's reduction as the engine launches it today (vectorized quad body, 512 threads).
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_st(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    tide_sum<TideBf16>(dst, probe_two(a, b), 2, n, 0, 1);
    probe_end(trace, base, t0, pdl);
}

// The same body with 16 quads of each source in flight per thread (twice today's).
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_st_u16(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    const TideSrcs s = probe_two(a, b);
    tide_sum_quad<TideBf16, 2, 16>(dst, s, n / 4, 0, tide_grid());
    tide_sum_scalar<TideBf16>(dst, s, 2, (n / 4) * 4, n, 0);
    probe_end(trace, base, t0, pdl);
}

// 1024 threads per CTA, 4 quads of each source in flight per thread.
extern "C" __global__ void __launch_bounds__(1024)
probe_st_1024(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    const TideSrcs s = probe_two(a, b);
    tide_sum_quad<TideBf16, 2, 4>(dst, s, n / 4, 0, tide_grid());
    tide_sum_scalar<TideBf16>(dst, s, 2, (n / 4) * 4, n, 0);
    probe_end(trace, base, t0, pdl);
}

// Read-only: the two sources' first n elements (16-byte loads, 8 per source in flight), reps times,
// folded into one word written only if it equals `never` (never), so the loads are not removed.
__device__ __forceinline__ void probe_read_body(float* dst, const void* a, const void* b, u64 n, u64 reps) {
    const u64 nvec = n * 2 / 16;
    const uint4* pa = (const uint4*)a;
    const uint4* pb = (const uint4*)b;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (u64 r = 0; r < reps; ++r)
        for (u64 v0 = (u64)blockIdx.x * blockDim.x + threadIdx.x; v0 < nvec; v0 += 8 * stride) {
            uint4 ra[8], rb[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const u64 v = v0 + u * stride;
                if (v < nvec) {
                    ra[u] = pa[v];
                    rb[u] = pb[v];
                } else {
                    ra[u] = make_uint4(0, 0, 0, 0);
                    rb[u] = ra[u];
                }
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) acc ^= ra[u].x ^ ra[u].y ^ ra[u].z ^ ra[u].w ^ rb[u].x ^ rb[u].w;
        }
    if (acc == 0x9e3779b9u) dst[threadIdx.x] = (float)acc;
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_read(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    probe_read_body(dst, a, b, n, 1);
    probe_end(trace, base, t0, pdl);
}

// Write-only: n fp32 values (one 16-byte store per thread and iteration, coalesced), by plain
// stores or (cs != 0) streaming ones (st.global.cs: evict-first).
__device__ __forceinline__ void probe_write_body(float* dst, u64 n, int cs) {
    const u64 nvec = n / 4;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const float4 val = make_float4(1.f, 2.f, 3.f, 4.f);
    for (u64 v = (u64)blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += stride) {
        if (cs)
            __stcs((float4*)dst + v, val);
        else
            ((float4*)dst)[v] = val;
    }
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_write(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    probe_write_body(dst, n, 0);
    probe_end(trace, base, t0, pdl);
}

// Copy of the n * 2 bytes of source a into dst (tide_copy's 16-byte body).
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_copy(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    tide_copy_units<uint4, 8>(dst, a, n * 2, tide_grid());
    probe_end(trace, base, t0, pdl);
}

// ----- Hopper bulk copies (cp.async.bulk, the TMA unit), sm_90+ -----
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PROBE_BULK 1
__device__ __forceinline__ unsigned probe_smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}
__device__ __forceinline__ void probe_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void probe_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void probe_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ void probe_g2s(unsigned dst_smem, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst_smem),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void probe_s2g(void* dst, unsigned src_smem, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src_smem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void probe_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void probe_bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void probe_bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
#endif

#define PROBE_TILE 8192  // source bytes of one tile (4096 bf16 elements; 16 KiB fp32 out)
#define PROBE_STAGES 4   // source stages (2 sources x 8 KiB each)
#define PROBE_OUTBUF 2   // fp32 out buffers (TMA-store variant)

extern __shared__ __align__(128) unsigned char probe_smem[];

// Bulk loads of both sources into a ring of PROBE_STAGES stages; results stored either by the
// threads (tma_store 0: one coalesced float4 store per thread) or staged in shared memory and
// written by one bulk store per tile (tma_store 1). Whole tiles only (n a multiple of 4096 elements;
// the host keeps to that). Dynamic shared memory: PROBE_STAGES * 2 * PROBE_TILE (+ PROBE_OUTBUF *
// 2 * PROBE_TILE with tma_store).
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_bulk(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl, int tma_store) {
    const u64 t0 = probe_now();
#ifdef PROBE_BULK
    __shared__ __align__(8) u64 bars[PROBE_STAGES];
    const unsigned tile_elems = PROBE_TILE / 2;
    const u64 ntiles = n / tile_elems;
    const u64 g = gridDim.x;
    const u64 mine = blockIdx.x < ntiles ? (ntiles - blockIdx.x + g - 1) / g : 0;
    const unsigned smem0 = probe_smem_addr(probe_smem);
    const unsigned bar0 = probe_smem_addr(bars);
    const unsigned out0 = smem0 + PROBE_STAGES * 2 * PROBE_TILE;
    float* outbuf = (float*)(probe_smem + PROBE_STAGES * 2 * PROBE_TILE);
    if (threadIdx.x == 0) {
        for (int s = 0; s < PROBE_STAGES; ++s) probe_mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](u64 k) {
        const unsigned s = (unsigned)(k % PROBE_STAGES);
        const u64 t = blockIdx.x + k * g;
        const unsigned bar = bar0 + 8 * s;
        probe_mbar_expect_tx(bar, 2 * PROBE_TILE);
        probe_g2s(smem0 + (s * 2 + 0) * PROBE_TILE, (const unsigned char*)a + t * PROBE_TILE, PROBE_TILE, bar);
        probe_g2s(smem0 + (s * 2 + 1) * PROBE_TILE, (const unsigned char*)b + t * PROBE_TILE, PROBE_TILE, bar);
    };
    if (threadIdx.x == 0)
        for (u64 k = 0; k < mine && k < PROBE_STAGES; ++k) issue(k);
    for (u64 k = 0; k < mine; ++k) {
        const unsigned s = (unsigned)(k % PROBE_STAGES);
        probe_mbar_wait(bar0 + 8 * s, (unsigned)((k / PROBE_STAGES) & 1));
        const u64 t = blockIdx.x + k * g;
        const unsigned char* sa = probe_smem + (s * 2 + 0) * PROBE_TILE;
        const unsigned char* sb = probe_smem + (s * 2 + 1) * PROBE_TILE;
        const unsigned ob = (unsigned)(k % PROBE_OUTBUF);
        if (tma_store && threadIdx.x == 0) probe_bulk_wait_read<PROBE_OUTBUF - 1>();  // out buffer ob free
        if (tma_store) __syncthreads();
        for (unsigned j = threadIdx.x; j < tile_elems / 4; j += blockDim.x) {
            const uint2 qa = ((const uint2*)sa)[j];
            const uint2 qb = ((const uint2*)sb)[j];
            float x[4], y[4];
            TideBf16::word(qa.x, x);
            TideBf16::word(qa.y, x + 2);
            TideBf16::word(qb.x, y);
            TideBf16::word(qb.y, y + 2);
            const float4 d = make_float4(x[0] + y[0], x[1] + y[1], x[2] + y[2], x[3] + y[3]);
            if (tma_store)
                ((float4*)(outbuf + ob * tile_elems))[j] = d;
            else
                ((float4*)(dst + t * tile_elems))[j] = d;
        }
        if (tma_store) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();  // stage s read by all; out buffer written by all
        if (threadIdx.x == 0) {
            if (tma_store) {
                probe_s2g(dst + t * tile_elems, out0 + ob * tile_elems * 4, tile_elems * 4);
                probe_bulk_commit();
            }
            if (k + PROBE_STAGES < mine) {
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                issue(k + PROBE_STAGES);
            }
        }
    }
    if (tma_store && threadIdx.x == 0) probe_bulk_wait<0>();
#endif
    probe_end(trace, base, t0, pdl);
}

// What XLA's fusion of upcast + add does: the whole grid, one element per thread and iteration.
extern "C" __global__ void probe_xla_sum2(float* dst, const unsigned short* a, const unsigned short* b, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = __uint_as_float(((unsigned)a[i]) << 16) + __uint_as_float(((unsigned)b[i]) << 16);
}

// Resident CTAs that only spin for `ns` nanoseconds.
extern "C" __global__ void probe_spin(u64 ns) {
    const u64 t0 = probe_now();
    while (probe_now() - t0 < ns) {
    }
}

// Victim: an fp32 elementwise pass y = x * 1.0001 (float4, full grid).
extern "C" __global__ void probe_scale(float4* y, const float4* x, u64 nvec) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (u64)gridDim.x * blockDim.x) {
        float4 v = x[i];
        v.x *= 1.0001f;
        v.y *= 1.0001f;
        v.z *= 1.0001f;
        v.w *= 1.0001f;
        y[i] = v;
    }
}

// The SM-id probe (the paper's Table 5): one CTA per SM (the host gives each enough dynamic shared
// memory that two never fit on one SM), each recording its SM and start time, then spinning
// `ns`; rec[2 * b] = smid, rec[2 * b + 1] = start.
extern "C" __global__ void probe_resident(u64* rec, u64 ns) {
    const u64 t0 = probe_now();
    if (threadIdx.x == 0) {
        rec[2 * blockIdx.x] = probe_smid();
        rec[2 * blockIdx.x + 1] = t0;
    }
    while (probe_now() - t0 < ns) {
    }
}

// ----- sumphase mode: the sum over a window repeated (L2-resident operands) -----

// tide's reduction over the first n elements, reps times (each pass writes the same values): the
// sources and destination stay in L2 when their bytes fit (H200: 50 MB).
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_st_rep(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl, u64 reps) {
    const u64 t0 = probe_now();
    for (u64 r = 0; r < reps; ++r) tide_sum<TideBf16>(dst, probe_two(a, b), 2, n, 0, 1);
    probe_end(trace, base, t0, pdl);
}

// Read-only over the first n elements of both sources, reps times (probe_read's body).
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_read_rep(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl, u64 reps) {
    const u64 t0 = probe_now();
    probe_read_body(dst, a, b, n, reps);
    probe_end(trace, base, t0, pdl);
}

// ----- sumphase mode: the store path (what caps an SM's sum rate) -----

// Write-only with streaming stores.
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_write_cs(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    probe_write_body(dst, n, 1);
    probe_end(trace, base, t0, pdl);
}

#define PROBE_OUT_TILE 4096  // elements of one fp32 out tile: 16 KiB, one bulk store
#define PROBE_OUT_U 4        // tiles per iteration (per buffer set)

// Write-only through the TMA unit: thread 0 issues one 16 KiB bulk store (shared -> global) per
// tile from a constant shared buffer, at most 8 in flight. Whole tiles only.
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_write_bulk(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
#ifdef PROBE_BULK
    float* buf = (float*)probe_smem;
    for (unsigned i = threadIdx.x; i < PROBE_OUT_TILE; i += blockDim.x) buf[i] = (float)i;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned s0 = probe_smem_addr(probe_smem);
        const u64 ntiles = n / PROBE_OUT_TILE;
        for (u64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
            probe_s2g(dst + t * PROBE_OUT_TILE, s0, PROBE_OUT_TILE * 4);
            probe_bulk_commit();
            probe_bulk_wait_read<7>();
        }
        probe_bulk_wait<0>();
    }
#endif
    probe_end(trace, base, t0, pdl);
}

// tide's sum of two bf16 sources with the quad body's loads (8 quads of each source in flight per
// thread) and its stores either streaming (cs != 0: st.global.cs) or plain; the bits of tide_sum.
template <int U>
__device__ __forceinline__ void probe_sum_quads_cs(float* dst, const void* a, const void* b, u64 nquad, int cs) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 q0 = (u64)blockIdx.x * blockDim.x + threadIdx.x; q0 < nquad; q0 += stride * U) {
        uint2 ra[U], rb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u64 q = q0 + u * stride;
            if (q < nquad) {
                ra[u] = ((const uint2*)a)[q];
                rb[u] = ((const uint2*)b)[q];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u64 q = q0 + u * stride;
            if (q < nquad) {
                float x[4], y[4];
                TideBf16::word(ra[u].x, x);
                TideBf16::word(ra[u].y, x + 2);
                TideBf16::word(rb[u].x, y);
                TideBf16::word(rb[u].y, y + 2);
                const float4 d = make_float4(x[0] + y[0], x[1] + y[1], x[2] + y[2], x[3] + y[3]);
                if (cs)
                    __stcs((float4*)dst + q, d);
                else
                    ((float4*)dst)[q] = d;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_st_cs(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    probe_sum_quads_cs<8>(dst, a, b, n / 4, 1);
    probe_end(trace, base, t0, pdl);
}

// The same loads, results staged in shared memory and written by the TMA unit: per iteration U
// tiles of 4096 elements (thread t sums quads t and t + 512 of each tile: 256-byte loads per warp
// instruction, conflict-free 16-byte shared stores), then thread 0 issues one 16 KiB bulk store
// per tile; two buffer sets, so the next iteration's loads and sums overlap the bulk stores of
// this one. Whole tiles only. Dynamic shared memory: 2 * U * 16 KiB.
extern "C" __global__ void __launch_bounds__(TIDE_THREADS)
probe_st_tma_out(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
#ifdef PROBE_BULK
    const u64 ntiles = n / PROBE_OUT_TILE;
    const unsigned s0 = probe_smem_addr(probe_smem);
    const uint2* pa = (const uint2*)a;
    const uint2* pb = (const uint2*)b;
    unsigned set = 0;
    for (u64 t0i = blockIdx.x; t0i < ntiles; t0i += (u64)gridDim.x * PROBE_OUT_U, set ^= 1) {
        uint2 ra[PROBE_OUT_U][2], rb[PROBE_OUT_U][2];
#pragma unroll
        for (int u = 0; u < PROBE_OUT_U; ++u) {
            const u64 t = t0i + (u64)u * gridDim.x;
            if (t < ntiles) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u64 q = t * (PROBE_OUT_TILE / 4) + h * 512 + threadIdx.x;
                    ra[u][h] = pa[q];
                    rb[u][h] = pb[q];
                }
            }
        }
        // Buffer set `set` was last read by the bulk stores of two iterations ago.
        if (threadIdx.x == 0) probe_bulk_wait_read<PROBE_OUT_U>();
        __syncthreads();
        float4* out = (float4*)(probe_smem + set * PROBE_OUT_U * PROBE_OUT_TILE * 4);
#pragma unroll
        for (int u = 0; u < PROBE_OUT_U; ++u) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float x[4], y[4];
                TideBf16::word(ra[u][h].x, x);
                TideBf16::word(ra[u][h].y, x + 2);
                TideBf16::word(rb[u][h].x, y);
                TideBf16::word(rb[u][h].y, y + 2);
                out[u * (PROBE_OUT_TILE / 4) + h * 512 + threadIdx.x] =
                    make_float4(x[0] + y[0], x[1] + y[1], x[2] + y[2], x[3] + y[3]);
            }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (threadIdx.x == 0) {
#pragma unroll
            for (int u = 0; u < PROBE_OUT_U; ++u) {
                const u64 t = t0i + (u64)u * gridDim.x;
                if (t < ntiles) probe_s2g(dst + t * PROBE_OUT_TILE, s0 + (set * PROBE_OUT_U + u) * PROBE_OUT_TILE * 4, PROBE_OUT_TILE * 4);
                probe_bulk_commit();
            }
        }
    }
    if (threadIdx.x == 0) probe_bulk_wait<0>();
#endif
    probe_end(trace, base, t0, pdl);
}

// ----- sumphase mode: sums of k sources (the reduce-scatter at world k) -----

// tide's sum of K bf16 sources at a, a + stride, ..., a + (K - 1) * stride (bytes) into fp32, over the
// first n elements (a multiple of 4), reps times: the quad body the engine runs for K sources, with
// its loads in flight per thread (tide_sum_quads: U = 8, 4, 2 for K = 2, 4, 8) and its register bound.
template <int K, int U>
__device__ __forceinline__ void probe_stk(float* dst, const void* a, u64 stride, u64 n, u64* trace, u64 base, int pdl, u64 reps) {
    const u64 t0 = probe_now();
    TideSrcs s;
#pragma unroll
    for (int i = 0; i < TIDE_MAX_SRCS; ++i) s.p[i] = i < K ? (const void*)((const unsigned char*)a + i * stride) : 0;
    for (u64 r = 0; r < reps; ++r) tide_sum_quad<TideBf16, K, U>(dst, s, n / 4, 0, tide_grid());
    probe_end(trace, base, t0, pdl);
}

extern "C" __global__ void __launch_bounds__(TIDE_THREADS, 2)
probe_stk2(float* dst, const void* a, u64 stride, u64 n, u64* trace, u64 base, int pdl, u64 reps) {
    probe_stk<2, 8>(dst, a, stride, n, trace, base, pdl, reps);
}
extern "C" __global__ void __launch_bounds__(TIDE_THREADS, 2)
probe_stk4(float* dst, const void* a, u64 stride, u64 n, u64* trace, u64 base, int pdl, u64 reps) {
    probe_stk<4, 4>(dst, a, stride, n, trace, base, pdl, reps);
}
extern "C" __global__ void __launch_bounds__(TIDE_THREADS, 2)
probe_stk8(float* dst, const void* a, u64 stride, u64 n, u64* trace, u64 base, int pdl, u64 reps) {
    probe_stk<8, 2>(dst, a, stride, n, trace, base, pdl, reps);
}

// ----- progress mode: a persistent full-SM victim -----

// One CTA per SM that holds the SM alone for `ns` nanoseconds from its start, as cuDNN's flash
// attention does on H100 (ncu: grid 132, 384 threads, 168 registers, 232448 B dynamic shared
// memory): the host gives it the device's opt-in maximum of dynamic shared memory, which with the
// 1 KiB the hardware reserves per CTA fills the SM, so no CTA of any other kernel starts there
// until it ends. It only spins (no memory traffic): what it measures is residency, not bandwidth.
// out[b] is written only if the spin's counter equals `never` (never), so nothing is removed.
extern "C" __global__ void __launch_bounds__(384, 1)
probe_fullsm(unsigned* out, u64 ns, unsigned never) {
    extern __shared__ unsigned probe_fullsm_smem[];
    const u64 t0 = probe_now();
    unsigned spins = 0;
    while (probe_now() - t0 < ns) ++spins;
    probe_fullsm_smem[threadIdx.x] = spins;
    __syncthreads();
    if (probe_fullsm_smem[(threadIdx.x + 1) % blockDim.x] == never && out) out[blockIdx.x] = spins;
}

// ----- coresidence mode (issue #38): does a tide CTA ever share an SM with a compute kernel's? -----

// A victim CTA that holds `K` floats live in registers across a spin of `ns` nanoseconds (an FMA
// chain through all of them per turn, so ptxas keeps every one in a register), then thread 0
// writes {smid, t_start, t_end} to trace[3 * blockIdx.x ...] as probe_end does. The host launches
// one CTA per SM with the shape's dynamic shared memory (never touched: residency is what counts).
// out[b] is written only if the sum equals `never` (never), so nothing is removed.
template <int K>
__device__ __forceinline__ void probe_cores_spin(u64* trace, u64 ns, unsigned never, unsigned* out) {
    const u64 t0 = probe_now();
    float v[K];
#pragma unroll
    for (int i = 0; i < K; ++i) v[i] = (float)(threadIdx.x + i);
    unsigned spins = 0;
    while (probe_now() - t0 < ns) {
#pragma unroll
        for (int i = 0; i < K; ++i) v[i] = fmaf(v[i], 0.999f, v[(i + 1) % K]);
        ++spins;
    }
    const u64 t1 = probe_now();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < K; ++i) s += v[i];
    if (__float_as_uint(s) == never && out) out[blockIdx.x] = spins;
    if (trace && threadIdx.x == 0) {
        u64* r = trace + 3 * blockIdx.x;
        r[0] = probe_smid();
        r[1] = t0;
        r[2] = t1;
    }
}

#define PROBE_CORES_K 144  // live floats: with the loop's own, ~154 registers (XLA's Triton GEMM on H100)

// XLA's Triton GEMM on H100: 256 threads, ~154 registers (one CTA per SM), 196,640 B dynamic shared.
extern "C" __global__ void __launch_bounds__(256, 1) probe_cores_gemm(u64* trace, u64 ns, unsigned never, unsigned* out) {
    probe_cores_spin<PROBE_CORES_K>(trace, ns, never, out);
}
// The same kernel as a separate function, so the host can set its preferred carveout to 100.
extern "C" __global__ void __launch_bounds__(256, 1) probe_cores_gemm_c100(u64* trace, u64 ns, unsigned never, unsigned* out) {
    probe_cores_spin<PROBE_CORES_K>(trace, ns, never, out);
}
// cuDNN's flash attention on H100: 384 threads (~154 registers here, 168 there), 232,448 B.
extern "C" __global__ void __launch_bounds__(384, 1) probe_cores_attn(u64* trace, u64 ns, unsigned never, unsigned* out) {
    probe_cores_spin<PROBE_CORES_K>(trace, ns, never, out);
}
// The control: 256 threads, few registers, no shared memory (a tide CTA surely fits beside it).
extern "C" __global__ void __launch_bounds__(256) probe_cores_small(u64* trace, u64 ns, unsigned never, unsigned* out) {
    probe_cores_spin<4>(trace, ns, never, out);
}

// The aggressors: tide's sum of two bf16 sources under the engine's register bound (64 per thread:
// __launch_bounds__(threads, 65536 / (threads * 64))), at 512 and 256 threads per CTA.
extern "C" __global__ void __launch_bounds__(512, 2)
probe_cores_st512(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    tide_sum<TideBf16>(dst, probe_two(a, b), 2, n, 0, 1);
    probe_end(trace, base, t0, pdl);
}
extern "C" __global__ void __launch_bounds__(256, 4)
probe_cores_st256(float* dst, const void* a, const void* b, u64 n, u64* trace, u64 base, int pdl) {
    const u64 t0 = probe_now();
    tide_sum<TideBf16>(dst, probe_two(a, b), 2, n, 0, 1);
    probe_end(trace, base, t0, pdl);
}
