// tide NVLink multicast store (the opt-in all-gather path of src/cuda/multicast.rs).
//
// NEVER launched unless the multicast gate granted it (TIDE_MULTICAST=1, the environment does not
// disable NVLink multicast, every device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, world >= 3,
// single node). Compiled at run time by NVRTC only on that path; tests/kernels_nvrtc.rs compiles it to
// PTX and a cubin (compiling is safe; launching multimem code on the lent 2-GPU machines is not).
//
// tide_mc_store(mc_dst, src, n16): for v in [0, n16): the 16 bytes src[v] are stored, by
// multimem.st, to the multicast address mc_dst + 16 v: the NVSwitch writes them into every member
// GPU's physical memory bound to the multicast object. mc_dst and src are 16-byte aligned (the
// host plans only shards whose sizes and offsets are multiples of 16 bytes). Grid-stride loop:
// any grid is correct. Ends with a system-scope fence so the stores are performed before the
// kernel's completion is observed by the peers' streams (through the "pushed" events).

#define TIDE_MC_THREADS 512

struct TideU4 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void __launch_bounds__(TIDE_MC_THREADS)
tide_mc_store(unsigned long long mc_dst, const TideU4* src, unsigned long long n16) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long v = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; v < n16;
         v += stride) {
        const TideU4 x = src[v];
        const unsigned long long a = mc_dst + 16ull * v;
        asm volatile("multimem.st.global.v4.f32 [%0], {%1, %2, %3, %4};"
                     :
                     : "l"(a), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                     : "memory");
    }
    asm volatile("fence.sc.sys;" ::: "memory");
}
