//! The index is split by group into databases opened side by side; each group's data,
//! marker and watermark live in one of them and come back from it after a reopen.

mod common;

use common::{TestResult, marker, put};
use logdex_index::{Index, IndexConfig, Lookup};
use std::path::Path;

fn config(shards: usize) -> IndexConfig {
    IndexConfig { shards, ..common::config() }
}

fn write_groups(index: &Index, groups: std::ops::Range<u64>) -> TestResult {
    for group in groups {
        let key = format!("key-of-{group}");
        index.apply(group, &[put(key.as_bytes(), group * 10)], &marker(group * 10 + 1))?;
        index.set_watermark(group, group)?;
    }
    Ok(())
}

fn assert_groups(index: &Index, groups: std::ops::Range<u64>) -> TestResult {
    for group in groups {
        let key = format!("key-of-{group}");
        assert_eq!(index.get(group, key.as_bytes())?, Lookup::Found(group * 10), "group {group}");
        assert_eq!(index.get(group, format!("key-of-{}", group + 1).as_bytes())?, Lookup::NotFound, "group {group}");
        assert_eq!(index.applied(group)?, Some(marker(group * 10 + 1)), "group {group}");
        assert_eq!(index.watermark(group)?, group, "group {group}");
    }
    Ok(())
}

fn shard_dirs(path: &Path) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(path)?
        .filter_map(|entry| entry.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|name| name.starts_with("shard-"))
        .collect();
    names.sort();
    Ok(names)
}

#[test]
fn groups_of_every_shard_come_back_after_a_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let index = Index::open(dir.path(), config(3))?;
        write_groups(&index, 1..13)?;
        index.persist()?;
        assert_eq!(index.stats()?.groups, 12);
    }
    assert_eq!(shard_dirs(dir.path())?, ["shard-0", "shard-1", "shard-2"]);
    let index = Index::open(dir.path(), config(3))?;
    assert_groups(&index, 1..13)?;
    assert_eq!(index.stats()?.groups, 12);
    Ok(())
}

#[test]
fn an_index_keeps_the_shard_count_it_was_created_with() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let index = Index::open(dir.path(), config(2))?;
        write_groups(&index, 1..9)?;
    }
    // A process kill leaves the writes in the journals; a node with more cores now
    // still finds every group where it put it.
    let index = Index::open(dir.path(), config(4))?;
    assert_eq!(shard_dirs(dir.path())?, ["shard-0", "shard-1"]);
    assert_groups(&index, 1..9)?;
    Ok(())
}

#[test]
fn an_index_written_as_one_database_opens_as_one_shard() -> TestResult {
    let dir = tempfile::tempdir()?;
    // An index from before the split: one fjall database in the index directory itself.
    // Made here from a one-shard index whose shard directory is moved into place.
    let created = dir.path().join("created");
    {
        let index = Index::open(&created, config(1))?;
        write_groups(&index, 1..5)?;
        index.persist()?;
    }
    let legacy = dir.path().join("legacy");
    std::fs::rename(created.join("shard-0"), &legacy)?;
    let index = Index::open(&legacy, config(2))?;
    assert_groups(&index, 1..5)?;
    write_groups(&index, 5..7)?;
    drop(index);
    let index = Index::open(&legacy, config(2))?;
    assert_groups(&index, 1..7)?;
    assert!(shard_dirs(&legacy)?.is_empty(), "no shard directories were added");
    assert!(!legacy.join("layout").exists(), "no layout file was added");
    Ok(())
}

#[test]
fn a_damaged_layout_file_fails_the_open_with_a_layout_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    drop(Index::open(dir.path(), config(2))?);
    std::fs::write(dir.path().join("layout"), [9u8, 2])?;
    match Index::open(dir.path(), config(2)) {
        Err(logdex_index::Error::Layout { reason, .. }) => assert!(reason.contains("version 9"), "{reason}"),
        Err(other) => panic!("expected a layout error, got {other}"),
        Ok(_) => panic!("an index with a layout of unknown version opened"),
    }
    Ok(())
}
