//! The exchange of the multi-process path (`multiproc` module header, "What is published") and
//! the meeting built from it: this rank's mailbox (`Mail`: its allocations, buffers as
//! (allocation, offset, bytes), how many phase points it signals, the rail's `ncclUniqueId`) composed
//! (`compose`), written and announced before the entry barrier (`publish`), the peers' mailboxes
//! read, mapped and opened after it (`read_peers`), and `Mailbox`, the `meeting::Meeting` of one
//! call over the group's barriers with the NCCL rail as its hooks.
//!
//! The wire format is this file's (`Mail::encode` / `decode`): little-endian u64 fields, a magic,
//! the call's sequence number (a mailbox of another call is refused), then the lists.

use super::rail::{self, RailOp};
use super::{DevPart, RankState, MAILBOX_BYTES};
use crate::call::{op_code, CallInfo};
use crate::cuda::device::DeviceState;
use crate::cuda::driver::{self, CUevent, CUstream};
use crate::cuda::ipc::{self, AllocDesc, FdChannel};
use crate::cuda::meeting::{Local, Meeting, RankInfo};
use crate::cuda::nccl;
use crate::cuda::schedule::Cmd;
use crate::cuda::signal::{self, Point};
use crate::error::{Result, TideError};
use crate::plan::Plan;
use crate::transport::group::Announcement;
use std::cell::Cell;
use std::collections::HashMap;
use std::time::Duration;

const MAILBOX_MAGIC: u64 = 0x7469_6465_6375_6d62; // "tidecumb"

/// Everything a peer published for one call.
#[derive(Debug, Default)]
pub(super) struct Mail {
    device: i64,
    pid: u64,
    allocs: Vec<AllocDesc>,
    /// How many phase points the rank signals for this call (its plan's phases - 1).
    phases: usize,
    /// (allocation index, offset, bytes)
    inputs: Vec<(usize, u64, usize)>,
    stages: Vec<(usize, u64, usize)>,
    pub(super) nccl_id: Option<nccl::UniqueId>,
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}


impl Mail {
    fn encode(&self, seq: u64) -> Vec<u8> {
        let mut o = Vec::with_capacity(1024);
        for v in [
            0, // total length, patched below
            MAILBOX_MAGIC,
            seq,
            self.device as u64,
            self.pid,
            self.allocs.len() as u64,
            self.phases as u64,
            self.inputs.len() as u64,
            self.stages.len() as u64,
            self.nccl_id.is_some() as u64,
        ] {
            put(&mut o, v);
        }
        for a in &self.allocs {
            a.encode(&mut o);
        }
        for &(a, off, b) in self.inputs.iter().chain(&self.stages) {
            put(&mut o, a as u64);
            put(&mut o, off);
            put(&mut o, b as u64);
        }
        if let Some(id) = &self.nccl_id {
            o.extend_from_slice(id);
        }
        let n = o.len() as u64;
        o[..8].copy_from_slice(&n.to_le_bytes());
        o
    }

    fn decode(b: &[u8], seq: u64) -> std::result::Result<Mail, String> {
        let mut pos = 0usize;
        let mut take = |n: usize| -> std::result::Result<&[u8], String> {
            let s = b
                .get(pos..pos + n)
                .ok_or_else(|| format!("truncated at byte {pos}"))?;
            pos += n;
            Ok(s)
        };
        let mut u = || -> std::result::Result<u64, String> {
            Ok(u64::from_le_bytes(take(8)?.try_into().unwrap()))
        };
        let _len = u()?;
        if u()? != MAILBOX_MAGIC {
            return Err("bad magic".into());
        }
        let their_seq = u()?;
        if their_seq != seq {
            return Err(format!("it holds call {their_seq}, not {seq}"));
        }
        let device = u()? as i64;
        let pid = u()?;
        let (na, np, ni, ns, has_id) = (
            u()? as usize,
            u()? as usize,
            u()? as usize,
            u()? as usize,
            u()? != 0,
        );
        let mut m = Mail {
            device,
            pid,
            phases: np,
            ..Default::default()
        };
        for _ in 0..na {
            m.allocs
                .push(AllocDesc::decode(take(AllocDesc::WIRE_BYTES)?).ok_or("bad allocation")?);
        }
        for k in 0..ni + ns {
            let t = take(24)?;
            let g = |i: usize| u64::from_le_bytes(t[i * 8..i * 8 + 8].try_into().unwrap());
            let e = (g(0) as usize, g(1), g(2) as usize);
            if e.0 >= na {
                return Err(format!("buffer {k} names allocation {} of {na}", e.0));
            }
            if k < ni {
                m.inputs.push(e);
            } else {
                m.stages.push(e);
            }
        }
        if has_id {
            let mut id = [0u8; 128];
            id.copy_from_slice(take(128)?);
            m.nccl_id = Some(id);
        }
        Ok(m)
    }
}


/// This rank's mailbox for a call of `local`'s plan: its operands and stage slots as (allocation,
/// offset, bytes) (exporting new allocations), how many phase points it signals (its `ready`,
/// `done` and phase points are the signal page at its mailbox's tail, never published); the
/// rail's `ncclUniqueId` when this rank is the rail's node 0 and must make it.
pub(super) fn compose(rs: &mut RankState, call: &CallInfo, local: &Local, nphases: usize, make_nccl_id: bool) -> Result<Mail> {
    let (me, ord) = (call.rank, call.device_ordinal);
    let mut mail = Mail {
        device: ord,
        pid: std::process::id() as u64,
        ..Default::default()
    };
    let mut alloc_index: HashMap<(u64, u64), usize> = HashMap::new();
    let mut describe = |rs: &mut RankState, mail: &mut Mail, ptr: u64, bytes: usize, label: &dyn Fn() -> String| -> Result<(usize, u64, usize)> {
        if bytes == 0 || ptr == 0 {
            return Ok((0, 0, 0));
        }
        let (a, off) = rs.exporter.describe(ptr, &|| format!("rank {me} device {ord}, {}", label()))?;
        let idx = *alloc_index.entry((a.base, a.gen)).or_insert_with(|| {
            mail.allocs.push(a);
            mail.allocs.len() - 1
        });
        Ok((idx, off, bytes))
    };
    for (i, &(p, b)) in local.info.inputs.iter().enumerate() {
        let e = describe(rs, &mut mail, p, b, &|| format!("operand {i}"))?;
        mail.inputs.push(e);
    }
    for (i, &(p, b)) in local.info.stages.iter().enumerate() {
        let e = describe(rs, &mut mail, p, b, &|| format!("stage slot {i}"))?;
        mail.stages.push(e);
    }
    if mail.allocs.is_empty() {
        // Keep index 0 valid for empty buffers.
        mail.allocs.push(AllocDesc {
            base: 0,
            size: 0,
            gen: 0,
            kind: ipc::KIND_LEGACY,
            legacy: [0; 64],
        });
        for e in mail.inputs.iter_mut().chain(mail.stages.iter_mut()) {
            e.0 = 0;
        }
    }
    mail.phases = nphases.saturating_sub(1);
    if make_nccl_id {
        mail.nccl_id = Some(nccl::unique_id()?);
    }
    Ok(mail)
}

/// Publishes `mail` for call `seq`: written to this rank's mailbox, the fds of new VMM exports
/// sent to the node's peers in other processes, the call announced; then the entry barrier, and
/// every member must announce the same call (sequence, op, plan fingerprint).
#[allow(clippy::too_many_arguments)]
pub(super) fn publish(rs: &mut RankState, call: &CallInfo, job: u64, seq: u64, what: &str, mail: &Mail, plan: &Plan, g: usize) -> Result<()> {
    let me = call.rank;
    let my_node = me / g;
    let bytes = mail.encode(seq);
    // The mailbox's last page is the rank's signal page.
    let room = MAILBOX_BYTES - signal::PAGE_BYTES;
    if bytes.len() > room {
        return crate::invalid!(
            "{what}: {} bytes to publish exceed the CUDA mailbox ({room} bytes)",
            bytes.len()
        );
    }
    // SAFETY: the mailbox is MAILBOX_BYTES long, bytes fit before its signal page, only this rank writes it; peers read it after
    // the entry barrier (Release/Acquire) and are done before they pass our exit barrier.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), rs.mailbox.as_ptr(), bytes.len()) };
    // File descriptors of new VMM exports to the peers of this node (they map our memory).
    for q in (0..call.world).filter(|&q| q != me && q / g == my_node && rs.group.pid_of(q) != mail.pid) {
        let addr = FdChannel::name_of(job, call.group, q);
        rs.exporter.send_new(&rs.chan, me, q, &addr, &mail.allocs)?;
    }
    let fp = crate::transport::cpu::fingerprint(plan);
    let op = op_code(call.op) as u64;
    rs.group.announce(Announcement {
        seq,
        op,
        site: call.site,
        fingerprint: fp,
        data_class: 0,
    });
    rs.group.barrier(&format!("entry of {what}"))?;
    let members = rs.group.members().to_vec();
    for q in members.iter().copied().filter(|&q| q != me) {
        let a = rs.group.announcement(q);
        if a.seq != seq || a.op != op || a.fingerprint != fp {
            return Err(rs.group.fail_with(format!(
                "{what}: rank {q} (pid {}) is in a different call (its call {}, op {}, site {}, plan {:016x}; ours: call {seq}, \
                 op {op}, plan {fp:016x}): every process must issue the same tide calls in the same order (across processes \
                 calls meet in launch order: programs launched from several threads can reach the processes in different \
                 orders; launch tide programs from one thread per process, tide_jax.dispatch_lock orders the threads of \
                 one process only)",
                rs.group.pid_of(q),
                a.seq,
                a.op,
                a.site,
                a.fingerprint
            )));
        }
    }
    Ok(())
}

/// What every rank published for call `seq`, after the entry barrier: this rank's own `local`
/// info; for each peer of this node, its mailbox read, its allocations mapped and its events
/// opened (peers in this process: their raw addresses and events); ranks of other nodes only by
/// device (reached through the rail). Also each rank's published `ncclUniqueId`.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(super) fn read_peers(
    rs: &mut RankState,
    st: &mut DeviceState,
    call: &CallInfo,
    seq: u64,
    what: &str,
    local: &Local,
    plan: &Plan,
    nphases: usize,
    wait_fd: Duration,
) -> Result<(Vec<RankInfo>, Vec<Option<nccl::UniqueId>>)> {
    let me = call.rank;
    let members = rs.group.members().to_vec();
    let mut infos: Vec<RankInfo> = Vec::with_capacity(call.world);
    let mut peer_ids: Vec<Option<nccl::UniqueId>> = vec![None; call.world];
    #[allow(clippy::needless_range_loop)] // q indexes infos, peer_ids and the mailboxes
    for q in 0..call.world {
        if q == me {
            // Own events: the device's (ready, done, phases), as the in-process engine uses them.
            infos.push(local.info.clone());
            continue;
        }
        if !members.contains(&q) {
            // Another node under a per-node control plane: reached only through the rail, never
            // addressed (its copies are NCCL transfers on this rank's own buffers).
            infos.push(RankInfo {
                device: -1,
                ..Default::default()
            });
            continue;
        }
        let (info, id) = read_peer(rs, st, call, q, (seq, what), plan, nphases, wait_fd)?;
        peer_ids[q] = id;
        infos.push(info);
    }
    Ok((infos, peer_ids))
}

/// Peer `q`'s mailbox (a member of this rank's control plane): decoded, checked against this
/// rank's plan, its allocations mapped and its events opened where it is on this node.
#[allow(clippy::too_many_arguments)]
fn read_peer(
    rs: &mut RankState,
    st: &mut DeviceState,
    call: &CallInfo,
    q: usize,
    (seq, what): (u64, &str),
    plan: &Plan,
    nphases: usize,
    wait_fd: Duration,
) -> Result<(RankInfo, Option<nccl::UniqueId>)> {
    let me = call.rank;
    let g = call.topology.gpus_per_node.max(1);
    let my_pid = std::process::id() as u64;
    let pid = rs.group.pid_of(q);
    let seg = rs.peer_boxes[q]
        .as_ref()
        .ok_or_else(|| TideError::Internal(format!("rank {q}'s mailbox not mapped")))?;
    // SAFETY: a mapping of MAILBOX_BYTES; the peer wrote it before the entry barrier.
    let raw = unsafe { std::slice::from_raw_parts(seg.as_ptr(), MAILBOX_BYTES) };
    let len = (u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize).min(MAILBOX_BYTES);
    let m = Mail::decode(&raw[..len], seq).map_err(|e| {
        TideError::Rendezvous(format!("{what}: rank {q}'s (pid {pid}) mailbox is unreadable: {e}"))
    })?;
    if q / g != me / g {
        return Ok((
            RankInfo {
                device: m.device,
                ..Default::default()
            },
            m.nccl_id,
        ));
    }
    let n = plan.layout.len();
    if m.inputs.len() != n || m.stages.len() < plan.stage_slot_bytes.len() || m.phases + 1 < nphases {
        return Err(rs.group.fail_with(format!(
            "{what}: rank {q} (pid {pid}) published {} operands, {} stage slots, {} phase events; this plan has {n}, {}, {} \
             (TIDE_RS_* settings must match)",
            m.inputs.len(),
            m.stages.len(),
            m.phases,
            plan.stage_slot_bytes.len(),
            nphases.saturating_sub(1)
        )));
    }
    // A peer in this process: its addresses and events are valid here as they are (and CUDA
    // refuses to open a process's own IPC handles); peer access as in the in-process engine.
    let same = m.pid == my_pid;
    if same {
        st.ensure_peer(m.device)?;
    }
    let d = rs.dev.as_mut().expect("device part");
    let mut bases = vec![None; m.allocs.len()];
    let mut addr = |idx: usize, off: u64, bytes: usize| -> Result<(u64, usize)> {
        if bytes == 0 {
            return Ok((0, 0));
        }
        let a = &m.allocs[idx];
        if off + bytes as u64 > a.size {
            return Err(TideError::Rendezvous(format!(
                "{what}: rank {q} (pid {pid}) published a buffer at offset {off} + {bytes} bytes past its allocation of {} bytes",
                a.size
            )));
        }
        let base = match bases[idx] {
            Some(b) => b,
            None if same => {
                d.importer.grant_local(me, q, a)?;
                bases[idx] = Some(a.base);
                a.base
            }
            None => {
                let b = d.importer.map(me, q, pid, a, &rs.chan, wait_fd)?;
                bases[idx] = Some(b);
                b
            }
        };
        Ok((base + off, bytes))
    };
    let mut info = RankInfo {
        device: m.device,
        ..Default::default()
    };
    for (i, &(a, off, b)) in m.inputs.iter().enumerate() {
        if b != plan.input_bytes(i) {
            return Err(rs.group.fail_with(format!(
                "{what}: rank {q} (pid {pid}): {}: operand of {b} bytes, expected {}; every rank must call with the same group",
                plan.layout.params[i].describe(),
                plan.input_bytes(i)
            )));
        }
        info.inputs.push(addr(a, off, b)?);
    }
    for &(a, off, b) in &m.stages {
        info.stages.push(addr(a, off, b)?);
    }
    // Its points: the signal page at the tail of its mailbox (also for a peer in this process:
    // another context's events cannot be waited on by raw handle, see the module header).
    let seg = rs.peer_boxes[q]
        .as_ref()
        .ok_or_else(|| TideError::Internal(format!("rank {q}'s mailbox not mapped")))?;
    info.signals = Some(d.peer_page(q, seg)?);
    Ok((info, m.nccl_id))
}

/// The multi-process meeting of one call (`meeting` module header): the group's barriers, the
/// values read from the mailboxes, and the rail's hooks. Built by `run_call` after the entry
/// barrier and the mailbox exchange; the group's exit barrier ends the call (nothing to leave:
/// peers' mailboxes are read before it, and a mailbox is rewritten only after the next entry).
pub(super) struct Mailbox<'a> {
    pub(super) rs: &'a RankState,
    pub(super) d: &'a DevPart,
    pub(super) infos: Vec<RankInfo>,
    /// The rail operations of each phase (empty on one node).
    pub(super) rails: Vec<Vec<RailOp>>,
    /// The device's own `ready`, `done` and phase events (the rail stream waits on them).
    pub(super) ready: CUevent,
    pub(super) done: CUevent,
    pub(super) phase: &'a [CUevent],
    pub(super) what: &'a str,
    pub(super) g: usize,
    pub(super) ord: i64,
    /// The last phase whose rail transfers were issued.
    pub(super) last_rail: Cell<Option<usize>>,
}

impl Mailbox<'_> {
    fn wait(&self, s: CUstream, ev: usize, label: &dyn Fn() -> String) -> Result<()> {
        let (me, ord) = (self.rs.rank, self.ord);
        // SAFETY: an event of this process or opened from a peer, valid for the process.
        unsafe { driver::stream_wait_event(s, ev as CUevent, || format!("rank {me} device {ord}: {}", label())) }
    }
    fn record(&self, ev: CUevent, main: CUstream, label: &dyn Fn() -> String) -> Result<()> {
        let (me, ord) = (self.rs.rank, self.ord);
        // SAFETY: valid event and stream.
        unsafe { driver::event_record(ev, main, || format!("rank {me} device {ord}: {}", label())) }
    }
}

impl Meeting for Mailbox<'_> {
    fn infos(&self) -> &[RankInfo] {
        &self.infos
    }
    fn barrier(&self, label: &str) -> Result<()> {
        self.rs.group.barrier(&format!("{label} of {}", self.what))
    }
    /// Nothing here: `multiproc::execute` publishes every error of the call (also those before the
    /// meeting existed) after it aborted the rail: the order this path always had, kept as it is
    /// (the rail cannot be tested on one GPU); its panic guard publishes a panic with its message.
    fn fail(&self, _err: &TideError) {}
    fn leave(&self) -> Result<()> {
        Ok(())
    }
    /// Ranks of this node (events of other nodes are never waited on: the module header's rail).
    fn reaches(&self, q: usize) -> bool {
        q / self.g == self.rs.rank / self.g
    }
    /// The rail (module header): the phase's NCCL group on the rail stream, after what precedes
    /// the phase, then the phase's rail event.
    fn phase_start(&self, p: usize, _main: CUstream) -> Result<()> {
        let ops = self.rails.get(p).map(|v| v.as_slice()).unwrap_or(&[]);
        if ops.is_empty() {
            return Ok(());
        }
        let (me, g, d) = (self.rs.rank, self.g, self.d);
        let comm = d
            .rail
            .as_ref()
            .ok_or_else(|| TideError::Internal("rail communicator missing".into()))?;
        let rsx = d.rail_stream;
        if p == 0 {
            self.wait(rsx, self.ready as usize, &|| "rail stream on ready".into())?;
            self.wait(rsx, self.done as usize, &|| "rail stream on the previous done".into())?;
        } else {
            self.wait(rsx, self.phase[p - 1] as usize, &|| format!("rail stream on phase {}", p - 1))?;
            for q in (0..self.infos.len()).filter(|&q| q != me && q / g == me / g) {
                let ord = self.ord;
                self.infos[q].wait(rsx, Point::Phase(p - 1), || {
                    format!("rank {me} device {ord}: rail stream on rank {q}'s phase {}", p - 1)
                })?;
            }
        }
        rail::transfer(self.rs, comm, ops, &self.infos, rsx, p, self.what, g)?;
        self.record(d.rail_events[p], rsx, &|| format!("rail event of phase {p}"))?;
        self.last_rail.set(Some(p));
        Ok(())
    }
    /// A copy between nodes: the stream waits on the phase's rail event in its place.
    fn rail_event(&self, p: usize, cmd: &Cmd) -> Option<CUevent> {
        match cmd {
            Cmd::Copy { src, dst, .. } if src.rank / self.g != dst.rank / self.g => Some(self.d.rail_events[p]),
            _ => None,
        }
    }
    /// The phase point for peers in other processes (`signal`), right after the phase event.
    fn phase_recorded(&self, p: usize, main: CUstream) -> Result<()> {
        let (me, ord) = (self.rs.rank, self.ord);
        // SAFETY: MAIN is XLA's stream of this call, live for the call.
        unsafe { self.d.signals.record(main, Point::Phase(p), || format!("rank {me} device {ord}: phase {p} signal")) }
    }
    /// MAIN after every rail transfer (sends read our inputs; XLA may reuse them after the call).
    fn phases_ended(&self, main: CUstream) -> Result<()> {
        match self.last_rail.get() {
            Some(p) => self.wait(main, self.d.rail_events[p] as usize, &|| "XLA's stream on the rail".into()),
            None => Ok(()),
        }
    }
    /// `done` for peers in other processes (`signal`), right after the done event.
    fn done_recorded(&self, main: CUstream) -> Result<()> {
        let (me, ord) = (self.rs.rank, self.ord);
        // SAFETY: as `phase_recorded`.
        unsafe { self.d.signals.record(main, Point::Done, || format!("rank {me} device {ord}: done signal")) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mailbox_roundtrip() {
        let m = Mail {
            device: 3,
            pid: 4242,
            allocs: vec![AllocDesc {
                base: 0x1000,
                size: 1 << 20,
                gen: 2,
                kind: ipc::KIND_VMM,
                legacy: [1; 64],
            }],
            phases: 2,
            inputs: vec![(0, 64, 100), (0, 256, 0)],
            stages: vec![(0, 4096, 65536)],
            nccl_id: Some([9; 128]),
        };
        let b = m.encode(17);
        let d = Mail::decode(&b, 17).unwrap();
        assert_eq!(
            (
                d.device,
                d.pid,
                d.allocs.clone(),
                d.phases,
            ),
            (
                3,
                4242,
                m.allocs.clone(),
                m.phases,
            )
        );
        assert_eq!(
            (d.inputs.clone(), d.stages.clone(), d.nccl_id),
            (m.inputs.clone(), m.stages.clone(), m.nccl_id)
        );
        assert!(Mail::decode(&b, 18).is_err());
        assert!(Mail::decode(&b[..b.len() - 1], 17).is_err());
    }
}
