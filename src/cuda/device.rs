//! Device resources of the CUDA engine, created on the first call for a device and kept for the
//! life of the process (keyed by XLA's device ordinal): the retained primary context (the one XLA
//! uses), compute capability, the NVRTC-compiled kernel module, the device-wide side copy streams,
//! events and bounded stage buffer (the multi-process path), the in-flight slots (`Slot`: the
//! start/done path's streams, events and staging per call in flight, owned through a `SlotLease`),
//! the set of peers with access enabled, and the prepared plans (`prepare::PlanCache`). Each
//! device's state sits behind its own mutex (`cuda` module header, "Concurrency").

use super::driver::{self, CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream};
use super::kernels;
use super::nvrtc;
use super::prepare::PlanCache;
use crate::call::CallInfo;
use crate::error::{Result, TideError};
use crate::layout::DType;
use crate::plan::Op;
use cudarc::driver::sys::CUdevice_attribute;
use once_cell::sync::Lazy;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The loaded kernel module of one device.
pub struct Module {
    _module: CUmodule,
    pub sum_bf16: CUfunction,
    pub sum_f16: CUfunction,
    pub sum_f32: CUfunction,
    pub copy: CUfunction,
    /// Batched launches: `tide_copy_batch`, `rs_sum_batch_{bf16,f16,f32}_f32` (TIDE_FUSE_BYTES).
    pub copy_batch: CUfunction,
    pub sum_batch: [CUfunction; 3],
    /// Into slices of larger buffers (`CallInfo::at`): `rs_sum_at_{bf16,f16,f32}_f32`, `tide_zero_at`.
    pub sum_at: [CUfunction; 3],
    pub zero_at: CUfunction,
    /// The casting all-gather's rounding (`cuda::cast`): `tide_cast_at_f32_bf16`.
    pub cast_at: CUfunction,
}

impl Module {
    /// Every kernel of the module with its name, in `kernels::KERNEL_NAMES`' order.
    pub fn functions(&self) -> [(&'static str, CUfunction); kernels::KERNEL_NAMES.len()] {
        let f = [
            self.sum_bf16,
            self.sum_f16,
            self.sum_f32,
            self.copy,
            self.copy_batch,
            self.sum_batch[0],
            self.sum_batch[1],
            self.sum_batch[2],
            self.sum_at[0],
            self.sum_at[1],
            self.sum_at[2],
            self.zero_at,
            self.cast_at,
        ];
        std::array::from_fn(|i| (kernels::KERNEL_NAMES[i], f[i]))
    }
}

// SAFETY: a loaded module's handles are plain identifiers the driver accepts from any host thread;
// the struct is never mutated after loading (shared read-only through `Arc`).
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    pub fn sum(&self, dtype: DType) -> Result<CUfunction> {
        Ok(match dtype {
            DType::BF16 => self.sum_bf16,
            DType::F16 => self.sum_f16,
            DType::F32 => self.sum_f32,
            other => {
                return Err(TideError::UnsupportedDtype {
                    dtype: other.name().to_string(),
                    op: "reduce_scatter on CUDA (bfloat16, float16 or float32 sources)",
                })
            }
        })
    }

    /// The sum kernel into a slice chosen on the device, for sources of `dtype`.
    pub fn sum_at(&self, dtype: DType) -> Result<CUfunction> {
        let k = match dtype {
            DType::BF16 => 0,
            DType::F16 => 1,
            DType::F32 => 2,
            _ => return self.sum(dtype), // the same error
        };
        Ok(self.sum_at[k])
    }

    /// The batched sum kernel for sources of `dtype`.
    pub fn sum_batch(&self, dtype: DType) -> Result<CUfunction> {
        Ok(match dtype {
            DType::BF16 => self.sum_batch[0],
            DType::F16 => self.sum_batch[1],
            DType::F32 => self.sum_batch[2],
            other => {
                return Err(TideError::UnsupportedDtype {
                    dtype: other.name().to_string(),
                    op: "reduce_scatter on CUDA (bfloat16, float16 or float32 sources)",
                })
            }
        })
    }
}

pub struct DeviceState {
    pub ordinal: i64,
    pub dev: CUdevice,
    pub ctx: CUcontext,
    pub cc: (i32, i32),
    /// Loaded once and never replaced; shared (`Arc`) so a call can issue without the lock.
    pub module: Option<Arc<Module>>,
    pub side: Vec<CUstream>,
    pub pool: Vec<CUevent>,
    pub ready: CUevent,
    pub done: CUevent,
    pub phase: Vec<CUevent>,
    stage: Option<(CUdeviceptr, usize)>,
    retired_stages: Vec<(CUdeviceptr, usize)>,
    peers: HashSet<i64>,
    /// Prepared plans by (call site, op, rank): several ranks may share a device (tests; one GPU).
    pub plans: PlanCache,
    /// In-flight slots of the start/done driver, per op (index `slot_list`): each call between its
    /// start and its done owns one (`cuda` module header, "Start/done").
    slots: [Vec<Slot>; 2],
}

/// What one call in flight owns on its device, from its start until its done: tide's stream `tide`
/// (the schedule's MAIN: reductions, zeroing, SM copies, joins), side copy streams, the call's events
/// and the reduce-scatter's stage slots. Created on first need, kept for the process, reused by
/// later calls once `busy` is clear. The handles are valid in every thread of the process.
pub struct Slot {
    pub tide: CUstream,
    pub side: Vec<CUstream>,
    /// Local (intra-call) events of the schedule, then one join event per side stream.
    pub pool: Vec<CUevent>,
    /// Recorded on XLA's stream at start (rule A1); tide's stream waits on it.
    pub entry: CUevent,
    /// Recorded on tide's stream after `entry`: this rank's inputs are written, its outputs free,
    /// and the slot's previous call is complete. Peers and side streams wait on it.
    pub ready: CUevent,
    /// Recorded on tide's stream at the end of the call's work (this rank's reads of peers done).
    pub done: CUevent,
    /// Recorded on tide's stream after waiting on every peer's `done`: XLA may reuse this rank's
    /// inputs and read its outputs. Done makes XLA's stream wait on it.
    pub released: CUevent,
    pub phase: Vec<CUevent>,
    stage: Option<(CUdeviceptr, usize)>,
    retired_stages: Vec<(CUdeviceptr, usize)>,
    /// Set while a call owns the slot; cleared when its `SlotLease` drops (at done).
    busy: Arc<AtomicBool>,
}

/// Ownership of a slot by one call, from its start until its done (the payload its
/// `inflight::Record` carries): rule A4's event and the slot. Dropping it frees the slot (no lock
/// needed: the drop may run on any thread, e.g. when `inflight` replaces the record of a start
/// that never got its done).
pub struct SlotLease {
    busy: Arc<AtomicBool>,
    ctx: CUcontext,
    ordinal: i64,
    /// The slot's `released` event: everything the call enqueued, and every peer's reads of this
    /// rank's inputs, precede it.
    released: CUevent,
}

// SAFETY: raw CUDA handles (a retained primary context and an event that lives for the process),
// valid in every thread of the process.
unsafe impl Send for SlotLease {}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.busy.store(false, Ordering::Release);
    }
}

impl SlotLease {
    /// Rule A4: XLA's `stream` waits on the slot's `released` event.
    ///
    /// # Safety
    /// `stream` is a valid stream of the slot's device (XLA's, valid for the call).
    pub unsafe fn join_into(&self, stream: CUstream) -> Result<()> {
        let device = self.ordinal;
        let _ctx = driver::CtxGuard::set(self.ctx, device)?;
        // SAFETY: XLA's stream (valid for the call) and the slot's event.
        unsafe {
            driver::stream_wait_event(stream, self.released, || {
                format!("device {device}: XLA's stream on the call's released event")
            })
        }
    }

    /// The end of a start on both paths: on an error, XLA's stream is still ordered after whatever
    /// was enqueued on tide's stream (which recorded `released` after joining its side streams),
    /// and the slot is freed.
    pub fn end_start(self, call: &CallInfo, result: Result<()>) -> Result<SlotLease> {
        match result {
            Ok(()) => Ok(self),
            Err(e) => {
                if call.stream != 0 {
                    // SAFETY: XLA's stream of the call.
                    if let Err(j) = unsafe { self.join_into(call.stream as CUstream) } {
                        log::warn!(
                            "tide: rank {} device {}: joining tide's stream after an error failed: {j}",
                            call.rank,
                            call.device_ordinal
                        );
                    }
                }
                Err(e)
            }
        }
    }
}

fn slot_list(op: Op) -> usize {
    match op {
        Op::AllGather => 0,
        Op::ReduceScatter => 1,
    }
}

// SAFETY: the raw CUDA handles (context, streams, events, module, device pointers) are plain
// identifiers the driver accepts from any host thread; the state is only used under its mutex.
unsafe impl Send for DeviceState {}

static DEVICES: Lazy<Mutex<HashMap<i64, Arc<Mutex<DeviceState>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));
/// Compiled cubins by architecture ("sm_90"): compiled once, loaded into every device of that arch.
static CUBINS: Lazy<Mutex<HashMap<String, Arc<Vec<u8>>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// The state of device `ordinal`, created on first use.
pub fn get(ordinal: i64) -> Result<Arc<Mutex<DeviceState>>> {
    let mut map = DEVICES.lock().map_err(|_| {
        TideError::Internal("CUDA device table poisoned by an earlier panic".into())
    })?;
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(Mutex::new(DeviceState::new(ordinal)?));
    map.insert(ordinal, d.clone());
    Ok(d)
}

fn event_create(device: i64, what: &str) -> Result<CUevent> {
    driver::event_create(|| format!("device {device}, {what} event"))
}

fn device_handle(ordinal: i64) -> Result<CUdevice> {
    let ord = i32::try_from(ordinal).map_err(|_| {
        TideError::InvalidArgument(format!("device ordinal {ordinal} out of range"))
    })?;
    let count = driver::device_count()?;
    if ord < 0 || ord >= count {
        return Err(TideError::InvalidArgument(format!(
            "device ordinal {ordinal} not among the {count} CUDA devices visible to this process"
        )));
    }
    driver::device_get(ord)
}

impl DeviceState {
    fn new(ordinal: i64) -> Result<DeviceState> {
        let dev = device_handle(ordinal)?;
        let ctx = driver::primary_ctx_retain(dev, ordinal)?;
        let _g = driver::CtxGuard::set(ctx, ordinal)?;
        use CUdevice_attribute as A;
        let attribute = driver::device_attribute;
        let major = attribute(
            dev,
            ordinal,
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            "compute capability",
        )?;
        let minor = attribute(
            dev,
            ordinal,
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            "compute capability",
        )?;
        if attribute(
            dev,
            ordinal,
            A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            "unified addressing",
        )? == 0
        {
            return Err(TideError::Cuda {
                call: "cuDeviceGetAttribute".into(),
                detail: format!(
                    "device {ordinal} has no unified addressing; tide's CUDA engine needs it"
                ),
            });
        }
        let ready = event_create(ordinal, "ready")?;
        let done = event_create(ordinal, "done")?;
        log::info!("tide: CUDA device {ordinal} ready (sm_{major}{minor})");
        Ok(DeviceState {
            ordinal,
            dev,
            ctx,
            cc: (major, minor),
            module: None,
            side: Vec::new(),
            pool: Vec::new(),
            ready,
            done,
            phase: Vec::new(),
            stage: None,
            retired_stages: Vec::new(),
            peers: HashSet::new(),
            plans: PlanCache::default(),
            slots: [Vec::new(), Vec::new()],
        })
    }

    /// A free in-flight slot for a call of `op` (creating one while fewer than `max` exist), with
    /// its lease. Fails, never waits, when `max` calls of `op` are in flight on this device: the
    /// dones that would free them run later on this very thread.
    pub fn acquire_slot(&mut self, op: Op, max: usize) -> Result<(usize, SlotLease)> {
        let ord = self.ordinal;
        let list = slot_list(op);
        // The bound counts calls in flight, not slots (more may exist from a larger setting).
        let busy = self.slots[list].iter().filter(|s| s.busy.load(Ordering::Acquire)).count();
        if busy >= max.max(1) {
            // tide_jax keeps one traced program's hand-written starts below `max` (python/tide_jax/
            // _inflight.py, [Note: in-flight lanes]): what is left is what tracing cannot see.
            return Err(TideError::InvalidArgument(format!(
                "device {ord}: {busy} tide {} calls are already in flight (started, not done; \
                 TIDE_MAX_IN_FLIGHT={max}): every *_start needs its *_done before more than {max} \
                 are outstanding. tide_jax keeps each traced program's own starts to {lanes} per op, \
                 so these come from what tracing cannot see: starts of several programs in flight \
                 on this device at once (let each program finish its starts before the next is \
                 launched), a jitted helper with a start traced once and called several times, \
                 the copies of a lax.scan(unroll=n) body, or scan_layers beside hand-written \
                 starts; or raise TIDE_MAX_IN_FLIGHT",
                match op {
                    Op::AllGather => "all_gather",
                    Op::ReduceScatter => "reduce_scatter",
                },
                lanes = max.max(1) - 1,
            )));
        }
        for (i, s) in self.slots[list].iter().enumerate() {
            if s
                .busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok((i, self.lease(s)));
            }
        }
        let have = self.slots[list].len();
        let what = |e: &str| format!("in-flight slot {have}, {e}");
        // Context current (CtxGuard held by the caller).
        let tide = if crate::config::current().high_priority {
            driver::stream_create_high_priority(|| format!("device {ord}, {}", what("tide stream, high priority")))?
        } else {
            driver::stream_create(|| format!("device {ord}, {}", what("tide stream")))?
        };
        let slot = Slot {
            tide,
            side: Vec::new(),
            pool: Vec::new(),
            entry: event_create(ord, &what("entry"))?,
            ready: event_create(ord, &what("ready"))?,
            done: event_create(ord, &what("done"))?,
            released: event_create(ord, &what("released"))?,
            phase: Vec::new(),
            stage: None,
            retired_stages: Vec::new(),
            busy: Arc::new(AtomicBool::new(true)),
        };
        let lease = self.lease(&slot);
        self.slots[list].push(slot);
        Ok((have, lease))
    }

    fn lease(&self, slot: &Slot) -> SlotLease {
        SlotLease {
            busy: slot.busy.clone(),
            ctx: self.ctx,
            ordinal: self.ordinal,
            released: slot.released,
        }
    }

    pub fn slot(&self, op: Op, index: usize) -> Result<&Slot> {
        self.slots[slot_list(op)]
            .get(index)
            .ok_or_else(|| TideError::Internal(format!("in-flight slot {index} missing")))
    }

    pub fn slot_mut(&mut self, op: Op, index: usize) -> Result<&mut Slot> {
        self.slots[slot_list(op)]
            .get_mut(index)
            .ok_or_else(|| TideError::Internal(format!("in-flight slot {index} missing")))
    }

    /// At least `n` side copy streams (non-blocking: no implicit sync with the legacy stream).
    pub fn ensure_side_streams(&mut self, n: usize) -> Result<()> {
        while self.side.len() < n {
            let ord = self.ordinal;
            let idx = self.side.len();
            // Context current (CtxGuard held by the caller).
            let s = driver::stream_create(|| format!("device {ord}, side copy stream {idx}"))?;
            self.side.push(s);
        }
        Ok(())
    }

    /// At least `n` local (intra-call) events.
    pub fn ensure_events(&mut self, n: usize) -> Result<()> {
        while self.pool.len() < n {
            let e = event_create(self.ordinal, "local")?;
            self.pool.push(e);
        }
        Ok(())
    }

    /// At least `n` phase events (one per phase boundary).
    pub fn ensure_phase_events(&mut self, n: usize) -> Result<()> {
        while self.phase.len() < n {
            let e = event_create(self.ordinal, "phase")?;
            self.phase.push(e);
        }
        Ok(())
    }

    /// Stage slots of the given sizes, each 256-byte aligned, in one allocation made once (at least
    /// `floor_bytes`, the configured bound) and reused by every call. Returns (address, bytes) per slot.
    /// A plan needing more than the allocation gets a new one; the old one is retired, not freed
    /// (work already enqueued may still use it), and a warning is logged.
    pub fn ensure_stage(
        &mut self,
        slots: &[usize],
        floor_bytes: usize,
    ) -> Result<Vec<(u64, usize)>> {
        ensure_stage_in(
            self.ordinal,
            &mut self.stage,
            &mut self.retired_stages,
            slots,
            floor_bytes,
        )
    }
    /// Frees the device-wide stage buffers (the current one and the retired ones: the
    /// multi-process path's) and returns their bytes; a later call allocates new ones. The caller
    /// knows no pending work, here or in a peer process, uses them (`multiproc`'s release after a
    /// failure) and holds the context.
    pub fn release_stage(&mut self) -> usize {
        let ord = self.ordinal;
        let mut freed = 0;
        for (ptr, bytes) in self.stage.take().into_iter().chain(self.retired_stages.drain(..)) {
            // SAFETY: our own allocation from `mem_alloc`; the caller guarantees nothing uses it.
            match unsafe { driver::mem_free(ptr, || format!("device {ord}, {bytes} bytes of staging")) } {
                Ok(()) => freed += bytes,
                Err(e) => log::warn!("tide: {e}"),
            }
        }
        freed
    }

    /// Device memory tide allocated on this device for staging, in bytes: the device-wide stage
    /// buffers and every in-flight slot's (retired ones included).
    pub fn staging_bytes(&self) -> usize {
        let sum = |stage: &Option<(CUdeviceptr, usize)>, retired: &[(CUdeviceptr, usize)]| {
            stage.map_or(0, |s| s.1) + retired.iter().map(|s| s.1).sum::<usize>()
        };
        sum(&self.stage, &self.retired_stages)
            + self
                .slots
                .iter()
                .flatten()
                .map(|s| sum(&s.stage, &s.retired_stages))
                .sum::<usize>()
    }

    /// The kernel module, compiled by NVRTC for this device's arch on first use (once per arch).
    pub fn ensure_module(&mut self) -> Result<&Module> {
        if self.module.is_none() {
            let arch = kernels::arch(self.cc.0, self.cc.1);
            let cubin = {
                let cached = CUBINS
                    .lock()
                    .map_err(|_| TideError::Internal("cubin cache poisoned".into()))?
                    .get(&arch)
                    .cloned();
                match cached {
                    Some(c) => c,
                    None => {
                        let opts = kernels::nvrtc_options(kernels::threads());
                        let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
                        let c = Arc::new(
                            nvrtc::compile_with(
                                kernels::SOURCE,
                                kernels::SOURCE_NAME,
                                &arch,
                                nvrtc::Output::Cubin,
                                &opts,
                            )?
                            .0,
                        );
                        CUBINS
                            .lock()
                            .map_err(|_| TideError::Internal("cubin cache poisoned".into()))?
                            .insert(arch.clone(), c.clone());
                        c
                    }
                }
            };
            let ord = self.ordinal;
            // Context current.
            let module: CUmodule = driver::module_load_data(&cubin, || format!("device {ord}, tide kernels for {arch}"))?;
            let get = |name: &str| -> Result<CUfunction> {
                // SAFETY: module loaded above, never unloaded.
                unsafe { driver::module_get_function(module, name, || format!("device {ord}, kernel {name}")) }
            };
            let m = Module {
                _module: module,
                sum_bf16: get("rs_sum_bf16_f32")?,
                sum_f16: get("rs_sum_f16_f32")?,
                sum_f32: get("rs_sum_f32_f32")?,
                copy: get("tide_copy")?,
                copy_batch: get("tide_copy_batch")?,
                sum_batch: [
                    get("rs_sum_batch_bf16_f32")?,
                    get("rs_sum_batch_f16_f32")?,
                    get("rs_sum_batch_f32_f32")?,
                ],
                sum_at: [get("rs_sum_at_bf16_f32")?, get("rs_sum_at_f16_f32")?, get("rs_sum_at_f32_f32")?],
                zero_at: get("tide_zero_at")?,
                cast_at: get("tide_cast_at_f32_bf16")?,
            };
            // TIDE_SM_CARVEOUT (read once per process, as the threads): every kernel's preferred
            // L1/shared split, so its CTAs may share an SM with a compute kernel's.
            let carveout = crate::config::CONFIG.sm_carveout;
            if carveout >= 0 {
                for (name, f) in m.functions() {
                    // SAFETY: a function of the module loaded above, never unloaded.
                    unsafe { driver::func_set_carveout(f, carveout, || format!("device {ord}, kernel {name}, TIDE_SM_CARVEOUT={carveout}"))? };
                }
            }
            self.module = Some(Arc::new(m));
        }
        self.module
            .as_deref()
            .ok_or_else(|| TideError::Internal("module missing after load".into()))
    }

    /// Enables this device's context to access `peer`'s memory (once; "already enabled" is fine).
    pub fn ensure_peer(&mut self, peer: i64) -> Result<()> {
        if peer == self.ordinal || self.peers.contains(&peer) {
            return Ok(());
        }
        let ord = self.ordinal;
        let pdev = device_handle(peer)?;
        if !driver::can_access_peer(self.dev, pdev, || format!("device {ord} -> device {peer}"))? {
            return Err(TideError::Cuda {
                call: "cuDeviceCanAccessPeer".into(),
                detail: format!(
                    "device {ord} cannot access device {peer}'s memory (no P2P); tide's CUDA engine needs \
                     peer access between the GPUs of a group"
                ),
            });
        }
        let pctx = driver::primary_ctx_retain(pdev, peer)?;
        // SAFETY: this device's context is current (CtxGuard held by the caller); pctx is retained.
        unsafe { driver::enable_peer_access(pctx, || format!("device {ord} -> device {peer}"))? };
        self.peers.insert(peer);
        Ok(())
    }
}

/// Waits until every stream in `streams` is idle and every event in `events` complete, polling
/// (never blocking in the driver) for at most `wait`; `Ok(false)` if some work is still pending
/// then. The device's context must be current.
pub fn drain(streams: &[CUstream], events: &[CUevent], wait: std::time::Duration, who: &dyn Fn() -> String) -> Result<bool> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let mut idle = true;
        for &s in streams {
            // SAFETY: streams of this process (tide's, or XLA's of the current call).
            idle &= unsafe { driver::stream_idle(s, || format!("{}: draining tide's streams", who()))? };
        }
        for &e in events {
            // SAFETY: tide's own events, never destroyed.
            idle &= unsafe { driver::event_complete(e, || format!("{}: draining tide's events", who()))? };
        }
        if idle {
            return Ok(true);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// `DeviceState::ensure_stage` over one stage allocation (the device's, or an in-flight slot's).
fn ensure_stage_in(
    ordinal: i64,
    stage: &mut Option<(CUdeviceptr, usize)>,
    retired: &mut Vec<(CUdeviceptr, usize)>,
    slots: &[usize],
    floor_bytes: usize,
) -> Result<Vec<(u64, usize)>> {
    if slots.is_empty() {
        return Ok(Vec::new());
    }
    let mut offsets = Vec::with_capacity(slots.len());
    let mut total = 0usize;
    for &b in slots {
        offsets.push(total);
        total = total
            .checked_add(b.div_ceil(256) * 256)
            .ok_or_else(|| TideError::Internal("stage size overflows".into()))?;
    }
    let have = stage.map(|s| s.1).unwrap_or(0);
    if have < total {
        let bytes = total.max(floor_bytes);
        let ord = ordinal;
        // Context current.
        let ptr = driver::mem_alloc(bytes, || {
            format!("device {ord}, {bytes} bytes of reduce-scatter staging (TIDE_RS_STAGE_SLOTS x TIDE_RS_SLOT_BYTES)")
        })?;
        if let Some(old) = stage.take() {
            log::warn!(
                "tide: device {ord}: stage buffer grown from {} to {bytes} bytes; the old one stays allocated",
                old.1
            );
            retired.push(old);
        }
        *stage = Some((ptr, bytes));
    }
    let base = stage.map(|s| s.0).unwrap_or(0);
    Ok(offsets
        .iter()
        .zip(slots)
        .map(|(&o, &b)| (base + o as u64, b))
        .collect())
}

impl Slot {
    /// At least `n` side copy streams (non-blocking).
    pub fn ensure_side_streams(&mut self, ordinal: i64, n: usize) -> Result<()> {
        while self.side.len() < n {
            let idx = self.side.len();
            // Context current (CtxGuard held by the caller).
            let s = driver::stream_create(|| format!("device {ordinal}, in-flight side copy stream {idx}"))?;
            self.side.push(s);
        }
        Ok(())
    }

    /// At least `n` local events.
    pub fn ensure_events(&mut self, ordinal: i64, n: usize) -> Result<()> {
        while self.pool.len() < n {
            self.pool.push(event_create(ordinal, "in-flight local")?);
        }
        Ok(())
    }

    /// At least `n` phase events.
    pub fn ensure_phase_events(&mut self, ordinal: i64, n: usize) -> Result<()> {
        while self.phase.len() < n {
            self.phase.push(event_create(ordinal, "in-flight phase")?);
        }
        Ok(())
    }

    /// This slot's stage slots (see `DeviceState::ensure_stage`): each call in flight has its own,
    /// so device memory for staging is TIDE_MAX_IN_FLIGHT x TIDE_RS_STAGE_SLOTS x TIDE_RS_SLOT_BYTES.
    pub fn ensure_stage(
        &mut self,
        ordinal: i64,
        slots: &[usize],
        floor_bytes: usize,
    ) -> Result<Vec<(u64, usize)>> {
        ensure_stage_in(ordinal, &mut self.stage, &mut self.retired_stages, slots, floor_bytes)
    }
}
