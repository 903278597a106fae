//! Compile-time checks of nexar live in tests/.
