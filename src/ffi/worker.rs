//! Threads for the asynchronous CPU handlers (docs/design.md "CPU handlers are asynchronous").
//!
//! XLA:CPU runs a program's independent thunks concurrently on a pool of max(cores, devices)
//! threads. A collective blocks its thread until every rank arrives, so with several tide calls in
//! flight per device (one per layer, say) the blocked calls can hold every pool thread while the
//! ranks they wait for cannot get one: a deadlock that only the timeout ends (seen with 12 layers
//! on 8 CPU devices). So the CPU handlers return an XLA future at once and run the call here.
//!
//! Every submitted job gets a thread of its own at once: an idle thread reserved for it, or a new
//! one. No job ever waits behind another (which could be blocked waiting for this one's rank).
//! Threads stay for later jobs; their number is the most calls ever in flight at once.

use once_cell::sync::Lazy;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send + 'static>;

struct Pool {
    /// Idle threads not yet reserved by a submitted job.
    idle: Mutex<usize>,
    tx: Mutex<Sender<Job>>,
    rx: Arc<Mutex<Receiver<Job>>>,
}

static POOL: Lazy<Arc<Pool>> = Lazy::new(|| {
    let (tx, rx) = channel();
    Arc::new(Pool {
        idle: Mutex::new(0),
        tx: Mutex::new(tx),
        rx: Arc::new(Mutex::new(rx)),
    })
});

fn worker(pool: Arc<Pool>) {
    loop {
        let job = {
            let rx = pool.rx.lock().unwrap_or_else(|e| e.into_inner());
            match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        job(); // jobs catch their own panics (src/ffi/mod.rs)
        *pool.idle.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }
}

/// Runs `job` on a thread that does nothing else meanwhile. Falls back to running it on the
/// caller's thread if no thread can be started (it then blocks the caller, as a synchronous
/// handler would).
pub fn submit(job: impl FnOnce() + Send + 'static) {
    let pool = POOL.clone();
    let reserved = {
        let mut idle = pool.idle.lock().unwrap_or_else(|e| e.into_inner());
        if *idle > 0 {
            *idle -= 1;
            true
        } else {
            false
        }
    };
    if !reserved {
        let p = pool.clone();
        if std::thread::Builder::new()
            .name("tide-cpu".into())
            .spawn(move || worker(p))
            .is_err()
        {
            log::warn!("tide: cannot start a CPU worker thread; running the call synchronously");
            job();
            return;
        }
    }
    let sent = pool
        .tx
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(Box::new(job));
    if let Err(e) = sent {
        (e.0)(); // the channel never closes while the pool lives; run it here if it somehow did
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    #[test]
    fn every_job_gets_its_own_thread_at_once() {
        // 24 jobs that can only finish together: they would deadlock on any bounded pool
        // smaller than 24 that let a job wait behind another.
        let n = 24;
        let barrier = Arc::new(Barrier::new(n + 1));
        for _ in 0..n {
            let b = barrier.clone();
            submit(move || {
                b.wait();
            });
        }
        barrier.wait();
        // And again, reusing the idle threads.
        let barrier = Arc::new(Barrier::new(n + 1));
        for _ in 0..n {
            let b = barrier.clone();
            submit(move || {
                b.wait();
            });
        }
        barrier.wait();
    }
}
