//! [`Scrubber`]: a background thread that scrubs blocks round-robin at a
//! set rate (blocks per second), so that a single flip in an ECC word is
//! corrected before a second flip can land in the same word and turn it
//! into an uncorrectable (or, for Hamming(7,4), miscorrected) one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_quant::ScrubStats;

use crate::error::{PagedCacheError, Result};
use crate::pool::BlockId;
use crate::storage::BlockStorage;

/// Totals of a [`Scrubber`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrubTotals {
    /// What the passes found and rewrote.
    pub stats: ScrubStats,
    /// Blocks scrubbed.
    pub blocks: u64,
    /// Complete passes over the storage.
    pub passes: u64,
}

/// A running background scrubber; stopped and joined on [`stop`](Self::stop) or drop.
#[derive(Debug)]
pub struct Scrubber {
    stop: Arc<AtomicBool>,
    totals: Arc<Mutex<ScrubTotals>>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Scrubber {
    /// Starts scrubbing every block of `storage`, `blocks_per_second` blocks
    /// a second (paced against the clock, so the rate holds on average).
    pub fn start(storage: Arc<BlockStorage>, blocks_per_second: f64) -> Result<Self> {
        if !(blocks_per_second.is_finite() && blocks_per_second > 0.0) {
            return Err(PagedCacheError::InvalidParameter {
                name: "blocks_per_second",
                reason: format!("{blocks_per_second} is not a positive rate"),
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let totals = Arc::new(Mutex::new(ScrubTotals::default()));
        let (stop2, totals2) = (stop.clone(), totals.clone());
        let interval = Duration::from_secs_f64(1.0 / blocks_per_second);
        let thread = std::thread::Builder::new()
            .name("kv-scrubber".into())
            .spawn(move || {
                let n = storage.num_blocks();
                let begin = Instant::now();
                let mut done: u64 = 0;
                while !stop2.load(Ordering::Relaxed) && n > 0 {
                    let stats = storage.scrub(BlockId((done % n as u64) as u32))?;
                    done += 1;
                    {
                        let mut t = totals2.lock().unwrap_or_else(PoisonError::into_inner);
                        t.stats += stats;
                        t.blocks = done;
                        t.passes = done / n as u64;
                    }
                    let due = begin + interval.mul_f64(done as f64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait.min(Duration::from_millis(50)));
                    }
                }
                Ok(())
            })
            .map_err(|e| PagedCacheError::InvalidParameter {
                name: "scrubber thread",
                reason: e.to_string(),
            })?;
        Ok(Self {
            stop,
            totals,
            thread: Some(thread),
        })
    }

    /// Totals so far.
    pub fn totals(&self) -> ScrubTotals {
        *self.totals.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops the thread and returns the totals (or the error that stopped it).
    pub fn stop(mut self) -> Result<ScrubTotals> {
        self.halt()?;
        Ok(self.totals())
    }

    fn halt(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(PagedCacheError::InvalidParameter {
                name: "scrubber thread",
                reason: "it panicked".into(),
            }),
            None => Ok(()),
        }
    }
}

impl Drop for Scrubber {
    fn drop(&mut self) {
        // Errors were the caller's to collect through `stop`.
        let _ = self.halt();
    }
}
