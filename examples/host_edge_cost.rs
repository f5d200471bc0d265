//! Host cost of tide's Rust FFI edge per call vs the number of parameters (no GPU, no XLA): the
//! decoding of a start and a done (`tide::ffi::decode_start` / `decode_done`) and the pairing of
//! the two (`tide::inflight`), for groups of N bf16 64x1024 parameters on a 1-rank mesh. Issue #9
//! budgets <= 1 us per parameter for a whole call; this is the part before the engine runs.
//!   cargo run --release --example host_edge_cost
use std::time::Instant;
use tide::call::op_code;
use tide::ffi::{decode_done, decode_start, FfiBuffer, FfiCall};
use tide::plan::Op;

const BF16: i32 = 16;

fn main() {
    for n in [1usize, 8, 64, 256, 1024] {
        let buf = |k: usize| FfiBuffer { data: 0x1000_0000 + k * 0x20000, dtype: BF16, dims: vec![64, 1024] };
        let ins: Vec<FfiBuffer> = (0..n).map(buf).collect();
        let outs: Vec<FfiBuffer> = (0..n).map(|k| buf(n + k)).collect();
        let names: Vec<String> = (0..n).map(|i| format!("layers.{i}.mlp.w")).collect();
        let base = FfiCall {
            site: 7,
            world: 1,
            nodes: 1,
            gpus_per_node: 1,
            device_ordinal: 0,
            device_ordinals: vec![0],
            device_ranks: vec![0],
            device_groups: vec![0],
            names: names.join("\n").into_bytes(),
            inputs: ins.clone(),
            outputs: outs.iter().cloned().chain(ins.iter().cloned()).collect(),
            stream: 0,
            run_id: 0,
            job: 0,
            urgent: 0,
        };
        let mut done = base.clone();
        done.inputs = outs.iter().cloned().chain(ins.iter().cloned()).collect();
        done.outputs = outs.clone();
        let reps = 2000 / n.max(1) + 20;
        let t = Instant::now();
        for _ in 0..reps {
            let info = decode_start(Op::AllGather, &base).unwrap();
            let rec = tide::inflight::Record::new(
                "start".into(),
                0,
                info.outputs.iter().map(|b| b.ptr).collect(),
                info.inputs.iter().map(|b| b.ptr).collect(),
            );
            tide::inflight::register(op_code(Op::AllGather), rec).unwrap();
            let d = decode_done(Op::AllGather, &done).unwrap();
            let o: Vec<usize> = d.outputs.iter().map(|b| b.ptr).collect();
            let i: Vec<usize> = d.inputs[n..].iter().map(|b| b.ptr).collect();
            tide::inflight::take("done", op_code(Op::AllGather), 0, &o, &i).unwrap();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
        println!("edge: {n:5} params: decode start + done and pairing {us:8.2} us per call, {:.3} us per param", us / n as f64);
    }
}
