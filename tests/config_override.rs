//! The test/bench configuration hook: `config::set_override` replaces what `config::current`
//! returns for calls that start afterwards, and `None` restores the environment's configuration.
//! (Its own test binary: the override is process-wide.)

use tide::config::{self, LocalCopy};

#[test]
fn override_replaces_and_restores() {
    let base = config::current();
    assert_eq!(*base, *config::CONFIG);
    let mut c = base.as_ref().clone();
    c.ag_streams = 7;
    c.local_copy = LocalCopy::Sm;
    c.rs_slot_bytes = 8 << 20;
    config::set_override(Some(c.clone()));
    assert_eq!(*config::current(), c);
    assert_eq!(
        tide::plan::RsOptions::from_config().slot_bytes,
        8 << 20,
        "plans read the override too"
    );
    config::set_override(None);
    assert_eq!(*config::current(), *config::CONFIG);
}
