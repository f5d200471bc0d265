//! The funnel of every CUDA call (`execute_phase`): a synchronous call, a start, or a done, on
//! either path (`call.job`: 0 in-process, else multi-process). Owns the pairing of a start and its
//! done through `crate::inflight` and the hand-over between them (the slot's `SlotLease`: rule
//! A4's `released` event and the slot); the paths below it own everything else:
//! - sync: in-process `inprocess::start` then A4 at once; multi-process `multiproc::execute` on
//!   XLA's stream.
//! - start: the record registered first, then (casting all-gather) its rounding on XLA's stream (at most `inflight::MAX_RECORDS_PER_DEVICE` per device and
//!   op: beyond that the start fails and tells its peers at once), then `inprocess::start` or
//!   `multiproc::start` (which may run synchronously: no lease); the record holds the lease.
//! - done: the record found by the buffers (never stale data), its start's result, then A4.

use super::device::SlotLease;
use super::driver::CUstream;
use super::inprocess;
use super::multiproc;
use super::prepare::op_name;
use crate::call::{op_code, CallInfo, Phase};
use crate::error::{Result, TideError};
use crate::inflight;
use crate::rendezvous;

/// Every call (the `cuda` module header, "Start/done").
pub fn execute_phase(call: &CallInfo, phase: Phase) -> Result<()> {
    match phase {
        Phase::Sync => execute(call),
        Phase::Start => start(call),
        Phase::Done => done(call),
    }
}

/// One whole collective call ordered on XLA's stream `call.stream` of device
/// `call.device_ordinal`. In-process: start and done back to back, with the rendezvous sequence
/// number of this rank's calls of the site within XLA's run `call.run_id`
/// (`rendezvous::run_seq`), so one rank's failure cannot leave later runs out of step.
/// Multi-process: the multi-process driver on XLA's stream. Enqueues work only; never
/// synchronizes the host with the device.
pub fn execute(call: &CallInfo) -> Result<()> {
    if call.job != 0 {
        return multiproc::execute(call, call.job);
    }
    let seq = rendezvous::run_seq(call.site, call.group, call.rank, call.run_id);
    let lease = inprocess::start(call, seq)?;
    if call.stream == 0 {
        return Err(TideError::Internal("no stream".into()));
    }
    // SAFETY: XLA's stream of the call (not null).
    unsafe { lease.join_into(call.stream as CUstream) }
}

/// A start: registers the call's record, then launches the collective on its path. In-process,
/// the whole collective is enqueued on tide's streams (the call's in-flight slot) ordered after
/// everything XLA enqueued before it, without making XLA's stream wait; multi-process, the
/// multi-process driver runs with a slot's tide stream as its MAIN (`multiproc::start`).
fn start(call: &CallInfo) -> Result<()> {
    let record = inflight::Record::new(
        format!(
            "tide {}_start site {} on device {}",
            op_name(call.op),
            call.site,
            call.device_ordinal
        ),
        call.device_ordinal,
        record_outputs(call, &call.outputs),
        call.held_operands(),
    );
    let seq = (call.job == 0).then(|| rendezvous::run_seq(call.site, call.group, call.rank, call.run_id));
    // The casting all-gather first rounds this rank's rows into its results on XLA's stream, so
    // the collective's `ready` follows them (`cuda::cast`).
    let registered = inflight::register(op_code(call.op), record.clone())
        .and_then(|()| super::cast::launch(call).inspect_err(|_| {
            let _ = inflight::take("", op_code(call.op), call.device_ordinal, &record.outputs, &record.inputs);
        }));
    if let Err(e) = registered {
        // Tell the peers at once rather than at their timeout.
        match seq {
            Some(seq) => inprocess::abandon(call, seq, &e),
            None => multiproc::fail(call, call.job, &e),
        }
        return Err(e);
    }
    let started = match seq {
        Some(seq) => inprocess::start(call, seq).map(Some),
        None => multiproc::start(call),
    };
    match started {
        // The multi-process fallback ran synchronously on XLA's stream: nothing to wait on.
        Ok(None) => {
            record.finish(Ok(()));
            Ok(())
        }
        Ok(Some(lease)) => {
            record.set_payload(Box::new(lease));
            record.finish(Ok(()));
            Ok(())
        }
        Err(e) => {
            let _ = inflight::take("", op_code(call.op), call.device_ordinal, &record.outputs, &record.inputs);
            record.finish(Err(e.clone()));
            Err(e)
        }
    }
}

/// Done (rule A4): finds the call by its buffers, returns its start's error if it failed, else
/// makes XLA's stream wait on the call's `released` event and frees its slot.
fn done(call: &CallInfo) -> Result<()> {
    let n = call.outputs.len();
    let what = format!("tide {}_done site {}", op_name(call.op), call.site);
    // Start's results, then the operands it held (none for the casting all-gather).
    let held = if call.cast.is_some() { 0 } else { n };
    if call.inputs.len() != n + held {
        return Err(TideError::InvalidArgument(format!(
            "{what}: expected {} operands (start's {n} results, then the {held} operands it held), got {}",
            n + held,
            call.inputs.len()
        )));
    }
    let outputs = record_outputs(call, &call.outputs);
    let inputs: Vec<usize> = call.inputs[n..].iter().map(|b| b.ptr).collect();
    let record = inflight::take(&what, op_code(call.op), call.device_ordinal, &outputs, &inputs)?;
    // A CUDA start finishes before it returns, so the result is there at once; the bound
    // only guards against a start that never finished (never a hang).
    let (tx, rx) = std::sync::mpsc::channel();
    record.on_finish(move |r| {
        let _ = tx.send(r);
    });
    let wait = crate::config::current().timeout();
    rx.recv_timeout(wait).unwrap_or_else(|_| {
        Err(TideError::Internal(format!(
            "{what}: its start did not finish within {wait:?}"
        )))
    })?;
    match record.take_payload() {
        // A multi-process start that ran synchronously on XLA's stream.
        None if call.job != 0 => Ok(()),
        None => Err(TideError::Internal(format!(
            "{what}: its start left nothing to wait on"
        ))),
        Some(p) => {
            let lease = p.downcast::<SlotLease>().map_err(|_| {
                TideError::Internal(format!("{what}: its start left foreign data"))
            })?;
            if call.stream == 0 {
                return Err(TideError::InvalidArgument(format!(
                    "{what} on device {}: XLA passed no CUDA stream",
                    call.device_ordinal
                )));
            }
            // The lease (the slot) is freed when it drops, after the wait.
            // SAFETY: XLA's stream of the call (not null).
            unsafe { lease.join_into(call.stream as CUstream) }
        }
    }
}

/// The buffers a start's record is found by: its results; for a reduce-scatter into slices
/// (`CallInfo::at`) the index operand first, then the whole buffers, so two calls in flight into
/// different slices of the same buffers keep records of their own (the index buffers differ).
fn record_outputs(call: &CallInfo, outputs: &[crate::call::BufferView]) -> Vec<usize> {
    call.at
        .map(|at| at.index_ptr)
        .into_iter()
        .chain(outputs.iter().map(|b| b.ptr))
        .collect()
}
