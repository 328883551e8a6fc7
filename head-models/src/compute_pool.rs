//! Running a forward on the thread pool its kernels use.
//!
//! candle's CPU kernels split each matmul over rayon's global pool. Called from any other
//! thread (an engine thread, a request's thread), every parallel op hands its work to the pool
//! and sleeps until it is done: a round trip of wake-ups per op, which dominates small
//! forwards such as a draft head's. Called from a pool thread, the caller does its share and
//! only the other threads are woken. Other devices run the work in place: their contexts are
//! bound to the calling thread.

use candle_core::Device;

/// Runs `work` on a thread of rayon's global pool and waits for it (directly when already on
/// one, or when `device` is not the CPU).
pub fn on_compute_pool<R: Send>(device: &Device, work: impl FnOnce() -> R + Send) -> R {
    if !device.is_cpu() || rayon::current_thread_index().is_some() {
        return work();
    }
    rayon::scope(|_| work())
}

/// Threads the CPU kernels split a forward over (rayon's global pool).
pub fn compute_threads() -> usize {
    rayon::current_num_threads()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_runs_on_a_pool_thread_and_returns_its_value() {
        assert!(rayon::current_thread_index().is_none());
        let cpu = &Device::Cpu;
        let (on_pool, value) = on_compute_pool(cpu, || (rayon::current_thread_index().is_some(), 41 + 1));
        assert!(on_pool);
        assert_eq!(value, 42);
        // A nested call runs in place, on the same pool thread.
        let (outer, inner) = on_compute_pool(cpu, || (rayon::current_thread_index(), on_compute_pool(cpu, rayon::current_thread_index)));
        assert_eq!(outer, inner);
    }
}
