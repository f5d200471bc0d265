"""Train a Llama-style decoder with FSDP: tide next to the strongest plain-JAX FSDP.

    python examples/train.py                     # tide vs jax (fp32 and bf16 reduction): the tiny model
                                                 # on 8 CPU devices, or 150m on the GPUs when present
    python examples/train.py --backend tide      # one run
    python examples/train.py --model 150m --steps 300 --compare --out runs/150m    # GPU
    python examples/train.py --cpu --mesh fsdp=4,tensor=2     # FSDP x Megatron tensor parallelism
    python examples/train.py --cpu --model tiny-moe --mesh fsdp=4,expert=2   # experts over "expert"

Runs (same data, same init, same optimizer; see examples/llama.py):
  tide      tide_jax.scan_layers + gather_params: bf16 all-gather, fp32-accumulated reduce-scatter
  jax-fp32  jax.lax.scan + all_gather, gradients cast to fp32 before psum_scatter (exact, 2x bytes)
  jax-bf16  jax.lax.scan + all_gather, bf16 psum_scatter (JAX's default FSDP)
The jax runs use MaxText's XLA flags (--xla-flags maxtext; `default` for none), tide runs XLA's
defaults. With --compare (the default without --backend) every run is its own process (XLA_FLAGS
differ), streaming its lines; then a table, DIR/summary.md, DIR/<run>.json and DIR/train.png.

Every step prints loss, step time, tokens/s, MFU (model FLOPs / (time x peak bf16 FLOP/s); peak known
for H100/H200/A100/B200 or --peak-tflops) and peak device memory (GPUs); eval loss on the held-out
split every --eval-every steps. Data: bytes of the standard library's .py files (default), --data FILE
(text, .npy or .bin tokens) or --data synthetic. Checkpoints (orbax-checkpoint, examples/checkpoint.py):
--save DIR [--save-every N] writes DIR/<step>, every process its own shards, in the background, every
array in its logical (unpadded) shape; --resume DIR (its latest step) or DIR/<step> continues bitwise
on the same device count, and on any other count (or mesh shape) to fp32 rounding.

Meshes (--mesh NAME=SIZE,...; default fsdp=<all devices>): "fsdp" (tide's FSDP axis), "tensor"
(Megatron-style attention and MLP), "expert" (the experts of --model tiny-moe), "data" (HSDP: the
shards replicated over it); the batch is split over "data" and "fsdp" (--batch-per-device sequences
per device of those), see examples/llama.py. Every run of --compare uses the same mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# MaxText's XLA:GPU flags (MaxText's gpu_multi_process_run.sh / its XLA flags guide). Flags the
# installed XLA does not know abort the process, so `maxtext_flags()` keeps only the known ones.
MAXTEXT_FLAGS = [
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_gpu_enable_command_buffer=",
]
DEFAULT_RUNS = "tide,jax-fp32,jax-bf16"


def _remat_arg(value: str) -> str:
    """--remat's value, checked against tide_jax.remat_policy's names without importing jax."""
    known = {"none", "full", "dots", "dots_all", "dots_with_context", "qkv_proj", "dots_except_mlp"}
    v = value.strip()
    if v.lower() in known or v.lower().startswith("names:") or v.replace("_", "").isalnum():
        return v.lower() if v.lower() in known else v
    raise argparse.ArgumentTypeError(f"unknown remat policy {value!r}: expected one of {sorted(known)}, names:a,b, "
                                     "or a jax.checkpoint_policies name")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="tiny | tiny-moe | 150m | 1b | 8b-layers (default: tiny on CPU, 150m on GPU)")
    ap.add_argument("--layers", type=int, help="override the model's depth (8b-layers: how many Llama-3-8B layers)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    ap.add_argument("--batch-per-device", type=int, help="sequences per device per step (default: the model's)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 150 on CPU, 300 on GPU)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the model's)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default: steps / 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--remat", default="dots", type=_remat_arg,
                    help="activation policy of each layer, the same for every backend: dots (save matmul outputs "
                         "without batch dimensions; default: the fastest step on one H200 for every model), none "
                         "(keep what autodiff keeps), full (recompute the layer), "
                         "dots_with_context, qkv_proj, dots_except_mlp, names:a,b, or any jax.checkpoint_policies name")
    ap.add_argument("--reshard", action=argparse.BooleanOptionalAction, default=True,
                    help="free each layer's gathered parameters after its forward and re-gather them in the "
                         "backward (FSDP2's reshard_after_forward; default); --no-reshard keeps them")
    ap.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                    help="jax.nn.dot_product_attention implementation (auto: cuDNN on GPUs where it applies, "
                         "else XLA's, saying why)")
    ap.add_argument("--data", default="stdlib", help="stdlib (default) | synthetic | FILE (text, .npy, .bin)")
    ap.add_argument("--vocab", type=int, help="vocabulary of synthetic / token-file data")
    ap.add_argument("--backend", choices=("tide", "jax"), help="one run with this backend (default: --compare)")
    ap.add_argument("--reduce", choices=("fp32", "bf16"), default="fp32", help="gradient reduction dtype of --backend jax")
    ap.add_argument("--xla-flags", choices=("default", "maxtext"), help="default: maxtext for jax, default for tide")
    ap.add_argument("--compare", action="store_true", help="run --runs back to back (one process each), then the table")
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help=f"runs of --compare, comma-separated NAME[:FLAGS] (default {DEFAULT_RUNS}; e.g. jax-bf16:default)")
    ap.add_argument("--check", action="store_true", help="--compare: exit 1 unless every run's loss agrees with the "
                    "first run's (see --rtol, --band)")
    ap.add_argument("--rtol", type=float, default=2e-2,
                    help="allowed relative loss difference over the first --check-steps steps (bf16 level)")
    ap.add_argument("--check-steps", type=int, default=10,
                    help="steps compared one by one (later, bf16 rounding makes trajectories drift apart chaotically)")
    ap.add_argument("--band", type=float, default=5e-2,
                    help="allowed relative difference of the smoothed loss curves after --check-steps "
                         "(moving average over --window steps) and of the last eval loss")
    ap.add_argument("--window", type=int, default=25, help="moving-average window of the smoothed comparison")
    ap.add_argument("--eval-every", type=int, default=None, help="eval loss every N steps (default steps / 6; 0: never)")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=None, help="print every N steps (default: about 30 lines)")
    ap.add_argument("--cpu", action="store_true", help="CPU devices even where GPUs exist")
    ap.add_argument("--devices", type=int, help="number of devices (default: all GPUs, 8 CPU devices)")
    ap.add_argument("--mesh", help="mesh axes NAME=SIZE,... in order, e.g. fsdp=4,tensor=2 (names: fsdp, tensor, "
                    "expert, data; one size may be -1); default: every device on fsdp")
    ap.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s per device for MFU (default: from the device kind)")
    ap.add_argument("--out", help="folder for <run>.json, summary.md and train.png (default with --compare: runs/<model>)")
    ap.add_argument("--save", metavar="DIR", help="orbax checkpoints in DIR/<step>: every --save-every steps and at "
                    "the end (needs orbax-checkpoint)")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", metavar="DIR", help="continue from a checkpoint: DIR/<step>, or DIR's latest step "
                    "(any device count)")
    ap.add_argument("--stop-after", type=int, help="stop after this step (the schedule still spans --steps)")
    ap.add_argument("--replot", metavar="DIR", help="only redo DIR's table, summary.md and train.png from its <run>.json "
                    "(e.g. on a machine with matplotlib)")
    ap.add_argument("--sweep", metavar="SETTINGS",
                    help="run --runs at each setting in THIS process (one XLA flag set: --xla-flags, default "
                         "'default'), e.g. none:reshard,none:no-reshard,full:reshard,dots:reshard; writes "
                         "OUT/<run>-<remat>-<reshard>.json (bench/train_bench.py uses it)")
    ap.add_argument("--name", help=argparse.SUPPRESS)  # run name (set by --compare)
    args = ap.parse_args(argv)
    if args.backend is None:
        args.compare = True
    if args.save and "{" in args.save:
        ap.error("--save DIR: the checkpoints go to DIR/<step> (no '{step}' needed)")
    return args


# ----------------------------------------------------------------------------------------------
# the environment (before jax is imported)
# ----------------------------------------------------------------------------------------------
def gpu_present(args) -> bool:
    """Decided before jax is imported: an NVIDIA driver and no request for CPU devices. (If JAX then
    has no GPU backend, `train` says so and runs on its CPU device.)"""
    if args.cpu or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return os.path.exists("/dev/nvidiactl")


def _probe(flags: list[str]) -> bool:
    """Whether XLA accepts these flags (checked on CPU in a subprocess: the flag table is shared)."""
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                       env=env, capture_output=True, timeout=300)
    return r.returncode == 0


def maxtext_flags() -> list[str]:
    cached = os.environ.get("TIDE_TRAIN_MAXTEXT_FLAGS")
    if cached is not None:
        return cached.split()
    if _probe(MAXTEXT_FLAGS):
        flags = list(MAXTEXT_FLAGS)
    else:
        flags = [f for f in MAXTEXT_FLAGS if _probe([f])]
        dropped = sorted(set(MAXTEXT_FLAGS) - set(flags))
        print(f"train: this XLA does not know {', '.join(dropped)}: left out", flush=True)
    os.environ["TIDE_TRAIN_MAXTEXT_FLAGS"] = " ".join(flags)
    return flags


def setup_env(args, use_gpu: bool, multiprocess: bool) -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not use_gpu and not multiprocess:  # (the launcher's --cpu-devices sets the count per process)
        flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={args.devices or 8}")
        os.environ["JAX_PLATFORMS"] = "cpu"
        # XLA:CPU's pool has max(NPROC or cores, devices) threads: spare ones so a busy thread cannot
        # starve the last device of a collective (README, "Tunables").
        os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 2 * (args.devices or 8))))
    if args.xla_flags == "maxtext":
        flags += [f for f in maxtext_flags() if f not in flags]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if importlib.util.find_spec("tide_jax") is None:  # a source checkout without `pip install .`
        sys.path.insert(0, os.path.join(REPO, "python"))
    if HERE not in sys.path:  # appended: examples/equinox.py must not shadow the equinox package
        sys.path.append(HERE)


def checkpoint_module():
    """examples/checkpoint.py, which needs orbax-checkpoint (an optional dependency of the example)."""
    try:
        import checkpoint
    except ImportError as e:
        if not (e.name or "").startswith("orbax"):
            raise
        raise SystemExit("train: --save / --resume need orbax-checkpoint: pip install orbax-checkpoint "
                         "(or pip install '.[examples]')") from e
    return checkpoint


def run_name(args) -> str:
    if args.name:
        return args.name
    label = "tide" if args.backend == "tide" else f"jax-{args.reduce}"
    default_flags = "default" if args.backend == "tide" else "maxtext"
    return label if args.xla_flags == default_flags else f"{label}:{args.xla_flags}"


# ----------------------------------------------------------------------------------------------
# one training run (this process)
# ----------------------------------------------------------------------------------------------
def train(args) -> dict:
    import jax
    import numpy as np

    import llama
    import tide_jax

    tide_jax.initialize()  # jax.distributed under a launcher; nothing for one process
    lead = jax.process_index() == 0
    say = (lambda *a: print(*a, flush=True)) if lead else (lambda *a: None)
    use_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not use_gpu and gpu_present(args):
        say(f"[train] WARNING: a GPU driver is present but JAX {jax.__version__} has no GPU backend "
            "(jax[cuda] not installed?): running on the CPU")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if args.devices:
        devices = devices[: args.devices]
    try:
        mesh = llama.make_mesh(devices, args.mesh)
    except ValueError as e:
        raise SystemExit(f"train: {e}") from None
    ndev = len(devices)
    n_batch = math.prod(mesh.shape[a] for a in llama.batch_axes(mesh))  # devices the batch is split over
    name = run_name(args)

    ckpt = checkpoint_module() if args.save or args.resume else None
    resume_meta = ckpt.read_meta(args.resume) if args.resume else None
    data = llama.load_data(args.data, args.vocab)
    cfg = llama.MODELS[args.model]
    over = {k: v for k, v in dict(layers=args.layers, seq=args.seq, batch_per_device=args.batch_per_device,
                                  lr=args.lr).items() if v is not None}
    cfg = dataclasses.replace(cfg, vocab=data.vocab, remat=args.remat, reshard=args.reshard,
                              attention=None if args.attention == "auto" else args.attention, **over)
    tide_jax.remat_policy(cfg.remat)  # an unknown policy name fails here, naming it
    cfg = dataclasses.replace(cfg, attention=llama.choose_attention(cfg, devices[0].platform, say))
    batch = cfg.batch_per_device * n_batch
    if resume_meta:  # same model, same global batch as the run being continued
        saved = llama.Config(**resume_meta["config"])
        how = dict(batch_per_device=0, remat="none", reshard=True, attention=None)  # may differ between the runs
        if dataclasses.replace(saved, **how) != dataclasses.replace(cfg, **how):
            raise SystemExit(f"train: --resume {args.resume}: the checkpoint is of {saved}, not {cfg}")
        batch = resume_meta["batch"]
        if batch % n_batch:
            raise SystemExit(f"train: the checkpoint's global batch {batch} does not split over {n_batch} devices")
    steps = args.steps
    opt_cfg = llama.OptConfig(steps=steps, lr=cfg.lr, warmup=args.warmup if args.warmup is not None else steps // 10)
    backend = llama.Backend("tide" if args.backend == "tide" else "jax", args.reduce)
    peak = args.peak_tflops or llama.peak_tflops(devices[0])
    tokens_per_step = batch * cfg.seq
    flops_per_step = cfg.flops_per_token() * tokens_per_step

    say(f"[{name}] {ndev} x {devices[0].device_kind} ({devices[0].platform}), mesh {dict(mesh.shape)}, jax {jax.__version__}, "
        f"XLA flags: {args.xla_flags}; model {args.model}: {cfg.n_params() / 1e6:.2f}M params, d {cfg.d_model}, "
        f"{cfg.layers} layers, {cfg.heads}/{cfg.kv_heads} heads, mlp {cfg.d_ff}, vocab {cfg.vocab}, "
        f"{'tied' if cfg.tied else 'untied'}; remat {cfg.remat}, {'reshard' if cfg.reshard else 'no reshard'}, "
        f"attention {cfg.attention or 'auto'}; batch {batch} x {cfg.seq} tokens; "
        f"{steps} steps, lr {cfg.lr:g}, warm-up {opt_cfg.warmup}; data {data.describe()}"
)

    try:
        lays = llama.Layouts.build(cfg, mesh)
    except ValueError as e:
        raise SystemExit(f"train: {e}") from None
    tx = llama.optimizer(opt_cfg, cfg)
    start = 0
    if args.resume:  # read straight into this mesh's shards (no initial state first)
        target = llama.abstract_state(cfg, lays, tx)
        state, meta = ckpt.restore(args.resume, target, llama.logical_state(target, lays))
        start = meta["step"]
        say(f"[{name}] resumed from {args.resume} at step {start} (saved on {meta['devices']} devices, now {ndev})")
    else:
        state = llama.init_state(cfg, lays, tx, args.seed)
    saver = ckpt.Checkpoints(args.save) if args.save else None
    logical = llama.logical_state(state, lays)
    shardings = llama.state_shardings(state)
    train_step = llama.make_train_step(cfg, backend, lays, mesh, tx, shardings)
    eval_step = llama.make_eval_step(cfg, backend, lays, mesh)
    eval_set = [llama.put_batch(b, mesh) for b in data.eval_batches(args.seed, args.eval_batches, batch, cfg.seq)]
    eval_every = max(1, steps // 6) if args.eval_every is None else args.eval_every
    log_every = args.log_every or max(1, steps // 30)
    stop = min(steps, args.stop_after or steps)
    if args.resume and start >= stop:
        raise SystemExit(f"train: --resume {args.resume} is at step {start}: nothing to do up to step {stop} "
                         "(--steps / --stop-after)")

    def evaluate(step):
        loss = float(np.mean([float(eval_step(state["params"], b)) for b in eval_set]))
        say(f"[{name}] eval  step {step:5d}  val loss {loss:.4f}")
        return {"step": step, "loss": loss}

    def save(step):  # returns once the shards are on the host; the writes go on behind the next steps
        meta = dict(step=step, model=args.model, config=dataclasses.asdict(cfg), batch=batch, seed=args.seed,
                    data=args.data, steps=steps, devices=ndev, backend=name)
        t0 = time.perf_counter()
        saver.save(step, state, logical, meta)
        say(f"[{name}] saving step {step} to {os.path.join(saver.directory, str(step))} "
            f"({1e3 * (time.perf_counter() - t0):.0f} ms to the host, writing in the background)")

    records, evals = [], []
    if start == 0 and eval_every:
        evals.append(evaluate(0))
    # Compiled ahead of time: the compile is timed on its own and XLA's memory plan of the step read.
    t0 = time.perf_counter()
    first_tokens = llama.put_batch(data.batch(args.seed, start, batch, cfg.seq), mesh)
    compiled = train_step.lower(state, first_tokens).compile()
    compile_s = time.perf_counter() - t0
    step_memory = _step_memory(compiled)
    t_run = time.perf_counter()
    done = start  # steps done: what the state is after
    for step in range(start, stop):
        tokens = first_tokens if step == start else llama.put_batch(data.batch(args.seed, step, batch, cfg.seq), mesh)
        t0 = time.perf_counter()
        state, metrics = compiled(state, tokens)
        done = step + 1
        loss = float(metrics["loss"])  # waits for the step
        dt = time.perf_counter() - t0
        rec = {"step": step, "loss": loss, "time_s": dt, "grad_norm": float(metrics["grad_norm"])}
        records.append(rec)
        if not math.isfinite(loss):
            say(f"[{name}] step {step}: loss is {loss}: stopping")
            break
        if step == start or (step + 1) % log_every == 0 or step + 1 == stop:
            mem = llama.peak_memory_bytes(devices)
            mfu = f"{100 * flops_per_step / (dt * peak * 1e12 * ndev):5.1f}%" if peak else "  n/a"
            what = "first step" if step == start else "step"
            say(f"[{name}] step {step + 1:5d}/{steps}  loss {loss:.4f}  gnorm {rec['grad_norm']:.3f}  "
                f"{what} {1e3 * dt:8.1f} ms  {tokens_per_step / dt:10,.0f} tok/s  MFU {mfu}  "
                f"mem {_gib(mem)}")
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == stop):
            evals.append(evaluate(step + 1))
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 != stop:
            save(step + 1)
    wall = time.perf_counter() - t_run
    if args.save:
        if done > start or not args.resume:  # (a resumed run that did no step has nothing new)
            save(done)  # = stop unless a non-finite loss stopped the run
        t0 = time.perf_counter()
        saver.close()  # waits for the writes
        say(f"[{name}] checkpoints written ({time.perf_counter() - t0:.1f} s waiting for the last one)")

    times = [r["time_s"] for r in records]
    skip = min(len(times) - 1, max(2, len(times) // 10))  # compile and warm-up steps
    median = statistics.median(times[skip:]) if times else float("nan")
    mem = llama.peak_memory_bytes(devices)
    summary = dict(
        name=name, backend=backend.name, reduce=backend.reduce if backend.name == "jax" else "fp32",
        xla_flags=args.xla_flags, model=args.model, config=dataclasses.asdict(cfg), devices=ndev,
        mesh=dict(mesh.shape),
        device_kind=devices[0].device_kind, platform=devices[0].platform, jax=jax.__version__,
        batch=batch, tokens_per_step=tokens_per_step, steps=steps, start=start, data=data.describe(),
        median_step_s=median, timed_steps=len(times[skip:]), tokens_per_s=tokens_per_step / median if times else None,
        mfu=flops_per_step / (median * peak * 1e12 * ndev) if peak and times else None,
        peak_memory_bytes=mem, step_memory_bytes=step_memory, compile_s=compile_s,
        remat=cfg.remat, reshard=cfg.reshard, attention=cfg.attention,
        first_step_s=times[0] if times else None, wall_s=wall,
        final_loss=records[-1]["loss"] if records else None, final_val_loss=evals[-1]["loss"] if evals else None,
        records=records, evals=evals, gpu=use_gpu, lead=lead,
    )
    val = f"val loss {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}" if evals else "no eval"
    say(f"[{name}] done: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}, {val}; median step {1e3 * median:.1f} ms "
        f"({summary['timed_steps']} steps), {summary['tokens_per_s']:,.0f} tok/s, "
        f"MFU {_pct(summary['mfu'])}, peak memory {_gib(mem)}, step memory (XLA) {_gib(step_memory)}; "
        f"compile {compile_s:.1f} s, {wall:.1f} s")
    if args.out and lead:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{name.replace(':', '-')}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _step_memory(compiled) -> int | None:
    """XLA's memory plan of one step: arguments + outputs - donated (aliased) + temporaries: the peak
    the step needs, per device, independent of what ran before it in the process."""
    try:
        m = compiled.memory_analysis()
        if isinstance(m, list):
            m = m[0]
        return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


# ----------------------------------------------------------------------------------------------
# --compare: one process per run, then the table and the plot
# ----------------------------------------------------------------------------------------------
def parse_runs(spec: str) -> list[tuple[str, str, str, str]]:
    """'tide,jax-bf16:default' -> [(name, backend, reduce, flags)]."""
    runs = []
    for item in spec.split(","):
        item = item.strip()
        label, _, flags = item.partition(":")
        if label == "tide":
            backend, reduce = "tide", "fp32"
        elif label in ("jax-fp32", "jax-bf16"):
            backend, reduce = "jax", label.split("-")[1]
        else:
            raise SystemExit(f"train: unknown run {label!r}: expected tide, jax-fp32 or jax-bf16")
        flags = flags or ("default" if backend == "tide" else "maxtext")
        if flags not in ("default", "maxtext"):
            raise SystemExit(f"train: unknown XLA flag set {flags!r} in {item!r}: expected default or maxtext")
        runs.append((item if ":" in item else label, backend, reduce, flags))
    return runs


def compare(args, argv) -> int:
    out = args.out or os.path.join("runs", args.model)
    runs = parse_runs(args.runs)
    if any(flags == "maxtext" for *_, flags in runs):
        flags = maxtext_flags()
        print(f"train: MaxText XLA flags: {' '.join(flags)}", flush=True)
    passthrough = _strip(argv, {"--compare", "--check"}, {"--runs", "--backend", "--reduce", "--xla-flags", "--out",
                                                         "--name", "--rtol", "--band", "--window", "--check-steps"})
    results, failed = [], []
    for name, backend, reduce, flags in runs:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--backend", backend, "--reduce", reduce,
               "--xla-flags", flags, "--name", name, "--out", out]
        path = os.path.join(out, f"{name.replace(':', '-')}.json")
        if os.path.exists(path):
            os.remove(path)  # a stale result must not stand in for a failed run
        r = subprocess.run(cmd)
        if r.returncode != 0 or not os.path.exists(path):
            print(f"train: run {name} failed (exit {r.returncode}); going on with the others", file=sys.stderr,
                  flush=True)
            failed.append(name)
            continue
        with open(path) as f:
            results.append(json.load(f))
    ok = report(results, out, argv, args) if results else False
    if failed:
        print(f"FAIL: run(s) {', '.join(failed)} failed", file=sys.stderr)
        return 1
    if args.check and not ok:
        print("FAIL: the runs' losses disagree (see above)", file=sys.stderr)
        return 1
    return 0


def report(results: list[dict], out: str, argv, args) -> bool:
    ok, text = summarize(results, args.rtol, args.check_steps, args.band, args.window)
    print(text, flush=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"`{' '.join(['python3', 'examples/train.py', *argv])}`\n\n{text}\n")
    plot(results, os.path.join(out, "train.png"))
    return ok


def replot(args) -> int:
    results = []
    for fname in sorted(os.listdir(args.replot)):
        if fname.endswith(".json"):
            with open(os.path.join(args.replot, fname)) as f:
                res = json.load(f)
            if "records" in res:
                results.append(res)
    if not results:
        print(f"train: no run results (<run>.json) in {args.replot}", file=sys.stderr)
        return 1
    results.sort(key=lambda r: (r["backend"] != "tide", r["name"]))  # tide first: the reference
    return 0 if report(results, args.replot, ["--replot", args.replot], args) else 1


def parse_sweep(spec: str) -> list[tuple[str, bool]]:
    """'none:reshard,dots:no-reshard' -> [("none", True), ("dots", False)]."""
    out = []
    for item in spec.split(","):
        remat, _, how = item.strip().partition(":")
        how = how or "reshard"
        if how not in ("reshard", "no-reshard"):
            raise SystemExit(f"train: --sweep {item!r}: expected REMAT:reshard or REMAT:no-reshard")
        out.append((_remat_arg(remat), how == "reshard"))
    return out


def sweep(args) -> int:
    """--runs at every --sweep setting in this process, each run interleaved with the others of its
    setting (which one goes first alternates): the same machine state for every comparison. A run
    that does not fit (out of device memory) is recorded as such and the sweep goes on."""
    out = args.out or os.path.join("runs", f"{args.model}-sweep")
    os.makedirs(out, exist_ok=True)
    runs = parse_runs(args.runs)
    failed = 0
    for n, (remat, reshard) in enumerate(parse_sweep(args.sweep)):
        order = runs if n % 2 == 0 else list(reversed(runs))
        for name, backend, reduce, _flags in order:
            tag = f"{name}-{remat.replace(':', '_')}-{'reshard' if reshard else 'no-reshard'}"
            run_args = argparse.Namespace(**vars(args))
            run_args.backend, run_args.reduce, run_args.remat, run_args.reshard = backend, reduce, remat, reshard
            run_args.name, run_args.out, run_args.save, run_args.resume = tag, None, None, None
            path = os.path.join(out, f"{tag}.json")
            try:
                summary = train(run_args)
            except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED: record and go on
                msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                print(f"[{tag}] FAILED: {msg}", flush=True)
                summary = dict(name=tag, backend=backend, reduce=reduce, remat=remat, reshard=reshard,
                               model=args.model, error=msg,
                               oom="RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower())
                failed += 0 if summary["oom"] else 1
            summary.setdefault("run", name)
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)
            import gc

            gc.collect()
    return 1 if failed else 0


def _strip(argv, flags, options):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in flags:
            continue
        if key in options:
            skip = "=" not in a
            continue
        out.append(a)
    return out


@dataclasses.dataclass
class Agreement:
    """How one run's losses compare with the reference run's (what `--check` decides on)."""

    ok: bool
    early: float  # worst relative difference over the first check_steps common steps
    smooth: float  # worst relative difference of the moving averages after them
    val: float  # relative difference of the last common eval loss (nan without evals)
    why: str  # the first violation, or "" when ok


def _moving_average(values: list[float], window: int) -> list[float]:
    """Centered moving average (shorter windows at the ends)."""
    half = max(window, 1) // 2
    csum = [0.0]
    for v in values:
        csum.append(csum[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((csum[hi] - csum[lo]) / (hi - lo))
    return out


def agreement(ref: dict, res: dict, rtol: float, check_steps: int, band: float, window: int) -> Agreement:
    """Two healthy runs of one model agree step by step early (to `rtol`: bf16 rounding is all that
    differs) and then drift apart chaotically (a gradient-norm spike amplifies a 1e-3 difference),
    while following the same curve. So: the first `check_steps` steps one by one to `rtol`; after
    them, the moving averages over `window` steps to `band`; the last common eval loss to `band`.
    A real disagreement (a wrong gradient, a different model) moves the curve itself, beyond `band`."""
    ref_loss = {r["step"]: r["loss"] for r in ref["records"]}
    loss = {r["step"]: r["loss"] for r in res["records"]}
    steps = sorted(s for s in loss if s in ref_loss)
    if not steps:
        return Agreement(False, math.nan, math.nan, math.nan, "no common steps")

    def rel(a, b):
        return abs(a - b) / max(abs(b), 1e-6)

    why = ""
    broken = [s for s in steps if not math.isfinite(loss[s]) and math.isfinite(ref_loss[s])]
    if broken:
        why = f"step {broken[0] + 1}: loss is {loss[broken[0]]} (the reference's is {ref_loss[broken[0]]:.4f})"
    early_steps, late_steps = steps[:check_steps], steps[check_steps:]
    early = max(rel(loss[s], ref_loss[s]) for s in early_steps)
    if not why and (not math.isfinite(early) or early > rtol):
        bad = next(s for s in early_steps if not rel(loss[s], ref_loss[s]) <= rtol)
        why = f"step {bad + 1}: loss {loss[bad]:.4f} vs {ref_loss[bad]:.4f} (rel. {rel(loss[bad], ref_loss[bad]):.1e} > {rtol:g})"
    smooth = 0.0
    if late_steps:
        a = _moving_average([loss[s] for s in steps], window)
        b = _moving_average([ref_loss[s] for s in steps], window)
        late = set(late_steps)
        diffs = [(rel(x, y), s) for x, y, s in zip(a, b, steps) if s in late]
        smooth, where = max(diffs, key=lambda d: (not math.isfinite(d[0]), d[0]))
        if not why and not smooth <= band:
            why = f"around step {where + 1}: smoothed loss {a[steps.index(where)]:.4f} vs {b[steps.index(where)]:.4f} (rel. {smooth:.1e} > {band:g})"
    ref_val = {e["step"]: e["loss"] for e in ref.get("evals", [])}
    common_val = [e for e in res.get("evals", []) if e["step"] in ref_val]
    val = rel(common_val[-1]["loss"], ref_val[common_val[-1]["step"]]) if common_val else math.nan
    if not why and common_val and not val <= band:
        why = f"last eval loss {common_val[-1]['loss']:.4f} vs {ref_val[common_val[-1]['step']]:.4f} (rel. {val:.1e} > {band:g})"
    return Agreement(not why, early, smooth, val, why)


def summarize(results: list[dict], rtol: float, check_steps: int, band: float = 5e-2,
              window: int = 25) -> tuple[bool, str]:
    """The table; ok = every run agrees with the first run (`agreement`)."""
    ref = results[0]
    ref_val = {e["step"]: e["loss"] for e in ref["evals"]}
    knobs = f"remat {ref['config'].get('remat')}, {'reshard' if ref['config'].get('reshard', True) else 'no reshard'}"
    lines = [
        f"{ref['model']} model ({ref['config']['layers']} layers, d {ref['config']['d_model']}; {knobs}, attention "
        f"{ref['config'].get('attention') or 'auto'}), {ref['devices']} x {ref['device_kind']}"
        f"{', mesh ' + str(ref['mesh']) if len(ref.get('mesh') or {}) > 1 else ''}, jax {ref['jax']}, "
        f"batch {ref['batch']} x {ref['config']['seq']} tokens, {ref['steps']} steps; data {ref['data']}",
        "",
        f"| run | XLA flags | loss first -> last | val loss | median step | tokens/s | MFU | peak memory | "
        f"vs {ref['name']}: max rel. diff steps 1-{check_steps} / smoothed after | last val loss diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok, verdicts = True, []
    for res in results:
        recs = res["records"]
        last_val = res["evals"][-1] if res["evals"] else None
        val_diff = "-" if res is ref or not last_val or last_val["step"] not in ref_val else (
            f"{last_val['loss'] - ref_val[last_val['step']]:+.4f}")
        diff = "-"
        if res is not ref:
            ag = agreement(ref, res, rtol, check_steps, band, window)
            diff = f"{ag.early:.1e} / {ag.smooth:.1e}"
            if not ag.ok:
                ok = False
                verdicts.append(f"{res['name']} DISAGREES with {ref['name']}: {ag.why}")
        lines.append(
            f"| {res['name']} | {res['xla_flags']} | {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f} | "
            f"{_val(res)} | {1e3 * res['median_step_s']:.1f} ms | "
            f"{res['tokens_per_s']:,.0f} | {_pct(res['mfu'])} | {_gib(res['peak_memory_bytes'])} | "
            f"{diff} | {val_diff} |")
    lines.append("")
    if ok:
        lines.append(f"losses agree: the first {check_steps} steps to rtol {rtol:g} (bf16 level), the curves smoothed "
                     f"over {window} steps and the last eval loss to {band:g}; median step time over the "
                     f"{ref['timed_steps']} steps after compile and warm-up")
    else:
        lines.extend(verdicts)
        lines.append(f"(checked: the first {check_steps} steps to rtol {rtol:g}, then curves smoothed over {window} "
                     f"steps and the last eval loss to {band:g})")
    return ok, "\n".join(lines)


def _val(res) -> str:
    ev = res["evals"]
    return f"{ev[0]['loss']:.4f} -> {ev[-1]['loss']:.4f}" if ev else "-"


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"train: no plot ({path}): matplotlib is not installed (pip install matplotlib); the curves are in "
              f"{os.path.dirname(path)}/*.json", flush=True)
        return
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        recs = res["records"]
        line, = ax_loss.plot([r["step"] + 1 for r in recs], [r["loss"] for r in recs], lw=0.8, alpha=0.8,
                             label=f"{res['name']} train")
        ev = res["evals"]
        ax_loss.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o--", color=line.get_color(), ms=4,
                     label=f"{res['name']} val")
        ax_time.plot([r["step"] + 1 for r in recs[1:]], [1e3 * r["time_s"] for r in recs[1:]], lw=0.8,
                     color=line.get_color(), label=f"{res['name']} (median {1e3 * res['median_step_s']:.1f} ms)")
    r0 = results[0]
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title=f"{r0['model']}: loss")
    ax_time.set(xlabel="step", ylabel="step time (ms)", ylim=(0, None),
                title=f"step time, {r0['devices']} x {r0['device_kind']}")
    ax_loss.legend(fontsize=8)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"train: wrote {path}", flush=True)


def main(argv=None):
    """Returns the exit code (--compare) or the run's summary (one run)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot:
        return replot(args)
    use_gpu = gpu_present(args)
    multiprocess = int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1
    if args.model is None:
        args.model = "150m" if use_gpu else "tiny"
        argv += ["--model", args.model]
    if args.steps is None:
        args.steps = 300 if use_gpu else 150
        argv += ["--steps", str(args.steps)]
    if args.sweep:
        args.xla_flags = args.xla_flags or "default"
        setup_env(args, use_gpu, multiprocess)
        return sweep(args)
    if args.compare:
        if args.save:
            raise SystemExit("train: --save needs one run (--backend tide or jax): --compare's runs would all "
                             "write the same checkpoints")
        if multiprocess:
            raise SystemExit("train: under a launcher, run one backend per job (--backend tide or jax); "
                             "--compare starts its runs as processes of its own")
        return compare(args, argv)
    if args.xla_flags is None:
        args.xla_flags = "default" if args.backend == "tide" else "maxtext"
    setup_env(args, use_gpu, multiprocess)
    summary = train(args)
    if args.out and not args.name and summary["lead"]:  # a run of its own (not one of --compare's)
        plot([summary], os.path.join(args.out, "train.png"))
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
