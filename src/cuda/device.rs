//! Per-device state of the CUDA engine, created on the first call for a device and kept for the
//! life of the process (keyed by XLA's device ordinal): the retained primary context (the one XLA
//! uses), compute capability, the NVRTC-compiled kernel module, side copy streams, events, the
//! bounded stage buffer, the set of peers with access enabled, and prepared plans/schedules per call
//! site. Each device's state sits behind its own mutex, held by the device's host thread for the
//! whole call (XLA runs one device's program on one thread; see the `cuda` module header).

use super::driver::{
    check, CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream,
};
use super::kernels;
use super::nvrtc;
use super::schedule::Schedule;
use crate::error::{Result, TideError};
use crate::layout::{DType, GroupLayout};
use crate::plan::{Op, Plan};
use crate::topology::Topology;
use cudarc::driver::sys;
use once_cell::sync::Lazy;
use std::collections::{HashMap, HashSet};
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

/// A plan and this rank's schedule of it, for one call site (rebuilt if the call's shape changes).
pub struct Prepared {
    pub op: Op,
    pub rank: usize,
    pub topology: Topology,
    pub layout: GroupLayout,
    pub plan: Plan,
    pub schedule: Schedule,
    /// The settings the plan and schedule were built under (rebuilt when they change).
    pub settings: PlanSettings,
}

/// The configuration values a prepared plan and schedule depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSettings {
    pub stage_slots: usize,
    pub slot_bytes: usize,
    pub streams: usize,
    pub local_copy: crate::config::LocalCopy,
}

impl PlanSettings {
    pub fn of(op: Op, c: &crate::config::Config) -> PlanSettings {
        PlanSettings {
            stage_slots: c.rs_stage_slots,
            slot_bytes: c.rs_slot_bytes,
            streams: match op {
                Op::AllGather => c.ag_streams,
                Op::ReduceScatter => c.rs_copy_streams,
            },
            local_copy: c.local_copy,
        }
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
    /// By (call site, op, rank): several ranks may share a device (tests; one GPU).
    pub prepared: HashMap<(i64, Op, usize), Arc<Prepared>>,
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
    busy: Arc<std::sync::atomic::AtomicBool>,
}

/// Ownership of a slot by one call. Dropping it frees the slot (no lock needed: the drop may run
/// on any thread, e.g. when `inflight` replaces the record of a start that never got its done).
pub struct SlotLease {
    busy: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.busy.store(false, std::sync::atomic::Ordering::Release);
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
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: the device's context is current (callers hold a CtxGuard); valid out-pointer.
    check(
        unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
        "cuEventCreate",
        || format!("device {device}, {what} event"),
    )?;
    Ok(e)
}

fn device_handle(ordinal: i64) -> Result<CUdevice> {
    let ord = i32::try_from(ordinal).map_err(|_| {
        TideError::InvalidArgument(format!("device ordinal {ordinal} out of range"))
    })?;
    let mut count = 0;
    // SAFETY: valid out-pointer; driver initialized by the caller.
    check(
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
        String::new,
    )?;
    if ord < 0 || ord >= count {
        return Err(TideError::InvalidArgument(format!(
            "device ordinal {ordinal} not among the {count} CUDA devices visible to this process"
        )));
    }
    let mut dev: CUdevice = 0;
    // SAFETY: valid out-pointer, ordinal checked.
    check(
        unsafe { sys::cuDeviceGet(&mut dev, ord) },
        "cuDeviceGet",
        || format!("ordinal {ordinal}"),
    )?;
    Ok(dev)
}

fn primary_ctx(dev: CUdevice, ordinal: i64) -> Result<CUcontext> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: valid device and out-pointer. Retained for the life of the process (never released):
    // XLA uses the same primary context.
    check(
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        "cuDevicePrimaryCtxRetain",
        || format!("device {ordinal}"),
    )?;
    Ok(ctx)
}

fn attribute(
    dev: CUdevice,
    ordinal: i64,
    attr: sys::CUdevice_attribute,
    name: &str,
) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid device and out-pointer.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
        || format!("device {ordinal}, {name}"),
    )?;
    Ok(v)
}

impl DeviceState {
    fn new(ordinal: i64) -> Result<DeviceState> {
        let dev = device_handle(ordinal)?;
        let ctx = primary_ctx(dev, ordinal)?;
        let _g = super::driver::CtxGuard::set(ctx, ordinal)?;
        use sys::CUdevice_attribute as A;
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
            prepared: HashMap::new(),
            slots: [Vec::new(), Vec::new()],
        })
    }

    /// A free in-flight slot for a call of `op` (creating one while fewer than `max` exist), with
    /// its lease. Fails, never waits, when `max` calls of `op` are in flight on this device: the
    /// dones that would free them run later on this very thread.
    pub fn acquire_slot(&mut self, op: Op, max: usize) -> Result<(usize, SlotLease)> {
        use std::sync::atomic::Ordering;
        let ord = self.ordinal;
        let list = slot_list(op);
        // The bound counts calls in flight, not slots (more may exist from a larger setting).
        let busy = self.slots[list].iter().filter(|s| s.busy.load(Ordering::Acquire)).count();
        if busy >= max.max(1) {
            return Err(TideError::InvalidArgument(format!(
                "device {ord}: {busy} tide {} calls are already in flight (started, not done; \
                 TIDE_MAX_IN_FLIGHT={max}): every *_start needs its *_done before more than {max} \
                 are outstanding; raise TIDE_MAX_IN_FLIGHT for deeper overlap",
                match op {
                    Op::AllGather => "all_gather",
                    Op::ReduceScatter => "reduce_scatter",
                }
            )));
        }
        for (i, s) in self.slots[list].iter().enumerate() {
            if s
                .busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok((i, SlotLease { busy: s.busy.clone() }));
            }
        }
        let have = self.slots[list].len();
        let what = |e: &str| format!("in-flight slot {have}, {e}");
        let mut tide: CUstream = std::ptr::null_mut();
        // SAFETY: context current (CtxGuard held by the caller); valid out-pointer.
        check(
            unsafe { sys::cuStreamCreate(&mut tide, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
            || format!("device {ord}, {}", what("tide stream")),
        )?;
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
            busy: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        };
        let lease = SlotLease { busy: slot.busy.clone() };
        self.slots[list].push(slot);
        Ok((have, lease))
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
            let mut s: CUstream = std::ptr::null_mut();
            let ord = self.ordinal;
            let idx = self.side.len();
            // SAFETY: context current (CtxGuard held by the caller); valid out-pointer.
            check(
                unsafe {
                    sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
                },
                "cuStreamCreate",
                || format!("device {ord}, side copy stream {idx}"),
            )?;
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
                        let c = Arc::new(nvrtc::compile(
                            kernels::SOURCE,
                            kernels::SOURCE_NAME,
                            &arch,
                            nvrtc::Output::Cubin,
                        )?);
                        CUBINS
                            .lock()
                            .map_err(|_| TideError::Internal("cubin cache poisoned".into()))?
                            .insert(arch.clone(), c.clone());
                        c
                    }
                }
            };
            let ord = self.ordinal;
            let mut module: CUmodule = std::ptr::null_mut();
            // SAFETY: context current; the cubin image outlives the call (the driver copies it).
            check(
                unsafe { sys::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) },
                "cuModuleLoadData",
                || format!("device {ord}, tide kernels for {arch}"),
            )?;
            let get = |name: &str| -> Result<CUfunction> {
                let c = std::ffi::CString::new(name).expect("kernel name without NUL");
                let mut f: CUfunction = std::ptr::null_mut();
                // SAFETY: module loaded above; valid out-pointer and name.
                check(
                    unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
                    "cuModuleGetFunction",
                    || format!("device {ord}, kernel {name}"),
                )?;
                Ok(f)
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
            };
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
        let mut can = 0;
        // SAFETY: valid devices and out-pointer.
        check(
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.dev, pdev) },
            "cuDeviceCanAccessPeer",
            || format!("device {ord} -> device {peer}"),
        )?;
        if can == 0 {
            return Err(TideError::Cuda {
                call: "cuDeviceCanAccessPeer".into(),
                detail: format!(
                    "device {ord} cannot access device {peer}'s memory (no P2P); tide's CUDA engine needs \
                     peer access between the GPUs of a group"
                ),
            });
        }
        let pctx = primary_ctx(pdev, peer)?;
        // SAFETY: this device's context is current (CtxGuard held by the caller); pctx is retained.
        let r = unsafe { sys::cuCtxEnablePeerAccess(pctx, 0) };
        if r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            check(r, "cuCtxEnablePeerAccess", || {
                format!("device {ord} -> device {peer}")
            })?;
        }
        self.peers.insert(peer);
        Ok(())
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
        let mut ptr: CUdeviceptr = 0;
        let ord = ordinal;
        // SAFETY: context current; valid out-pointer.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) },
            "cuMemAlloc",
            || {
                format!("device {ord}, {bytes} bytes of reduce-scatter staging (TIDE_RS_STAGE_SLOTS x TIDE_RS_SLOT_BYTES)")
            },
        )?;
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
            let mut s: CUstream = std::ptr::null_mut();
            let idx = self.side.len();
            // SAFETY: context current (CtxGuard held by the caller); valid out-pointer.
            check(
                unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
                "cuStreamCreate",
                || format!("device {ordinal}, in-flight side copy stream {idx}"),
            )?;
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
