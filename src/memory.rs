//! Gives freed heap back to the operating system: after a large one-off release (the initial
//! fold's parse buffers and worker arenas, a batch of retired leases) glibc's allocator keeps
//! freed pages mapped otherwise, and RSS stays at its peak. No-ops where the allocator is not
//! glibc's. Never on the request path.

/// The most free memory an arena keeps at its top before `free` returns it to the system.
/// glibc's default is 128 KiB but grows to twice the largest block it handed out by `mmap` (up
/// to 64 MiB): after the fold's 4 MiB journal reads, every thread's arena kept up to 8 MiB of
/// freed pages resident, and `malloc_trim` does not shrink the top of a thread's arena.
const TRIM_THRESHOLD: i32 = 128 << 10;

/// Fixes the allocator's trim threshold at `TRIM_THRESHOLD` (which also fixes its `mmap`
/// threshold at 128 KiB: a larger block is mapped and unmapped on its own). Call once, before
/// any thread starts.
#[allow(unsafe_code)]
pub fn configure() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt takes two integers and only sets the allocator's own parameters under
    // its lock; M_TRIM_THRESHOLD is a parameter glibc documents.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

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
