//! Gives freed heap back to the operating system after a large one-off release (the initial
//! fold's parse buffers and worker arenas, a batch of retired leases): glibc's allocator keeps
//! freed pages mapped otherwise, and RSS stays at its peak. A no-op where the allocator is not
//! glibc's. Never on the request path.

/// Returns free memory at the top of each heap and in every arena to the OS (`malloc_trim(0)`).
#[allow(unsafe_code)]
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and only walks the allocator's own free lists
    // under its locks; it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
