//! Basic write and read behaviour of `apply`, `get`, markers and persistence.

mod common;

use common::{TestResult, delete, marker, open, put};
use logdex_index::{Error, Lookup, Update};

/// A put is found at its offset, a delete makes the key `NotFound`, and the
/// marker written with the batch is returned by `applied`.
#[test]
fn apply_puts_deletes_and_marker_are_visible() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    assert_eq!(index.applied(1)?, None);
    index.apply(1, &[put(b"a", 0), put(b"b", 1)], &marker(2))?;
    assert_eq!(index.get(1, b"a")?, Lookup::Found(0));
    assert_eq!(index.get(1, b"b")?, Lookup::Found(1));
    assert_eq!(index.get(1, b"c")?, Lookup::NotFound);
    index.apply(1, &[delete(b"a"), put(b"b", 3)], &marker(4))?;
    assert_eq!(index.get(1, b"a")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"b")?, Lookup::Found(3));
    assert_eq!(index.applied(1)?, Some(marker(4)));
    assert_eq!(index.get_many(1, &[b"a", b"b", b"zz"])?, vec![Lookup::NotFound, Lookup::Found(3), Lookup::NotFound]);
    Ok(())
}

/// A view answers as the index was when it was taken, whatever is applied after; once the
/// group is dropped (or rebuilt) it refuses to answer rather than call every key gone.
#[test]
fn a_view_answers_as_the_index_was_and_refuses_after_a_drop() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    let empty = index.view(1);
    index.apply(1, &[put(b"a", 0), put(b"b", 1)], &marker(2))?;
    let view = index.view(1);
    index.apply(1, &[put(b"a", 2), delete(b"b"), put(b"c", 3)], &marker(4))?;
    assert_eq!(empty.get(b"a")?, Lookup::NotFound, "a view of a group never written");
    assert_eq!(
        (view.get(b"a")?, view.get(b"b")?, view.get(b"c")?),
        (Lookup::Found(0), Lookup::Found(1), Lookup::NotFound)
    );
    assert_eq!((index.get(1, b"a")?, index.get(1, b"b")?), (Lookup::Found(2), Lookup::NotFound));
    index.drop_group(1)?;
    assert!(matches!(view.get(b"a"), Err(Error::ViewStale { group: 1 })), "{:?}", view.get(b"a"));
    Ok(())
}

/// Within one batch, the last update of a key wins.
#[test]
fn apply_last_update_of_a_key_in_a_batch_wins() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"k", 1), delete(b"k"), put(b"k", 3)], &marker(4))?;
    assert_eq!(index.get(1, b"k")?, Lookup::Found(3));
    index.apply(1, &[put(b"k", 5), delete(b"k")], &marker(6))?;
    assert_eq!(index.get(1, b"k")?, Lookup::NotFound);
    Ok(())
}

/// Applying the same updates and marker twice leaves the same answers.
#[test]
fn apply_reapplying_the_same_batch_is_idempotent() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    let batch = [put(b"x", 10), put(b"y", 11), delete(b"z")];
    index.apply(7, &batch, &marker(12))?;
    index.apply(7, &batch, &marker(12))?;
    assert_eq!(index.get(7, b"x")?, Lookup::Found(10));
    assert_eq!(index.get(7, b"y")?, Lookup::Found(11));
    assert_eq!(index.get(7, b"z")?, Lookup::NotFound);
    assert_eq!(index.applied(7)?, Some(marker(12)));
    Ok(())
}

/// A key over `key_bytes_max` fails with `KeyTooLong` and nothing of the batch
/// (neither its other keys nor its marker) is written.
#[test]
fn apply_rejects_key_too_long_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"before", 0)], &marker(1))?;
    let long = vec![b'x'; 16 * 1024 + 1];
    let result = index.apply(1, &[put(b"ok", 1), put(&long, 2)], &marker(3));
    assert!(matches!(result, Err(Error::KeyTooLong { group: 1, len: 16_385, max: 16_384 })), "{result:?}");
    assert_eq!(index.get(1, b"ok")?, Lookup::NotFound);
    assert_eq!(index.applied(1)?, Some(marker(1)));
    assert!(matches!(index.get(1, &long), Err(Error::KeyTooLong { .. })));
    // A new group is not created by a rejected batch either.
    let result = index.apply(2, &[put(&long, 0)], &marker(1));
    assert!(matches!(result, Err(Error::KeyTooLong { .. })));
    assert_eq!(index.applied(2)?, None);
    // The longest allowed key works.
    let max = vec![b'y'; 16 * 1024];
    index.apply(1, &[put(&max, 4)], &marker(5))?;
    assert_eq!(index.get(1, &max)?, Lookup::Found(4));
    Ok(())
}

/// `set_applied` moves the marker without touching entries.
#[test]
fn set_applied_writes_the_marker_only() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(3, &[put(b"k", 0)], &marker(1))?;
    index.set_applied(3, &marker(5))?;
    assert_eq!(index.applied(3)?, Some(marker(5)));
    assert_eq!(index.get(3, b"k")?, Lookup::Found(0));
    // On a fresh group it creates the group with just the marker.
    index.set_applied(4, &marker(9))?;
    assert_eq!(index.applied(4)?, Some(marker(9)));
    assert_eq!(index.get(4, b"k")?, Lookup::NotFound);
    Ok(())
}

/// Everything applied (buffered) and persisted is there after reopening.
#[test]
fn apply_survives_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let index = open(dir.path())?;
        let keys: Vec<Vec<u8>> = (0..1000u32).map(|i| format!("k-{i:07}").into_bytes()).collect();
        let updates: Vec<Update<'_>> = keys.iter().enumerate().map(|(offset, key)| put(key, offset as u64)).collect();
        index.apply(1, &updates, &marker(1000))?;
        index.apply(2, &[put(b"other", 0)], &marker(1))?;
        index.persist()?;
        index.apply(1, &[delete(b"k-0000000")], &marker(1001))?;
    }
    let index = open(dir.path())?;
    assert_eq!(index.applied(1)?, Some(marker(1001)));
    assert_eq!(index.get(1, b"k-0000000")?, Lookup::NotFound);
    assert_eq!(index.get(1, b"k-0000999")?, Lookup::Found(999));
    assert_eq!(index.get(2, b"other")?, Lookup::Found(0));
    assert_eq!(index.key_count_estimate(1)?, 999);
    Ok(())
}

/// The index handle can be cloned and used from many threads at once.
#[test]
fn get_runs_concurrently_with_apply() -> TestResult {
    let dir = tempfile::tempdir()?;
    let index = open(dir.path())?;
    index.apply(1, &[put(b"stable", 0)], &marker(1))?;
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let index = index.clone();
            std::thread::spawn(move || -> Result<(), logdex_index::Error> {
                for _ in 0..2000 {
                    assert_eq!(index.get(1, b"stable")?, Lookup::Found(0));
                }
                Ok(())
            })
        })
        .collect();
    for offset in 1..500u64 {
        let key = format!("k{offset}");
        index.apply(1, &[put(key.as_bytes(), offset)], &marker(offset + 1))?;
    }
    for reader in readers {
        reader.join().map_err(|_| "reader panicked")??;
    }
    Ok(())
}
