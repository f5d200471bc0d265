//! Calls in flight between a start and its done (docs/design.md "Start/done").
//!
//! A `*_start` target launches a collective and returns; its `*_done` target, later in the same
//! program on the same device, receives start's results (aliased: the very same buffers) and start's
//! operands again, and must complete exactly that call. Done finds its start by those addresses:
//! the record is keyed by (device ordinal, address of start's first result), and done checks every
//! result and operand address against the record. So:
//! - done without a start (or whose buffers XLA moved or copied between start and done) finds no
//!   record, or one with other addresses, and fails naming the site: it never returns stale data;
//! - two starts of one site in flight at once are two records (their results are distinct live
//!   buffers), each found by its own done;
//! - a start without a done leaves a record that the next start writing the same result buffer
//!   replaces (XLA reused the memory, so the old call's results are dead); the number of records
//!   per device is bounded by `MAX_RECORDS_PER_DEVICE` so a program that never calls done cannot
//!   grow memory without bound (the start beyond it fails with an error).
//!
//! A record's completion is a `Result` set once by whoever runs the collective (a CPU worker
//! thread; the CUDA engine at start, since its completion is ordered by streams) and consumed by
//! done: done either sees it set, or registers a continuation that the completing thread runs.
//! `payload` carries engine data from start to done (the CUDA engine's per-call events and
//! staging).

use crate::error::{Result, TideError};
use once_cell::sync::Lazy;
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// At most this many calls in flight (started, not yet done) per device and op, all sites together.
pub const MAX_RECORDS_PER_DEVICE: usize = 256;

type Continuation = Box<dyn FnOnce(Result<()>) + Send>;

enum Completion {
    Running(Option<Continuation>),
    Finished(Result<()>),
    Taken,
}

/// One call between start and done.
pub struct Record {
    /// What to name in messages: "tide all_gather_start site 7 on device 0".
    pub what: String,
    pub device: i64,
    pub outputs: Vec<usize>,
    pub inputs: Vec<usize>,
    completion: Mutex<Completion>,
    payload: Mutex<Option<Box<dyn Any + Send>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Record {
    pub fn new(what: String, device: i64, outputs: Vec<usize>, inputs: Vec<usize>) -> Arc<Record> {
        Arc::new(Record {
            what,
            device,
            outputs,
            inputs,
            completion: Mutex::new(Completion::Running(None)),
            payload: Mutex::new(None),
        })
    }

    /// Sets the call's result (once; later calls are ignored) and runs done's continuation if done
    /// already arrived.
    pub fn finish(&self, result: Result<()>) {
        let cont = {
            let mut c = lock(&self.completion);
            match &mut *c {
                Completion::Running(cont) => match cont.take() {
                    Some(k) => {
                        *c = Completion::Taken;
                        Some((k, result))
                    }
                    None => {
                        *c = Completion::Finished(result);
                        None
                    }
                },
                _ => None,
            }
        };
        if let Some((k, r)) = cont {
            k(r);
        }
    }

    /// Runs `k` with the call's result: now if it is finished, else on the finishing thread.
    pub fn on_finish(&self, k: impl FnOnce(Result<()>) + Send + 'static) {
        let ready = {
            let mut c = lock(&self.completion);
            match std::mem::replace(&mut *c, Completion::Taken) {
                Completion::Finished(r) => Some(r),
                Completion::Running(_) => {
                    *c = Completion::Running(Some(Box::new(k)));
                    return;
                }
                Completion::Taken => Some(Err(TideError::Internal(format!(
                    "{}: done called twice for one start",
                    self.what
                )))),
            }
        };
        if let Some(r) = ready {
            k(r);
        }
    }

    pub fn set_payload(&self, p: Box<dyn Any + Send>) {
        *lock(&self.payload) = Some(p);
    }

    pub fn take_payload(&self) -> Option<Box<dyn Any + Send>> {
        lock(&self.payload).take()
    }
}

/// (device, op code, address of the first result).
type RecordKey = (i64, u8, usize);

static RECORDS: Lazy<Mutex<HashMap<RecordKey, Arc<Record>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// Registers a started call. `op` separates all-gathers from reduce-scatters.
pub fn register(op: u8, record: Arc<Record>) -> Result<()> {
    let Some(&first) = record.outputs.first() else {
        return crate::invalid!("{}: a start needs at least one result", record.what);
    };
    let mut map = lock(&RECORDS);
    let key = (record.device, op, first);
    if !map.contains_key(&key) {
        let on_device = map
            .keys()
            .filter(|k| k.0 == record.device && k.1 == op)
            .count();
        if on_device >= MAX_RECORDS_PER_DEVICE {
            return crate::invalid!(
                "{}: {on_device} calls of this op are already started and not done on device {} \
                 (limit {MAX_RECORDS_PER_DEVICE}): every *_start needs its *_done",
                record.what,
                record.device
            );
        }
    } else {
        log::debug!(
            "{}: replaces a start that was never done (its result buffer was reused)",
            record.what
        );
    }
    map.insert(key, record);
    Ok(())
}

/// Takes the record of the call whose results are `outputs` and operands `inputs` on `device`.
/// `what` names the done call in errors.
pub fn take(
    what: &str,
    op: u8,
    device: i64,
    outputs: &[usize],
    inputs: &[usize],
) -> Result<Arc<Record>> {
    let Some(&first) = outputs.first() else {
        return crate::invalid!("{what}: done needs at least one result");
    };
    let mut map = lock(&RECORDS);
    let Some(record) = map.get(&(device, op, first)) else {
        return crate::invalid!(
            "{what} on device {device}: no matching start is in flight for these buffers (result 0 at \
             {first:#x}). Either done ran without its start, or XLA copied the start's results before \
             done: pass them to done unchanged, as tide_jax does. In a loop, XLA hoists a start whose \
             operands are the same in every iteration out of the loop, and a done kept inside then gets \
             a copy: tie the start's operands to the iteration first (`shards, carry = \
             tide_jax.ordered(shards, carry)`), or start and finish the collective outside the loop"
        );
    };
    if record.outputs != outputs {
        let i = record.outputs.iter().zip(outputs).position(|(a, b)| a != b);
        return crate::invalid!(
            "{what} on device {device}: the buffers do not match its start ({}): result {} is at a \
             different address than start wrote (XLA copied it between start and done) or the \
             number of results differs ({} vs {})",
            record.what,
            i.map_or("count".to_string(), |i| i.to_string()),
            outputs.len(),
            record.outputs.len()
        );
    }
    if record.inputs != inputs {
        let i = record.inputs.iter().zip(inputs).position(|(a, b)| a != b);
        return crate::invalid!(
            "{what} on device {device}: the operands passed again to done are not the ones its start \
             ({}) read: operand {} differs (XLA copied it, so the original could be freed while peers \
             read it)",
            record.what,
            i.map_or("count".to_string(), |i| i.to_string())
        );
    }
    Ok(map.remove(&(device, op, first)).expect("present"))
}

/// Number of calls in flight on `device` (all ops). For tests and diagnostics.
pub fn in_flight(device: i64) -> usize {
    lock(&RECORDS).keys().filter(|k| k.0 == device).count()
}
