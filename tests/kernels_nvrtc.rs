//! Compiles every kernel of kernels/rs_sum.cu with NVRTC for sm_90 (the H200), to PTX and to a cubin,
//! so a broken kernel fails CI rather than the GPU run. Needs no GPU, only libnvrtc: found through
//! TIDE_NVRTC_LIB_DIR (e.g. site-packages/nvidia/cu13/lib of `pip install nvidia-cuda-nvrtc==13.0.*`),
//! the loader path, or /usr/local/cuda. Without it the test prints SKIPPED on the terminal and passes,
//! unless TIDE_REQUIRE_NVRTC=1, where a missing NVRTC fails it.

use std::io::Write;
use tide::cuda::kernels::{nvrtc_options, KERNEL_NAMES, MAX_REGISTERS, SOURCE, SOURCE_NAME};
use tide::cuda::nvrtc::{compile, compile_with, ensure_loaded, version, Output};

/// Prints past libtest's capture (it captures print!/eprint!, not direct writes to stderr).
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

fn nvrtc_or_skip(test: &str) -> bool {
    let dir = std::env::var("TIDE_NVRTC_LIB_DIR").ok();
    match ensure_loaded(dir.as_deref()) {
        Ok(()) => true,
        Err(e) => {
            if std::env::var("TIDE_REQUIRE_NVRTC")
                .map(|v| v == "1")
                .unwrap_or(false)
            {
                panic!("{test}: TIDE_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}");
            }
            say(&format!("SKIPPED {test}: NVRTC not available ({e})"));
            false
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm90() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm90") {
        return;
    }
    let (major, minor) = version().unwrap();
    say(&format!("kernels_nvrtc: NVRTC {major}.{minor}"));
    let ptx = compile(SOURCE, SOURCE_NAME, "compute_90", Output::Ptx).unwrap();
    let ptx = String::from_utf8_lossy(&ptx);
    for k in KERNEL_NAMES {
        assert!(
            ptx.contains(&format!(".entry {k}(")),
            "kernel {k} missing from the PTX"
        );
    }
    // No local memory (register arrays indexed at run time, spills of the source pointers).
    assert!(
        !ptx.contains("ld.local") && !ptx.contains("st.local"),
        "local memory in the PTX"
    );
    // The f16 path uses the PTX conversion, the fp32 vector path 16-byte loads, the 2-byte quad
    // path 8-byte loads; no shared memory (the bulk kernels are gone, issue #9).
    assert!(ptx.contains("cvt.f32.f16"));
    assert!(
        ptx.contains("ld.global.v4.u32")
            || ptx.contains("ld.global.v4.b32")
            || ptx.contains("ld.global.nc.v4")
    );
    assert!(
        ptx.contains("ld.global.v2.u32")
            || ptx.contains("ld.global.v2.b32")
            || ptx.contains("ld.global.nc.v2")
    );
    assert!(!ptx.contains(".shared") && !ptx.contains("mbarrier"));
    let (cubin, log) = compile_with(
        SOURCE,
        SOURCE_NAME,
        "sm_90",
        Output::Cubin,
        &["--ptxas-options=-v"],
    )
    .unwrap();
    say(&format!("kernels_nvrtc: ptxas for sm_90:\n{}", log.trim()));
    check_ptxas_log(&log, 512);
    assert_eq!(&cubin[..4], b"\x7fELF", "a cubin is an ELF image");
    for k in KERNEL_NAMES {
        assert!(
            cubin.windows(k.len()).any(|w| w == k.as_bytes()),
            "kernel {k} missing from the cubin"
        );
    }
}

/// Every kernel of the ptxas log (`--ptxas-options=-v`): no spills to local memory, at most
/// `kernels::MAX_REGISTERS` registers per thread (the `__launch_bounds__(TIDE_THREADS,
/// TIDE_MIN_CTAS)` bound), no shared memory.
fn check_ptxas_log(log: &str, threads: u32) {
    for line in log.lines().filter(|l| l.contains("spill")) {
        assert!(
            line.contains("0 bytes spill stores") && line.contains("0 bytes spill loads"),
            "{threads} threads: spills: {line}"
        );
    }
    let used: Vec<u32> = log
        .lines()
        .filter_map(|l| l.split("Used ").nth(1))
        .filter_map(|r| r.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(used.len(), KERNEL_NAMES.len(), "{threads} threads: a ptxas report per kernel: {log}");
    for r in &used {
        assert!(*r <= MAX_REGISTERS, "{threads} threads: {r} registers > {MAX_REGISTERS}: {log}");
    }
    assert!(!log.contains("bytes smem"), "{threads} threads: shared memory: {log}");
}

/// TIDE_SM_THREADS: the module compiles for 128- and 256-thread CTAs too, within the same bounds
/// (64 registers, no spills), so a CTA of 256 threads holds a quarter of an SM's registers.
#[test]
fn every_kernel_compiles_for_smaller_ctas() {
    if !nvrtc_or_skip("every_kernel_compiles_for_smaller_ctas") {
        return;
    }
    for threads in [128u32, 256] {
        let mut opts = nvrtc_options(threads);
        opts.push("--ptxas-options=-v".to_string());
        let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
        let (cubin, log) = compile_with(SOURCE, SOURCE_NAME, "sm_90", Output::Cubin, &opts).unwrap();
        say(&format!("kernels_nvrtc: {threads} threads: {} registers at most",
                     log.lines().filter_map(|l| l.split("Used ").nth(1)).filter_map(|r| r.split_whitespace().next()?.parse::<u32>().ok()).max().unwrap_or(0)));
        check_ptxas_log(&log, threads);
        assert_eq!(&cubin[..4], b"\x7fELF");
    }
}

#[test]
fn a_broken_kernel_reports_the_nvrtc_log() {
    if !nvrtc_or_skip("a_broken_kernel_reports_the_nvrtc_log") {
        return;
    }
    let e = compile(
        "extern \"C\" __global__ void k() { undefined_thing(); }",
        "broken.cu",
        "sm_90",
        Output::Cubin,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("nvrtcCompileProgram")
            && e.contains("undefined_thing")
            && e.contains("broken.cu"),
        "{e}"
    );
}

/// The opt-in NVLink multicast store kernel compiles for sm_90 (compiling multimem code is safe;
/// this test never loads or launches it).
#[test]
fn multicast_kernel_compiles_for_sm90() {
    use tide::cuda::multicast;
    if !nvrtc_or_skip("multicast_kernel_compiles_for_sm90") {
        return;
    }
    let ptx = compile(
        multicast::SOURCE,
        multicast::SOURCE_NAME,
        "compute_90",
        Output::Ptx,
    )
    .unwrap();
    let ptx = String::from_utf8_lossy(&ptx);
    assert!(ptx.contains(&format!(".entry {}(", multicast::KERNEL)));
    assert!(ptx.contains("multimem.st"));
    let (cubin, log) = compile_with(
        multicast::SOURCE,
        multicast::SOURCE_NAME,
        "sm_90",
        Output::Cubin,
        &["--ptxas-options=-v"],
    )
    .unwrap();
    assert!(!cubin.is_empty());
    say(&format!("kernels_nvrtc: multicast ptxas for sm_90:\n{log}"));
    assert!(log.contains("0 bytes spill stores"), "{log}");
}
