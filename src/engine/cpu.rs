//! CPU engine: executes plans on host memory, one thread per rank. The test oracle, and the engine of
//! JAX's CPU platform (the XLA CPU handler calls `execute_rank` from each device's thread).
//!
//! Memory model: ranks share one address space. Within a phase the plan guarantees (`Plan::validate`)
//! that no executor reads or writes what another executor writes, so the only synchronisation needed
//! is the barrier after each phase, which must give happens-before (a mutex/condvar barrier does).
//! Reduce sums in fp32 in the listed order; bf16/f16 are widened exactly (subnormals, inf, nan).
//!
//! [Note: IEEE arithmetic] Reductions follow IEEE 754 binary32 with subnormals kept, whatever the
//! calling thread's floating-point mode: XLA:CPU runs its threads with flush-to-zero and
//! denormals-are-zero set (x86 MXCSR FTZ/DAZ), and threads spawned from them (tide's CPU workers,
//! `ffi::worker`) inherit the mode, which flushed 8 x FLT_MIN/4 to 0. `execute_rank_with` clears
//! the flush bits for the duration of a rank's work (`IeeeFloats`) and restores them after, so CPU
//! results equal the CUDA kernels' (NVRTC's default `-ftz=false`, kernels/rs_sum.cu) bit for bit.
//! Signed zeros follow IEEE too: the first source initializes the sum (not `0.0 +`), so a sum of
//! -0.0 values is -0.0 and -0.0 + 0.0 is +0.0, on both engines.

use super::{Barrier, Rail, RankBuffers};
use crate::error::{Result, TideError};
use crate::layout::DType;
use crate::plan::{Action, BufKind, Plan, Region};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// bfloat16 bits to f32: the upper half of an f32, exact for every value.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// IEEE half bits to f32, exact for every value (subnormals become normal f32s; nan payload kept).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits as u32) & 0x8000) << 16;
    let exp = ((bits >> 10) & 0x1f) as u32;
    let mant = (bits & 0x3ff) as u32;
    let magnitude = match exp {
        0 => {
            // mant * 2^-24, exactly representable in f32.
            return f32::from_bits(sign | (mant as f32 * (1.0 / 16_777_216.0)).to_bits());
        }
        31 => 0x7f80_0000 | (mant << 13),
        _ => ((exp + 127 - 15) << 23) | (mant << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// Round-to-nearest-even f32 -> bf16 bits (nan stays nan). For tests and callers making data.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

/// Flush-to-zero and denormals-are-zero, cleared while alive and restored on drop: see
/// [Note: IEEE arithmetic]. Only the calling thread's mode changes.
pub struct IeeeFloats {
    saved: fp_mode::Mode,
}

impl IeeeFloats {
    pub fn enter() -> IeeeFloats {
        let saved = fp_mode::read();
        if saved & fp_mode::FLUSH != 0 {
            fp_mode::write(saved & !fp_mode::FLUSH);
        }
        IeeeFloats { saved }
    }
}

impl Drop for IeeeFloats {
    fn drop(&mut self) {
        if self.saved & fp_mode::FLUSH != 0 {
            fp_mode::write(self.saved);
        }
    }
}

/// Whether the calling thread flushes subnormals (FTZ or DAZ set), and a way to set it: for tests.
pub fn flushes_subnormals() -> bool {
    fp_mode::read() & fp_mode::FLUSH != 0
}

/// Sets (or clears) FTZ and DAZ on the calling thread, as XLA:CPU does on its threads: for tests.
pub fn set_flush_subnormals(on: bool) {
    let m = fp_mode::read();
    fp_mode::write(if on {
        m | fp_mode::FLUSH
    } else {
        m & !fp_mode::FLUSH
    });
}

/// The thread's floating-point control register.
#[cfg(target_arch = "x86_64")]
mod fp_mode {
    pub type Mode = u32;
    /// MXCSR bit 15 (FTZ) and bit 6 (DAZ).
    pub const FLUSH: Mode = (1 << 15) | (1 << 6);
    pub fn read() -> Mode {
        let mut csr: Mode = 0;
        // SAFETY: stmxcsr stores the 4-byte MXCSR to a valid, writable u32.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr as *mut Mode, options(nostack, preserves_flags))
        };
        csr
    }
    pub fn write(csr: Mode) {
        // SAFETY: ldmxcsr loads a value read from MXCSR with only FTZ/DAZ changed (no reserved bit).
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr as *const Mode, options(nostack, preserves_flags, readonly))
        };
    }
}

#[cfg(target_arch = "aarch64")]
mod fp_mode {
    pub type Mode = u64;
    /// FPCR bit 24 (FZ) and bit 19 (FZ16).
    pub const FLUSH: Mode = (1 << 24) | (1 << 19);
    pub fn read() -> Mode {
        let v: Mode;
        // SAFETY: reading FPCR has no side effects.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) v, options(nomem, nostack, preserves_flags))
        };
        v
    }
    pub fn write(v: Mode) {
        // SAFETY: writes back FPCR as read with only FZ/FZ16 changed.
        unsafe {
            std::arch::asm!("msr fpcr, {}", in(reg) v, options(nomem, nostack, preserves_flags))
        };
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
mod fp_mode {
    pub type Mode = u32;
    pub const FLUSH: Mode = 0;
    pub fn read() -> Mode {
        0
    }
    pub fn write(_: Mode) {}
}

/// Reads `elems` values of `dtype` at `ptr` as f32 into `out` (`acc == false`) or adds them (`acc == true`).
///
/// # Safety
/// `ptr` must be valid for reads of `elems * dtype.size_bytes()` bytes.
unsafe fn widen(
    ptr: *const u8,
    dtype: DType,
    elems: usize,
    out: &mut [f32],
    acc: bool,
) -> Result<()> {
    let apply = |out: &mut f32, v: f32| {
        if acc {
            *out += v
        } else {
            *out = v
        }
    };
    match dtype {
        DType::F32 => {
            for (e, o) in out.iter_mut().enumerate().take(elems) {
                // SAFETY: e < elems, within the caller's range; unaligned reads are allowed.
                apply(o, unsafe { (ptr as *const f32).add(e).read_unaligned() });
            }
        }
        DType::BF16 => {
            for (e, o) in out.iter_mut().enumerate().take(elems) {
                // SAFETY: as above.
                apply(
                    o,
                    bf16_to_f32(unsafe { (ptr as *const u16).add(e).read_unaligned() }),
                );
            }
        }
        DType::F16 => {
            for (e, o) in out.iter_mut().enumerate().take(elems) {
                // SAFETY: as above.
                apply(
                    o,
                    f16_to_f32(unsafe { (ptr as *const u16).add(e).read_unaligned() }),
                );
            }
        }
        other => {
            return Err(TideError::UnsupportedDtype {
                dtype: other.name().to_string(),
                op: "CPU engine Reduce (bfloat16, float16 or float32 operands)",
            })
        }
    }
    Ok(())
}

fn address(plan: &Plan, bufs: &[RankBuffers], r: &Region) -> Result<*mut u8> {
    let b = bufs.get(r.rank).ok_or_else(|| {
        TideError::Internal(format!(
            "CPU engine: no buffers for rank {} (have {})",
            r.rank,
            bufs.len()
        ))
    })?;
    let list = match r.kind {
        BufKind::Input => &b.inputs,
        BufKind::Output => &b.outputs,
        BufKind::Stage => &b.stages,
    };
    let base = *list.get(r.index).ok_or_else(|| {
        TideError::Internal(format!(
            "CPU engine: rank {} has no {:?} buffer {} ({} given) for a {:?} plan",
            r.rank,
            r.kind,
            r.index,
            list.len(),
            plan.op
        ))
    })?;
    if base == 0 {
        return Err(TideError::Internal(format!(
            "CPU engine: rank {} {:?} buffer {} is null",
            r.rank, r.kind, r.index
        )));
    }
    Ok((base + r.offset) as *mut u8)
}

/// Executes `rank`'s steps of every phase in order, calling `barrier.wait(rank, k)` after phase k
/// (the last included, so no peer returns while another may still read its buffers).
///
/// # Safety
/// `bufs[q]` must hold, for every rank q of the plan, host pointers to live buffers of the sizes the
/// plan names (`Plan::input_bytes`, `output_bytes`, `stage_slot_bytes`), not accessed by anything
/// but this plan's executors until every rank has passed the last barrier.
pub unsafe fn execute_rank(
    plan: &Plan,
    rank: usize,
    bufs: &[RankBuffers],
    barrier: &dyn Barrier,
) -> Result<()> {
    // SAFETY: forwarded caller contract.
    unsafe { execute_rank_with(plan, rank, bufs, barrier, None) }
}

/// `execute_rank` where the copies whose source rank `rail.is_remote` are received through `rail`
/// (the multi-process transport's link between nodes) instead of read from `bufs`: the rail is
/// told when each phase begins (to send what this rank owes) and ends (before the barrier), and
/// each such copy becomes `rail.recv` into its destination, at its place in the plan.
///
/// # Safety
/// As `execute_rank`, for every rank that is not remote; remote ranks' buffers are never addressed.
pub unsafe fn execute_rank_with(
    plan: &Plan,
    rank: usize,
    bufs: &[RankBuffers],
    barrier: &dyn Barrier,
    mut rail: Option<&mut dyn Rail>,
) -> Result<()> {
    if bufs.len() != plan.layout.world {
        return Err(TideError::Internal(format!(
            "CPU engine: {} rank buffer sets for world size {}",
            bufs.len(),
            plan.layout.world
        )));
    }
    let _ieee = IeeeFloats::enter(); // [Note: IEEE arithmetic]
    let mut scratch: Vec<f32> = Vec::new();
    for (k, phase) in plan.phases.iter().enumerate() {
        if let Some(r) = rail.as_deref_mut() {
            r.begin_phase(k)?;
        }
        for (i, step) in phase
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.executor == rank)
        {
            match &step.action {
                Action::Copy { src, dst, bytes }
                    if rail.as_deref().is_some_and(|r| r.is_remote(src.rank)) =>
                {
                    let d = address(plan, bufs, dst)?;
                    let r = rail.as_deref_mut().expect("checked by the guard");
                    // SAFETY: dst lies in this rank's live buffer (caller contract + validated plan).
                    unsafe { r.recv(k, i, d, *bytes)? };
                }
                Action::Copy { src, dst, bytes } => {
                    let s = address(plan, bufs, src)?;
                    let d = address(plan, bufs, dst)?;
                    // SAFETY: both ranges lie in live buffers (caller contract + validated plan);
                    // `copy` tolerates overlap.
                    unsafe { std::ptr::copy(s as *const u8, d, *bytes) };
                }
                Action::CopyBlocks { src, dst, bytes, blocks, src_pitch, dst_pitch } => {
                    for j in 0..*blocks {
                        let s = address(plan, bufs, &Region { offset: src.offset + j * src_pitch, ..*src })?;
                        let d = address(plan, bufs, &Region { offset: dst.offset + j * dst_pitch, ..*dst })?;
                        // SAFETY: every piece lies in a live buffer (caller contract + validated
                        // plan: `validate` checks each piece); `copy` tolerates overlap.
                        unsafe { std::ptr::copy(s as *const u8, d, *bytes) };
                    }
                }
                Action::Zero { dst, bytes } => {
                    let d = address(plan, bufs, dst)?;
                    // SAFETY: as above.
                    unsafe { std::ptr::write_bytes(d, 0, *bytes) };
                }
                Action::Reduce { dst, srcs, elems } => {
                    scratch.clear();
                    scratch.resize(*elems, 0.0);
                    for (j, o) in srcs.iter().enumerate() {
                        let s = address(plan, bufs, &o.region)?;
                        // SAFETY: the operand range lies in a live buffer; all sources are read before
                        // dst is written, so a source may alias dst.
                        unsafe { widen(s, o.dtype, *elems, &mut scratch, j > 0)? };
                    }
                    let d = address(plan, bufs, dst)? as *mut f32;
                    for (e, v) in scratch.iter().enumerate() {
                        // SAFETY: dst holds `elems` f32s (validated plan).
                        unsafe { d.add(e).write_unaligned(*v) };
                    }
                }
            }
        }
        if let Some(r) = rail.as_deref_mut() {
            r.end_phase(k)?;
        }
        barrier.wait(rank, k)?;
    }
    Ok(())
}

/// One rank's stage slots, 64-byte aligned and zeroed, owned by the caller of the engine.
pub struct StageBuffers {
    slots: Vec<(*mut u8, std::alloc::Layout)>,
}

// SAFETY: the slots are plain heap memory owned by this value; access is coordinated by the plan.
unsafe impl Send for StageBuffers {}
unsafe impl Sync for StageBuffers {}

impl StageBuffers {
    /// Allocates the plan's stage slots; an allocation failure is an error naming the slot, not an abort.
    pub fn new(plan: &Plan) -> Result<StageBuffers> {
        let mut out = StageBuffers {
            slots: Vec::with_capacity(plan.stage_slot_bytes.len()),
        };
        for (slot, &bytes) in plan.stage_slot_bytes.iter().enumerate() {
            let layout = std::alloc::Layout::from_size_align(bytes.max(1), 64).map_err(|_| {
                TideError::InvalidArgument(format!(
                    "stage slot {slot}: {bytes} bytes is not allocatable"
                ))
            })?;
            // SAFETY: layout has non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            if ptr.is_null() {
                return Err(TideError::Internal(format!(
                    "out of host memory allocating stage slot {slot} ({bytes} bytes)"
                )));
            }
            out.slots.push((ptr, layout));
        }
        Ok(out)
    }
    pub fn addrs(&self) -> Vec<usize> {
        self.slots.iter().map(|&(p, _)| p as usize).collect()
    }
}

impl Drop for StageBuffers {
    fn drop(&mut self) {
        for &(p, layout) in &self.slots {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(p, layout) };
        }
    }
}

/// A barrier over threads that fails instead of hanging: after `timeout`, or once any rank poisons it.
pub struct ThreadBarrier {
    world: usize,
    timeout: Duration,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    poisoned: Option<String>,
}

impl ThreadBarrier {
    pub fn new(world: usize, timeout: Duration) -> ThreadBarrier {
        ThreadBarrier {
            world,
            timeout,
            state: Mutex::new(BarrierState {
                arrived: 0,
                generation: 0,
                poisoned: None,
            }),
            cv: Condvar::new(),
        }
    }
    /// Makes every current and future wait fail with `why`.
    pub fn poison(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.poisoned.get_or_insert(why);
        self.cv.notify_all();
    }
}

impl Barrier for ThreadBarrier {
    fn wait(&self, rank: usize, phase: usize) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &st.poisoned {
            return Err(TideError::Rendezvous(format!(
                "rank {rank} at phase {phase}: {why}"
            )));
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = std::time::Instant::now() + self.timeout;
        while st.generation == gen {
            if let Some(why) = &st.poisoned {
                return Err(TideError::Rendezvous(format!(
                    "rank {rank} at phase {phase}: {why}"
                )));
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                let why = format!(
                    "rank {rank} timed out at phase {phase} barrier after {:?}",
                    self.timeout
                );
                st.poisoned.get_or_insert(why.clone());
                self.cv.notify_all();
                return Err(TideError::Rendezvous(why));
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

/// Runs `plan` with one thread per rank over fresh host buffers. `inputs[rank][param]` are the bytes
/// of each rank's `Input(param)`; returns `outputs[rank][param]`.
pub fn run_threads(plan: &Plan, inputs: &[Vec<Vec<u8>>]) -> Result<Vec<Vec<Vec<u8>>>> {
    let world = plan.layout.world;
    let n = plan.layout.len();
    if inputs.len() != world {
        return crate::invalid!(
            "run_threads: {} ranks of inputs for world size {world}",
            inputs.len()
        );
    }
    for (r, ins) in inputs.iter().enumerate() {
        if ins.len() != n {
            return crate::invalid!(
                "run_threads: rank {r} has {} inputs, the group has {n} params",
                ins.len()
            );
        }
        for (i, b) in ins.iter().enumerate() {
            if b.len() != plan.input_bytes(i) {
                return crate::invalid!(
                    "run_threads: rank {r}: {}: input has {} bytes, the plan wants {}",
                    plan.layout.params[i].describe(),
                    b.len(),
                    plan.input_bytes(i)
                );
            }
        }
    }
    let mut outputs: Vec<Vec<Vec<u8>>> = (0..world)
        .map(|_| (0..n).map(|i| vec![0xa5u8; plan.output_bytes(i)]).collect())
        .collect();
    let stages: Vec<StageBuffers> = (0..world)
        .map(|_| StageBuffers::new(plan))
        .collect::<Result<_>>()?;
    // Zero-byte buffers still need a distinct non-null address; none is ever dereferenced.
    let addr = |p: *const u8| p as usize;
    let bufs: Vec<RankBuffers> = (0..world)
        .map(|r| RankBuffers {
            inputs: inputs[r].iter().map(|b| addr(b.as_ptr())).collect(),
            outputs: outputs[r]
                .iter_mut()
                .map(|b| addr(b.as_mut_ptr()))
                .collect(),
            stages: stages[r].addrs(),
        })
        .collect();
    let barrier = ThreadBarrier::new(world, Duration::from_secs(120));
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (bufs, barrier) = (&bufs, &barrier);
                std::thread::Builder::new()
                    .name(format!("tide-cpu-rank-{rank}"))
                    .stack_size(1 << 20)
                    .spawn_scoped(scope, move || {
                        // SAFETY: bufs point into `inputs`, `outputs` and `stages`, alive and not
                        // otherwise touched until every thread has joined.
                        let res = unsafe { execute_rank(plan, rank, bufs, barrier) };
                        if let Err(e) = &res {
                            barrier.poison(format!("rank {rank} failed: {e}"));
                        }
                        res
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(TideError::Internal(
                        "CPU engine rank thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    // The first real error (not a peer's "someone else failed").
    if let Some(e) = results.iter().find_map(|r| {
        r.as_ref()
            .err()
            .filter(|e| !matches!(e, TideError::Rendezvous(_)))
    }) {
        return Err(e.clone());
    }
    if let Some(Err(e)) = results.into_iter().find(|r| r.is_err()) {
        return Err(e);
    }
    drop(stages);
    Ok(outputs)
}
