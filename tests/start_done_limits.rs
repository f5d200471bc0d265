//! The limits of start/done that no other test reaches, on CPU (no GPU, no XLA):
//! - `inflight::MAX_RECORDS_PER_DEVICE`: 256 starts without done are kept per device and op; the
//!   257th is refused with an error naming the limit, a start that replaces a record (its result
//!   buffer was reused) still registers, other ops and devices are unaffected, and a done makes
//!   room again.
//! - The CUDA engine's start at that limit (`tide::cuda::execute_phase`): it fails at once with
//!   that error, before touching the driver, and tells its peers: in-process through the
//!   rendezvous, multi-process through the job's control plane, so a peer in another process (a
//!   thread here) fails at once naming it instead of waiting for TIDE_TIMEOUT_S.
//! - The multi-process start's fallback (`multiproc::start`: no in-flight slot, or an error before
//!   the call) runs the call synchronously instead of skipping it: on a machine without a CUDA
//!   driver, both ranks' starts take the fallback and fail in the call itself, naming the driver.
//!   On the GPU, `tests/cuda_failure.rs` runs the fallback to completion, bitwise.

use std::sync::Mutex;
use std::time::{Duration, Instant};
use tide::call::{op_code, BufferView, CallInfo, Phase};
use tide::inflight::{self, Record, MAX_RECORDS_PER_DEVICE};
use tide::layout::DType;
use tide::plan::Op;
use tide::topology::Topology;

/// The tests below set the process-wide configuration override; one at a time.
static CONFIG: Mutex<()> = Mutex::new(());

fn record(device: i64, first: usize) -> std::sync::Arc<Record> {
    Record::new(format!("test start {first:#x} on device {device}"), device, vec![first, first + 8], vec![first + 16])
}

#[test]
fn the_257th_start_without_done_is_refused() {
    let (dev, op) = (9001, op_code(Op::AllGather));
    let base = 0x10_0000usize;
    for k in 0..MAX_RECORDS_PER_DEVICE {
        inflight::register(op, record(dev, base + k * 64)).unwrap_or_else(|e| panic!("start {k}: {e}"));
    }
    assert_eq!(inflight::in_flight(dev), MAX_RECORDS_PER_DEVICE);
    let e = inflight::register(op, record(dev, base + MAX_RECORDS_PER_DEVICE * 64)).unwrap_err().to_string();
    for want in ["256 calls of this op are already started and not done on device 9001", "limit 256", "every *_start needs its *_done"] {
        assert!(e.contains(want), "{e}");
    }
    // A start writing the buffer of a start that was never done replaces its record.
    inflight::register(op, record(dev, base + 5 * 64)).unwrap();
    assert_eq!(inflight::in_flight(dev), MAX_RECORDS_PER_DEVICE);
    // The limit is per device and op.
    inflight::register(op_code(Op::ReduceScatter), record(dev, base)).unwrap();
    inflight::register(op, record(dev + 100, base)).unwrap();
    // A done makes room for one more start.
    let r = record(dev, base + 7 * 64);
    inflight::take("test done", op, dev, &r.outputs, &r.inputs).unwrap();
    inflight::register(op, record(dev, base + MAX_RECORDS_PER_DEVICE * 64)).unwrap();
    // Every remaining record is found by its done.
    for k in (0..=MAX_RECORDS_PER_DEVICE).filter(|&k| k != 7) {
        let r = record(dev, base + k * 64);
        inflight::take("test done", op, dev, &r.outputs, &r.inputs).unwrap_or_else(|e| panic!("done {k}: {e}"));
    }
    inflight::take("test done", op_code(Op::ReduceScatter), dev, &record(dev, base).outputs, &record(dev, base).inputs).unwrap();
    inflight::take("test done", op, dev + 100, &record(dev, base).outputs, &record(dev, base).inputs).unwrap();
    assert_eq!(inflight::in_flight(dev) + inflight::in_flight(dev + 100), 0);
    eprintln!("inflight: 256 starts kept, the 257th refused ({e}); replacement, other op/device and a done behave");
}

/// A call of one f32 parameter (8 x 4) on `device`, its buffers at `addr` (never dereferenced:
/// the calls below fail before any data moves).
fn call(job: u64, rank: usize, world: usize, device: i64, addr: usize) -> CallInfo {
    let rows = 8usize;
    let shard = rows.div_ceil(world);
    CallInfo {
        op: Op::AllGather,
        site: 77 << 16,
        run_id: 5,
        rank_devices: Default::default(),
        job,
        device_ordinal: device,
        rank,
        group: 0,
        world,
        topology: Topology::single_node(world),
        names: vec!["w".into()],
        inputs: vec![BufferView { ptr: addr, dtype: DType::F32, dims: vec![shard, 4] }],
        outputs: vec![BufferView { ptr: addr + 4096, dtype: DType::F32, dims: vec![rows, 4] }],
        stream: 1,
        at: None,
        cast: None,
        urgent: false,
    }
}

/// Fills device `dev`'s all-gather records up to the limit.
fn fill_to_limit(dev: i64) {
    for k in 0..MAX_RECORDS_PER_DEVICE {
        inflight::register(op_code(Op::AllGather), record(dev, 0x4000_0000 + k * 64)).unwrap();
    }
}

fn with_timeout<T>(timeout_s: f64, f: impl FnOnce() -> T) -> T {
    let _one = CONFIG.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = tide::config::Config::from_env();
    c.timeout_s = timeout_s;
    tide::config::set_override(Some(c));
    let r = f();
    tide::config::set_override(None);
    r
}

/// Removes what a failed job may leave in /dev/shm (control blocks and mailboxes that were never
/// unlinked because the job failed before its join barrier).
fn unlink_job(job: u64) {
    for rank in 0..2 {
        for what in ["ctl", "cu"] {
            tide::transport::shm::unlink_name(&tide::transport::shm::segment_name(job, 0, rank, what));
        }
    }
}

fn job_id(salt: u64) -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    ((t ^ (std::process::id() as u64) << 24 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 3).max(1)
}

#[test]
fn a_cuda_start_at_the_limit_fails_at_once_in_process() {
    with_timeout(30.0, || {
        let dev = 9002;
        fill_to_limit(dev);
        let t = Instant::now();
        let e = tide::cuda::execute_phase(&call(0, 0, 1, dev, 0x7000_0000), Phase::Start).unwrap_err().to_string();
        assert!(e.contains("limit 256") && e.contains("device 9002"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
        assert_eq!(inflight::in_flight(dev), MAX_RECORDS_PER_DEVICE, "the refused start left a record");
        eprintln!("cuda start at the limit (in-process): refused in {:?}: {e}", t.elapsed());
    });
}

#[test]
fn a_cuda_start_at_the_limit_tells_its_multi_process_peers_at_once() {
    with_timeout(30.0, || {
        let job = job_id(1);
        let dev = 9003;
        fill_to_limit(dev);
        let t = Instant::now();
        let (e0, e1) = std::thread::scope(|s| {
            let r0 = s.spawn(|| tide::cuda::execute_phase(&call(job, 0, 2, dev, 0x7100_0000), Phase::Start));
            let r1 = s.spawn(|| {
                // The peer arrives a little later, as a process in another state would.
                std::thread::sleep(Duration::from_millis(200));
                tide::cuda::execute(&call(job, 1, 2, dev + 1, 0x7200_0000))
            });
            (r0.join().unwrap().unwrap_err().to_string(), r1.join().unwrap().unwrap_err().to_string())
        });
        let took = t.elapsed();
        assert!(e0.contains("limit 256"), "rank 0: {e0}");
        assert!(e1.contains("limit 256") && e1.contains("rank 0"), "rank 1 should name rank 0's failure: {e1}");
        assert!(took < Duration::from_secs(5), "took {took:?} (TIDE_TIMEOUT_S is 30 s)");
        unlink_job(job);
        eprintln!("cuda start at the limit (multi-process): both ranks failed in {took:?}; rank 1: {e1}");
    });
}

#[test]
fn the_multi_process_start_fallback_runs_the_call() {
    if tide::cuda::driver::init().is_ok() {
        eprintln!("a CUDA driver is present: the fallback runs on the GPU in tests/cuda_failure.rs; skipped here");
        return;
    }
    with_timeout(30.0, || {
        let job = job_id(2);
        let before = tide::cuda::multiproc::sync_fallbacks();
        let t = Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| s.spawn(move || tide::cuda::execute_phase(&call(job, r, 2, 9010 + r as i64, 0x7300_0000 + r * 0x10_0000), Phase::Start)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap_err().to_string()).collect()
        });
        let took = t.elapsed();
        assert_eq!(tide::cuda::multiproc::sync_fallbacks() - before, 2, "both starts take the synchronous fallback");
        for (r, e) in errs.iter().enumerate() {
            assert!(e.contains("CUDA driver"), "rank {r}: the synchronous call itself should fail on the driver: {e}");
        }
        assert!(took < Duration::from_secs(5), "took {took:?}");
        unlink_job(job);
        // The failed start left no record.
        assert_eq!(inflight::in_flight(9010) + inflight::in_flight(9011), 0);
        eprintln!("multi-process start fallback: both ranks ran the call synchronously and failed in {took:?}: {}", errs[0]);
    });
}
