//! The multi-process CPU transport (src/transport): ranks in separate processes (this test binary
//! re-run as children) and ranks as threads with separate mappings of the same segments, against
//! the single-process CPU engine (bitwise); timeouts, peer errors, mismatched calls, dead peers.
//! Topologies of several nodes run their cross-node copies over the TCP rail (loopback here), and
//! one test gives each node its own /dev/shm (a private mount namespace), as separate hosts have.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tide::call::{BufferView, CallInfo};
use tide::engine::cpu::{f32_to_bf16, run_threads};
use tide::layout::{DType, GroupLayout, ParamSpec};
use tide::plan::{self, Op, Plan, RsOptions};
use tide::transport::{fail_cpu_multiprocess, rail, run_cpu_multiprocess_with, ShmOptions, Timing};
use tide::{TideError, Topology};

fn opts(timeout_s: f64) -> ShmOptions {
    ShmOptions {
        timing: Timing {
            timeout: Duration::from_secs_f64(timeout_s),
            poll: Duration::from_millis(10),
            liveness_interval: Duration::from_millis(50),
        },
    }
}

/// A job id no other test (or earlier run) uses.
/// `rail::bytes_received` counts every rail of this process: tests that check it hold this lock,
/// and so does every test that moves bytes over a rail in this process (tests run in parallel).
static RAIL_COUNTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rail_lock() -> std::sync::MutexGuard<'static, ()> {
    RAIL_COUNTER.lock().unwrap_or_else(|p| p.into_inner())
}

fn fresh_job(tag: u64) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    (t ^ ((std::process::id() as u64) << 32) ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1
}

fn specs(scale: usize) -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("w", &[7 * scale, 3], DType::BF16),
        ParamSpec::new("b", &[5], DType::F32),
        ParamSpec::new("s", &[], DType::BF16),
        ParamSpec::new("e", &[2 * scale + 1, 2, 3], DType::F16),
    ]
}

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

/// Deterministic bytes for `rank`'s inputs of `plan` (finite values of each dtype).
fn inputs_for(plan: &Plan, rank: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut s = seed ^ ((rank as u64 + 1) * 0x1234_5678_9abc);
    plan.layout
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let bytes = plan.input_bytes(i);
            let elems = bytes / p.dtype.size_bytes();
            let mut out = Vec::with_capacity(bytes);
            for _ in 0..elems {
                let v = (lcg(&mut s) % 2001) as f32 / 97.0 - 10.0;
                match p.dtype {
                    DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                    DType::BF16 => out.extend_from_slice(&f32_to_bf16(v).to_le_bytes()),
                    DType::F16 => {
                        // small integers are exact in f16
                        let h: u16 = match (lcg(&mut s) % 9) as u16 {
                            0 => 0,
                            k => 0x3c00 + (k << 8),
                        };
                        out.extend_from_slice(&h.to_le_bytes())
                    }
                    _ => out.resize(out.len() + p.dtype.size_bytes(), (lcg(&mut s) & 0xff) as u8),
                }
            }
            out
        })
        .collect()
}

fn build(op: Op, topo: Topology, scale: usize) -> Plan {
    let layout = GroupLayout::new(&specs(scale), topo.world()).unwrap();
    match op {
        Op::AllGather => plan::all_gather(&layout, topo).unwrap(),
        Op::ReduceScatter => plan::reduce_scatter(
            &layout,
            topo,
            RsOptions {
                stage_slots: 2,
                slot_bytes: if scale > 100 { 4096 } else { 96 },
            },
        )
        .unwrap(),
    }
}

fn call_for(plan: &Plan, rank: usize, inputs: &[Vec<u8>], outputs: &mut [Vec<u8>]) -> CallInfo {
    let p = &plan.layout;
    let view = |ptr: usize, i: usize, full: bool, dtype: DType| {
        let q = &p.params[i];
        let mut dims: Vec<usize> = if full {
            q.shape.clone()
        } else {
            vec![q.shard_rows]
        };
        if !full {
            dims.extend(q.shape.iter().skip(1));
        }
        BufferView { ptr, dtype, dims }
    };
    let (ins, outs) = match plan.op {
        Op::AllGather => (
            (0..p.len())
                .map(|i| view(inputs[i].as_ptr() as usize, i, false, p.params[i].dtype))
                .collect(),
            (0..p.len())
                .map(|i| view(outputs[i].as_mut_ptr() as usize, i, true, p.params[i].dtype))
                .collect(),
        ),
        Op::ReduceScatter => (
            (0..p.len())
                .map(|i| view(inputs[i].as_ptr() as usize, i, true, p.params[i].dtype))
                .collect(),
            (0..p.len())
                .map(|i| view(outputs[i].as_mut_ptr() as usize, i, false, DType::F32))
                .collect(),
        ),
    };
    CallInfo {
        op: plan.op,
        site: 1 + plan.op as i64,
        run_id: 0,
        rank_devices: Default::default(),
        job: 0,
        device_ordinal: rank as i64,
        rank,
        group: 0,
        world: plan.world(),
        topology: plan.topology,
        names: Vec::new(),
        inputs: ins,
        outputs: outs,
        stream: 0,
        at: None,
        cast: None,
        urgent: false,
    }
}

/// Runs one rank's call over the transport and returns its outputs (call site 1 + op).
fn run_rank(
    plan: &Plan,
    rank: usize,
    seed: u64,
    job: u64,
    o: &ShmOptions,
) -> Result<Vec<Vec<u8>>, TideError> {
    run_rank_at(plan, rank, seed, job, o, None)
}

/// `run_rank` at call site `site` (None: 1 + op).
fn run_rank_at(
    plan: &Plan,
    rank: usize,
    seed: u64,
    job: u64,
    o: &ShmOptions,
    site: Option<i64>,
) -> Result<Vec<Vec<u8>>, TideError> {
    let inputs = inputs_for(plan, rank, seed);
    let mut outputs: Vec<Vec<u8>> = (0..plan.layout.len())
        .map(|i| vec![0x5au8; plan.output_bytes(i)])
        .collect();
    let mut call = call_for(plan, rank, &inputs, &mut outputs);
    if let Some(site) = site {
        call.site = site;
    }
    run_cpu_multiprocess_with(&call, plan, job, o)?;
    Ok(outputs)
}

fn reference(plan: &Plan, seed: u64) -> Vec<Vec<Vec<u8>>> {
    let inputs: Vec<_> = (0..plan.world())
        .map(|r| inputs_for(plan, r, seed))
        .collect();
    run_threads(plan, &inputs).unwrap()
}

/// The sequence of calls every rank makes in the "same data" scenarios: both ops, a size class
/// that grows, then shrinks back (reusing the bigger segment, whose stage slots hold stale data).
fn scenario(topo: Topology) -> Vec<(Op, usize, u64)> {
    vec![
        (Op::AllGather, 1, 11),
        (Op::ReduceScatter, 1, 12),
        (Op::AllGather, 6000, 13),
        (Op::ReduceScatter, 3000, 14),
        (Op::ReduceScatter, 1, 15),
        (Op::AllGather, 2, 16 + topo.world() as u64),
    ]
}

fn check_rank(topo: Topology, ranks: &[usize], job: u64) {
    let o = opts(60.0);
    for (op, scale, seed) in scenario(topo) {
        let plan = build(op, topo, scale);
        let want = reference(&plan, seed);
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|&rank| {
                    let (plan, o) = (&plan, &o);
                    s.spawn(move || (rank, run_rank(plan, rank, seed, job, o)))
                })
                .collect();
            for h in handles {
                let (rank, got) = h.join().unwrap();
                let got =
                    got.unwrap_or_else(|e| panic!("{topo} {op:?} scale {scale} rank {rank}: {e}"));
                assert!(got == want[rank], "{topo} {op:?} scale {scale}: rank {rank} differs from the single-process engine");
            }
        });
    }
}

/// Rail addresses when every rank of `job` lives in this process.
fn rail_here(job: u64, world: usize) {
    let port = rail::listen("127.0.0.1").unwrap();
    for r in 0..world {
        rail::register_peer(job, 0, r, &format!("127.0.0.1:{port}")).unwrap();
    }
}

/// Rail addresses through files in `dir` (a stand-in for JAX's key-value store): process `me`
/// publishes its port, then reads every other process's.
fn rail_files(job: u64, dir: &str, me: usize, per_process: &[Vec<usize>]) {
    let port = rail::listen("127.0.0.1").unwrap();
    let tmp = format!("{dir}/p{me}.tmp");
    std::fs::write(&tmp, port.to_string()).unwrap();
    std::fs::rename(&tmp, format!("{dir}/p{me}.port")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (p, ranks) in per_process.iter().enumerate() {
        let port = loop {
            if let Ok(t) = std::fs::read_to_string(format!("{dir}/p{p}.port")) {
                break t;
            }
            assert!(
                Instant::now() < deadline,
                "process {p} never published its rail port"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        for &r in ranks {
            rail::register_peer(job, 0, r, &format!("127.0.0.1:{port}")).unwrap();
        }
    }
}

// ----- ranks as threads (each with its own mappings) -----

#[test]
fn threads_match_single_process_engine() {
    let _rail = rail_lock();
    for (k, topo) in [
        (1, 2),
        (1, 3),
        (1, 5),
        (2, 1),
        (3, 1),
        (5, 1),
        (2, 2),
        (3, 2),
        (2, 3),
        (4, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let topo = Topology::new(topo.0, topo.1).unwrap();
        let ranks: Vec<usize> = (0..topo.world()).collect();
        let job = fresh_job(100 + k as u64);
        rail_here(job, topo.world());
        let before = rail::bytes_received();
        check_rank(topo, &ranks, job);
        // Several nodes: the cross-node bytes went over the rail, not through shared memory.
        assert_eq!(
            rail::bytes_received() > before,
            topo.nodes > 1,
            "{topo}: rail bytes {} -> {}",
            before,
            rail::bytes_received()
        );
    }
}

/// Many ranks and nodes through the rail: 8x8 (64 ranks, recursive doubling over 8 nodes) and 3x5,
/// both ops, odd shapes, bitwise equal to the single-process engine.
#[test]
fn many_nodes_over_the_rail() {
    let _rail = rail_lock();
    for (k, (nodes, gpus)) in [(8usize, 8usize), (3, 5)].into_iter().enumerate() {
        let topo = Topology::new(nodes, gpus).unwrap();
        let job = fresh_job(150 + k as u64);
        rail_here(job, topo.world());
        let o = opts(120.0);
        for (op, scale, seed) in [
            (Op::AllGather, 3, 31u64),
            (Op::ReduceScatter, 5, 32),
            (Op::AllGather, 1, 33),
        ] {
            let plan = build(op, topo, scale);
            let want = reference(&plan, seed);
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..topo.world())
                    .map(|rank| {
                        let (plan, o) = (&plan, &o);
                        s.spawn(move || (rank, run_rank(plan, rank, seed, job, o)))
                    })
                    .collect();
                for h in handles {
                    let (rank, got) = h.join().unwrap();
                    let got = got.unwrap_or_else(|e| panic!("{topo} {op:?} rank {rank}: {e}"));
                    assert!(
                        got == want[rank],
                        "{topo} {op:?}: rank {rank} differs from the single-process engine"
                    );
                }
            });
        }
    }
}

/// XLA:CPU may run independent calls of one program concurrently, in different orders on
/// different ranks: calls of different sites are independent lanes. Every rank runs 4 sites at
/// once (both ops, one node and 2x2 through the rail), each site twice, threads started in a
/// different order per rank; every result bitwise equal to the single-process engine.
#[test]
fn concurrent_call_sites_in_any_order() {
    let _rail = rail_lock();
    for (k, (nodes, gpus)) in [(1usize, 3usize), (2, 2)].into_iter().enumerate() {
        let topo = Topology::new(nodes, gpus).unwrap();
        let job = fresh_job(170 + k as u64);
        rail_here(job, topo.world());
        let o = opts(60.0);
        let calls: Vec<(i64, Plan, u64)> = vec![
            (11, build(Op::AllGather, topo, 2), 41),
            (12, build(Op::ReduceScatter, topo, 3), 42),
            (13, build(Op::AllGather, topo, 1), 43),
            (14, build(Op::ReduceScatter, topo, 1), 44),
        ];
        let wants: Vec<_> = calls
            .iter()
            .map(|(_, p, seed)| reference(p, *seed))
            .collect();
        std::thread::scope(|s| {
            let mut handles = Vec::new();
            for rank in 0..topo.world() {
                // Rank r starts the sites rotated by r (and reversed on odd ranks).
                let mut order: Vec<usize> = (0..calls.len()).collect();
                order.rotate_left(rank % calls.len());
                if rank % 2 == 1 {
                    order.reverse();
                }
                for c in order {
                    let (site, plan, seed) = (&calls[c].0, &calls[c].1, calls[c].2);
                    let o = &o;
                    handles.push(s.spawn(move || {
                        let a = run_rank_at(plan, rank, seed, job, o, Some(*site));
                        let b = run_rank_at(plan, rank, seed, job, o, Some(*site));
                        (c, rank, a, b)
                    }));
                }
            }
            for h in handles {
                let (c, rank, a, b) = h.join().unwrap();
                for got in [a, b] {
                    let got = got
                        .unwrap_or_else(|e| panic!("{topo} site {} rank {rank}: {e}", calls[c].0));
                    assert!(
                        got == wants[c][rank],
                        "{topo} site {}: rank {rank} differs",
                        calls[c].0
                    );
                }
            }
        });
    }
}

// ----- ranks in separate processes: this binary re-run as children -----

const CHILD_ENV: &str = "TIDE_TRANSPORT_TEST_CHILD";

/// Child entry point: does nothing unless run by `spawn_children`.
#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    // scenario:nodes:gpus:job:ranks(comma separated):rail dir:process index:all ranks (a,b/c,d)
    let parts: Vec<&str> = spec.split(':').collect();
    let (what, nodes, gpus, job) = (
        parts[0],
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
        parts[3].parse().unwrap(),
    );
    let ranks: Vec<usize> = parts[4].split(',').map(|r| r.parse().unwrap()).collect();
    let topo = Topology::new(nodes, gpus).unwrap();
    let per_process: Vec<Vec<usize>> = parts[7]
        .split('/')
        .map(|l| l.split(',').map(|r| r.parse().unwrap()).collect())
        .collect();
    rail_files(job, parts[5], parts[6].parse().unwrap(), &per_process);
    match what {
        "match" => check_rank(topo, &ranks, job),
        "die" => {
            let rank = ranks[0];
            let plan = build(Op::AllGather, topo, 3);
            let o = opts(60.0);
            run_rank(&plan, rank, 1, job, &o).expect("first call");
            if rank == 1 {
                std::process::exit(7); // dies between calls: its peers wait for it in the next one
            }
            let start = Instant::now();
            let err = run_rank(&plan, rank, 2, job, &o).expect_err("peer died: the call must fail");
            let took = start.elapsed();
            println!("rank {rank} error after {took:?}: {err}");
            let msg = err.to_string();
            // Same node: the control plane names the dead pid; another node: the rail names the
            // rank whose stream closed: rank 1, or the failure notice of a rank that failed because
            // of it first (which names rank 1). Only if that notice is later than the reader's grace
            // (250 ms, a loaded machine) does the error name that rank alone; the parent then
            // checks that rank's own error names rank 1.
            assert!(
                (msg.contains("rank 1 (pid") && msg.contains("died"))
                    || (msg.contains(" on node") && msg.contains("closed its rail stream")),
                "unclear error: {msg}"
            );
            assert!(
                took < Duration::from_secs(10),
                "took {took:?} to notice the dead peer"
            );
            // Sticky: later calls fail at once.
            let again = run_rank(&plan, rank, 3, job, &o).expect_err("sticky failure");
            assert!(again.to_string().contains("earlier tide call"), "{again}");
        }
        other => panic!("unknown child scenario {other}"),
    }
}

fn join(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn spawn_children(
    what: &str,
    topo: Topology,
    per_process: &[Vec<usize>],
    job: u64,
) -> Vec<(Vec<usize>, std::process::Output)> {
    spawn_children_wrapped(what, topo, per_process, job, &[])
}

/// `spawn_children`, each child started through `wrapper` (a command prefix) when not empty.
fn spawn_children_wrapped(
    what: &str,
    topo: Topology,
    per_process: &[Vec<usize>],
    job: u64,
    wrapper: &[&str],
) -> Vec<(Vec<usize>, std::process::Output)> {
    let exe = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!("tide-rail-{job:016x}"));
    std::fs::create_dir_all(&dir).unwrap();
    let all: Vec<String> = per_process.iter().map(|r| join(r)).collect();
    let children: Vec<_> = per_process
        .iter()
        .enumerate()
        .map(|(p, ranks)| {
            let mut cmd = match wrapper.split_first() {
                Some((first, rest)) => {
                    let mut c = Command::new(first);
                    c.args(rest).arg(&exe);
                    c
                }
                None => Command::new(&exe),
            };
            let child = cmd
                .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
                .env(
                    CHILD_ENV,
                    format!(
                        "{what}:{}:{}:{job}:{}:{}:{p}:{}",
                        topo.nodes,
                        topo.gpus_per_node,
                        join(ranks),
                        dir.display(),
                        all.join("/")
                    ),
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (ranks.clone(), child)
        })
        .collect();
    children
        .into_iter()
        .map(|(r, c)| (r, c.wait_with_output().unwrap()))
        .collect()
}

fn report(out: &std::process::Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn processes_match_single_process_engine() {
    let _rail = rail_lock();
    type Case = ((usize, usize), Vec<Vec<usize>>);
    let cases: Vec<Case> = vec![
        ((1, 2), vec![vec![0], vec![1]]),
        ((1, 3), vec![vec![0], vec![1], vec![2]]),
        ((1, 5), vec![vec![0], vec![1], vec![2], vec![3], vec![4]]),
        ((5, 1), vec![vec![0], vec![1], vec![2], vec![3], vec![4]]),
        // several ranks per process (several CPU devices per process), hierarchical plan
        ((2, 2), vec![vec![0, 1], vec![2, 3]]),
        ((1, 5), vec![vec![0, 3], vec![1, 2, 4]]),
        // a node split over processes, a process spanning nodes
        ((2, 3), vec![vec![0], vec![1, 2], vec![3, 4, 5]]),
        ((3, 2), vec![vec![0, 1, 2], vec![3, 4, 5]]),
    ];
    for (k, ((nodes, gpus), per_process)) in cases.into_iter().enumerate() {
        let topo = Topology::new(nodes, gpus).unwrap();
        for (ranks, out) in spawn_children("match", topo, &per_process, fresh_job(200 + k as u64)) {
            assert!(
                out.status.success(),
                "{topo}: process with ranks {ranks:?} failed:\n{}",
                report(&out)
            );
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("1 passed"),
                "{}",
                report(&out)
            );
        }
    }
}

#[test]
fn dead_peer_is_named_within_bounded_time() {
    let _rail = rail_lock();
    // 1x3: rank 1 shares the node's control plane; 3x1: it is on another node (the rail);
    // 2x2 with one rank per process: rank 1 is a node peer of rank 0 and a rail peer of rank 3.
    for (k, (nodes, gpus)) in [(1, 3), (3, 1), (2, 2)].into_iter().enumerate() {
        let topo = Topology::new(nodes, gpus).unwrap();
        let procs: Vec<Vec<usize>> = (0..topo.world()).map(|r| vec![r]).collect();
        let start = Instant::now();
        let outs = spawn_children("die", topo, &procs, fresh_job(300 + k as u64));
        for (ranks, out) in &outs {
            if ranks[0] == 1 {
                assert_eq!(out.status.code(), Some(7), "{topo}: {}", report(out));
            } else {
                assert!(
                    out.status.success(),
                    "{topo}: rank {ranks:?}:\n{}",
                    report(out)
                );
            }
        }
        // Every survivor's error leads to rank 1: it names rank 1, or a rank whose own error does.
        let errors: HashMap<usize, String> = outs
            .iter()
            .filter(|(ranks, _)| ranks[0] != 1)
            .filter_map(|(ranks, out)| {
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let line = text.lines().find(|l| l.contains(" error after "))?.to_string();
                Some((ranks[0], line))
            })
            .collect();
        let names_rank_1 = |m: &str| m.contains("rank 1 (pid") || m.contains("rank 1 on node");
        for (rank, msg) in &errors {
            if names_rank_1(msg) {
                continue;
            }
            let q: usize = msg
                .split(" closed its rail stream")
                .next()
                .and_then(|head| head.rsplit("rank ").next())
                .and_then(|s| s.split(' ').next())
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("{topo}: rank {rank}: no rank named: {msg}"));
            let theirs = errors.get(&q).map(String::as_str).unwrap_or("");
            assert!(
                q != *rank && names_rank_1(theirs),
                "{topo}: rank {rank} blames rank {q}, whose error does not lead to rank 1: {msg} / {theirs}"
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{topo}: {:?}",
            start.elapsed()
        );
    }
}

/// Each node in its own mount namespace with a private /dev/shm, as on separate hosts: nothing
/// may cross nodes through shared memory. Needs `unshare -m` (root or user namespaces); says
/// SKIPPED otherwise.
#[test]
fn nodes_share_no_memory() {
    let _rail = rail_lock();
    let probe = Command::new("unshare")
        .args([
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /dev/shm",
        ])
        .output();
    if !matches!(&probe, Ok(o) if o.status.success()) {
        println!("SKIPPED: cannot give a process a private /dev/shm here (unshare -m): {probe:?}");
        return;
    }
    let wrapper = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount -t tmpfs tmpfs /dev/shm && exec \"$@\"",
        "sh",
    ];
    for (k, ((nodes, gpus), per_process)) in [
        ((2, 1), vec![vec![0], vec![1]]),
        ((2, 2), vec![vec![0, 1], vec![2, 3]]),
        ((3, 2), vec![vec![0, 1], vec![2, 3], vec![4, 5]]),
    ]
    .into_iter()
    .enumerate()
    {
        let topo = Topology::new(nodes, gpus).unwrap();
        let outs = spawn_children_wrapped(
            "match",
            topo,
            &per_process,
            fresh_job(350 + k as u64),
            &wrapper,
        );
        for (ranks, out) in outs {
            assert!(
                out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
                "{topo}: process with ranks {ranks:?} (its own /dev/shm) failed:\n{}",
                report(&out)
            );
        }
    }
}

#[test]
fn timeout_names_the_missing_rank() {
    let _rail = rail_lock();
    let topo = Topology::new(1, 2).unwrap();
    let plan = build(Op::AllGather, topo, 1);
    let job = fresh_job(400);
    let o = opts(1.0);
    std::thread::scope(|s| {
        let late = s.spawn(|| run_rank(&plan, 1, 1, job, &o));
        run_rank(&plan, 0, 1, job, &o).unwrap();
        late.join().unwrap().unwrap();
    });
    // Rank 1 (alive, same process) never makes its second call.
    let start = Instant::now();
    let err = run_rank(&plan, 0, 2, job, &o).unwrap_err().to_string();
    assert!(
        start.elapsed() >= Duration::from_millis(900) && start.elapsed() < Duration::from_secs(10)
    );
    assert!(
        err.contains("timed out") && err.contains("ranks [1 (pid"),
        "{err}"
    );
}

/// Rank `rank` fails a call of `plan` before running it (as the FFI edge does for a bad operand).
fn fail_before_call(plan: &Plan, rank: usize, job: u64, why: &str) {
    let inputs = inputs_for(plan, rank, 1);
    let mut outputs: Vec<Vec<u8>> = (0..plan.layout.len())
        .map(|i| vec![0; plan.output_bytes(i)])
        .collect();
    let call = call_for(plan, rank, &inputs, &mut outputs);
    fail_cpu_multiprocess(&call, job, &TideError::InvalidArgument(why.into()));
}

#[test]
fn peer_failure_propagates_fast() {
    let _rail = rail_lock();
    let topo = Topology::new(1, 3).unwrap();
    let plan = build(Op::ReduceScatter, topo, 2);
    let job = fresh_job(500);
    let o = opts(60.0);
    let start = Instant::now();
    std::thread::scope(|s| {
        let waiters: Vec<_> = [0usize, 2]
            .iter()
            .map(|&r| {
                s.spawn({
                    let (plan, o) = (&plan, &o);
                    move || run_rank(plan, r, 1, job, o)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        fail_before_call(&plan, 1, job, "gradient 'w' has the wrong shape");
        for w in waiters {
            let err = w.join().unwrap().unwrap_err().to_string();
            assert!(
                err.contains("peer rank 1") && err.contains("wrong shape"),
                "{err}"
            );
        }
    });
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// A rank on another node fails before a call its rail peer waits in (the peer must send to it,
/// and it will never connect): the failure notice over the rail ends the wait at once with the
/// root cause, not at the timeout.
#[test]
fn failure_notice_reaches_other_nodes_fast() {
    let topo = Topology::new(2, 1).unwrap();
    let plan = build(Op::AllGather, topo, 2);
    let job = fresh_job(550);
    rail_here(job, topo.world());
    let o = opts(60.0);
    let start = Instant::now();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| run_rank(&plan, 0, 1, job, &o));
        std::thread::sleep(Duration::from_millis(200));
        fail_before_call(&plan, 1, job, "shard 'w' has the wrong dtype");
        let err = waiter.join().unwrap().unwrap_err().to_string();
        assert!(
            err.contains("rank 1 on node 1") && err.contains("wrong dtype"),
            "{err}"
        );
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn different_calls_are_an_error_not_garbage() {
    let topo = Topology::new(1, 2).unwrap();
    let ag = build(Op::AllGather, topo, 1);
    let rs = build(Op::ReduceScatter, topo, 1);
    let job = fresh_job(600);
    let o = opts(20.0);
    // Same call site, different plans on the two ranks (calls of different sites are independent
    // lanes: a site one rank never calls is a timeout naming the site instead).
    std::thread::scope(|s| {
        let other = s.spawn(|| run_rank_at(&rs, 1, 1, job, &o, Some(9)));
        let err = run_rank_at(&ag, 0, 1, job, &o, Some(9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("different call"), "{err}");
        let err1 = other.join().unwrap().unwrap_err().to_string();
        assert!(err1.contains("different call"), "{err1}");
    });
}

#[test]
fn segments_are_unlinked_once_joined() {
    let topo = Topology::new(1, 2).unwrap();
    let plan = build(Op::AllGather, topo, 1);
    let job = fresh_job(700);
    let o = opts(20.0);
    std::thread::scope(|s| {
        let h = s.spawn(|| run_rank(&plan, 1, 1, job, &o));
        run_rank(&plan, 0, 1, job, &o).unwrap();
        h.join().unwrap().unwrap();
    });
    let prefix = format!("tide-{job:016x}-");
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
}
