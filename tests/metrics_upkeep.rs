//! The metrics recorder keeps every histogram observation until something drains it: a scrape
//! or its upkeep. A server nobody scrapes must still not grow with the requests it serves.
//! Counted exactly by a counting allocator (this test binary's global allocator; one test, so
//! nothing else allocates meanwhile).

// `GlobalAlloc` is an unsafe trait: the counting allocator forwards to the system's.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

#[test]
fn histogram_samples_are_drained_without_a_scrape() {
    let _handle = reprise::metrics::prometheus();
    let h = metrics::histogram!("reprise_request_duration_seconds", "outcome" => "miss", "tenant" => "upkeep", "model" => "m");
    h.record(0.01);
    let before = LIVE.load(Ordering::SeqCst);
    for i in 0..200_000 {
        h.record(f64::from(i % 1000) / 1000.0);
    }
    let grown = LIVE.load(Ordering::SeqCst) - before;
    // 200,000 pending samples of 8 bytes each, in the recorder's blocks.
    assert!(
        grown > 1_000_000,
        "the samples are held until drained ({grown} bytes)"
    );
    // Within a few upkeep periods, without a render, they are folded into their buckets and
    // their memory given back.
    let deadline = Instant::now() + 4 * reprise::metrics::UPKEEP_INTERVAL;
    let mut held = grown;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        // Another observation pins the recorder's memory epoch, so what the upkeep freed is
        // reclaimed (as every request does).
        h.record(0.5);
        held = LIVE.load(Ordering::SeqCst) - before;
        if held < grown / 10 {
            break;
        }
    }
    assert!(
        held < grown / 10,
        "{grown} bytes of pending samples, {held} still held after {:?}",
        4 * reprise::metrics::UPKEEP_INTERVAL
    );
}
