//! Builds the C++ half of the XLA FFI edge (`cxxbridge/`) against XLA's FFI headers from jaxlib.
//!
//! Header choice (docs/design.md "FFI contract", platform-notes "Version gate"): XLA rejects a handler
//! whose header API version is newer than the runtime's, and a rejected handler takes the backend
//! down. We build against jaxlib 0.10.2's headers (XLA FFI API 0.3), the oldest runtime we support;
//! newer runtimes (0.11.2 = API 0.4) accept it.
//!
//! Where the headers come from, first match wins:
//! 1. `TIDE_XLA_FFI_INCLUDE`: a directory holding `xla/ffi/api/ffi.h`;
//! 2. `<jaxlib>/include` of the Python in `PYO3_PYTHON`, `PYTHON_SYS_EXECUTABLE`, or `python3`.
//!
//! Headers newer than API 0.3 fail the build unless `TIDE_ALLOW_NEWER_XLA_HEADERS=1`.
//!
//! Build stamp (`src/info.rs`, `tide_build_info`): the git commit of the source (`TIDE_GIT_COMMIT`
//! overrides it; `unknown` outside a git checkout, e.g. from an sdist) and whether the files that make
//! the library differ from it, the XLA FFI API and jaxlib version of the headers, the profile and
//! rustc, as `TIDE_BUILD_*` compile-time variables. The script reruns when HEAD moves or those files
//! change, so the stamp never describes another build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The newest XLA FFI API the built library may declare (jaxlib 0.10.2).
const MAX_API: (u32, u32) = (0, 3);

const PY_INCLUDE: &str =
    "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))";

fn main() {
    for var in [
        "TIDE_XLA_FFI_INCLUDE",
        "TIDE_ALLOW_NEWER_XLA_HEADERS",
        "PYO3_PYTHON",
        "PYTHON_SYS_EXECUTABLE",
        "TIDE_GIT_COMMIT",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/ffi/mod.rs");
    println!("cargo:rerun-if-changed=cxxbridge");
    for f in ["cxxbridge/tide_ffi.h", "cxxbridge/tide_ffi.cc"] {
        println!("cargo:rerun-if-changed={f}");
    }

    let include = match find_headers() {
        Ok(dir) => dir,
        Err(why) => fail(&format!(
            "cannot find XLA FFI headers (xla/ffi/api/ffi.h): {why}.\n\
             tide builds its XLA FFI handlers against jaxlib 0.10.2's headers. Either install it into \
             the Python the build uses (`pip install jaxlib==0.10.2`; the build runs $PYO3_PYTHON, \
             $PYTHON_SYS_EXECUTABLE or python3) or set TIDE_XLA_FFI_INCLUDE to a directory holding \
             xla/ffi/api/ffi.h."
        )),
    };
    let c_api = include.join("xla/ffi/api/c_api.h");
    println!("cargo:rerun-if-changed={}", c_api.display());
    let api = match read_api_version(&c_api) {
        Ok(v) => v,
        Err(why) => fail(&format!(
            "cannot read the XLA FFI API version from {}: {why}",
            c_api.display()
        )),
    };
    if api > MAX_API {
        if env::var("TIDE_ALLOW_NEWER_XLA_HEADERS")
            .map(|v| v.trim() == "1")
            .unwrap_or(false)
        {
            println!(
                "cargo:warning=tide: building against XLA FFI API {}.{} headers from {} \
                 (TIDE_ALLOW_NEWER_XLA_HEADERS=1); the library will be rejected by older jaxlib",
                api.0,
                api.1,
                include.display()
            );
        } else {
            fail(&format!(
                "the XLA FFI headers in {} declare API {}.{}, newer than {}.{} (jaxlib 0.10.2).\n\
                 XLA rejects a handler built on headers newer than its runtime, and a rejected handler \
                 takes the whole backend down, so tide builds against jaxlib 0.10.2's headers to load \
                 under every jaxlib from 0.10.2 on. Install them (`pip install jaxlib==0.10.2`) or point \
                 TIDE_XLA_FFI_INCLUDE at them; set TIDE_ALLOW_NEWER_XLA_HEADERS=1 to build anyway.",
                include.display(),
                api.0,
                api.1,
                MAX_API.0,
                MAX_API.1
            ));
        }
    }

    stamp(&include, api);

    cxx_build::bridge("src/ffi/mod.rs")
        .file("cxxbridge/tide_ffi.cc")
        // As a system include: XLA's headers are not warning-clean and their warnings are not ours.
        .flag(format!("-isystem{}", include.display()))
        .std("c++17")
        .flag_if_supported("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("tide_ffi");
}

/// The files whose change makes another library (the dirty check and its reruns).
const SOURCES: [&str; 6] = ["src", "kernels", "cxxbridge", "build.rs", "Cargo.toml", "Cargo.lock"];

/// Sets the `TIDE_BUILD_*` variables `src/info.rs` bakes into `tide_build_info`.
fn stamp(include: &Path, api: (u32, u32)) {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let (commit, dirty) = match env::var("TIDE_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => (c.trim().to_string(), "unknown (TIDE_GIT_COMMIT)".to_string()),
        _ => git_commit(&root),
    };
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let var = |k: &str| env::var(k).unwrap_or_else(|_| "?".into());
    let vars = [
        ("TIDE_BUILD_COMMIT", commit),
        ("TIDE_BUILD_DIRTY", dirty),
        ("TIDE_BUILD_FFI_API", format!("{}.{}", api.0, api.1)),
        ("TIDE_BUILD_JAXLIB", jaxlib_version(include)),
        ("TIDE_BUILD_HEADERS", include.display().to_string()),
        (
            "TIDE_BUILD_PROFILE",
            format!("{} (opt-level {})", var("PROFILE"), var("OPT_LEVEL")),
        ),
        ("TIDE_BUILD_RUSTC", rustc_version),
        ("TIDE_BUILD_TARGET", var("TARGET")),
    ];
    for (k, v) in vars {
        // One line each: the values end up in a "key: value" text.
        println!("cargo:rustc-env={k}={}", v.replace(['\n', '\r'], " "));
    }
}

/// (commit, dirty) of the checkout at `root`: the HEAD commit and whether `SOURCES` differ from it
/// ("yes", "no"), or ("unknown", reason) without git. Registers the reruns: HEAD, the branch's ref,
/// packed refs, and `SOURCES` (a directory reruns on any change inside it).
fn git_commit(root: &Path) -> (String, String) {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").current_dir(root).args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--verify", "HEAD"]) else {
        return ("unknown".into(), "unknown (not a git checkout)".into());
    };
    let abs = |p: String| -> PathBuf {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            root.join(p)
        }
    };
    let mut watch: Vec<PathBuf> = Vec::new();
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        watch.push(abs(dir).join("HEAD"));
    }
    if let Some(common) = git(&["rev-parse", "--git-common-dir"]) {
        let common = abs(common);
        watch.push(common.join("packed-refs"));
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(common.join(branch));
        }
    }
    // Only files that exist: cargo reruns a script whose watched path is missing on every build.
    for p in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    for s in SOURCES {
        println!("cargo:rerun-if-changed={s}");
    }
    let mut args = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    args.extend(SOURCES);
    let dirty = match git(&args) {
        Some(s) if s.is_empty() => "no",
        Some(_) => "yes",
        None => "unknown",
    };
    (commit, dirty.into())
}

/// The version of the jaxlib whose `include` directory this is (`<jaxlib>/version.py`, next to it),
/// or "unknown" (headers from elsewhere, through TIDE_XLA_FFI_INCLUDE).
fn jaxlib_version(include: &Path) -> String {
    let Some(text) = include
        .parent()
        .and_then(|d| std::fs::read_to_string(d.join("version.py")).ok())
    else {
        return "unknown".into();
    };
    // `_release_version: str = '0.10.2'` (release wheels), else `_version = "0.10.2"`.
    let value = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.trim().strip_prefix(name)?;
            let rest = rest.trim_start_matches(|c: char| c == ':' || c == ' ' || c.is_alphabetic());
            let rest = rest.trim().strip_prefix('=')?.trim();
            let q = rest.chars().next().filter(|c| *c == '"' || *c == '\'')?;
            Some(rest[1..].split(q).next()?.to_string())
        })
    };
    value("_release_version")
        .or_else(|| value("_version"))
        .unwrap_or_else(|| "unknown".into())
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    for line in msg.lines() {
        println!("cargo:warning={line}");
    }
    std::process::exit(1);
}

fn find_headers() -> Result<PathBuf, String> {
    let has_ffi = |dir: &Path| dir.join("xla/ffi/api/ffi.h").is_file();
    if let Ok(dir) = env::var("TIDE_XLA_FFI_INCLUDE") {
        let dir = PathBuf::from(dir);
        return if has_ffi(&dir) {
            Ok(dir)
        } else {
            Err(format!(
                "TIDE_XLA_FFI_INCLUDE={} has no xla/ffi/api/ffi.h",
                dir.display()
            ))
        };
    }
    let python = env::var("PYO3_PYTHON")
        .or_else(|_| env::var("PYTHON_SYS_EXECUTABLE"))
        .unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .args(["-c", PY_INCLUDE])
        .output()
        .map_err(|e| format!("running {python}: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().last().unwrap_or("").trim().to_string();
        let why = if last.is_empty() {
            out.status.to_string()
        } else {
            last
        };
        return Err(format!("{python} cannot import jaxlib ({why})"));
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if has_ffi(&dir) {
        Ok(dir)
    } else {
        Err(format!(
            "{python}'s jaxlib has no {}",
            dir.join("xla/ffi/api/ffi.h").display()
        ))
    }
}

/// Parses `#define XLA_FFI_API_MAJOR n` and `#define XLA_FFI_API_MINOR n`.
fn read_api_version(c_api: &Path) -> Result<(u32, u32), String> {
    let text = std::fs::read_to_string(c_api).map_err(|e| e.to_string())?;
    let define = |name: &str| -> Result<u32, String> {
        text.lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some("#define") && words.next() == Some(name))
                    .then(|| words.next())?
            })
            .next()
            .ok_or_else(|| format!("no #define {name}"))?
            .parse()
            .map_err(|e| format!("{name}: {e}"))
    };
    Ok((define("XLA_FFI_API_MAJOR")?, define("XLA_FFI_API_MINOR")?))
}
