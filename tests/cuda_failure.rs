//! How the CUDA engine fails, measured on ONE GPU (every rank on GPU 0): ranks as threads of one
//! process (the in-process path) and two processes sharing GPU 0 through the VMM export (the
//! multi-process path, as `cuda_mp::processes_share_one_gpu`). Every test prints one line
//! `PASS <test>: <numbers>` or `FAIL <test>: <why> <numbers>` (and fails on FAIL). GPU tests are
//! `#[ignore]`d (a machine without a GPU reports them ignored, never passed); on the GPU machine,
//! where there is no Rust, `scripts/gpu bundle` builds this binary here and `scripts/gpu run OUT
//! failure` runs it there (`.carry/cuda_failure --ignored --nocapture --test-threads=1`).
//!
//! - `peer_process_killed_mid_start_done`: two processes, every call start + done with two in
//!   flight; rank 1 SIGKILLs itself. Rank 0's next call must fail within 2 s of the kill naming
//!   rank 1, its call after that at once, its device must drain (no hang), and the device memory
//!   tide took must be back: rank 0's footprint on GPU 0 after the failure (measured by this
//!   parent process with cuMemGetInfo while rank 0 lives, then after it exited) equals its
//!   footprint before its first tide call, within `RESIDUAL` (tide's streams, events, kernels);
//!   tide's own accounts (staging, peer mappings) read 0.
//! - `rank_failing_mid_stream_in_process`: three ranks as threads with two calls in flight each;
//!   rank 2's call 10 is malformed (a thread cannot be SIGKILLed alone: a rank that errs is what
//!   one process can show; a rank that stops is the timeout test). Both survivors' call 10 must
//!   fail within 2 s naming rank 2, the calls in flight still complete bitwise, the device drains,
//!   threads and fds are unchanged; staging stays allocated for the next calls (in-process slots
//!   are reused; reported).
//! - `rank_never_arrives_times_out`: a rank that never comes to a call: in-process (TIDE_TIMEOUT_S
//!   = 1 s by override) and across processes (TIDE_TIMEOUT_S=3 in the environment); the waiting
//!   rank fails in [TIDE_TIMEOUT_S, TIDE_TIMEOUT_S + 1.5 s) naming the missing rank.
//! - `programs_interleaved_in_process_fail_fast`: two programs launched in opposite orders on two
//!   ranks (threads on GPU 0, XLA devices 100 and 101): every call fails within 1 s naming the
//!   interleaving (issue #17), the device drains, and the next runs are bitwise.
//! - `more_starts_than_slots`: across processes with TIDE_MAX_IN_FLIGHT=1, four starts of each op
//!   before their dones: the three without a slot run synchronously (`multiproc::sync_fallbacks`),
//!   all eight results bitwise equal to the CPU engine. In-process with TIDE_MAX_IN_FLIGHT=2 for
//!   two ranks on the device: the start beyond the slots fails at once on every rank naming the
//!   setting, the calls in flight complete bitwise, and after their dones it runs.
//! - `ten_thousand_pairs_leak_nothing`: 10,000 start/done pairs (alternating all-gather and
//!   reduce-scatter) after 100 warm-up pairs, in-process (two ranks) and in each of two processes:
//!   free device memory, threads (/proc/self/task) and file descriptors (/proc/self/fd) before and
//!   after must be equal (device memory within `FLAT_BYTES`), and tide's accounts unchanged.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

mod common;

use common::gpu::{done_of, fds, make_case, mib, threads, threads_settled, tide_held, verify, Case, Gpu, Pool};
use common::{odd_group, say};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tide::call::Phase;
use tide::layout::ParamSpec;
use tide::plan::Op;

const CHILD_ENV: &str = "TIDE_CUDA_FAILURE_CHILD";
/// Device memory tide may keep after giving a failed job's memory back: its streams, events and
/// the loaded kernel module (the staging of the test, 96 MiB, and the peer's 64 MiB pool are each
/// well above it).
const RESIDUAL: usize = 32 << 20;
/// "Flat": free device memory before and after 10,000 pairs may differ by this much (driver
/// bookkeeping), tide's own accounts not at all.
const FLAT_BYTES: usize = 2 << 20;
const POOL_BYTES: usize = 64 << 20;

fn specs() -> Vec<ParamSpec> {
    odd_group()
}

/// The verdict line of a test; panics on FAIL.
fn verdict(test: &str, ok: bool, detail: &str) {
    let line = format!("{} {test}: {detail}", if ok { "PASS" } else { "FAIL" });
    say(&line);
    assert!(ok, "{line}");
}

fn config(f: impl FnOnce(&mut tide::config::Config)) {
    let mut c = tide::config::Config::from_env();
    c.timeout_s = 60.0;
    f(&mut c);
    tide::config::set_override(Some(c));
}

fn start(call: &tide::call::CallInfo) -> tide::Result<()> {
    tide::cuda::execute_phase(call, Phase::Start)
}

fn done(call: &tide::call::CallInfo) -> tide::Result<()> {
    tide::cuda::execute_phase(&done_of(call), Phase::Done)
}

// ----- processes: the parent's side -----

fn child_spec() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}

fn fresh_job(salt: u64) -> u64 {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    ((t ^ (std::process::id() as u64) << 20 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 2).max(1)
}

fn fresh_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tide-cuda-failure-{}-{what}-{}", std::process::id(), fresh_job(0) % 100_000));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Rank `rank` of scenario `what` as a child process on GPU 0 (output in `dir/r<rank>.log`).
fn spawn(what: &str, rank: usize, job: u64, dir: &Path, env: &[(&str, &str)]) -> std::process::Child {
    let log = std::fs::File::create(dir.join(format!("r{rank}.log"))).unwrap();
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{what}:{rank}:{job}:{}", dir.display()))
        .env("TIDE_TIMEOUT_S", "60")
        .env("NCCL_NVLS_ENABLE", "0")
        .envs(env.iter().copied())
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap()
}

/// Waits at most `within` for `child`; kills it past that. Its exit code (None: killed or signal).
fn wait_bounded(child: &mut std::process::Child, within: Duration) -> Option<i32> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.code();
        }
        if t.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn log_of(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("r{rank}.log"))).unwrap_or_default()
}

/// The `key=value` fields of the last `RESULT <name> ...` line of a child's log.
fn result_of(log: &str, name: &str) -> Option<std::collections::HashMap<String, String>> {
    let line = log.lines().rev().find(|l| l.starts_with(&format!("RESULT {name} ")))?;
    Some(
        line.split_whitespace()
            .skip(2)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

fn num(m: &std::collections::HashMap<String, String>, k: &str) -> f64 {
    m.get(k).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

fn touch(dir: &Path, name: &str) {
    std::fs::write(dir.join(name), b"").unwrap();
}

/// Waits (at most `within`) until `dir/name` exists.
fn wait_file(dir: &Path, name: &str, within: Duration) -> bool {
    let t = Instant::now();
    while !dir.join(name).exists() {
        if t.elapsed() > within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Free device memory once it stopped changing (two reads 200 ms apart agree; at most 5 s).
fn settled_free(gpu: &Gpu) -> usize {
    let t = Instant::now();
    let mut last = gpu.free_bytes();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = gpu.free_bytes();
        if now == last || t.elapsed() > Duration::from_secs(5) {
            return now;
        }
        last = now;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn wall_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

// ----- processes: the children -----

/// Child entry point: does nothing unless run by `spawn`.
#[test]
fn child_entry() {
    let Some(spec) = child_spec() else {
        return;
    };
    // scenario:rank:job:dir
    let mut it = spec.splitn(4, ':');
    let (what, rank, job, dir) = (
        it.next().unwrap().to_string(),
        it.next().unwrap().parse::<usize>().unwrap(),
        it.next().unwrap().parse::<u64>().unwrap(),
        PathBuf::from(it.next().unwrap()),
    );
    let gpu = Gpu::open();
    let x = gpu.stream();
    let mut pool = Pool::new(&gpu, POOL_BYTES);
    let mut case = |op: Op, site: i64, seed: u64| -> Case {
        make_case(&gpu, op, site, job, 2, &[(rank, x)], &specs(), seed, &mut |d| pool.upload(d))
    };
    match what.as_str() {
        "kill" => child_kill(&gpu, x, rank, &dir, [case(Op::ReduceScatter, 1, 1), case(Op::AllGather, 2, 2)]),
        "late" => child_late(rank, case(Op::AllGather, 1, 3)),
        "slots" => {
            let ag: Vec<Case> = (0..4).map(|k| case(Op::AllGather, 10 + k, 20 + k as u64)).collect();
            let rs: Vec<Case> = (0..4).map(|k| case(Op::ReduceScatter, 20 + k, 40 + k as u64)).collect();
            child_slots(&gpu, x, rank, ag, rs)
        }
        "pairs" => child_pairs(&gpu, x, rank, [case(Op::AllGather, 1, 5), case(Op::ReduceScatter, 2, 6)]),
        other => panic!("unknown scenario {other}"),
    }
    let _ = std::io::Write::flush(&mut std::io::stdout());
    std::process::exit(0);
}

/// Start/done with two calls in flight until rank 1 is killed (by itself) or rank 0 fails; then
/// rank 0 measures what follows and reports a `RESULT kill` line.
fn child_kill(gpu: &Gpu, x: usize, rank: usize, dir: &Path, cases: [Case; 2]) {
    touch(dir, &format!("r{rank}-setup"));
    assert!(wait_file(dir, "go", Duration::from_secs(120)), "no go");
    if rank == 1 {
        let kill_ms: u64 = std::env::var("TIDE_FAILURE_KILL_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(2500);
        let dir = dir.to_path_buf();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(kill_ms));
            let tmp = dir.join("kill-at.tmp");
            std::fs::write(&tmp, wall_ns().to_string()).unwrap();
            std::fs::rename(&tmp, dir.join("kill-at")).unwrap();
            // SAFETY: signalling ourselves.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    let t0 = Instant::now();
    let mut held_warm = (0usize, 0u64);
    let mut k = 0usize;
    let (err, failed_at) = loop {
        let r = start(&cases[k % 2].calls[0]).and_then(|()| if k > 0 { done(&cases[(k - 1) % 2].calls[0]) } else { Ok(()) });
        if let Err(e) = r {
            break (e.to_string(), wall_ns());
        }
        if k == 1 {
            held_warm = tide_held();
        }
        k += 1;
        assert!(t0.elapsed() < Duration::from_secs(60), "rank {rank} never failed");
    };
    // Rank 0 only from here (rank 1 is killed before it could fail).
    let kill_at: u128 = if wait_file(dir, "kill-at", Duration::from_secs(2)) {
        std::fs::read_to_string(dir.join("kill-at")).unwrap().trim().parse().unwrap()
    } else {
        0
    };
    let since_kill_ms = if kill_at > 0 { (failed_at.saturating_sub(kill_at)) as f64 / 1e6 } else { f64::NAN };
    let names_dead = err.contains("rank 1") && err.contains("died");
    let t = Instant::now();
    let next = start(&cases[(k + 1) % 2].calls[0]).map_err(|e| e.to_string());
    let next_ms = ms(t.elapsed());
    let next_names_dead = matches!(&next, Err(e) if e.contains("rank 1") && e.contains("died"));
    // The done of the start still in flight (if it succeeded): returns, whatever its result.
    let t = Instant::now();
    let _ = done(&cases[(k + 1) % 2].calls[0]);
    let last_done_ms = ms(t.elapsed());
    let drained = gpu.drains_within(Duration::from_secs(10));
    let held = tide_held();
    println!("cuda_failure kill: rank 0 failed {since_kill_ms:.0} ms after the kill ({k} pairs): {err}");
    println!("cuda_failure kill: rank 0's next call: {next:?} in {next_ms:.1} ms; device drained: {drained:?}");
    println!(
        "RESULT kill since_kill_ms={since_kill_ms:.1} names_dead={} next_ms={next_ms:.1} next_names_dead={} last_done_ms={last_done_ms:.1} \
         drained={} staging_warm={} mapped_warm={} staging_after={} mapped_after={} pairs={k}",
        names_dead as u8,
        next_names_dead as u8,
        (drained == Some(cudarc::driver::sys::CUresult::CUDA_SUCCESS)) as u8,
        held_warm.0,
        held_warm.1,
        held.0,
        held.1
    );
    let _ = std::io::Write::flush(&mut std::io::stdout());
    touch(dir, "r0-released");
    wait_file(dir, "exit", Duration::from_secs(60));
    let _ = x;
}

/// One call together; then rank 1 stays away from the next (sleeps, alive) while rank 0 waits.
fn child_late(rank: usize, case: Case) {
    tide::cuda::execute(&case.calls[0]).unwrap_or_else(|e| panic!("rank {rank}: first call: {e}"));
    if rank == 1 {
        std::thread::sleep(Duration::from_secs(9));
        println!("RESULT late rank=1 stayed_away=1");
        return;
    }
    let t = Instant::now();
    let r = tide::cuda::execute(&case.calls[0]);
    let took = t.elapsed();
    let err = r.err().map(|e| e.to_string()).unwrap_or_default();
    println!("cuda_failure late: rank 0's call failed after {took:.2?}: {err}");
    println!(
        "RESULT late took_s={:.3} failed={} names_missing={}",
        took.as_secs_f64(),
        (!err.is_empty()) as u8,
        (err.contains("did not arrive") && err.contains("1 (pid")) as u8
    );
}

/// TIDE_MAX_IN_FLIGHT=1 (environment): four starts of each op before their dones.
fn child_slots(gpu: &Gpu, x: usize, rank: usize, ag: Vec<Case>, rs: Vec<Case>) {
    let before = tide::cuda::multiproc::sync_fallbacks();
    for cases in [&ag, &rs] {
        for (k, c) in cases.iter().enumerate() {
            start(&c.calls[0]).unwrap_or_else(|e| panic!("rank {rank} start {k}: {e}"));
        }
        for (k, c) in cases.iter().enumerate() {
            done(&c.calls[0]).unwrap_or_else(|e| panic!("rank {rank} done {k}: {e}"));
        }
    }
    gpu.sync(x);
    let fallbacks = tide::cuda::multiproc::sync_fallbacks() - before;
    let bad: Vec<String> = ag.iter().chain(&rs).enumerate().filter_map(|(k, c)| verify(gpu, c).err().map(|e| format!("call {k}: {e}"))).collect();
    println!("cuda_failure slots: rank {rank}: 8 starts, {fallbacks} ran synchronously; mismatches: {bad:?}");
    println!("RESULT slots fallbacks={fallbacks} bitwise={}", bad.is_empty() as u8);
}

/// 100 warm-up pairs, then 10,000, measuring this process before and after.
fn child_pairs(gpu: &Gpu, x: usize, rank: usize, cases: [Case; 2]) {
    let run = |n: usize| {
        for k in 0..n {
            let c = &cases[k % 2].calls[0];
            start(c).and_then(|()| done(c)).unwrap_or_else(|e| panic!("rank {rank} pair {k}: {e}"));
            if k % 1000 == 999 {
                gpu.sync(x);
            }
        }
        gpu.sync(x);
    };
    run(100);
    let before = (gpu.free_bytes(), threads(), fds(), tide_held());
    let t = Instant::now();
    run(10_000);
    let took = t.elapsed();
    let after = (gpu.free_bytes(), threads_settled(before.1), fds(), tide_held());
    let bad: Vec<String> = cases.iter().filter_map(|c| verify(gpu, c).err()).collect();
    println!("cuda_failure pairs: rank {rank}: 10,000 pairs in {took:.2?}; before {before:?} after {after:?}; mismatches {bad:?}");
    println!(
        "RESULT pairs free_before={} free_after={} threads_before={} threads_after={} fds_before={} fds_after={} \
         staging_before={} staging_after={} mapped_before={} mapped_after={} bitwise={} secs={:.2}",
        before.0, after.0, before.1, after.1, before.2, after.2, before.3 .0, after.3 .0, before.3 .1, after.3 .1,
        bad.is_empty() as u8,
        took.as_secs_f64()
    );
}

// ----- the tests -----

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn peer_process_killed_mid_start_done() {
    if child_spec().is_some() {
        return;
    }
    let test = "peer_process_killed_mid_start_done";
    let gpu = Gpu::open();
    let dir = fresh_dir("kill");
    let job = fresh_job(1);
    let free_before = settled_free(&gpu);
    let mut r0 = spawn("kill", 0, job, &dir, &[]);
    assert!(wait_file(&dir, "r0-setup", Duration::from_secs(120)), "rank 0 did not set up:\n{}", log_of(&dir, 0));
    // Rank 0 set up (context, stream, pool, buffers), no tide call yet.
    let free_r0 = settled_free(&gpu);
    let mut r1 = spawn("kill", 1, job, &dir, &[("TIDE_FAILURE_KILL_MS", "2500")]);
    assert!(wait_file(&dir, "r1-setup", Duration::from_secs(120)), "rank 1 did not set up:\n{}", log_of(&dir, 1));
    touch(&dir, "go");
    let released = wait_file(&dir, "r0-released", Duration::from_secs(90));
    let r1_code = wait_bounded(&mut r1, Duration::from_secs(30));
    // Rank 0 alive after its failure, rank 1 dead (reaped).
    let free_mid = settled_free(&gpu);
    touch(&dir, "exit");
    let r0_code = wait_bounded(&mut r0, Duration::from_secs(60));
    let free_end = settled_free(&gpu);
    let log0 = log_of(&dir, 0);
    for line in log0.lines().filter(|l| l.starts_with("cuda_failure")) {
        say(line);
    }
    let Some(r) = result_of(&log0, "kill").filter(|_| released) else {
        verdict(test, false, &format!("rank 0 reported nothing (exit {r0_code:?}, rank 1 exit {r1_code:?}):\n{log0}"));
        return;
    };
    let before = free_before.saturating_sub(free_r0);
    let after = free_end.saturating_sub(free_mid);
    let since_kill = num(&r, "since_kill_ms");
    let checks = [
        (since_kill < 2000.0, format!("failed {since_kill:.0} ms after the kill (< 2000)")),
        (num(&r, "names_dead") == 1.0, "the error names rank 1 as dead".to_string()),
        (num(&r, "next_ms") < 500.0 && num(&r, "next_names_dead") == 1.0, format!("next call failed in {:.1} ms naming it", num(&r, "next_ms"))),
        (num(&r, "last_done_ms") < 2000.0, format!("the last done returned in {:.1} ms", num(&r, "last_done_ms"))),
        (num(&r, "drained") == 1.0, "device drained".to_string()),
        (num(&r, "staging_after") == 0.0 && num(&r, "mapped_after") == 0.0, format!(
            "tide's staging {:.1} -> {:.1} MiB, peer mappings {:.1} -> {:.1} MiB",
            num(&r, "staging_warm") / 1048576.0,
            num(&r, "staging_after") / 1048576.0,
            num(&r, "mapped_warm") / 1048576.0,
            num(&r, "mapped_after") / 1048576.0
        )),
        (after <= before + RESIDUAL, format!(
            "rank 0 on GPU 0: {:.1} MiB before its first tide call, {:.1} MiB after the failure (cuMemGetInfo free: {:.1} with \
             neither process, {:.1} with rank 0 set up, {:.1} after the failure, {:.1} after rank 0 exited; residual allowed {:.0} MiB)",
            mib(before),
            mib(after),
            mib(free_before),
            mib(free_r0),
            mib(free_mid),
            mib(free_end),
            mib(RESIDUAL)
        )),
        (r0_code == Some(0) && r1_code.is_none(), format!("rank 0 exit {r0_code:?}, rank 1 killed ({r1_code:?})")),
    ];
    let ok = checks.iter().all(|c| c.0);
    let detail: Vec<String> = checks.iter().map(|(ok, s)| if *ok { s.clone() } else { format!("NOT {s}") }).collect();
    verdict(test, ok, &format!("{} ({} pairs before the kill)", detail.join("; "), num(&r, "pairs")));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank's first failure (call index, when, error) and the results of its dones after it.
type RankOutcome = (Option<(usize, Instant, String)>, Vec<tide::Result<()>>);

/// One rank of the in-process failure test: its calls as start/done, `depth` in flight; `broken`
/// replaces call `at`. Returns (index and time of its first failure and the error, results of
/// the dones after it).
fn in_process_rank(cases: &[Case], r: usize, depth: usize, broken: Option<(usize, &tide::call::CallInfo)>) -> RankOutcome {
    let mut in_flight = std::collections::VecDeque::new();
    let mut failed = None;
    let mut late = Vec::new();
    for (k, c) in cases.iter().enumerate() {
        let call = match broken {
            Some((at, b)) if at == k => b,
            _ => &c.calls[r],
        };
        if let Err(e) = start(call) {
            failed = Some((k, Instant::now(), e.to_string()));
            break;
        }
        in_flight.push_back(k);
        if in_flight.len() == depth {
            let j = in_flight.pop_front().unwrap();
            done(&cases[j].calls[r]).unwrap_or_else(|e| panic!("rank {r} done {j}: {e}"));
        }
    }
    for j in in_flight {
        late.push(done(&cases[j].calls[r]));
    }
    (failed, late)
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn rank_failing_mid_stream_in_process() {
    if child_spec().is_some() {
        return;
    }
    let test = "rank_failing_mid_stream_in_process";
    let gpu = Gpu::open();
    let (world, depth, at) = (3usize, 2usize, 10usize);
    config(|c| c.max_in_flight = depth * world);
    let streams: Vec<usize> = (0..world).map(|_| gpu.stream()).collect();
    let ranks: Vec<(usize, usize)> = (0..world).map(|r| (r, streams[r])).collect();
    let cases: Vec<Case> = (0..16)
        .map(|k| {
            let op = if k % 2 == 0 { Op::ReduceScatter } else { Op::AllGather };
            make_case(&gpu, op, 9000 + (k % 2) as i64, 0, world, &ranks, &specs(), 100 + k as u64, &mut |d| gpu.upload(d))
        })
        .collect();
    // Rank 2's call `at`: its first operand one row short (the layout check refuses it).
    let mut broken = cases[at].calls[2].clone();
    broken.inputs[0].dims[0] -= 1;
    let staging_before = tide_held().0;
    let (threads_before, fds_before) = (threads(), fds());
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (cases, broken) = (&cases, &broken);
                s.spawn(move || {
                    gpu.set_current();
                    in_process_rank(cases, r, depth, (r == 2).then_some((at, broken)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let drained = gpu.drains_within(Duration::from_secs(10));
    let staging_after = tide_held().0;
    let mut checks = Vec::new();
    let t2 = results[2].0.as_ref().map(|f| f.1);
    for r in 0..2 {
        match (&results[r].0, t2) {
            (Some((k, t, e)), Some(t2)) => {
                let gap = if *t > t2 { *t - t2 } else { Duration::ZERO };
                checks.push((*k == at && gap < Duration::from_secs(2) && e.contains("rank 2"), format!("rank {r} failed at call {k} {:.1} ms after rank 2, naming it ({})", ms(gap), &e[..e.len().min(160)])));
            }
            (f, _) => checks.push((false, format!("rank {r}: {f:?}, rank 2 failed: {}", t2.is_some()))),
        }
        checks.push((results[r].1.iter().all(|d| d.is_ok()), format!("rank {r}'s {} dones in flight completed", results[r].1.len())));
    }
    for (k, c) in cases.iter().enumerate().take(at) {
        if let Err(e) = verify(&gpu, c) {
            checks.push((false, format!("call {k}: {e}")));
        }
    }
    checks.push((true, format!("calls 0..{at} bitwise equal to the CPU engine")));
    checks.push((drained == Some(cudarc::driver::sys::CUresult::CUDA_SUCCESS), format!("device drained: {drained:?}")));
    // In-process slots keep their staging for the next calls (at most TIDE_MAX_IN_FLIGHT per op):
    // reported, not freed.
    checks.push((true, format!(
        "staging kept for reuse by the in-flight slots: {:.1} MiB before, {:.1} MiB after",
        mib(staging_before),
        mib(staging_after)
    )));
    let threads_after = threads_settled(threads_before);
    checks.push((threads_after == threads_before && fds() == fds_before, format!("threads {threads_before} -> {threads_after}, fds {fds_before} -> {}", fds())));
    tide::config::set_override(None);
    let ok = checks.iter().all(|c| c.0);
    let detail: Vec<String> = checks.iter().map(|(ok, s)| if *ok { s.clone() } else { format!("NOT {s}") }).collect();
    verdict(test, ok, &detail.join("; "));
}

/// Issue #17 on the CUDA engine, ranks as threads on GPU 0 (XLA devices 100 and 101 sharing it):
/// rank 0 runs program A (an all-gather, run 0xa1) then B (a reduce-scatter, run 0xb2), rank 1 B
/// then A, as two Python threads can launch them. With TIDE_TIMEOUT_S = 60 every call must fail
/// within 1 s naming the interleaving, the device must drain, and a new run of both programs in
/// one order must be bitwise equal to the CPU engine.
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn programs_interleaved_in_process_fail_fast() {
    if child_spec().is_some() {
        return;
    }
    let test = "programs_interleaved_in_process_fail_fast";
    let gpu = Gpu::open();
    config(|_| {});
    let streams: Vec<usize> = (0..2).map(|_| gpu.stream()).collect();
    let ranks: Vec<(usize, usize)> = (0..2).map(|r| (r, streams[r])).collect();
    let programs = |runs: [i64; 2], seed: u64| {
        let mut a = make_case(&gpu, Op::AllGather, 9200, 0, 2, &ranks, &specs(), seed, &mut |d| gpu.upload(d));
        let mut b = make_case(&gpu, Op::ReduceScatter, 9201, 0, 2, &ranks, &specs(), seed + 1, &mut |d| gpu.upload(d));
        for (case, run) in [(&mut a, runs[0]), (&mut b, runs[1])] {
            for c in case.calls.iter_mut() {
                c.run_id = run;
                c.rank_devices = vec![100, 101].into();
            }
        }
        (a, b)
    };
    // Warm-up: both programs once in one order (the module, the slots, the plans), so the timed
    // calls below measure the break, not the first call's set-up.
    // Both ranks run A then B, each call expected to succeed.
    let in_one_order = |a: &Case, b: &Case, when: &str| {
        std::thread::scope(|s| {
            for r in 0..2 {
                s.spawn(move || {
                    gpu.set_current();
                    for c in [&a.calls[r], &b.calls[r]] {
                        tide::cuda::execute(c).unwrap_or_else(|e| panic!("{when}, rank {r}: {e}"));
                    }
                });
            }
        });
    };
    let (a0, b0) = programs([0xa0, 0xb0], 5);
    in_one_order(&a0, &b0, "warm-up");
    let (a, b) = programs([0xa1, 0xb2], 11);
    let t0 = Instant::now();
    let out: Vec<Vec<(String, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (a, b, gpu) = (&a, &b, gpu);
                s.spawn(move || {
                    gpu.set_current();
                    let order = if r == 0 { [&a.calls[0], &b.calls[0]] } else { [&b.calls[1], &a.calls[1]] };
                    order
                        .map(|c| {
                            let t = Instant::now();
                            let e = tide::cuda::execute(c).err().map(|e| e.to_string()).unwrap_or_else(|| "succeeded".into());
                            (e, t.elapsed().as_secs_f64())
                        })
                        .to_vec()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut fast = true;
    let mut detail = Vec::new();
    for (r, calls) in out.iter().enumerate() {
        for (e, at) in calls {
            fast &= e.contains("programs interleaved across devices") && *at < 1.0;
            detail.push(format!("rank {r} call failed after {at:.3} s: {}", &e[..e.len().min(240)]));
        }
    }
    let all_within = t0.elapsed().as_secs_f64();
    let drained = gpu.drains_within(Duration::from_secs(5)).is_some();
    // The next runs, in one order on both ranks: bitwise.
    let (a2, b2) = programs([0xa3, 0xb4], 21);
    in_one_order(&a2, &b2, "after the break");
    for st in &streams {
        gpu.sync(*st);
    }
    let exact = verify(&gpu, &a2).and_then(|()| verify(&gpu, &b2));
    tide::config::set_override(None);
    let ok = fast && drained && exact.is_ok();
    verdict(
        test,
        ok,
        &format!(
            "{}every call failed within 1 s naming the interleaving, all within {:.3} s ({}); {}drained; next runs {}",
            if fast { "" } else { "NOT " },
            all_within,
            detail.join(" | "),
            if drained { "" } else { "NOT " },
            match &exact { Ok(()) => "bitwise".to_string(), Err(e) => format!("NOT bitwise: {e}") }
        ),
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn rank_never_arrives_times_out() {
    if child_spec().is_some() {
        return;
    }
    let test = "rank_never_arrives_times_out";
    let gpu = Gpu::open();
    // In-process: both ranks once, then rank 0 alone.
    config(|c| c.timeout_s = 1.0);
    let streams: Vec<usize> = (0..2).map(|_| gpu.stream()).collect();
    let ranks: Vec<(usize, usize)> = (0..2).map(|r| (r, streams[r])).collect();
    let warm = make_case(&gpu, Op::AllGather, 9100, 0, 2, &ranks, &specs(), 7, &mut |d| gpu.upload(d));
    let alone = make_case(&gpu, Op::ReduceScatter, 9101, 0, 2, &ranks, &specs(), 8, &mut |d| gpu.upload(d));
    std::thread::scope(|s| {
        for r in 0..2 {
            let (warm, gpu) = (&warm, gpu);
            s.spawn(move || {
                gpu.set_current();
                tide::cuda::execute(&warm.calls[r]).unwrap_or_else(|e| panic!("warm-up rank {r}: {e}"));
            });
        }
    });
    let t = Instant::now();
    let e = start(&alone.calls[0]).err().map(|e| e.to_string()).unwrap_or_default();
    let took = t.elapsed().as_secs_f64();
    tide::config::set_override(None);
    let in_process_ok = (1.0..2.5).contains(&took) && e.contains("rank 1") && e.contains("did not arrive");
    let in_process = format!("in-process: rank 0 failed after {took:.3} s (TIDE_TIMEOUT_S=1): {}", &e[..e.len().min(200)]);
    // Two processes, TIDE_TIMEOUT_S=3 (their first call must connect within it).
    let dir = fresh_dir("late");
    let job = fresh_job(2);
    let mut kids: Vec<_> = (0..2).map(|r| spawn("late", r, job, &dir, &[("TIDE_TIMEOUT_S", "3")])).collect();
    let codes: Vec<_> = kids.iter_mut().map(|k| wait_bounded(k, Duration::from_secs(60))).collect();
    let log0 = log_of(&dir, 0);
    let (mp_ok, mp) = match result_of(&log0, "late") {
        Some(r) => {
            let s = num(&r, "took_s");
            (
                (3.0..4.5).contains(&s) && num(&r, "failed") == 1.0 && num(&r, "names_missing") == 1.0 && codes == [Some(0), Some(0)],
                format!(
                    "two processes: rank 0 failed after {s:.3} s (TIDE_TIMEOUT_S=3), naming rank 1: {} (exits {codes:?})",
                    num(&r, "names_missing") == 1.0
                ),
            )
        }
        None => (false, format!("two processes: rank 0 reported nothing (exits {codes:?}):\n{log0}\n{}", log_of(&dir, 1))),
    };
    for line in log0.lines().filter(|l| l.starts_with("cuda_failure")) {
        say(line);
    }
    let _ = std::fs::remove_dir_all(&dir);
    verdict(test, in_process_ok && mp_ok, &format!("{}{in_process}; {}{mp}", if in_process_ok { "" } else { "NOT " }, if mp_ok { "" } else { "NOT " }));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn more_starts_than_slots() {
    if child_spec().is_some() {
        return;
    }
    let test = "more_starts_than_slots";
    let gpu = Gpu::open();
    // Two processes, one slot per op and device: three of each op's four starts run synchronously.
    let dir = fresh_dir("slots");
    let job = fresh_job(3);
    let mut kids: Vec<_> = (0..2).map(|r| spawn("slots", r, job, &dir, &[("TIDE_MAX_IN_FLIGHT", "1")])).collect();
    let codes: Vec<_> = kids.iter_mut().map(|k| wait_bounded(k, Duration::from_secs(120))).collect();
    let mut checks = Vec::new();
    for r in 0..2 {
        let log = log_of(&dir, r);
        match result_of(&log, "slots") {
            Some(m) => checks.push((
                num(&m, "fallbacks") == 6.0 && num(&m, "bitwise") == 1.0 && codes[r] == Some(0),
                format!("process {r}: 8 starts with TIDE_MAX_IN_FLIGHT=1, {} ran synchronously, bitwise: {}", num(&m, "fallbacks"), num(&m, "bitwise") == 1.0),
            )),
            None => checks.push((false, format!("process {r} reported nothing (exit {:?}):\n{log}", codes[r]))),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // In-process: two ranks share the device's two slots of the op.
    config(|c| c.max_in_flight = 2);
    let streams: Vec<usize> = (0..2).map(|_| gpu.stream()).collect();
    let ranks: Vec<(usize, usize)> = (0..2).map(|r| (r, streams[r])).collect();
    let a = make_case(&gpu, Op::ReduceScatter, 9300, 0, 2, &ranks, &specs(), 30, &mut |d| gpu.upload(d));
    let b = make_case(&gpu, Op::ReduceScatter, 9301, 0, 2, &ranks, &specs(), 31, &mut |d| gpu.upload(d));
    let outcome: Vec<(String, f64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (a, b, gpu) = (&a, &b, gpu);
                s.spawn(move || {
                    gpu.set_current();
                    start(&a.calls[r]).unwrap_or_else(|e| panic!("rank {r} start a: {e}"));
                    let t = Instant::now();
                    let e = start(&b.calls[r]).err().map(|e| e.to_string()).unwrap_or_default();
                    let took = ms(t.elapsed());
                    done(&a.calls[r]).unwrap_or_else(|e| panic!("rank {r} done a: {e}"));
                    start(&b.calls[r]).unwrap_or_else(|e| panic!("rank {r} start b again: {e}"));
                    done(&b.calls[r]).unwrap_or_else(|e| panic!("rank {r} done b: {e}"));
                    (e, took)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for &s in &streams {
        gpu.sync(s);
    }
    tide::config::set_override(None);
    for (r, (e, took)) in outcome.iter().enumerate() {
        checks.push((e.contains("TIDE_MAX_IN_FLIGHT") && *took < 1000.0, format!("in-process rank {r}: the start beyond the slots failed in {took:.1} ms: {}", &e[..e.len().min(120)])));
    }
    for (name, c) in [("a", &a), ("b", &b)] {
        let v = verify(&gpu, c);
        checks.push((v.is_ok(), format!("in-process call {name} bitwise: {v:?}")));
    }
    let ok = checks.iter().all(|c| c.0);
    let detail: Vec<String> = checks.iter().map(|(ok, s)| if *ok { s.clone() } else { format!("NOT {s}") }).collect();
    verdict(test, ok, &detail.join("; "));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn ten_thousand_pairs_leak_nothing() {
    if child_spec().is_some() {
        return;
    }
    let test = "ten_thousand_pairs_leak_nothing";
    let gpu = Gpu::open();
    let mut checks = Vec::new();
    // In-process: two ranks as threads.
    config(|c| c.max_in_flight = 4);
    let streams: Vec<usize> = (0..2).map(|_| gpu.stream()).collect();
    let ranks: Vec<(usize, usize)> = (0..2).map(|r| (r, streams[r])).collect();
    let cases = [
        make_case(&gpu, Op::AllGather, 9400, 0, 2, &ranks, &specs(), 50, &mut |d| gpu.upload(d)),
        make_case(&gpu, Op::ReduceScatter, 9401, 0, 2, &ranks, &specs(), 51, &mut |d| gpu.upload(d)),
    ];
    let run = |n: usize| {
        std::thread::scope(|s| {
            for r in 0..2 {
                let (cases, gpu, x) = (&cases, gpu, streams[r]);
                s.spawn(move || {
                    gpu.set_current();
                    for k in 0..n {
                        let c = &cases[k % 2].calls[r];
                        start(c).and_then(|()| done(c)).unwrap_or_else(|e| panic!("rank {r} pair {k}: {e}"));
                        if k % 1000 == 999 {
                            gpu.sync(x);
                        }
                    }
                    gpu.sync(x);
                });
            }
        });
    };
    run(100);
    let before = (gpu.free_bytes(), threads(), fds(), tide_held());
    let t = Instant::now();
    run(10_000);
    let took = t.elapsed();
    let after = (gpu.free_bytes(), threads_settled(before.1), fds(), tide_held());
    tide::config::set_override(None);
    let bitwise = cases.iter().all(|c| verify(&gpu, c).is_ok());
    checks.push((
        before.0.abs_diff(after.0) <= FLAT_BYTES && before.1 == after.1 && before.2 == after.2 && before.3 == after.3 && bitwise,
        format!(
            "in-process (2 ranks, {took:.2?}): free device memory {:.1} -> {:.1} MiB, threads {} -> {}, fds {} -> {}, tide staging {:.1} -> {:.1} MiB, bitwise {bitwise}",
            mib(before.0),
            mib(after.0),
            before.1,
            after.1,
            before.2,
            after.2,
            mib(before.3 .0),
            mib(after.3 .0)
        ),
    ));
    // Two processes.
    let dir = fresh_dir("pairs");
    let job = fresh_job(4);
    let mut kids: Vec<_> = (0..2).map(|r| spawn("pairs", r, job, &dir, &[])).collect();
    let codes: Vec<_> = kids.iter_mut().map(|k| wait_bounded(k, Duration::from_secs(240))).collect();
    for r in 0..2 {
        let log = log_of(&dir, r);
        match result_of(&log, "pairs") {
            Some(m) => {
                let free_diff = (num(&m, "free_before") - num(&m, "free_after")).abs();
                let flat = free_diff <= FLAT_BYTES as f64
                    && num(&m, "threads_before") == num(&m, "threads_after")
                    && num(&m, "fds_before") == num(&m, "fds_after")
                    && num(&m, "staging_before") == num(&m, "staging_after")
                    && num(&m, "mapped_before") == num(&m, "mapped_after");
                checks.push((
                    flat && num(&m, "bitwise") == 1.0 && codes[r] == Some(0),
                    format!(
                        "process {r} ({:.2} s): free device memory {:.1} -> {:.1} MiB, threads {} -> {}, fds {} -> {}, tide staging {:.1} -> {:.1} MiB, peer mappings {:.1} -> {:.1} MiB, bitwise {}",
                        num(&m, "secs"),
                        num(&m, "free_before") / 1048576.0,
                        num(&m, "free_after") / 1048576.0,
                        num(&m, "threads_before"),
                        num(&m, "threads_after"),
                        num(&m, "fds_before"),
                        num(&m, "fds_after"),
                        num(&m, "staging_before") / 1048576.0,
                        num(&m, "staging_after") / 1048576.0,
                        num(&m, "mapped_before") / 1048576.0,
                        num(&m, "mapped_after") / 1048576.0,
                        num(&m, "bitwise") == 1.0
                    ),
                ));
            }
            None => checks.push((false, format!("process {r} reported nothing (exit {:?}):\n{log}", codes[r]))),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let ok = checks.iter().all(|c| c.0);
    let detail: Vec<String> = checks.iter().map(|(ok, s)| if *ok { s.clone() } else { format!("NOT {s}") }).collect();
    verdict(test, ok, &detail.join("; "));
}
