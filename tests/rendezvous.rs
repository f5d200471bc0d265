//! Rendezvous under threads: value exchange, many rounds, timeouts naming the missing ranks, failure
//! propagation, ranks that fail before joining, 64 ranks. Each test uses its own site ids, since the
//! registry and the sequence counters are process-wide.

use std::sync::{Arc, Barrier as StdBarrier};
use std::thread;
use std::time::{Duration, Instant};
use tide::engine::Barrier;
use tide::error::TideError;
use tide::rendezvous::{live_sessions, next_seq, Key, Session};

const LONG: Duration = Duration::from_secs(30);

fn key(site: i64, seq: u64) -> Key {
    Key {
        site,
        group: 0,
        seq,
    }
}

/// Runs `f(rank)` on `world` threads and returns the results by rank.
fn on_ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(usize) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            thread::spawn(move || f(rank))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

#[test]
fn exchanges_values() {
    let out = on_ranks(5, |rank| {
        let s = Session::join("test exchange", key(100, 0), rank, 5, rank * 10, LONG).unwrap();
        s.barrier(rank, "exit").unwrap();
        s.values().to_vec()
    });
    for v in out {
        assert_eq!(v, vec![0, 10, 20, 30, 40]);
    }
}

#[test]
fn world_of_one() {
    let s = Session::join("test single", key(101, 0), 0, 1, "x".to_string(), LONG).unwrap();
    assert_eq!(s.values(), ["x".to_string()]);
    s.barrier(0, "a").unwrap();
    s.wait(0, 1).unwrap();
}

#[test]
fn many_rounds_with_next_seq_and_barriers() {
    const WORLD: usize = 6;
    const ROUNDS: u64 = 200;
    let out = on_ranks(WORLD, |rank| {
        let mut sums = Vec::new();
        for round in 0..ROUNDS {
            let seq = next_seq(102, 0, rank);
            assert_eq!(seq, round);
            let s = Session::join(
                "test rounds",
                key(102, seq),
                rank,
                WORLD,
                (rank as u64) * 1000 + round,
                LONG,
            )
            .unwrap();
            for phase in 0..3 {
                s.wait(rank, phase).unwrap();
            }
            s.barrier(rank, "exit").unwrap();
            sums.push(s.values().iter().sum::<u64>());
        }
        sums
    });
    for sums in out {
        for (round, sum) in sums.into_iter().enumerate() {
            let want: u64 = (0..WORLD as u64).map(|r| r * 1000 + round as u64).sum();
            assert_eq!(sum, want);
        }
    }
}

#[test]
fn next_seq_counts_per_site_group_rank() {
    assert_eq!(next_seq(103, 0, 0), 0);
    assert_eq!(next_seq(103, 0, 0), 1);
    assert_eq!(next_seq(103, 0, 1), 0);
    assert_eq!(next_seq(103, 1, 0), 0);
    assert_eq!(next_seq(104, 0, 0), 0);
    assert_eq!(next_seq(103, 0, 0), 2);
}

#[test]
fn groups_are_separate_sessions() {
    // Two groups of 3 ranks meet at the same site and seq without mixing.
    let out = on_ranks(6, |t| {
        let (group, rank) = (t / 3, t % 3);
        let k = Key {
            site: 105,
            group,
            seq: 0,
        };
        let s = Session::join("test groups", k, rank, 3, t, LONG).unwrap();
        s.barrier(rank, "exit").unwrap();
        s.values().to_vec()
    });
    assert_eq!(out[0], vec![0, 1, 2]);
    assert_eq!(out[4], vec![3, 4, 5]);
}

#[test]
fn join_timeout_names_missing_ranks() {
    // Ranks 2 and 5 of 6 never come.
    let t0 = Instant::now();
    let out = on_ranks(6, |rank| {
        if rank == 2 || rank == 5 {
            return None;
        }
        Some(
            Session::join(
                "tide all_gather site 106",
                key(106, 3),
                rank,
                6,
                (),
                Duration::from_millis(200),
            )
            .err()
            .expect("join must time out"),
        )
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
    for e in out.into_iter().flatten() {
        let msg = e.to_string();
        assert!(matches!(e, TideError::Rendezvous(_)), "{msg}");
        assert!(
            msg.contains("tide all_gather site 106 group 0 seq 3: ranks [2, 5] did not arrive at 'join' within 0.2 s"),
            "{msg}"
        );
    }
}

#[test]
fn late_arrival_fails_fast_after_timeout() {
    let k = key(107, 0);
    let e = Session::join("test late", k, 0, 2, (), Duration::from_millis(50))
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("rank 1 did not arrive at 'join'"),
        "{e}"
    );
    // Rank 1 comes long after rank 0 gave up: it fails at once with rank 0's error.
    let t0 = Instant::now();
    let e = Session::join("test late", k, 1, 2, (), LONG).err().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(
        e.to_string().contains("rank 1 did not arrive at 'join'"),
        "{e}"
    );
    // Both ranks arrived: the failed session is gone, the next seq works.
    let out = on_ranks(2, |rank| {
        Session::join("test late", key(107, 1), rank, 2, rank, LONG).map(|s| s.values().to_vec())
    });
    for v in out {
        assert_eq!(v.unwrap(), vec![0, 1]);
    }
}

#[test]
fn barrier_timeout_names_missing_rank_and_label() {
    let out = on_ranks(4, |rank| {
        let s = Session::join(
            "tide reduce_scatter site 108",
            key(108, 0),
            rank,
            4,
            (),
            Duration::from_millis(300),
        )
        .unwrap();
        s.wait(rank, 0).unwrap();
        if rank == 3 {
            // Rank 3 leaves without entering phase 1.
            return None;
        }
        Some(s.wait(rank, 1).expect_err("barrier must fail"))
    });
    let errs: Vec<_> = out.into_iter().flatten().collect();
    assert_eq!(errs.len(), 3);
    for e in errs {
        let msg = e.to_string();
        // The first rank to time out names rank 3; peers fail fast with the same message.
        assert!(
            msg.contains("site 108 group 0 seq 0: rank 3 did not arrive at 'phase 1' within 0.3 s"),
            "{msg}"
        );
    }
}

#[test]
fn fail_propagates_to_waiting_peers_fast() {
    let t0 = Instant::now();
    let out = on_ranks(8, |rank| {
        let s = Session::join("test fail", key(109, 0), rank, 8, (), LONG).unwrap();
        if rank == 4 {
            thread::sleep(Duration::from_millis(50));
            let err = TideError::InvalidArgument("param 2 'w' has a bad shape".into());
            s.fail(rank, &err);
            return Err(err);
        }
        s.wait(rank, 0)
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "peers must not wait for the timeout"
    );
    for (rank, r) in out.into_iter().enumerate() {
        let msg = r.expect_err("every rank fails").to_string();
        if rank != 4 {
            assert!(
                msg.contains(
                    "test fail group 0 seq 0: rank 4 failed: invalid argument: param 2 'w'"
                ),
                "{msg}"
            );
        }
    }
}

#[test]
fn rank_failing_before_join_poisons_peers() {
    let t0 = Instant::now();
    let out = on_ranks(4, |rank| {
        if rank == 1 {
            let err = TideError::InvalidArgument("shard shape mismatch".into());
            Session::<usize>::abandon("test abandon", key(110, 0), 1, 4, &err, LONG);
            return Err(err);
        }
        Session::join("test abandon", key(110, 0), rank, 4, rank, LONG).map(|_| ())
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
    for (rank, r) in out.into_iter().enumerate() {
        let msg = r.err().unwrap().to_string();
        if rank != 1 {
            assert!(
                msg.contains("rank 1 failed: invalid argument: shard shape mismatch"),
                "{msg}"
            );
        }
    }
    // Every rank arrived: the key is gone, and the next call (next seq) works.
    let out = on_ranks(4, |rank| {
        Session::join("test abandon", key(110, 1), rank, 4, rank, LONG).map(|s| s.values().len())
    });
    assert!(out.into_iter().all(|r| r.unwrap() == 4));
}

#[test]
fn rank_that_never_joins_is_named_and_later_seqs_work() {
    // Rank 0 errors before joining without telling anyone: peers time out naming it.
    let out = on_ranks(3, |rank| {
        if rank == 0 {
            return None;
        }
        Some(
            Session::join(
                "test silent",
                key(111, 0),
                rank,
                3,
                (),
                Duration::from_millis(100),
            )
            .err()
            .unwrap(),
        )
    });
    for e in out.into_iter().flatten() {
        assert!(
            e.to_string()
                .contains("rank 0 did not arrive at 'join' within 0.1 s"),
            "{e}"
        );
    }
    let out = on_ranks(3, |rank| {
        Session::join("test silent", key(111, 1), rank, 3, rank, LONG).is_ok()
    });
    assert!(out.into_iter().all(|ok| ok));
}

#[test]
fn world_mismatch_and_double_join_are_errors() {
    let k = key(112, 0);
    let a = thread::spawn(move || Session::join("test mismatch", k, 0, 2, 0u8, LONG));
    thread::sleep(Duration::from_millis(50));
    let e = Session::join("test mismatch", k, 1, 3, 1u8, LONG)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("world size 3 but peers use 2"),
        "{e}"
    );
    let e = a.join().unwrap().err().unwrap();
    assert!(
        e.to_string().contains("world size 3 but peers use 2"),
        "{e}"
    );

    let k = key(113, 0);
    let a = thread::spawn(move || Session::join("test twice", k, 0, 2, 0u8, LONG));
    thread::sleep(Duration::from_millis(50));
    let e = Session::join("test twice", k, 0, 2, 1u8, LONG)
        .err()
        .unwrap();
    assert!(e.to_string().contains("rank 0 joined twice"), "{e}");
    assert!(a.join().unwrap().is_err());

    let e = Session::join("test range", key(114, 0), 3, 2, 0u8, LONG)
        .err()
        .unwrap();
    assert!(matches!(e, TideError::InvalidArgument(_)), "{e}");
}

#[test]
fn mismatched_barrier_labels_fail() {
    let out = on_ranks(2, |rank| {
        let s = Session::join("test labels", key(115, 0), rank, 2, (), LONG).unwrap();
        if rank == 0 {
            thread::sleep(Duration::from_millis(20));
        }
        s.barrier(rank, if rank == 0 { "a" } else { "b" })
    });
    assert!(out.iter().all(|r| r.is_err()));
    assert!(out[0]
        .as_ref()
        .err()
        .unwrap()
        .to_string()
        .contains("disagree"));
}

#[test]
fn sixty_four_ranks() {
    const WORLD: usize = 64;
    let out = on_ranks(WORLD, |rank| {
        let mut ok = 0;
        for round in 0..20 {
            let seq = next_seq(116, 0, rank);
            assert_eq!(seq, round);
            let s = Session::join("test 64", key(116, seq), rank, WORLD, rank, LONG).unwrap();
            assert_eq!(s.values().len(), WORLD);
            assert!(s.values().iter().enumerate().all(|(r, &v)| r == v));
            for phase in 0..4 {
                s.wait(rank, phase).unwrap();
            }
            s.barrier(rank, "exit").unwrap();
            ok += 1;
        }
        ok
    });
    assert!(out.into_iter().all(|n| n == 20));
}

#[test]
fn sixty_four_ranks_one_fails_mid_plan() {
    const WORLD: usize = 64;
    let start = Arc::new(StdBarrier::new(WORLD));
    let t0 = Instant::now();
    let out = on_ranks(WORLD, move |rank| {
        start.wait();
        let s = Session::join("test 64 fail", key(117, 0), rank, WORLD, (), LONG).unwrap();
        s.wait(rank, 0)?;
        if rank == 37 {
            let e = TideError::Internal("boom".into());
            s.fail(rank, &e);
            return Err(e);
        }
        s.wait(rank, 1)
    });
    assert!(t0.elapsed() < Duration::from_secs(10));
    for (rank, r) in out.into_iter().enumerate() {
        let msg = r.err().unwrap().to_string();
        if rank != 37 {
            assert!(
                msg.contains("rank 37 failed: internal error (a tide bug): boom"),
                "{msg}"
            );
        }
    }
}

#[test]
fn completed_sessions_leave_the_registry() {
    // Other tests run concurrently, so only check that our own key is gone: a fresh join of the same
    // key after completion creates a new session (it would otherwise see "joined twice").
    let k = key(118, 0);
    let out = on_ranks(3, move |rank| {
        Session::join("test reg", k, rank, 3, rank, LONG).is_ok()
    });
    assert!(out.into_iter().all(|ok| ok));
    let out = on_ranks(3, move |rank| {
        Session::join("test reg", k, rank, 3, rank, LONG).is_ok()
    });
    assert!(out.into_iter().all(|ok| ok));
    let _ = live_sessions();
}

#[test]
fn leave_waits_for_every_rank_even_after_a_failure() {
    // Rank 1 fails and is slow to leave; the others must not return before it has left.
    use std::sync::atomic::{AtomicBool, Ordering};
    let rank1_left = Arc::new(AtomicBool::new(false));
    let flag = rank1_left.clone();
    let out = on_ranks(4, move |rank| {
        let s = Session::join("test leave", key(119, 0), rank, 4, (), LONG).unwrap();
        if rank == 1 {
            s.fail(1, &TideError::Internal("copy failed".into()));
            thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::SeqCst);
            let r = s.leave(1);
            assert!(s.all_left());
            return (r, true);
        }
        // join may return before or after rank 1's failure; either way the barrier fails.
        let e = s.wait(rank, 0).err().unwrap();
        assert!(e.to_string().contains("rank 1 failed"), "{e}");
        assert!(s.check().is_err());
        let r = s.leave(rank);
        (r, flag.load(Ordering::SeqCst))
    });
    for (r, saw_rank1_leave) in out {
        assert!(saw_rank1_leave, "a rank returned before rank 1 left");
        assert!(r
            .err()
            .unwrap()
            .to_string()
            .contains("rank 1 failed: internal error (a tide bug): copy failed"));
    }
}

#[test]
fn leave_ok_and_timeout_names_who_stayed() {
    let out = on_ranks(3, |rank| {
        let s = Session::join("test leave ok", key(120, 0), rank, 3, (), LONG).unwrap();
        s.leave(rank)
    });
    assert!(out.into_iter().all(|r| r.is_ok()));
    let out = on_ranks(3, |rank| {
        let s = Session::join(
            "test leave to",
            key(121, 0),
            rank,
            3,
            (),
            Duration::from_millis(150),
        )
        .unwrap();
        if rank == 2 {
            thread::sleep(Duration::from_millis(600));
            return None;
        }
        let r = s.leave(rank);
        assert!(!s.all_left());
        Some(r.err().unwrap().to_string())
    });
    for m in out.into_iter().flatten() {
        assert!(
            m.contains("rank 2 did not arrive at 'exit' within 0.15 s"),
            "{m}"
        );
    }
}

#[test]
fn run_seq_counts_within_a_run_and_resyncs_across_runs() {
    use tide::rendezvous::run_seq;
    let run_a = 0x1234_i64;
    assert_eq!(run_seq(122, 0, 0, run_a), 0x1234 << 32);
    assert_eq!(run_seq(122, 0, 0, run_a), (0x1234 << 32) | 1);
    assert_eq!(run_seq(122, 0, 1, run_a), 0x1234 << 32);
    // Rank 1 never ran its second call of run A (it failed earlier); in run B both start at 0.
    let run_b = -5_i64;
    assert_eq!(run_seq(122, 0, 0, run_b), run_seq(122, 0, 1, run_b));
    let k = Key {
        site: 122,
        group: 3,
        seq: run_seq(122, 3, 0, 0x10),
    };
    assert_eq!(k.to_string(), "group 3 run 0x10 call 0");
    assert_eq!(key(1, 7).to_string(), "group 0 seq 7");
}

#[test]
fn run_seq_keeps_interleaved_runs_apart() {
    // Two launches of one program in flight on a device (two Python threads): a loop calls site
    // 123 twice per run, and the device interleaves the runs A, B, A, B. Each run counts its own
    // calls, so a rank that did not interleave (A, A, B, B) gets the same keys.
    use tide::rendezvous::run_seq;
    let (a, b) = (0x51_i64, 0x52_i64);
    let interleaved: Vec<u64> = [a, b, a, b]
        .iter()
        .map(|&r| run_seq(123, 0, 0, r))
        .collect();
    let in_order: Vec<u64> = [a, a, b, b]
        .iter()
        .map(|&r| run_seq(123, 0, 1, r))
        .collect();
    let of = |r: i64, call: u64| ((r as u64) << 32) | call;
    assert_eq!(interleaved, vec![of(a, 0), of(b, 0), of(a, 1), of(b, 1)]);
    assert_eq!(in_order, vec![of(a, 0), of(a, 1), of(b, 0), of(b, 1)]);
}

/// The place of rank `rank` of a 2-rank group on devices 0 and 1 (engine "test-cycle") in `run`.
fn cycle_place(run: i64) -> tide::deadlock::Place {
    tide::deadlock::Place {
        engine: "test-cycle",
        run,
        devices: vec![0, 1].into(),
        confirm_after: tide::deadlock::CONFIRM_AFTER_CPU,
        stall_after: None,
    }
}

#[test]
fn programs_interleaved_across_devices_fail_at_once_not_at_the_timeout() {
    // Issue #17: device 0 runs program A (run 0xa1) then B (run 0xb2), device 1 runs B then A, as
    // when two threads launch A and B at once. Each program is one call per device. Without the
    // check both first calls wait for the 30 s timeout; with it every call fails within a second
    // naming what happened, and the next run meets normally.
    let t0 = Instant::now();
    let out = on_ranks(2, move |rank| {
        let order = if rank == 0 { [(7001, 0xa1), (7002, 0xb2)] } else { [(7002, 0xb2), (7001, 0xa1)] };
        let mut results = Vec::new();
        for (site, run) in order {
            let place = cycle_place(run);
            let r = Session::join_at("test program", key(site, 0), rank, 2, rank, LONG, Some(&place));
            results.push((site, r.map(|s| s.leave(rank)).err().map(|e| e.to_string()), t0.elapsed()));
        }
        results
    });
    for (rank, results) in out.iter().enumerate() {
        for (site, err, at) in results {
            let err = err.as_ref().unwrap_or_else(|| panic!("rank {rank} site {site}: the call succeeded"));
            assert!(err.contains("programs interleaved across devices"), "rank {rank} site {site}: {err}");
            assert!(err.contains("run 0xa1") && err.contains("run 0xb2"), "{err}");
            assert!(err.contains("dispatch_lock"), "{err}");
            assert!(*at < Duration::from_secs(1), "rank {rank} site {site} failed after {at:?}");
        }
    }
    // Usable afterwards: a new run of program A on both devices meets.
    let out = on_ranks(2, |rank| {
        let place = cycle_place(0xa3);
        let s = Session::join_at("test program", key(7001, 1), rank, 2, rank, LONG, Some(&place)).unwrap();
        s.leave(rank).unwrap();
        s.values().to_vec()
    });
    assert_eq!(out, vec![vec![0, 1], vec![0, 1]]);
    assert_eq!(tide::deadlock::waiting(), 0);
}

#[test]
fn a_rank_that_never_arrives_still_fails_at_the_timeout_naming_it() {
    // Run 0xc3 on device 0 only; device 1 computes (no waiting call): no cycle, the timeout.
    let place = cycle_place(0xc3);
    let t0 = Instant::now();
    let err = Session::join_at("test absent", key(7003, 0), 0, 2, 0u8, Duration::from_millis(300), Some(&place))
        .err()
        .expect("the peer never arrives");
    let waited = t0.elapsed();
    let msg = err.to_string();
    assert!(msg.contains("rank 1 did not arrive at 'join' within 0.3 s"), "{msg}");
    assert!(msg.contains("no tide call waits on device 1") && msg.contains("dispatch_lock"), "{msg}");
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5), "{waited:?}");
}

/// The place of a 2-rank group on devices 0 and 1 of engine "test-stall" in `run`, with XLA:CPU's
/// stall check after 200 ms.
fn stall_place(run: i64) -> tide::deadlock::Place {
    tide::deadlock::Place {
        engine: "test-stall",
        run,
        devices: vec![0, 1].into(),
        confirm_after: tide::deadlock::CONFIRM_AFTER_CPU,
        stall_after: Some(Duration::from_millis(200)),
    }
}

const STALL: &str = "XLA:CPU never started this program on device 1";

#[test]
fn a_device_that_never_started_the_run_in_an_idle_process_fails_as_a_stall() {
    // Issue #17 on XLA:CPU: device 1 never starts run 0xd1 (its launch is held back inside XLA),
    // nothing computes. The wait fails once the process was idle for 200 ms (other tests of this
    // binary may keep it busy for a while: the bound is the timeout, 20 s), naming the stall and the
    // fix; a late call of the run on device 1 then fails at once.
    let place = stall_place(0xd1);
    let t0 = Instant::now();
    let err = Session::join_at("test stall", key(7101, 0), 0, 2, 0u8, Duration::from_secs(20), Some(&place))
        .err()
        .expect("device 1 never arrives");
    let waited = t0.elapsed();
    let msg = err.to_string();
    assert!(msg.contains(STALL), "{msg}");
    assert!(msg.contains("run 0xd1") && msg.contains("dispatch_lock") && msg.contains("TIDE_STALL_MS"), "{msg}");
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(19), "{waited:?}");
    let t1 = Instant::now();
    let late = Session::join_at("test stall", key(7101, 0), 1, 2, 1u8, LONG, Some(&place)).err().expect("the run failed");
    assert!(late.to_string().contains(STALL), "{late}");
    assert!(t1.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_device_that_started_the_run_is_not_a_stall() {
    // Device 1 took part in an earlier call of run 0xd2 (it started the program; now it computes,
    // or skips the call): no stall, the timeout names it.
    let place = stall_place(0xd2);
    let out = on_ranks(2, move |rank| {
        let s = Session::join_at("test started", key(7102, 0), rank, 2, rank as u8, LONG, Some(&place)).unwrap();
        s.leave(rank).unwrap();
    });
    assert_eq!(out.len(), 2);
    let place = stall_place(0xd2);
    let err = Session::join_at("test started", key(7103, 0), 0, 2, 0u8, Duration::from_millis(800), Some(&place))
        .err()
        .expect("device 1 never arrives");
    let msg = err.to_string();
    assert!(msg.contains("rank 1 did not arrive at 'join' within 0.8 s") && !msg.contains(STALL), "{msg}");
}

#[test]
fn a_busy_process_is_not_a_stall() {
    // Device 1 never started run 0xd3, but the process computes (a thread spins): the missing
    // device may be computing its way to the program; the timeout decides.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spin = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        })
    };
    let place = stall_place(0xd3);
    let err = Session::join_at("test busy", key(7104, 0), 0, 2, 0u8, Duration::from_millis(800), Some(&place))
        .err()
        .expect("device 1 never arrives");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spin.join().unwrap();
    let msg = err.to_string();
    assert!(msg.contains("rank 1 did not arrive at 'join' within 0.8 s") && !msg.contains(STALL), "{msg}");
}
