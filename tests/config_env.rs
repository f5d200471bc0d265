//! An invalid setting in the environment fails every tide call with an error naming the variable,
//! its value and the accepted range (issue #8 part 3), instead of a panic (`inf`), a silent clamp
//! (`0`, `nan`) or a silent default (`abc`); a test override still replaces the environment.
//! (Its own test binary: the environment is read once per process.)

use tide::config;
use tide::ffi::{run_cpu, FfiBuffer, FfiCall, StatusCode};
use tide::plan::Op;

fn single_rank_call(site: i64, src: &[f32], dst: &mut [f32]) -> FfiCall {
    let buf = |data: usize, n: usize| FfiBuffer {
        data,
        dtype: 11,
        dims: vec![n as i64],
    };
    FfiCall {
        site,
        world: 1,
        nodes: 1,
        gpus_per_node: 1,
        device_ordinal: 0,
        device_ordinals: vec![0],
        device_ranks: vec![0],
        device_groups: vec![0],
        names: b"w".to_vec(),
        inputs: vec![buf(src.as_ptr() as usize, src.len())],
        outputs: vec![buf(dst.as_mut_ptr() as usize, dst.len())],
        stream: 0,
        run_id: 0,
        job: 0,
        urgent: 0,
    }
}

#[test]
fn an_invalid_setting_fails_every_call_naming_it() {
    // Before anything reads the configuration (edition 2021: set_var is safe; one test here).
    std::env::set_var("TIDE_TIMEOUT_S", "inf");
    std::env::set_var("TIDE_RS_KERNEL", "abc");
    let src = [1.0f32, 2.0, 3.0];
    let mut dst = [0f32; 3];

    for site in 1..3 {
        let s = run_cpu(Op::AllGather, &single_rank_call(site, &src, &mut dst));
        assert_eq!(s.code, StatusCode::InvalidArgument);
        assert!(
            s.message.contains(
                "TIDE_TIMEOUT_S=\"inf\" is not a valid setting: expected seconds, a number in \
                 [0.001, 1000000]"
            ),
            "{}",
            s.message
        );
        assert!(
            s.message
                .contains("TIDE_RS_KERNEL=\"abc\" is not a valid setting: expected it unset: TIDE_RS_KERNEL was removed"),
            "{}",
            s.message
        );
        assert_eq!(dst, [0.0; 3], "a refused call writes nothing");
    }
    // The same message for tide_jax, through the C entry point.
    let mut buf = vec![0u8; 4096];
    // SAFETY: buf holds 4096 writable bytes.
    let n = unsafe { config::tide_settings_error(buf.as_mut_ptr(), buf.len()) };
    let msg = String::from_utf8_lossy(&buf[..n]);
    assert!(msg.contains("TIDE_TIMEOUT_S=\"inf\""), "{msg}");
    // SAFETY: cap 0 writes nothing.
    assert_eq!(
        unsafe { config::tide_settings_error(std::ptr::null_mut(), 0) },
        n
    );

    // A test override replaces the environment: calls work again, and fail again without it.
    config::set_override(Some(config::Config::defaults()));
    let s = run_cpu(Op::AllGather, &single_rank_call(3, &src, &mut dst));
    assert_eq!(s.code, StatusCode::Ok, "{}", s.message);
    assert_eq!(dst, src);
    assert_eq!(
        unsafe { config::tide_settings_error(std::ptr::null_mut(), 0) },
        0
    );
    config::set_override(None);
    let s = run_cpu(Op::AllGather, &single_rank_call(4, &src, &mut dst));
    assert_eq!(s.code, StatusCode::InvalidArgument, "{}", s.message);
}
