//! XLA FFI edge (stub; filled in by the FFI work).
