//! Unit tests of the index internals.

use super::*;

#[test]
fn a_removal_racing_an_insert_never_leaves_a_live_slot_behind() {
    // A removal between the insert's `location` write and its push used to find no slot,
    // and the push then left one nothing could remove.
    let idx = Arc::new(SemanticIndex::new(2, IndexConfig::default()));
    for round in 0..2_000u32 {
        let id = EntryId(u128::from(round));
        let mut p = [0u8; 32];
        p[..4].copy_from_slice(&round.to_le_bytes());
        let start = Arc::new(std::sync::Barrier::new(2));
        let remover = {
            let (idx, start) = (idx.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                idx.remove(id)
            })
        };
        start.wait();
        idx.insert(p, id, Vector::new(&[1.0, 0.0]));
        remover.join().unwrap();
        let found = idx.search(&p, &[1.0, 0.0], 1);
        assert_eq!(
            found.iter().any(|c| c.id == id),
            idx.contains(id),
            "round {round}: searchable but not removable, or the reverse"
        );
    }
}

fn unit(v: &[f32]) -> Vector {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / n).collect::<Vec<_>>().into()
}

#[test]
fn scan_keeps_the_best_k_in_order() {
    let idx = SemanticIndex::new(2, IndexConfig::default());
    let p = [1u8; 32];
    for (i, angle) in [0.0f32, 0.5, 1.0, 1.5, 0.25].iter().enumerate() {
        idx.insert(p, EntryId(i as u128), unit(&[angle.cos(), angle.sin()]));
    }
    let got = idx.search(&p, &[1.0, 0.0], 3);
    let ids: Vec<u128> = got.iter().map(|c| c.id.0).collect();
    assert_eq!(ids, vec![0, 4, 1]);
    assert!((got[0].similarity - 1.0).abs() < 1e-6);
}

#[test]
fn a_removal_that_wears_a_partition_past_the_ratio_wakes_maintenance() {
    use futures::FutureExt;
    let idx = SemanticIndex::new(
        2,
        IndexConfig {
            rebuild_tombstone_ratio: 0.5,
            ..IndexConfig::default()
        },
    );
    let p = [1u8; 32];
    for i in 0..4 {
        idx.insert(p, EntryId(i), unit(&[1.0, i as f32]));
    }
    assert!(idx.remove(EntryId(0)));
    assert!(idx.worn().now_or_never().is_none(), "1 of 4 is under half");
    assert!(idx.remove(EntryId(1)));
    assert!(idx.worn().now_or_never().is_some(), "2 of 4 is half");
    assert_eq!(idx.maintain().rebuilt, 1);
    assert!(idx.worn().now_or_never().is_none(), "woken once");
}

/// An insert that takes a partition past exact scans builds no graph itself (that would
/// hold the partition's lock, searches and removals waiting, for the whole build): it
/// wakes maintenance, once, which builds it.
#[test]
fn an_insert_past_exact_scans_wakes_maintenance_and_builds_nothing() {
    use futures::FutureExt;
    let idx = SemanticIndex::new(
        2,
        IndexConfig {
            exact_scan_max: 8,
            ..IndexConfig::default()
        },
    );
    let p = [2u8; 32];
    for i in 0..8 {
        idx.insert(p, EntryId(i), unit(&[1.0, i as f32]));
    }
    assert!(idx.worn().now_or_never().is_none(), "8 are scanned");
    for i in 8..100 {
        idx.insert(p, EntryId(i), unit(&[1.0, i as f32]));
    }
    assert_eq!(idx.graphs(), 0, "no insert built the graph");
    assert!(idx.worn().now_or_never().is_some(), "maintenance is woken");
    assert!(idx.worn().now_or_never().is_none(), "once");
    assert_eq!(idx.maintain().rebuilt, 1);
    assert_eq!(idx.graph_points(&p), Some(100));
    // Crossing, falling back under the limit before maintenance ran, crossing again:
    // asked again.
    let q = [3u8; 32];
    for i in 200..210 {
        idx.insert(q, EntryId(i), unit(&[1.0, i as f32]));
    }
    assert!(idx.worn().now_or_never().is_some());
    for i in 200..205 {
        idx.remove(EntryId(i));
    }
    idx.insert(q, EntryId(300), unit(&[1.0, 3.0]));
    let _ = idx.worn().now_or_never();
    for i in 301..310 {
        idx.insert(q, EntryId(i), unit(&[1.0, i as f32]));
    }
    assert!(idx.worn().now_or_never().is_some(), "asked again");
}

#[test]
fn the_charge_covers_a_slot_and_its_share_of_tombstones() {
    let at = |r: f32| {
        SemanticIndex::new(
            384,
            IndexConfig {
                rebuild_tombstone_ratio: r,
                ..IndexConfig::default()
            },
        )
        .charge()
    };
    let slot = at(0.0);
    assert!(slot >= SLOT_BASE_BYTES);
    // At a ratio of 1/2, each live entry carries one dead slot and one dead vector (its
    // handle's two counts and two bytes a component).
    assert_eq!(at(0.5), 2 * slot + 16 + 384 * 2);
}

#[test]
fn reinserting_an_id_replaces_its_vector() {
    let idx = SemanticIndex::new(2, IndexConfig::default());
    let p = [1u8; 32];
    idx.insert(p, EntryId(7), unit(&[1.0, 0.0]));
    idx.insert(p, EntryId(7), unit(&[0.0, 1.0]));
    assert_eq!(idx.len(), 1);
    let got = idx.search(&p, &[0.0, 1.0], 5);
    assert_eq!(got.len(), 1);
    assert!((got[0].similarity - 1.0).abs() < 1e-6);
}

#[test]
fn dot_distance_never_goes_negative() {
    let v = [unit(&[0.3, 0.4, 0.5])];
    assert!(DotDistance.eval(&v, &v) >= 0.0);
}
