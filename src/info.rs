//! What this library is and what it finds at run time, asked for by `tide_jax.info()`
//! (python/tide_jax/_info.py) through two C entry points:
//!
//! - `tide_build_info`: a static text baked in at build time (build.rs, "Build stamp"): crate
//!   version, git commit and whether the sources differed from it, the XLA FFI API and jaxlib version
//!   of the headers, profile, rustc, target. It comes from the library itself, so a stale or foreign
//!   library (another commit, other headers) shows as such, whatever the Python package says.
//! - `tide_runtime_info`: the CUDA driver (loaded and initialized if present: "not found: why" on a
//!   machine without GPUs), the NVRTC and NCCL this process has loaded (never loading them), and
//!   the files of all three (`/proc/self/maps`). Never fails and never panics.
//!
//! Both texts are `key: value` lines.

use std::ffi::c_char;

/// The build stamp, NUL-terminated (`tide_build_info`).
pub const BUILD_INFO: &str = concat!(
    "version: ",
    env!("CARGO_PKG_VERSION"),
    "\ncommit: ",
    env!("TIDE_BUILD_COMMIT"),
    "\nuncommitted changes: ",
    env!("TIDE_BUILD_DIRTY"),
    "\nxla ffi api: ",
    env!("TIDE_BUILD_FFI_API"),
    "\njaxlib headers: ",
    env!("TIDE_BUILD_JAXLIB"),
    "\nheaders from: ",
    env!("TIDE_BUILD_HEADERS"),
    "\nprofile: ",
    env!("TIDE_BUILD_PROFILE"),
    "\nrustc: ",
    env!("TIDE_BUILD_RUSTC"),
    "\ntarget: ",
    env!("TIDE_BUILD_TARGET"),
    "\0"
);

/// For `tide_jax` (ctypes): the build stamp, a static NUL-terminated `key: value` text.
#[no_mangle]
pub extern "C" fn tide_build_info() -> *const c_char {
    BUILD_INFO.as_ptr().cast()
}

/// The runtime probe as `key: value` lines: `cuda driver`, `cuda devices`, `nvrtc`, `nccl`, and
/// `loaded <lib>` for each CUDA library file mapped into the process.
///
/// It loads nothing but the CUDA driver (whose absence is final): NVRTC and NCCL are reported as
/// this process has them loaded now (`RTLD_NOLOAD`), so asking never changes which copy tide
/// uses later (NCCL: the one JAX loaded, README "Tunables" `TIDE_NCCL_LIB`), nor caches a miss.
pub fn runtime_info() -> String {
    let mut lines = Vec::new();
    match crate::cuda::driver::init() {
        Ok(v) => {
            lines.push(format!(
                "cuda driver: {}.{} (CUDA driver API)",
                v / 1000,
                (v % 1000) / 10
            ));
            lines.push(format!("cuda devices: {}", devices()));
        }
        Err(e) => lines.push(format!("cuda driver: not found: {}", detail(e))),
    }
    lines.push(format!("nvrtc: {}", nvrtc()));
    lines.push(format!("nccl: {}", nccl()));
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    for (name, path) in loaded_libraries(&maps) {
        lines.push(format!("loaded {name}: {path}"));
    }
    lines.join("\n")
}

/// `name` if this process has loaded it already (matched by path or soname); never loads it.
fn already_loaded(name: &str) -> Option<libloading::os::unix::Library> {
    // SAFETY: with RTLD_NOLOAD dlopen only returns another reference to a library already loaded
    // (no initializer runs); dropping it (dlclose) leaves the library loaded.
    unsafe { libloading::os::unix::Library::open(Some(name), libc::RTLD_NOW | libc::RTLD_NOLOAD) }
        .ok()
}

fn nvrtc() -> String {
    type Version =
        unsafe extern "C" fn(*mut std::ffi::c_int, *mut std::ffi::c_int) -> std::ffi::c_int;
    for name in ["libnvrtc.so.13", "libnvrtc.so.12"] {
        let Some(lib) = already_loaded(name) else {
            continue;
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: `nvrtcVersion(int*, int*)` (nvrtc.h); valid out-pointers.
        let ok = unsafe { lib.get::<Version>(b"nvrtcVersion\0") }
            .map(|f| unsafe { f(&mut major, &mut minor) } == 0)
            .unwrap_or(false);
        return if ok {
            format!("{major}.{minor} ({name}, loaded)")
        } else {
            format!("{name} loaded, but nvrtcVersion failed")
        };
    }
    "not loaded yet (tide loads libnvrtc.so.13 or .12 for its first kernel compile, from \
     TIDE_NVRTC_LIB_DIR, the NVIDIA wheels JAX loaded, or /usr/local/cuda)"
        .into()
}

fn nccl() -> String {
    let name = crate::config::CONFIG
        .nccl_lib
        .clone()
        .unwrap_or_else(|| "libnccl.so.2".into());
    let Some(lib) = already_loaded(&name) else {
        return format!(
            "not loaded yet (tide loads {name} at its first NCCL rail call, across nodes; \
             TIDE_NCCL_LIB names another)"
        );
    };
    type GetVersion = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    let mut v = 0;
    // SAFETY: `ncclGetVersion(int*)` (nccl.h); valid out-pointer.
    let ok = unsafe { lib.get::<GetVersion>(b"ncclGetVersion\0") }
        .map(|f| unsafe { f(&mut v) } == 0)
        .unwrap_or(false);
    if ok {
        format!(
            "{}.{}.{} ({name}, loaded)",
            v / 10000,
            (v / 100) % 100,
            v % 100
        )
    } else {
        format!("{name} loaded, but ncclGetVersion failed")
    }
}

fn detail(e: crate::TideError) -> String {
    match e {
        crate::TideError::Cuda { detail, .. } => detail,
        other => other.to_string(),
    }
}

/// "2: NVIDIA H200, NVIDIA H200", or why the count or names could not be read.
fn devices() -> String {
    use crate::cuda::driver;
    let n = match driver::device_count() {
        Ok(n) => n,
        Err(e) => return format!("unknown: {e}"),
    };
    let names: Vec<String> = (0..n)
        .map(|i| {
            driver::device_get(i)
                .and_then(driver::device_name)
                .unwrap_or_else(|e| format!("? ({e})"))
        })
        .collect();
    if names.is_empty() {
        "0".into()
    } else {
        format!("{n}: {}", names.join(", "))
    }
}

/// The CUDA libraries tide loads (libcuda, libnvrtc, libnccl) as mapped in `maps` (the text of
/// `/proc/self/maps`): (library, file), each file once, in map order. Two NCCL files here means two
/// NCCLs in one process (docs: load `libnccl.so.2`, the soname JAX loaded).
pub fn loaded_libraries(maps: &str) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let file = path.rsplit('/').next().unwrap_or(path);
        let Some(name) = ["libcuda.so", "libnvrtc.so", "libnccl.so"]
            .into_iter()
            .find(|n| file.starts_with(n))
        else {
            continue;
        };
        if !out.iter().any(|(_, p)| p == path) {
            out.push((name.trim_end_matches(".so"), path.to_string()));
        }
    }
    out
}

/// For `tide_jax` (ctypes): writes `runtime_info()` into `buf` (at most `cap` bytes, not
/// NUL-terminated) and returns its full length (call again with a larger buffer if it is larger).
///
/// # Safety
/// `buf` must be valid for writes of `cap` bytes (or `cap` 0).
#[no_mangle]
pub unsafe extern "C" fn tide_runtime_info(buf: *mut u8, cap: usize) -> usize {
    let text = std::panic::catch_unwind(runtime_info)
        .unwrap_or_else(|_| "error: panic while probing the CUDA libraries (a tide bug)".into());
    let n = text.len().min(cap);
    if n > 0 && !buf.is_null() {
        // SAFETY: the caller gives `cap` writable bytes at `buf`; n <= cap.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), buf, n) };
    }
    text.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_info_is_one_nul_terminated_text_of_key_value_lines() {
        assert!(BUILD_INFO.ends_with('\0'));
        let text = &BUILD_INFO[..BUILD_INFO.len() - 1];
        assert!(!text.contains('\0'));
        for key in [
            "version",
            "commit",
            "xla ffi api",
            "jaxlib headers",
            "profile",
            "rustc",
            "target",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{key}: "))),
                "no `{key}:` line in {text}"
            );
        }
        assert!(text.contains(&format!("version: {}\n", env!("CARGO_PKG_VERSION"))));
    }

    #[test]
    fn runtime_info_never_fails() {
        let text = runtime_info();
        for key in ["cuda driver: ", "nvrtc: ", "nccl: "] {
            assert!(
                text.lines().any(|l| l.starts_with(key)),
                "no `{key}` in {text}"
            );
        }
        let mut buf = [0u8; 8];
        // SAFETY: 8 writable bytes.
        let n = unsafe { tide_runtime_info(buf.as_mut_ptr(), buf.len()) };
        assert!(n >= 8);
    }

    #[test]
    fn loaded_libraries_from_maps() {
        let maps = "\
7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f01-7f02 r--p 00001000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f02-7f03 r-xp 00000000 08:01 2 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2
7f03-7f04 r-xp 00000000 08:01 3 /lib/x86_64-linux-gnu/libnccl.so.2.28.3
7f04-7f05 r-xp 00000000 08:01 4 /usr/lib/libcudart.so.13
7f05-7f06 rw-p 00000000 00:00 0
";
        assert_eq!(
            loaded_libraries(maps),
            vec![
                (
                    "libcuda",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04".to_string()
                ),
                (
                    "libnccl",
                    "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2".to_string()
                ),
                (
                    "libnccl",
                    "/lib/x86_64-linux-gnu/libnccl.so.2.28.3".to_string()
                ),
            ]
        );
    }
}
