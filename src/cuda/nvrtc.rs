//! NVRTC: finding the library and compiling tide's kernels, through cudarc's `nvrtc` bindings.
//!
//! cudarc loads NVRTC lazily by name (libnvrtc.so, libnvrtc.so.13, .12, ...) and panics when it
//! finds none, so nothing here touches it before `ensure_loaded` succeeded. Where NVRTC is looked
//! for, in order:
//! 1. `TIDE_NVRTC_LIB_DIR` (config `nvrtc_lib_dir`): its `libnvrtc-builtins.so.*` and then its
//!    `libnvrtc.so*` are loaded with RTLD_GLOBAL, so cudarc's later `dlopen("libnvrtc.so.13")` finds
//!    the loaded copy by its soname (the pip wheel `nvidia-cuda-nvrtc` ships
//!    `nvidia/cu13/lib/libnvrtc.so.13` without an rpath to its builtins, hence the builtins first);
//! 2. the dynamic loader's search path (LD_LIBRARY_PATH, ldconfig);
//! 3. the folders of NVIDIA pip wheels this process already loaded libraries from (JAX's CUDA
//!    plugin loads cuBLAS etc. from site-packages/nvidia/cu13/lib, where the nvidia-cuda-nvrtc wheel
//!    puts libnvrtc.so.13 too), then /usr/local/cuda/lib64 and /usr/local/cuda/lib (as in 1).
//!
//! Nothing here runs at library load time; the first compile happens on the first CUDA call that
//! needs a kernel.

use crate::error::{Result, TideError};
use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString};
use std::sync::{Mutex, OnceLock};

/// What `compile` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// PTX text (arch must be `compute_XY` or `sm_XY`).
    Ptx,
    /// A cubin for exactly `sm_XY` (no driver JIT at load time).
    Cubin,
}

fn nvrtc_err(call: &str, r: sys::nvrtcResult, detail: &str) -> TideError {
    // SAFETY: nvrtcGetErrorString returns a static string for every result code; only called once
    // the library is loaded.
    let msg = unsafe {
        let p = sys::nvrtcGetErrorString(r);
        if p.is_null() {
            format!("{r:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    TideError::Cuda {
        call: call.into(),
        detail: format!("{msg}{}{detail}", if detail.is_empty() { "" } else { ": " }),
    }
}

/// Files in `dir` whose names start with `prefix`, excluding NVIDIA's `.alt.` variants, sorted.
fn libs_in(dir: &std::path::Path, prefix: &str) -> Vec<std::path::PathBuf> {
    let mut v: Vec<std::path::PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .map(|n| n.starts_with(prefix) && n.contains(".so") && !n.contains(".alt."))
                    .unwrap_or(false)
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

/// Loads NVRTC (and its builtins) from `dir` with RTLD_GLOBAL and keeps them loaded for the life of
/// the process. Returns the library path loaded, or None when `dir` holds none.
fn preload_dir(dir: &std::path::Path) -> std::result::Result<Option<String>, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    let builtins = libs_in(dir, "libnvrtc-builtins");
    let libs = libs_in(dir, "libnvrtc.so");
    if libs.is_empty() {
        return Ok(None);
    }
    for b in &builtins {
        // SAFETY: loading NVIDIA's NVRTC builtins library runs no initializers with requirements on us.
        match unsafe { Library::open(b.to_str(), RTLD_NOW | RTLD_GLOBAL) } {
            Ok(l) => std::mem::forget(l),
            Err(e) => log::warn!("tide: could not preload {}: {e}", b.display()),
        }
    }
    // Prefer a versioned soname (libnvrtc.so.13) over the development symlink.
    let lib = libs
        .iter()
        .rev()
        .find(|p| p.to_string_lossy().contains(".so."))
        .unwrap_or(&libs[0]);
    // SAFETY: as above, NVRTC's own library.
    match unsafe { Library::open(lib.to_str(), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(l) => {
            std::mem::forget(l);
            Ok(Some(lib.display().to_string()))
        }
        Err(e) => Err(format!("{}: {e}", lib.display())),
    }
}

static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// Makes NVRTC available to cudarc (see the module header), once per process.
pub fn ensure_loaded(dir: Option<&str>) -> Result<()> {
    let r = LOADED.get_or_init(|| {
        let mut notes = Vec::new();
        if let Some(d) = dir {
            match preload_dir(std::path::Path::new(d)) {
                Ok(Some(p)) => log::info!("tide: NVRTC from TIDE_NVRTC_LIB_DIR: {p}"),
                Ok(None) => notes.push(format!("TIDE_NVRTC_LIB_DIR={d} holds no libnvrtc.so*")),
                Err(e) => notes.push(format!("TIDE_NVRTC_LIB_DIR: {e}")),
            }
        }
        // SAFETY: is_culib_present only dlopens candidate names and drops them.
        if unsafe { sys::is_culib_present() } {
            return Ok(());
        }
        let mut dirs: Vec<std::path::PathBuf> = loaded_nvidia_lib_dirs();
        dirs.push("/usr/local/cuda/lib64".into());
        dirs.push("/usr/local/cuda/lib".into());
        for d in &dirs {
            if let Err(e) = preload_dir(d) {
                notes.push(e);
            }
            // SAFETY: as above.
            if unsafe { sys::is_culib_present() } {
                return Ok(());
            }
        }
        Err(format!(
            "NVRTC (libnvrtc.so.13 or .12) not found{}{}. Install the nvidia-cuda-nvrtc wheel (CUDA 13) and \
             set TIDE_NVRTC_LIB_DIR to its site-packages/nvidia/cu13/lib, or add the CUDA toolkit's lib64 \
             to LD_LIBRARY_PATH",
            if notes.is_empty() { "" } else { ": " },
            notes.join("; ")
        ))
    });
    r.clone().map_err(|detail| TideError::Cuda {
        call: "loading NVRTC".into(),
        detail,
    })
}

/// Folders where NVIDIA's pip wheels put libraries this process already loaded (JAX's CUDA plugin
/// loads cuBLAS and friends from site-packages/nvidia/...): `nvidia/cu13/lib` (CUDA 13 wheels, NVRTC
/// included) and, for CUDA 12 wheels, the sibling `nvidia/cuda_nvrtc/lib`. Read from
/// /proc/self/maps; empty where that is unreadable.
fn loaded_nvidia_lib_dirs() -> Vec<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    nvidia_lib_dirs_from_maps(&maps)
}

/// The parsing half of `loaded_nvidia_lib_dirs`, for tests.
pub fn nvidia_lib_dirs_from_maps(maps: &str) -> Vec<std::path::PathBuf> {
    let mut out: Vec<std::path::PathBuf> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        if !path.contains("/nvidia/") || !path.contains(".so") {
            continue;
        }
        let Some(dir) = std::path::Path::new(path).parent() else {
            continue;
        };
        let mut cands = vec![dir.to_path_buf()];
        if let Some(pkg_root) = dir.parent().and_then(|p| p.parent()) {
            cands.push(pkg_root.join("cuda_nvrtc").join("lib"));
        }
        for c in cands {
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    out
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32)> {
    ensure_loaded(crate::config::CONFIG.nvrtc_lib_dir.as_deref())?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: library loaded (ensure_loaded); out-pointers are valid locals.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcVersion", r, ""));
    }
    Ok((major, minor))
}

/// Serializes compiles: NVRTC is thread-safe, but compiling the same module on every device thread
/// at once wastes the first call's time; the per-arch cache in `cuda::device` holds the result.
static COMPILE_LOCK: Mutex<()> = Mutex::new(());

/// Compiles `source` for `arch` ("sm_90" or "compute_90") and returns PTX or a cubin. Errors carry
/// NVRTC's log. Options: `--fmad=false` (the kernels only add; kept so no contraction can change
/// bits), no fast math: NVRTC's default `-ftz=false`, so denormals are kept, as in the CPU engine
/// (src/engine/cpu.rs [Note: IEEE arithmetic]; tests/kernels_host_harness.cpp `check_ieee`).
pub fn compile(source: &str, name: &str, arch: &str, output: Output) -> Result<Vec<u8>> {
    compile_with(source, name, arch, output, &[]).map(|(image, _log)| image)
}

/// `compile` with extra NVRTC options (e.g. `--ptxas-options=-v`); returns the image and the log.
pub fn compile_with(
    source: &str,
    name: &str,
    arch: &str,
    output: Output,
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    ensure_loaded(crate::config::CONFIG.nvrtc_lib_dir.as_deref())?;
    let _guard = COMPILE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let src = CString::new(source)
        .map_err(|_| TideError::Internal("kernel source contains a NUL byte".into()))?;
    let cname = CString::new(name)
        .map_err(|_| TideError::Internal("kernel name contains a NUL byte".into()))?;
    let opts: Vec<CString> = [
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_string(),
        "--std=c++17".to_string(),
    ]
    .into_iter()
    .chain(extra.iter().map(|e| e.to_string()))
    .map(|o| {
        CString::new(o).map_err(|_| TideError::Internal("NVRTC option contains a NUL byte".into()))
    })
    .collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: library loaded; src and cname outlive prog (destroyed below); no headers.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcCreateProgram", r, name));
    }
    struct Prog(sys::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once.
            let r = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                log::warn!("tide: nvrtcDestroyProgram failed: {r:?}");
            }
        }
    }
    let prog = Prog(prog);
    // SAFETY: valid program; opt_ptrs point into `opts`, alive for the call.
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(prog.0).unwrap_or_else(|e| format!("(no log: {e})"));
        return Err(nvrtc_err(
            "nvrtcCompileProgram",
            r,
            &format!("{name} for {arch}:\n{log}"),
        ));
    }
    type SizeFn = unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult;
    type GetFn = unsafe fn(sys::nvrtcProgram, *mut std::ffi::c_char) -> sys::nvrtcResult;
    let (size_fn, get_fn, what): (SizeFn, GetFn, &str) = match output {
        Output::Ptx => (sys::nvrtcGetPTXSize, sys::nvrtcGetPTX, "nvrtcGetPTX"),
        Output::Cubin => (sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN, "nvrtcGetCUBIN"),
    };
    let mut size = 0usize;
    // SAFETY: compiled program; size is a valid out-pointer.
    let r = unsafe { size_fn(prog.0, &mut size) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err(what, r, &format!("{name} for {arch} (size)")));
    }
    if size == 0 {
        return Err(TideError::Cuda {
            call: what.into(),
            detail: format!(
                "{name} for {arch}: empty output (is {arch} a real sm_XY for a cubin?)"
            ),
        });
    }
    let mut buf = vec![0u8; size];
    // SAFETY: buf holds `size` bytes as NVRTC asked.
    let r = unsafe { get_fn(prog.0, buf.as_mut_ptr() as *mut std::ffi::c_char) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err(what, r, &format!("{name} for {arch}")));
    }
    let log = program_log(prog.0).unwrap_or_default();
    Ok((buf, log))
}

fn program_log(prog: sys::nvrtcProgram) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: valid program; out-pointer valid.
    let r = unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcGetProgramLogSize", r, ""));
    }
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: buffer of the size NVRTC reported.
    let r = unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcGetProgramLog", r, ""));
    }
    Ok(String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nvidia_wheel_dirs_in_maps() {
        let maps = "\
7f0000000000-7f0000001000 r-xp 00000000 08:01 123 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcublas.so.13
7f0000001000-7f0000002000 r--p 00000000 08:01 124 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcublasLt.so.13
7f0000002000-7f0000003000 r-xp 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 r-xp 00000000 08:01 126 /sp/nvidia/cublas/lib/libcublas.so.12
";
        let d = nvidia_lib_dirs_from_maps(maps);
        let s: Vec<String> = d.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            s,
            vec![
                "/venv/lib/python3.12/site-packages/nvidia/cu13/lib",
                "/venv/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib",
                "/sp/nvidia/cublas/lib",
                "/sp/nvidia/cuda_nvrtc/lib",
            ]
        );
        assert!(nvidia_lib_dirs_from_maps("").is_empty());
    }
}
