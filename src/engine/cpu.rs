//! CPU engine (stub; filled in by the core work).
