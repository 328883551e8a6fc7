//! The allocator's handling of freed memory while decoding. Every layer of a forward allocates
//! its outputs afresh and frees them a moment later; glibc hands such memory back to the
//! kernel (trimming a thread's heap, unmapping large blocks), so the next forward faults the
//! same pages in again and has them zeroed. Keeping freed memory in the process removes those
//! faults from every decode step; the price is that the process's resident size stays at its
//! peak instead of shrinking after a burst.

/// The environment variable that turns the setting off (`0`): glibc's defaults then apply.
pub const KEEP_FREED_MEMORY_ENV: &str = "VERDICT_KEEP_FREED_MEMORY";

/// Tells glibc to keep freed memory for reuse: heaps are not trimmed below 1 GiB of free space
/// and blocks up to 32 MiB (glibc's ceiling for this setting) come from the heaps instead of
/// their own mappings. Call it at start-up, before the engines exist. Returns whether the
/// setting was applied (not with `VERDICT_KEEP_FREED_MEMORY=0`, nor off glibc).
pub fn keep_freed_memory() -> bool {
    if std::env::var(KEEP_FREED_MEMORY_ENV).is_ok_and(|v| v == "0") {
        tracing::info!("{KEEP_FREED_MEMORY_ENV}=0: the allocator returns freed memory as glibc does by default");
        return false;
    }
    apply()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> bool {
    const TRIM_THRESHOLD: libc::c_int = 1 << 30;
    const MMAP_THRESHOLD: libc::c_int = 32 << 20;
    // SAFETY: mallopt only changes the allocator's parameters; both values are in its range.
    let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) } == 1;
    let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } == 1;
    if !(trim && mmap) {
        tracing::warn!("the allocator refused to keep freed memory (mallopt: trim {trim}, mmap {mmap})");
    }
    trim && mmap
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> bool {
    false
}
