//! The metrics recorder keeps every histogram observation until something drains it: a scrape
//! or its upkeep. A server nobody scrapes must still not grow with the requests it serves.
//! Counted exactly by a counting allocator (this test binary's global allocator; one test, so
//! nothing else allocates meanwhile).

use std::time::{Duration, Instant};

use reprise_cache::testing::CountingAllocator;

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

#[test]
fn histogram_samples_are_drained_without_a_scrape() {
    let _handle = reprise::metrics::prometheus();
    let h = metrics::histogram!("reprise_request_duration_seconds", "outcome" => "miss", "tenant" => "upkeep", "model" => "m");
    h.record(0.01);
    let before = HEAP.live();
    for i in 0..200_000 {
        h.record(f64::from(i % 1000) / 1000.0);
    }
    let grown = HEAP.live() - before;
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
        held = HEAP.live() - before;
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
